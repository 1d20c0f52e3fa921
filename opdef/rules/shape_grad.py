"""The shape and matmul ops of onnxruntime-training's graphs: ``FusedMatMul``, ``GatherGrad``, ``SliceGrad``,
``ConcatTraining`` and ``SplitTraining`` (``specs/com.microsoft/``; each spec's notes are its C1..Cn, and
the errors carry them).

GatherGrad's and SliceGrad's output shape is the value of their ``shape`` input, known only at run time:
their rank comes from that input's length, and the dims ``dY`` decides (every axis but the gathered or
sliced ones) come from ``dY``. ConcatTraining and SplitTraining are variadic: every position of their
variadic argument is checked and typed.
"""

from __future__ import annotations

from collections.abc import Sequence

from opdef.node import Dim, TensorType
from opdef.rules.base import Conflict, NodeContext, RuleResult, bound_roles, format_shape, merge_dim, register_rule


def _shape(ctx: NodeContext, name: str) -> tuple[Dim, ...] | None:
    t = ctx.input_type(name)
    return None if t is None else t.shape


def _set(ctx: NodeContext, name: str, shape: Sequence[Dim] | None) -> None:
    if ctx.has_output(name):
        current = ctx.output_type(name)
        ctx.set_output_type(name, TensorType(None if current is None else current.elem_type,
                                             None if shape is None else tuple(shape)))


def _axis(ctx: NodeContext, rank: int | None, label: str | None) -> int | None:
    """The ``axis`` attribute made non-negative (None while the rank is unknown); out of range is an error."""
    axis = int(ctx.attributes.get("axis", 0))
    if rank is None:
        return None
    if not -rank <= axis < rank:
        raise ctx.error(f"axis is {axis}; expected a value in [{-rank}, {rank - 1}] (rank {rank})", label)
    return axis % rank


def _vector_length(ctx: NodeContext, name: str, label: str | None) -> int | None:
    """The static length of a 1-D input (None when unknown); any other rank is an error."""
    shape = _shape(ctx, name)
    if shape is None:
        return None
    if len(shape) != 1:
        raise ctx.error(f"{name} has shape {format_shape(shape)}; expected a 1-D tensor", label)
    return shape[0] if isinstance(shape[0], int) else None


# -- FusedMatMul -----------------------------------------------------------------------------------

def _arranged(shape: tuple[Dim, ...], trans_batch: bool, trans: bool) -> tuple[Dim, ...]:
    if trans_batch:
        shape = (*shape[1:-1], shape[0], shape[-1])
    if trans and len(shape) > 1:
        shape = (*shape[:-2], shape[-1], shape[-2])
    return shape


def _broadcast(ctx: NodeContext, a: tuple[Dim, ...], b: tuple[Dim, ...], label: str | None) -> tuple[Dim, ...]:
    out: list[Dim] = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x == 1:
            out.append(y)
        elif y == 1:
            out.append(x)
        else:
            try:
                out.append(merge_dim(x, y))
            except Conflict:
                raise ctx.error(f"the batch axes {format_shape(a)} and {format_shape(b)} do not broadcast "
                                f"(A {format_shape(_shape(ctx, 'A'))}, B {format_shape(_shape(ctx, 'B'))})",
                                label) from None
    return tuple(reversed(out))


