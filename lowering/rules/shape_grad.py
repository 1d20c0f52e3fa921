"""Lowering of the shape and matmul ops of onnxruntime-training's graphs (``specs/com.microsoft/``):
FusedMatMul, GatherGrad, SliceGrad, ConcatTraining, SplitTraining.

- FusedMatMul: Transpose of each operand that the flags rearrange, MatMul, Mul by alpha (when not 1).
  onnxruntime fuses Transpose + MatMul back into its own kernel. One form for both targets.
- GatherGrad: the gradient rows are added into zeros of ``shape`` at their indices along ``axis``, on the
  [P, n, R] view of dY (P: the product of the axes before ``axis``, n: the number of indices, R: of those
  after). onnxruntime target from opset 16: one ScatterND with ``reduction="add"`` (the rows of the
  [D, P, R] view; axis > 0 transposes P and n around it); portable target, or below opset 16: a one-hot
  [D, n] matrix (Equal of a Range with the indices) times the [P, n, R] view, one MatMul. An index outside
  [-D, D) (a bad value: the forward Gather refuses it) adds nothing in both forms: the one-hot has no 1 for
  it, and the ScatterND form adds a row of zeros at position 0 in its place (a Where over the rows of dY).
- SliceGrad: per sliced axis, the positions the forward Slice read (start normalized and clamped as ONNX
  Slice does, then start + step * Range(n), n being dY's length there) receive dY's slices: a ScatterND
  (no reduction: the positions are distinct) for onnxruntime, the one-hot MatMul for portable. ``ends`` is
  not needed: dY's length on the axis is the slice's. Everything is computed from the run-time values of
  ``shape``, ``starts``, ``axes`` and ``steps``; only their number of entries must be known. A dY of another
  rank than ``shape``'s length (flattened: onnxruntime's kernel copies dY's elements in order into the slice) is
  first reshaped to the slice's shape, computed from ``ends`` too.
- ConcatTraining: Concat, and the per-input lengths from each input's Shape (a Constant when static).
- SplitTraining: onnxruntime target from opset 13: one Split with the run-time ``split``; otherwise one Slice
  per output, its offsets summed from ``split`` (ReduceSum of a prefix). An empty ``split`` cuts equal pieces,
  one per output, as onnxruntime's kernel does (a constant ``split`` where the axis is static).

f16/bf16 data are computed in f32 and rounded once; f64 stays f64.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from lowering.builder import NodeBuilder
from lowering.emit_common import Emitter, compute_type, index_in_range
from lowering.rules import TARGETS, LoweringRequest, register_rule
from lowering.rules.elementwise_grad import input_elem

INT64_MAX = np.iinfo(np.int64).max
SCATTER_ADD_SINCE = 16  # ScatterND's reduction attribute
SPLIT_INPUT_SINCE = 13  # Split's split as an input
ALLOWZERO_SINCE = 14  # Reshape's allowzero


def _reshape(b: NodeBuilder, data: str, shape: str, output: str | None = None) -> str:
    """Reshape to a computed shape whose entries may be 0 (an empty slice): ``allowzero`` from opset 14 keeps
    a 0 a 0 instead of copying the input's dim (before 14 an empty piece is not lowered correctly)."""
    return b.op1("Reshape", [data, shape], output, allowzero=1 if b.opset >= ALLOWZERO_SINCE else None)


def _rank(request: LoweringRequest, name: str) -> int | None:
    inference = request.inference
    t = inference.input_types[inference.schema.input_index(name)]
    return None if t is None or t.shape is None else len(t.shape)


def _declares_no_elements(request: LoweringRequest, name: str) -> bool:
    """The input's declared shape has a dimension of 0."""
    inference = request.inference
    t = inference.input_types[inference.schema.input_index(name)]
    return t is not None and t.shape is not None and any(d == 0 for d in t.shape if isinstance(d, int))


def _static_length(request: LoweringRequest, name: str) -> int | None:
    """The static number of entries of a 1-D input, None when unknown."""
    inference = request.inference
    t = inference.input_types[inference.schema.input_index(name)]
    if t is None or t.shape is None or len(t.shape) != 1 or not isinstance(t.shape[0], int):
        return None
    return t.shape[0]


def _unsqueeze(b: NodeBuilder, e: Emitter, name: str, axes: list[int]) -> str:
    if b.opset < 13:
        return b.op1("Unsqueeze", [name], axes=axes)
    return b.op1("Unsqueeze", [name, e.ints(axes, "axes")])


