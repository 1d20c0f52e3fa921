"""Gradient rules: reshaping, indexing, selection and reductions.

Where onnxruntime-training's gradient builder uses a training op the rule emits it: Slice -> ``SliceGrad``,
Gather -> ``GatherGrad`` (both fed the input's shape), Concat -> ``ConcatTraining`` in the forward graph (the
per-input lengths as a second output, onnxruntime-training's ConcatReplacement) and ``SplitTraining`` of the
gradient. Everything else is standard ONNX:

- Reshape, Flatten, Squeeze without axes -> Reshape of dY to the input's shape; Squeeze <-> Unsqueeze with the
  same axes (attribute before opset 13, the same axes input from 13); Transpose -> the inverse permutation;
- Split -> Concat of the outputs' gradients (zeros where an output gets none);
- Expand -> dY summed down to the input's shape; Tile -> dY viewed as [r0, d0, r1, d1, ...] and summed over
  the repeats; Pad (constant mode) -> Slice (or Pad by the negated pads where they are not constants >= 0);
- GatherElements -> ScatterElements(reduction="add") into zeros (from opset 16; a one-hot sum below);
  GatherND -> ScatterND(reduction="add"); TopK -> ScatterElements of the values' gradient at the indices;
- Where -> dY masked by the condition for each branch, summed to its shape; CumSum -> the reverse CumSum;
  Trilu -> the same Trilu of dY;
- ReduceSum, ReduceMean, ReduceMax/ReduceMin (dY shared evenly by the ties, as torch's amax does),
  ReduceSumSquare, ReduceL1, ReduceL2 (zero where the norm is zero), ReduceLogSumExp.

Every rule works on symbolic shapes (the input's shape from a Shape node at run time) and uses constants where
shape inference knows the shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper

from lowering.training.gradients.context import FLOAT_TYPES, ForwardContext, GradientContext, GradientError
from lowering.training.gradients.registry import gradient_rule

MS = "com.microsoft"
INT64 = onnx.TensorProto.INT64
INT64_MAX = int(np.iinfo(np.int64).max)
AXES_AS_INPUT = 13        # Squeeze/Unsqueeze/ReduceSum/Split take axes (split) as an input from opset 13
SCATTER_REDUCTION = 16    # ScatterElements/ScatterND's reduction attribute
VARIADIC = tuple(range(1024))  # the positions of a variadic op's inputs (Concat)


# -- helpers ---------------------------------------------------------------------------------------

def _shape_of(ctx: GradientContext, name: str) -> str:
    """The shape of ``name`` as a 1-D int64 value: a constant where static, a Shape node otherwise."""
    f = ctx.f
    static = f.static_shape(name)
    if static is not None:
        return f.const(np.asarray(static, np.int64), hint="shape")
    return f.node1("Shape", [name], hint="shape")


def _reshape_to(ctx: GradientContext, grad: str, like: str) -> str:
    f = ctx.f
    static = f.static_shape(like)
    allowzero = 1 if static is not None and 0 in static and f.opset >= 14 else None
    return f.node1("Reshape", [grad, _shape_of(ctx, like)], allowzero=allowzero)


def _unsqueeze(f: ForwardContext, x: str, axes: Sequence[int]) -> str:
    if f.opset >= AXES_AS_INPUT:
        return f.node1("Unsqueeze", [x, f.axes(axes)])
    return f.node1("Unsqueeze", [x], axes=list(axes))


def _squeeze(f: ForwardContext, x: str, axes: Sequence[int]) -> str:
    if f.opset >= AXES_AS_INPUT:
        return f.node1("Squeeze", [x, f.axes(axes)])
    return f.node1("Squeeze", [x], axes=list(axes))


def _zeros(ctx: GradientContext, shape: str, like: str) -> str:
    """Zeros of the run-time ``shape`` in the element type of ``like``."""
    elem = ctx.f.elem_type(like) or onnx.TensorProto.FLOAT
    return ctx.f.node1("ConstantOfShape", [shape], value=helper.make_tensor("value", elem, [1], [0]), hint="zeros")


def _scalar(ctx: GradientContext, value: float, like: str) -> str:
    return ctx.f.const(np.asarray(value, ctx.f.np_dtype(like)), hint="scalar")


def _axis(ctx: GradientContext, axis: int, name: str) -> int:
    """``axis`` made non-negative against the rank of ``name`` (left as is while the rank is unknown)."""
    if axis >= 0:
        return axis
    rank = ctx.f.rank(name)
    return axis if rank is None else axis + rank


# -- reshaping -------------------------------------------------------------------------------------

@gradient_rule("Reshape")
def reshape(ctx: GradientContext) -> None:
    ctx.set_dx(0, _reshape_to(ctx, ctx.dy(0), ctx.x(0)))


@gradient_rule("Flatten")
def flatten(ctx: GradientContext) -> None:
    ctx.set_dx(0, _reshape_to(ctx, ctx.dy(0), ctx.x(0)))


@gradient_rule("Squeeze")
def squeeze(ctx: GradientContext) -> None:
    f, dy = ctx.f, ctx.dy(0)
    if f.opset >= AXES_AS_INPUT and len(ctx.node.input) > 1 and ctx.x(1):
        ctx.set_dx(0, f.node1("Unsqueeze", [dy, ctx.x(1)]))
    elif f.opset < AXES_AS_INPUT and ctx.attr("axes") is not None:
        ctx.set_dx(0, f.node1("Unsqueeze", [dy], axes=list(ctx.attr("axes"))))
    else:  # every axis of length 1 was removed: only the input's shape tells which
        ctx.set_dx(0, _reshape_to(ctx, dy, ctx.x(0)))


@gradient_rule("Unsqueeze")
def unsqueeze(ctx: GradientContext) -> None:
    f, dy = ctx.f, ctx.dy(0)
    if f.opset >= AXES_AS_INPUT:
        ctx.set_dx(0, f.node1("Squeeze", [dy, ctx.x(1)]))
    else:
        ctx.set_dx(0, f.node1("Squeeze", [dy], axes=list(ctx.attr("axes", []))))


@gradient_rule("Transpose")
def transpose(ctx: GradientContext) -> None:
    perm = ctx.attr("perm")
    if perm is None:  # the reversed axes: their own inverse
        ctx.set_dx(0, ctx.f.node1("Transpose", [ctx.dy(0)]))
        return
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[int(p)] = i
    ctx.set_dx(0, ctx.f.node1("Transpose", [ctx.dy(0)], perm=inverse))


# -- joining and cutting ---------------------------------------------------------------------------

def _concat_training(node: onnx.NodeProto, f: ForwardContext) -> list[onnx.NodeProto] | None:
    """A floating-point Concat becomes ConcatTraining with its per-input lengths (what onnxruntime-training's
    ConcatReplacement does before building the gradient graph); integer Concats (shape arithmetic) stay."""
    if f.elem_type(node.output[0]) not in FLOAT_TYPES:
        return None
    if len(node.input) > len(VARIADIC):
        raise GradientError(f"node {node.name or node.output[0]!r} (Concat): more than {len(VARIADIC)} inputs")
    lengths = f.fresh(f"{node.output[0]}_per_input_length")
    f.set_type(lengths, INT64, [len(node.input)])
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return [helper.make_node("ConcatTraining", list(node.input), [node.output[0], lengths],
                             name=node.name or f.fresh("ConcatTraining"), domain=MS, **attrs)]


def _split_outputs(ctx: GradientContext) -> list[str]:
    return [ctx.f.fresh(f"{ctx.x(i)}_grad") if ctx.requires(i) else ctx.f.fresh("unused_grad")
            for i in range(len(ctx.node.input))]


@gradient_rule("ConcatTraining", domain=MS, differentiable=VARIADIC)
def concat_training(ctx: GradientContext) -> None:
    outs = _split_outputs(ctx)
    lengths = ctx.y(1)
    if not lengths:
        raise ctx.fail("ConcatTraining without its per_input_length output")
    ctx.f.node("SplitTraining", [ctx.dy(0), lengths], outs, domain=MS, axis=int(ctx.attr("axis")))
    for i, name in enumerate(outs):
        ctx.set_dx(i, name)


@gradient_rule("Concat", differentiable=VARIADIC, prepare=_concat_training)
def concat(ctx: GradientContext) -> None:
    """A Concat the forward pass kept (not rewritten): Split by the inputs' lengths on the axis."""
    f = ctx.f
    axis = int(ctx.attr("axis"))
    lengths: list[int | str] = []
    for i in range(len(ctx.node.input)):
        shape = f.shape(ctx.x(i))
        a = _axis(ctx, axis, ctx.x(i))
        lengths.append(shape[a] if shape is not None and a >= 0 and isinstance(shape[a], int)
                       else f.node1("Gather", [f.node1("Shape", [ctx.x(i)]), f.axes([a if a >= 0 else axis])], axis=0))
    outs = _split_outputs(ctx)
    if f.opset < AXES_AS_INPUT:
        if not all(isinstance(n, int) for n in lengths):
            raise ctx.fail("the inputs' lengths on the axis are not static (Split takes them as an attribute before "
                           "opset 13)")
        f.node("Split", [ctx.dy(0)], outs, axis=axis, split=lengths)
    else:
        if all(isinstance(n, int) for n in lengths):
            split = f.const(np.asarray(lengths, np.int64), hint="split")
        else:
            split = f.node1("Concat", [f.axes([n]) if isinstance(n, int) else n for n in lengths], axis=0)
        f.node("Split", [ctx.dy(0), split], outs, axis=axis)
    for i, name in enumerate(outs):
        ctx.set_dx(i, name)