@register_rule("fused_matmul")
def fused_matmul(ctx: NodeContext) -> RuleResult:
    a, b = _shape(ctx, "A"), _shape(ctx, "B")
    attrs = ctx.attributes
    trans_batch_a, trans_batch_b = bool(attrs.get("transBatchA", 0)), bool(attrs.get("transBatchB", 0))
    for name, shape in (("A", a), ("B", b)):
        if shape is not None and len(shape) < 1:
            raise ctx.error(f"{name} is a scalar; expected rank 1 or more",
                            ctx.constraint_label(["A", "B"], ("rank 1",)))
    if trans_batch_a or trans_batch_b:
        label = ctx.constraint_label(["transBatchA", "transBatchB"])
        ranks = [len(s) for s in (a, b) if s is not None]
        if any(r < 3 for r in ranks) or (len(ranks) == 2 and ranks[0] != ranks[1]):
            raise ctx.error(f"transBatchA={int(trans_batch_a)}, transBatchB={int(trans_batch_b)} need A and B of one "
                            f"rank >= 3; A is {format_shape(a)}, B is {format_shape(b)}", label)
    shape = None
    if a is not None and b is not None:
        ea = _arranged(a, trans_batch_a, bool(attrs.get("transA", 0)))
        eb = _arranged(b, trans_batch_b, bool(attrs.get("transB", 0)))
        label = ctx.constraint_label(["A", "B"], ("contracted",))
        k_a, k_b = ea[-1], eb[-2] if len(eb) > 1 else eb[0]
        try:
            merge_dim(k_a, k_b)
        except Conflict:
            raise ctx.error(f"the contracted sizes differ: {k_a} (A {format_shape(a)} arranged {format_shape(ea)}) "
                            f"and {k_b} (B {format_shape(b)} arranged {format_shape(eb)})", label) from None
        batch = _broadcast(ctx, ea[:-2], eb[:-2], label)
        shape = (*batch, *ea[-2:-1], *(eb[-1:] if len(eb) > 1 else ()))
    _set(ctx, "Y", shape)
    return RuleResult(roles=bound_roles(ctx), rank=None if shape is None else len(shape))


# -- GatherGrad ------------------------------------------------------------------------------------

@register_rule("gather_grad")
def gather_grad(ctx: NodeContext) -> RuleResult:
    rank = _vector_length(ctx, "shape", ctx.constraint_label(["shape", "axis"]))
    if rank is not None and rank < 1:
        raise ctx.error("shape has 0 entries; X has rank 1 or more", ctx.constraint_label(["shape", "axis"]))
    axis = _axis(ctx, rank, ctx.constraint_label(["shape", "axis"]))
    indices, dy = _shape(ctx, "indices"), _shape(ctx, "dY")
    dx: list[Dim] | None = None if rank is None else [None] * rank
    if rank is not None and indices is not None and dy is not None:
        q = len(indices)
        if len(dy) != rank - 1 + q:
            raise ctx.error(f"dY has rank {len(dy)} {format_shape(dy)}; expected {rank - 1 + q} (rank {rank} of X "
                            f"from shape, minus 1, plus the rank {q} of indices {format_shape(indices)})",
                            ctx.constraint_label(["dY", "indices"]))
        for i, (want, have) in enumerate(zip(indices, dy[axis:axis + q], strict=True)):
            try:
                merge_dim(want, have)
            except Conflict:
                raise ctx.error(f"dY has shape {format_shape(dy)}; axis {axis + i} is {have}, but indices "
                                f"{format_shape(indices)} has {want} there", ctx.constraint_label(["dY", "indices"])) \
                    from None
        dx = [*dy[:axis], None, *dy[axis + q:]]
    _set(ctx, "dX", dx)
    return RuleResult(roles=bound_roles(ctx), rank=rank)


# -- SliceGrad -------------------------------------------------------------------------------------