def _piece(b: NodeBuilder, e: Emitter, vector: str, start, end) -> str:
    """``vector[start:end]`` of a 1-D tensor; start/end are ints or [1] tensors."""
    starts = e.ints([start], "start") if isinstance(start, int) else start
    ends = e.ints([end], "end") if isinstance(end, int) else end
    return b.op1("Slice", [vector, starts, ends, e.ints([0], "axes")])


def _entry(b: NodeBuilder, e: Emitter, vector: str, at) -> str:
    """``vector[at]`` as a [1] tensor; ``at`` an int or a [1] tensor (then a Gather: a Slice with run-time
    bounds has a length OpenVINO and tract cannot prove to be 1)."""
    return _piece(b, e, vector, at, at + 1) if isinstance(at, int) else b.op1("Gather", [vector, at], axis=0)


def _product(b: NodeBuilder, e: Emitter, vector: str) -> str:
    """The product of a 1-D int64 tensor's entries as a [1] tensor (1 when it is empty)."""
    return b.op1("ReduceProd", [b.op1("Concat", [e.ints([1], "one"), vector], axis=0)], keepdims=1)


def _view_sizes(b: NodeBuilder, e: Emitter, shape: str, axis) -> tuple[str, str, str]:
    """(P, D, R) as [1] tensors: the products of ``shape``'s entries before ``axis`` and after it, and its
    entry at ``axis`` (an int or a [1] tensor)."""
    after = axis + 1 if isinstance(axis, int) else b.op1("Add", [axis, e.ints([1], "one")])
    outer = e.ints([1], "one") if axis == 0 else _product(b, e, _piece(b, e, shape, 0, axis))
    inner = _product(b, e, _piece(b, e, shape, after, INT64_MAX))
    return outer, _piece(b, e, shape, axis, after), inner


def _scatter_rows(b: NodeBuilder, e: Emitter, view: str, positions: str, outer: str, size: str, inner: str,
                  axis_is_first: bool, reduction: str | None) -> str:
    """The [P, D, R] tensor with the rows of the [P, n, R] ``view`` put (or added) at ``positions`` [n] of
    axis 1, zeros elsewhere: one ScatterND on the [D, P, R] layout."""
    index = _unsqueeze(b, e, positions, [1])
    if axis_is_first:  # P is 1: the [n, R] rows scatter straight into [D, R]
        zeros = b.op1("ConstantOfShape", [b.op1("Concat", [size, inner], axis=0)],
                      value=_zero_tensor(e.ct))
        rows = _reshape(b, view, b.op1("Concat", [e.ints([-1], "rest"), inner], axis=0))
        return b.op1("ScatterND", [zeros, index, rows], reduction=reduction)
    zeros = b.op1("ConstantOfShape", [b.op1("Concat", [size, outer, inner], axis=0)], value=_zero_tensor(e.ct))
    rows = b.op1("Transpose", [view], perm=[1, 0, 2])
    return b.op1("Transpose", [b.op1("ScatterND", [zeros, index, rows], reduction=reduction)], perm=[1, 0, 2])


def _one_hot_rows(b: NodeBuilder, e: Emitter, view: str, positions: str, size: str) -> str:
    """The same by a one-hot [D, n] matrix times the [P, n, R] view (positions out of range drop out)."""
    classes = b.op1("Range", [e.ints(0, "zero"), e.reduce("ReduceSum", size, (0,), keepdims=0), e.ints(1, "one_step")])
    onehot = b.op1("Equal", [_unsqueeze(b, e, classes, [1]), _unsqueeze(b, e, positions, [0])])
    return b.op1("MatMul", [b.op1("Cast", [onehot], to=e.ct), view])


def _zero_tensor(elem: int) -> TensorProto:
    return helper.make_tensor("zero", elem, [1], [0.0])


# -- FusedMatMul -----------------------------------------------------------------------------------

def _arrangement(rank: int, trans_batch: bool, trans: bool) -> list[int] | None:
    perm = list(range(rank))
    if trans_batch:
        perm = [*perm[1:-1], perm[0], perm[-1]]
    if trans and rank > 1:
        perm[-2], perm[-1] = perm[-1], perm[-2]
    return None if perm == list(range(rank)) else perm