@gradient_rule("Split")
def split(ctx: GradientContext) -> None:
    f = ctx.f
    parts = []
    for i in range(len(ctx.node.output)):
        dy = ctx.dy(i)
        parts.append(dy if dy is not None else _zeros(ctx, _shape_of(ctx, ctx.y(i)), ctx.y(i)))
    ctx.set_dx(0, parts[0] if len(parts) == 1 else f.node1("Concat", parts, axis=int(ctx.attr("axis", 0))))


@gradient_rule("Slice")
def slice_(ctx: GradientContext) -> None:
    f = ctx.f
    shape = _shape_of(ctx, ctx.x(0))
    if f.opset >= 10:
        rest = [ctx.x(i) for i in range(1, len(ctx.node.input))]
    else:  # starts, ends, axes as attributes
        rest = [f.const(np.asarray(ctx.attr("starts"), np.int64), hint="starts"),
                f.const(np.asarray(ctx.attr("ends"), np.int64), hint="ends")]
        if ctx.attr("axes") is not None:
            rest.append(f.const(np.asarray(ctx.attr("axes"), np.int64), hint="axes"))
    while rest and not rest[-1]:
        rest.pop()
    ctx.set_dx(0, f.node1("SliceGrad", [ctx.dy(0), shape, *rest], domain=MS))