@register_rule("slice_grad")
def slice_grad(ctx: NodeContext) -> RuleResult:
    dy = _shape(ctx, "dY")
    # dX's rank is shape's length; dY has that rank too, or arrives flattened (onnxruntime's kernel copies dY's
    # elements in order into the slice, whatever dY's shape), so dY's rank says nothing about dX's
    rank = _vector_length(ctx, "shape", ctx.constraint_label(["shape", "dY"]))
    label = ctx.constraint_label(["starts", "ends", "axes", "steps"])
    lengths = {name: _vector_length(ctx, name, label) for name in ("starts", "ends", "axes", "steps")
               if ctx.has_input(name)}
    known = {n: v for n, v in lengths.items() if v is not None}
    if len(set(known.values())) > 1:
        shown = ", ".join(f"{n} {v}" for n, v in known.items())
        raise ctx.error(f"starts, ends, axes and steps need one entry per sliced axis; they have {shown}", label)
    count = next(iter(known.values()), None)
    if count is not None and rank is not None and count > rank:
        raise ctx.error(f"{count} sliced axes for rank {rank} (the length of shape; dY {format_shape(dy)})", label)
    dx: list[Dim] | None = None if rank is None else [None] * rank
    if dx is not None and dy is not None and len(dy) == rank and not ctx.has_input("axes") and count is not None:
        dx[count:] = dy[count:]  # axes 0..count-1 are sliced, the rest taken whole
    _set(ctx, "dX", dx)
    return RuleResult(roles=bound_roles(ctx), rank=rank)


# -- ConcatTraining and SplitTraining --------------------------------------------------------------

@register_rule("concat_training")
def concat_training(ctx: NodeContext) -> RuleResult:
    label = ctx.constraint_label(["inputs", "axis"])
    shapes = [(i, t.shape) for i, t in enumerate(ctx.input_types) if t is not None and t.shape is not None]
    rank = len(shapes[0][1]) if shapes else None
    for i, shape in shapes:
        if len(shape) != rank or rank < 1:
            raise ctx.error(f"inputs {i} has rank {len(shape)} {format_shape(shape)}; expected {rank} (inputs "
                            f"{shapes[0][0]} is {format_shape(shapes[0][1])}), and rank 1 or more", label)
    axis = _axis(ctx, rank, label)
    out: tuple[Dim, ...] | None = None
    if rank is not None:
        dims: list[Dim] = [None] * rank
        for i, shape in shapes:
            for a in range(rank):
                if a == axis:
                    continue
                try:
                    dims[a] = merge_dim(dims[a], shape[a])
                except Conflict:
                    raise ctx.error(f"inputs {i} has shape {format_shape(shape)}; axis {a} must be {dims[a]} as in "
                                    "the other inputs (only the concatenation axis may differ)", label) from None
        lengths = [t.shape[axis] if t is not None and t.shape is not None else None for t in ctx.input_types]
        dims[axis] = sum(lengths) if all(isinstance(n, int) for n in lengths) else None
        out = tuple(dims)
    _set(ctx, "concat_result", out)
    _set(ctx, "per_input_length", (len(ctx.inputs),))
    return RuleResult(roles=bound_roles(ctx), rank=rank)


@register_rule("split_training")
def split_training(ctx: NodeContext) -> RuleResult:
    shape = _shape(ctx, "input")
    rank = None if shape is None else len(shape)
    if rank == 0:
        raise ctx.error("input is a scalar; expected rank 1 or more", ctx.constraint_label(["input", "axis"]))
    axis = _axis(ctx, rank, ctx.constraint_label(["input", "axis"]))
    label = ctx.constraint_label(["split"], ("entry",))
    entries = _vector_length(ctx, "split", label)
    count = len(ctx.outputs)
    if entries is not None and entries not in (0, count):
        raise ctx.error(f"split has {entries} entries; expected one per output ({count}), or none (equal pieces)",
                        label)
    piece: Dim = None
    if entries == 0 and shape is not None and isinstance(shape[axis], int):  # equal pieces, as the kernel cuts
        if shape[axis] % count:
            raise ctx.error(f"split is empty (equal pieces) and axis {axis} of input {format_shape(shape)} has "
                            f"{shape[axis]} entries, not a multiple of the {count} outputs", label)
        piece = shape[axis] // count
    out = None if shape is None else (*shape[:axis], piece, *shape[axis + 1:])
    for i, value in enumerate(ctx.outputs):  # every position of the variadic output
        if value is not None:
            current = ctx.output_types[i]
            ctx.output_types[i] = TensorType(None if current is None else current.elem_type, out)
    return RuleResult(roles=bound_roles(ctx), rank=rank)