@register_rule("fused_matmul", targets=TARGETS)
def lower_fused_matmul(b: NodeBuilder, request: LoweringRequest) -> None:
    out = request.output("Y")
    if out is None:
        return
    io = input_elem(request, "A")
    e = Emitter(b, compute_type(io))
    attrs = request.inference.attributes
    operands = []
    for name, batch_flag, flag in (("A", "transBatchA", "transA"), ("B", "transBatchB", "transB")):
        value = e.up(request.input(name), io)
        trans_batch, trans = bool(attrs.get(batch_flag, 0)), bool(attrs.get(flag, 0))
        if trans_batch or trans:
            rank = _rank(request, name)
            if rank is None:
                raise request.error(f"{flag}/{batch_flag} need the rank of {name} known to lower it")
            perm = _arrangement(rank, trans_batch, trans)
            if perm is not None:
                value = b.op1("Transpose", [value], perm=perm)
        operands.append(value)
    alpha = float(np.float32(attrs.get("alpha", 1.0)))
    if alpha == 1.0:
        e.finish("MatMul", operands, out, io)
    else:
        e.finish("Mul", [b.op1("MatMul", operands), e.scalar(alpha, "alpha")], out, io)


# -- GatherGrad ------------------------------------------------------------------------------------

@register_rule("gather_grad", targets=TARGETS)
def lower_gather_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    out = request.output("dX")
    if out is None:
        return
    io = input_elem(request, "dY")
    e = Emitter(b, compute_type(io))
    shape = request.input("shape")
    axis = int(request.inference.attributes.get("axis", 0))
    if axis < 0:
        rank = _static_length(request, "shape")
        if rank is None:
            raise request.error(f"axis {axis} is negative and the length of shape is unknown")
        axis += rank
    outer, size, inner = _view_sizes(b, e, shape, axis)
    positions = request.input("indices")
    if input_elem(request, "indices") != TensorProto.INT64:
        positions = b.op1("Cast", [positions], to=TensorProto.INT64)
    positions = b.op1("Reshape", [positions, e.ints([-1], "flat")])
    negative = b.op1("Less", [positions, e.ints(0, "zero")])
    positions = b.op1("Where", [negative, b.op1("Add", [positions, size]), positions])
    view = _reshape(b, e.up(request.input("dY"), io), b.op1("Concat", [outer, e.ints([-1], "rest"), inner], axis=0))
    if request.options.target == "onnxruntime" and b.opset >= SCATTER_ADD_SINCE:
        # an index outside [-D, D) adds nothing: its row of zeros goes to position 0
        inside = index_in_range(b, positions, TensorProto.INT64, size, None)
        positions = b.op1("Where", [inside, positions, e.ints(0, "zero")])
        view = b.op1("Where", [_unsqueeze(b, e, inside, [0, 2]), view, e.scalar(0.0, "zero_value")])
        dx = _scatter_rows(b, e, view, positions, outer, size, inner, axis == 0, "add")
    else:
        dx = _one_hot_rows(b, e, view, positions, size)
    e.finish("Reshape", [dx, shape], out, io)


# -- SliceGrad -------------------------------------------------------------------------------------