@gradient_rule("Pad")
def pad(ctx: GradientContext) -> None:
    f, dy, x = ctx.f, ctx.dy(0), ctx.x(0)
    mode = ctx.attr("mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if f.opset < 11:
        pads = [int(p) for p in ctx.attr("pads")]
    else:
        const = f.constant(ctx.x(1))
        pads = None if const is None else [int(p) for p in np.asarray(const).ravel()]
    rank = f.rank(x)
    axes = list(range(rank)) if rank is not None else None
    if f.opset >= 18 and len(ctx.node.input) > 3 and ctx.x(3):
        const_axes = f.constant(ctx.x(3))
        axes = None if const_axes is None or rank is None else [int(a) % rank for a in np.asarray(const_axes).ravel()]
    if mode != "constant":  # reflect, edge, wrap: the copies summed back (a map per padded axis)
        from lowering.training.gradients.upsample import pad_gradient  # noqa: PLC0415

        ctx.set_dx(0, pad_gradient(ctx, mode, pads, axes))
        return
    if pads is not None and axes is not None and all(p >= 0 for p in pads) and len(pads) == 2 * len(axes):
        n = len(axes)
        starts = pads[:n]
        ends = [-e if e > 0 else INT64_MAX for e in pads[n:]]
        ctx.set_dx(0, f.node1("Slice", [dy, f.const(np.asarray(starts, np.int64), hint="starts"),
                                         f.const(np.asarray(ends, np.int64), hint="ends"), f.axes(axes)]))
        return
    # pads computed at run time (or cropping ones): a Pad by the negated pads removes what the forward added
    if f.opset < 11:
        ctx.set_dx(0, f.node1("Pad", [dy], pads=[-p for p in pads], mode="constant"))
        return
    inputs = [dy, f.node1("Neg", [ctx.x(1)])]
    if f.opset >= 18 and len(ctx.node.input) > 3 and ctx.x(3):
        inputs += ["", ctx.x(3)]
    ctx.set_dx(0, f.node1("Pad", inputs, mode="constant"))


# -- broadcasting and repetition ------------------------------------------------------------------

@gradient_rule("Expand")
def expand(ctx: GradientContext) -> None:
    ctx.set_dx(0, ctx.sum_to(ctx.dy(0), ctx.x(0)))


@gradient_rule("Tile")
def tile(ctx: GradientContext) -> None:
    """Y = Tile(X, r): dY viewed as [r0, d0, r1, d1, ...], summed over the repeats (the even axes)."""
    f, x = ctx.f, ctx.x(0)
    rank = f.rank(x)
    repeats = f.constant(ctx.x(1))
    if rank is None:
        rshape = f.static_shape(ctx.x(1))
        rank = None if rshape is None else rshape[0]
    if rank is None:
        raise ctx.fail("the rank of the input is unknown")
    static = f.static_shape(x)
    if static is not None and repeats is not None:
        view = [int(v) for pair in zip(np.asarray(repeats).ravel().tolist(), static, strict=True) for v in pair]
        view_shape = f.const(np.asarray(view, np.int64), hint="tile_view")
    else:
        pairs = f.node1("Concat", [_unsqueeze(f, ctx.x(1), [1]), _unsqueeze(f, f.node1("Shape", [x]), [1])], axis=1)
        view_shape = f.node1("Reshape", [pairs, f.const(np.asarray([-1], np.int64))])
    viewed = f.node1("Reshape", [ctx.dy(0), view_shape])
    ctx.set_dx(0, f.reduce("ReduceSum", viewed, list(range(0, 2 * rank, 2)), keepdims=0))


# -- indexing --------------------------------------------------------------------------------------

@gradient_rule("Gather")
def gather(ctx: GradientContext) -> None:
    f = ctx.f
    axis = _axis(ctx, int(ctx.attr("axis", 0)), ctx.x(0))
    ctx.set_dx(0, f.node1("GatherGrad", [_shape_of(ctx, ctx.x(0)), ctx.x(1), ctx.dy(0)], domain=MS, axis=axis))


@gradient_rule("GatherElements")
def gather_elements(ctx: GradientContext) -> None:
    f, x, indices, dy = ctx.f, ctx.x(0), ctx.x(1), ctx.dy(0)
    axis = int(ctx.attr("axis", 0))
    shape = _shape_of(ctx, x)
    if f.opset >= SCATTER_REDUCTION:
        ctx.set_dx(0, f.node1("ScatterElements", [_zeros(ctx, shape, x), indices, dy], axis=axis, reduction="add"))
        return
    # before opset 16: a one-hot sum. onehot[..., m] = (index == m), summed with dY over the gathered axis
    rank = f.rank(x)
    if rank is None:
        raise ctx.fail("the rank of the input is unknown")
    axis %= rank
    size = f.node1("Gather", [f.node1("Shape", [x]), f.const(np.asarray(axis, np.int64))], axis=0)
    index = indices if f.elem_type(indices) == INT64 else f.node1("Cast", [indices], to=INT64)
    index = f.node1("Where", [f.node1("Less", [index, f.const(np.asarray(0, np.int64))]),
                              f.node1("Add", [index, size]), index])
    classes = f.node1("Range", [f.const(np.asarray(0, np.int64)), size, f.const(np.asarray(1, np.int64))])
    onehot = f.node1("Cast", [f.node1("Equal", [_unsqueeze(f, index, [rank]), classes])], to=f.elem_type(x))
    summed = f.reduce("ReduceSum", f.node1("Mul", [onehot, _unsqueeze(f, dy, [rank])]), [axis], keepdims=1)
    perm = list(range(rank + 1))
    perm[axis], perm[rank] = rank, axis
    grad = _squeeze(f, f.node1("Transpose", [summed], perm=perm), [rank])
    # the indices may be shorter than the input on the other axes: pad with zeros at the end
    short = f.node1("Sub", [shape, f.node1("Shape", [grad])])
    pads = f.node1("Concat", [f.const(np.zeros(rank, np.int64)), short], axis=0)
    ctx.set_dx(0, f.node1("Pad", [grad, pads], mode="constant"))


@gradient_rule("GatherND")
def gather_nd(ctx: GradientContext) -> None:
    f, x = ctx.f, ctx.x(0)
    if int(ctx.attr("batch_dims", 0)) != 0:
        raise ctx.fail("the gradient of GatherND is defined for batch_dims 0 only")
    if f.opset < SCATTER_REDUCTION:
        raise ctx.fail(f"the gradient of GatherND needs ScatterND's reduction (opset {SCATTER_REDUCTION}); the "
                       f"model imports opset {f.opset}")
    zeros = _zeros(ctx, _shape_of(ctx, x), x)
    ctx.set_dx(0, f.node1("ScatterND", [zeros, ctx.x(1), ctx.dy(0)], reduction="add"))


@gradient_rule("TopK")
def top_k(ctx: GradientContext) -> None:
    """The values' gradient put back at their (distinct) positions along the axis."""
    f, x = ctx.f, ctx.x(0)
    if f.opset < 11:
        raise ctx.fail("the gradient of TopK needs ScatterElements (opset 11)")
    zeros = _zeros(ctx, _shape_of(ctx, x), x)
    ctx.set_dx(0, f.node1("ScatterElements", [zeros, ctx.y(1), ctx.dy(0)], axis=int(ctx.attr("axis", -1))))


# -- selection, prefix sums, triangles -------------------------------------------------------------

@gradient_rule("Where", differentiable=(1, 2))
def where(ctx: GradientContext) -> None:
    f, dy, cond = ctx.f, ctx.dy(0), ctx.x(0)
    zero = _scalar(ctx, 0.0, ctx.y(0))
    if ctx.requires(1):
        ctx.set_dx(1, ctx.sum_to(f.node1("Where", [cond, dy, zero]), ctx.x(1)))
    if ctx.requires(2):
        ctx.set_dx(2, ctx.sum_to(f.node1("Where", [cond, zero, dy]), ctx.x(2)))


@gradient_rule("CumSum")
def cum_sum(ctx: GradientContext) -> None:
    reverse = 0 if int(ctx.attr("reverse", 0)) else 1
    ctx.set_dx(0, ctx.f.node1("CumSum", [ctx.dy(0), ctx.x(1)], exclusive=int(ctx.attr("exclusive", 0)),
                              reverse=reverse))


@gradient_rule("Trilu")
def trilu(ctx: GradientContext) -> None:
    inputs = [ctx.dy(0)] + ([ctx.x(1)] if len(ctx.node.input) > 1 and ctx.x(1) else [])
    ctx.set_dx(0, ctx.f.node1("Trilu", inputs, upper=int(ctx.attr("upper", 1))))


# -- reductions ------------------------------------------------------------------------------------

def _runtime_axes(ctx: GradientContext) -> str | None:
    """The axes input of a reduction when it is computed at run time (not a constant), else None."""
    if ctx.attr("axes") is None and len(ctx.node.input) > 1 and ctx.x(1) and ctx.f.constant(ctx.x(1)) is None:
        return ctx.x(1)
    return None


def _reduce_axes(ctx: GradientContext) -> list[int] | None:
    """The reduced axes (normalised, sorted) of a reduction node, or None for all axes (the axes must not be a
    run-time input: see :func:`_runtime_axes`)."""
    f = ctx.f
    rank = f.rank(ctx.x(0))
    axes = ctx.attr("axes")
    if axes is None and len(ctx.node.input) > 1 and ctx.x(1):
        value = f.constant(ctx.x(1))
        if value is None:
            raise ctx.fail("the reduction axes are not a constant")
        axes = value.ravel().tolist()
    if axes is None or len(axes) == 0:
        if ctx.attr("noop_with_empty_axes", 0) and axes is not None:
            return []
        if ctx.attr("noop_with_empty_axes", 0) and axes is None and len(ctx.node.input) < 2:
            return []
        return None
    if rank is None:
        raise ctx.fail("the input's rank is unknown")
    return sorted(int(a) % rank for a in axes)


def _kept(ctx: GradientContext, value: str) -> str:
    """``value`` (of the reduction's output shape) with the reduced axes back as ones where keepdims=0 dropped
    them: it broadcasts against the input."""
    if ctx.attr("keepdims", 1):
        return value
    runtime = _runtime_axes(ctx)
    if runtime is not None:  # Unsqueeze counts negative axes from the back of its output: the input's rank
        return ctx.f.node1("Unsqueeze", [value, runtime])
    axes = _reduce_axes(ctx)
    if axes is None:  # every axis reduced: a scalar, which broadcasts as it is
        return value
    return _unsqueeze(ctx.f, value, axes) if axes else value


def _broadcast_back(ctx: GradientContext, dy: str) -> str:
    """``dy`` (the reduction's output) unsqueezed where keepdims=0 dropped axes, expanded to the input's shape."""
    return ctx.f.node1("Expand", [_kept(ctx, dy), _shape_of(ctx, ctx.x(0))])


@gradient_rule("ReduceSum")
def reduce_sum(ctx: GradientContext) -> None:
    ctx.set_dx(0, _broadcast_back(ctx, ctx.dy(0)))


@gradient_rule("ReduceMean")
def reduce_mean(ctx: GradientContext) -> None:
    f = ctx.f
    x = ctx.x(0)
    shape = f.static_shape(x)
    axes = _reduce_axes(ctx) if _runtime_axes(ctx) is None else None
    if shape is not None and _runtime_axes(ctx) is None:
        count = int(np.prod([shape[a] for a in (range(len(shape)) if axes is None else axes)], dtype=np.int64))
        scale = f.const(np.asarray(count, f.np_dtype(x)), hint="reduce_count")
    else:
        scale = f.node1("Cast", [f.node1("Div", [f.node1("Size", [x]), f.node1("Size", [ctx.y(0)])])],
                        to=f.elem_type(x))
    ctx.set_dx(0, _broadcast_back(ctx, f.node1("Div", [ctx.dy(0), scale])))


def _reduce_extreme(ctx: GradientContext) -> None:
    """ReduceMax/ReduceMin: dY goes to the positions that equal the result, shared evenly among ties."""
    f, x = ctx.f, ctx.x(0)
    hit = f.node1("Cast", [f.node1("Equal", [x, _kept(ctx, ctx.y(0))])], to=f.elem_type(x))
    runtime = _runtime_axes(ctx)
    if runtime is not None:
        ties = f.node1("ReduceSum", [hit, runtime], keepdims=1,
                       noop_with_empty_axes=int(ctx.attr("noop_with_empty_axes", 0)))
    else:
        axes = _reduce_axes(ctx)
        ties = f.reduce("ReduceSum", hit, axes, keepdims=1) if axes != [] else None
    share = _kept(ctx, ctx.dy(0)) if ties is None else f.node1("Div", [_kept(ctx, ctx.dy(0)), ties])
    ctx.set_dx(0, f.node1("Mul", [hit, share]))


@gradient_rule("ReduceMax")
def reduce_max(ctx: GradientContext) -> None:
    _reduce_extreme(ctx)


@gradient_rule("ReduceMin")
def reduce_min(ctx: GradientContext) -> None:
    _reduce_extreme(ctx)


@gradient_rule("ReduceSumSquare")
def reduce_sum_square(ctx: GradientContext) -> None:
    f, x = ctx.f, ctx.x(0)
    twice = f.node1("Mul", [_kept(ctx, ctx.dy(0)), _scalar(ctx, 2.0, x)])
    ctx.set_dx(0, f.node1("Mul", [x, twice]))


@gradient_rule("ReduceL1")
def reduce_l1(ctx: GradientContext) -> None:
    f, x = ctx.f, ctx.x(0)
    ctx.set_dx(0, f.node1("Mul", [f.node1("Sign", [x]), _kept(ctx, ctx.dy(0))]))


@gradient_rule("ReduceL2")
def reduce_l2(ctx: GradientContext) -> None:
    """dX = X dY / Y, zero where the norm Y is zero (the subgradient torch takes)."""
    f, x, y = ctx.f, ctx.x(0), ctx.y(0)
    zero = _scalar(ctx, 0.0, x)
    scaled = f.node1("Where", [f.node1("Equal", [y, zero]), zero, f.node1("Div", [ctx.dy(0), y])])
    ctx.set_dx(0, f.node1("Mul", [x, _kept(ctx, scaled)]))


@gradient_rule("ReduceLogSumExp")
def reduce_log_sum_exp(ctx: GradientContext) -> None:
    """dX = dY exp(X - Y): the softmax over the reduced axes (X - Y <= 0, no overflow)."""
    f, x = ctx.f, ctx.x(0)
    weights = f.node1("Exp", [f.node1("Sub", [x, _kept(ctx, ctx.y(0))])])
    ctx.set_dx(0, f.node1("Mul", [weights, _kept(ctx, ctx.dy(0))]))