@register_rule("slice_grad", targets=TARGETS)
def lower_slice_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    out = request.output("dX")
    if out is None:
        return
    io = input_elem(request, "dY")
    e = Emitter(b, compute_type(io))
    shape = request.input("shape")
    count = _static_length(request, "starts")
    if count is None:
        raise request.error("the number of entries of starts must be known to lower it")
    index_type = input_elem(request, "starts")

    def entries(name: str) -> str | None:
        value = request.input(name)
        if value is not None and index_type != TensorProto.INT64:
            value = b.op1("Cast", [value], to=TensorProto.INT64)
        return value

    starts, ends, axes, steps = entries("starts"), entries("ends"), entries("axes"), entries("steps")
    if axes is not None:  # a negative axis counts from the back: add the rank (the length of shape)
        axes = b.op1("Where", [b.op1("Less", [axes, e.ints(0, "zero")]), b.op1("Add", [axes, b.op1("Shape", [shape])]),
                               axes])
    current = e.up(request.input("dY"), io)
    rank = _static_length(request, "shape")
    if count == 0:
        e.finish("Reshape", [current, shape], out, io)  # nothing sliced: dY is X's gradient (perhaps flattened)
        return
    if _declares_no_elements(request, "dY"):
        # an empty slice: dX is zeros, and no MatMul or ScatterND over empty operands (onnxruntime 1.23, the last
        # for Python 3.10, refuses to broadcast a batch of 0 rows against a 2-D one-hot matrix)
        if io == e.ct:
            b.op1("ConstantOfShape", [shape], out, value=_zero_tensor(io))
        else:  # ConstantOfShape has no bfloat16 before opset 20
            b.op1("Cast", [b.op1("ConstantOfShape", [shape], value=_zero_tensor(e.ct))], out, to=io)
        return
    sliced_axes = []
    for j in range(count):  # each sliced axis: (axis, its size D, step, the first position read)
        axis = j if axes is None else _piece(b, e, axes, j, j + 1)
        size = _entry(b, e, shape, axis)
        step = e.ints([1], "one") if steps is None else _piece(b, e, steps, j, j + 1)
        start = _piece(b, e, starts, j, j + 1)
        start = b.op1("Where", [b.op1("Less", [start, e.ints(0, "zero")]), b.op1("Add", [start, size]), start])
        # ONNX Slice clamps the start to [0, D] for a positive step and to [0, D - 1] for a negative one
        highest = size if steps is None else b.op1("Where", [b.op1("Greater", [step, e.ints(0, "zero")]), size,
                                                             b.op1("Sub", [size, e.ints([1], "one")])])
        start = b.op1("Min", [b.op1("Max", [start, e.ints([0], "zero_1d")]), highest])
        sliced_axes.append((j, axis, size, step, start))
    if rank is None or _rank(request, "dY") != rank:
        # dY arrives flattened (or of unknown rank): onnxruntime's kernel copies its elements in order into the
        # slice, so it is viewed as the slice's shape, computed from starts, ends and steps as ONNX Slice does
        current = _reshape(b, current, _slice_shape(b, e, shape, ends, steps, sliced_axes, rank))
    scatter = request.options.target == "onnxruntime"
    for j, axis, size, step, start in sliced_axes:
        after = j + 1 if axes is None else b.op1("Add", [axis, e.ints([1], "one")])
        dims = b.op1("Shape", [current])
        outer = e.ints([1], "one") if axis == 0 else _product(b, e, _piece(b, e, dims, 0, axis))
        inner = _product(b, e, _piece(b, e, dims, after, INT64_MAX))
        length = _entry(b, e, dims, axis)
        # the length as a scalar by a ReduceSum (a Reshape to [] needs a length tract can prove to be 1)
        taken = b.op1("Range", [e.ints(0, "zero"), e.reduce("ReduceSum", length, (0,), keepdims=0),
                                e.ints(1, "one_step")])
        positions = b.op1("Add", [start, b.op1("Mul", [taken, step])])
        view = _reshape(b, current, b.op1("Concat", [outer, length, inner], axis=0))
        if scatter:
            grown = _scatter_rows(b, e, view, positions, outer, size, inner, axis == 0, None)
        else:
            grown = _one_hot_rows(b, e, view, positions, size)
        if j == count - 1:
            e.finish("Reshape", [grown, shape], out, io)
        elif rank is not None:  # the dims with the axis's entry replaced, of a length every runtime sees
            at_axis = b.op1("Equal", [e.ints(list(range(rank)), "axis_ids"), axis if axes is not None else
                                      e.ints(j, "axis_id")])
            current = _reshape(b, grown, b.op1("Where", [at_axis, size, dims]))
        else:
            new_dims = b.op1("Concat", [_piece(b, e, dims, 0, axis), size, _piece(b, e, dims, after, INT64_MAX)],
                             axis=0)
            current = _reshape(b, grown, new_dims)


def _slice_shape(b: NodeBuilder, e: Emitter, shape: str, ends: str, steps: str | None, sliced_axes: list,
                 rank: int | None) -> str:
    """The forward Slice's output shape: ``shape`` with each sliced axis's entry replaced by the number of
    positions from the clamped start towards the end (normalized and clamped as ONNX Slice does: [0, D] for a
    positive step, [-1, D - 1] for a negative one), ceil(|end - start| / |step|) or 0."""
    ids = e.ints(list(range(rank)), "axis_ids") if rank is not None else \
        b.op1("Range", [e.ints(0, "zero"), e.reduce("ReduceSum", b.op1("Shape", [shape]), (0,), keepdims=0),
                        e.ints(1, "one_step")])
    zero = e.ints([0], "zero_1d")
    result = shape
    for j, axis, size, step, start in sliced_axes:
        end = _piece(b, e, ends, j, j + 1)
        end = b.op1("Where", [b.op1("Less", [end, e.ints(0, "zero")]), b.op1("Add", [end, size]), end])
        if steps is None:
            length = b.op1("Max", [b.op1("Sub", [b.op1("Min", [b.op1("Max", [end, zero]), size]), start]), zero])
        else:
            forward = b.op1("Greater", [step, e.ints(0, "zero")])
            lowest = b.op1("Where", [forward, zero, e.ints([-1], "minus_one")])
            highest = b.op1("Where", [forward, size, b.op1("Sub", [size, e.ints([1], "one")])])
            end = b.op1("Min", [b.op1("Max", [end, lowest]), highest])
            # with |step| and the distance in the step's direction both >= 0, Div's floor is its truncation
            stride = b.op1("Abs", [step])
            distance = b.op1("Max", [b.op1("Where", [forward, b.op1("Sub", [end, start]), b.op1("Sub", [start, end])]),
                                     zero])
            length = b.op1("Div", [b.op1("Sub", [b.op1("Add", [distance, stride]), e.ints([1], "one")]), stride])
        result = b.op1("Where", [b.op1("Equal", [ids, axis if isinstance(axis, str) else e.ints(axis, "axis_id")]),
                                 length, result])
    return result


# -- ConcatTraining and SplitTraining --------------------------------------------------------------

@register_rule("concat_training", targets=TARGETS)
def lower_concat_training(b: NodeBuilder, request: LoweringRequest) -> None:
    inference = request.inference
    axis = int(inference.attributes["axis"])
    values = [v for v in inference.inputs if v is not None]
    result = request.output("concat_result")
    if result is not None:
        b.op1("Concat", values, result, axis=axis)
    lengths_out = request.output("per_input_length")
    if lengths_out is None:
        return
    e = Emitter(b, TensorProto.FLOAT)
    known = []
    for t in inference.input_types:
        rank = None if t is None or t.shape is None else len(t.shape)
        dim = None if rank is None else t.shape[axis % rank]
        known.append(dim if isinstance(dim, int) else None)
    if all(n is not None for n in known):
        b.op("Constant", [], [lengths_out], value=helper.make_tensor(lengths_out, TensorProto.INT64, [len(known)],
                                                                      known))
        return
    end = axis + 1 if axis != -1 else INT64_MAX  # Slice's end: axis -1 runs to the end
    pieces = [_piece(b, e, b.op1("Shape", [v]), axis, end) for v in values]
    b.op1("Concat", pieces, lengths_out, axis=0)


@register_rule("split_training", targets=TARGETS)
def lower_split_training(b: NodeBuilder, request: LoweringRequest) -> None:
    inference = request.inference
    axis = int(inference.attributes.get("axis", 0))
    outputs = [name if name and name in request.wanted else None for name in inference.outputs]
    if not any(outputs):
        return
    data, split = request.input("input"), request.input("split")
    e = Emitter(b, TensorProto.FLOAT)
    entries = _static_length(request, "split")
    if entries != len(outputs):  # empty (equal pieces, as onnxruntime's kernel cuts), or unknown: either
        split = _equal_split(b, e, request, data, split, axis, len(outputs), entries)
    if request.options.target == "onnxruntime" and b.opset >= SPLIT_INPUT_SINCE:
        names = [name or b.fresh("unused_piece") for name in outputs]
        b.op("Split", [data, split], names, axis=axis)
        return
    for i, name in enumerate(outputs):
        if name is None:
            continue
        start = e.ints([0], "zero_1d") if i == 0 else e.reduce("ReduceSum", _piece(b, e, split, 0, i), (0,))
        end = b.op1("Add", [start, _piece(b, e, split, i, i + 1)])
        b.op1("Slice", [data, start, end, e.ints([axis], "split_axis")], name)


def _equal_split(b: NodeBuilder, e: Emitter, request: LoweringRequest, data: str, split: str, axis: int, count: int,
                 entries: int | None) -> str:
    """The lengths of ``count`` equal pieces of ``data`` along ``axis`` (a Constant when that length is static;
    verification refused a static length that does not divide), for an empty ``split``; when ``split``'s length
    is not static, the first ``count`` entries of ``split`` followed by the equal lengths (``split`` itself
    unless it is empty)."""
    t = request.inference.input_types[request.inference.schema.input_index("input")]
    dim = None if t is None or t.shape is None else t.shape[axis]
    if isinstance(dim, int):
        equal = e.ints([dim // count] * count, "equal_split")
    else:
        length = _piece(b, e, b.op1("Shape", [data]), axis, axis + 1 if axis != -1 else INT64_MAX)
        equal = b.op1("Expand", [b.op1("Div", [length, e.ints([count], "pieces")]), e.ints([count], "pieces")])
    if entries == 0:
        return equal
    return _piece(b, e, b.op1("Concat", [split, equal], axis=0), 0, count)
