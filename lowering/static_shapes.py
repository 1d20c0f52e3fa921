"""Shape arithmetic folded where shapes are static: ``Shape`` and ``Size`` of a tensor whose shape is known when
the model is lowered become constants, and so does the small integer arithmetic on them.

Training graphs carry such chains: onnxruntime-training's gradient builder writes ReduceMean's gradient as
``Size(x) / Size(y)`` and ``Expand(.., Shape(x))``, torch exports ``Shape -> Gather -> Concat -> Reshape``. Each
is a kernel per step. onnxruntime folds a ``Shape`` of a statically shaped input when it loads a model, but not a
``Size`` (the held-out ConvNeXt's step ran 10 of them), and it only knows the shapes its own inference found (a
shape that flows through ``Shape -> Expand`` stays unknown to it, and so do the shapes after it). Here each round
runs onnx's shape inference, folds what it fixes (``Shape``/``Size``, then Gather, Slice, Concat ... of
constants, evaluated by onnx.reference), and the next round sees the shapes the folded constants give (a Reshape
or Expand to a constant shape). onnx's own data propagation would follow the chains in one pass, but on a
MobileNetV2 train step it held 650 MB of the process for good.

The shapes are onnx's inference, which onnxruntime trusts too when it folds a ``Shape``. One place where it is
known to disagree with the runtimes: a ceil-mode pool whose last window starts in the end padding (onnx counts
that window, onnxruntime and onnx.reference drop it). A model with such a pool (or a ceil-mode pool of an input
shape not known) is left as it is.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

from lowering.graphs import default_opset

_POOLS = ("AveragePool", "MaxPool", "LpPool")


def fold_static_shapes(model: onnx.ModelProto) -> int:
    """Replace, in ``model``'s main graph, each ``Shape`` / ``Size`` whose value the inferred shapes fix (every
    dim a ``Size`` multiplies, or a ``Shape`` reads with its start / end: [1:] of [batch, 8] is [8]) by a
    ``Constant`` of it (same output name), and the small integer arithmetic on such constants after it (Gather,
    Slice, Concat ... of shapes: :data:`_ARITHMETIC`) by its value, again and again while shape inference finds
    more (a Reshape or Expand to a folded shape has a static shape next time); returns how many nodes were folded.
    Subgraphs are left alone."""
    graph = model.graph
    if not any(n.op_type in ("Shape", "Size") for n in graph.node):
        return 0  # nothing to start from (constant arithmetic alone the runtimes fold themselves)
    opset = default_opset(model.opset_import)
    if opset is None:
        return 0
    folded = 0
    for _ in range(_ROUNDS):
        shapes = static_shapes(model)
        if any(_window_in_end_padding(n, shapes) for n in graph.node):
            return folded
        constants = _constants(graph)
        now = 0
        for index, node in enumerate(graph.node):
            kept = _where_kept(node, shapes, constants)
            if kept is not None:  # a Where whose constant condition picks one operand whole
                graph.node[index].CopyFrom(helper.make_node("Identity", [kept], [node.output[0]], name=node.name))
                now += 1
                continue
            value = _value(node, shapes, constants, opset)
            if value is None:
                continue
            constants[node.output[0]] = value
            graph.node[index].CopyFrom(helper.make_node("Constant", [], [node.output[0]], name=node.name,
                                                        value=numpy_helper.from_array(value, node.output[0])))
            now += 1
        folded += now
        if not now:
            break
    return folded


def static_shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """The inferred shapes (onnx's shape inference) of main-graph values of known rank: a dim's size, or None where
    it is not static. Without onnx's data propagation: on a MobileNetV2 train step it held 650 MB of the process's
    memory for good; :func:`fold_static_shapes` folds the shape arithmetic it would have followed instead."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 -- a model onnx's inference cannot read: nothing is known
        return {}
    shapes = {t.name: list(t.dims) for t in inferred.graph.initializer}
    for value in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        tensor = value.type.tensor_type
        if value.type.HasField("tensor_type") and tensor.HasField("shape"):
            shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    return shapes


_ROUNDS = 8  # folding rounds (each one shape inference); torch's Shape -> Gather -> Unsqueeze -> Concat takes 2
# integer ops on constants evaluated at lowering time (outputs of at most _SMALL elements): shape arithmetic
_ARITHMETIC = ("Gather", "Slice", "Concat", "Unsqueeze", "Squeeze", "Reshape", "Identity", "Cast", "Add", "Sub",
               "Mul", "Div", "Neg", "Max", "Min", "ReduceProd", "Equal", "Where", "Range",
               # index checks on constant indices (GatherGrad's, once a symbolic batch is fixed)
               "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Not", "Abs", "Mod", "ReduceSum",
               "ReduceMin", "ReduceMax", "Expand")
_SMALL = 64


def _constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Small integer values the main graph holds as initializers (none a caller may feed: not a graph input) or
    Constant nodes (filtered before decoding: a train step's weights are initializers of no interest here)."""
    found = {}
    inputs = {i.name for i in graph.input}
    for tensor in graph.initializer:
        if tensor.name not in inputs and helper.tensor_dtype_to_np_dtype(tensor.data_type).kind in "iub" \
                and math.prod(tensor.dims) <= _SMALL:
            found[tensor.name] = numpy_helper.to_array(tensor)
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            attr = next((a for a in node.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR),
                        None)
            if attr is not None and helper.tensor_dtype_to_np_dtype(attr.t.data_type).kind in "iub" \
                    and math.prod(attr.t.dims) <= _SMALL:
                found[node.output[0]] = numpy_helper.to_array(attr.t)
    return found


def _value(node: onnx.NodeProto, shapes: dict[str, list[int | None]], constants: dict[str, np.ndarray],
           opset: int) -> np.ndarray | None:
    """The value of a foldable node: a Shape / Size its input's shape fixes, or small integer arithmetic on
    constants (evaluated by onnx.reference); else None."""
    if node.domain not in ("", "ai.onnx") or len(node.output) != 1:
        return None
    if node.op_type in ("Shape", "Size") and node.input:
        dims = shapes.get(node.input[0])
        if dims is not None and node.op_type == "Shape":
            dims = dims[_shape_slice(node, len(dims))]
        if dims is None or None in dims:
            return None
        return np.array(math.prod(dims) if node.op_type == "Size" else dims, np.int64)
    if node.op_type not in _ARITHMETIC or not node.input or any(i and i not in constants for i in node.input):
        return None
    out = shapes.get(node.output[0])
    if out is not None and None not in out and math.prod(out) > _SMALL:
        return None
    try:
        value = _evaluate(node, constants, opset)
    except Exception:  # noqa: BLE001 -- what onnx.reference cannot evaluate stays a node
        return None
    if value.dtype.kind not in "iub" or value.size > _SMALL:
        return None
    return value


def _where_kept(node: onnx.NodeProto, shapes: dict[str, list[int | None]], constants: dict[str, np.ndarray]
                ) -> str | None:
    """The operand a ``Where`` returns as it is, when its condition is a constant of one value throughout and that
    operand has the output's static shape (the condition broadcasts without growing it), else None."""
    if node.op_type != "Where" or node.domain not in ("", "ai.onnx") or len(node.input) != 3:
        return None
    condition = constants.get(node.input[0])
    if condition is None or condition.dtype != np.bool_ or condition.size == 0:
        return None
    if condition.all():
        kept = node.input[1]
    elif not condition.any():
        kept = node.input[2]
    else:
        return None
    out, operand = shapes.get(node.output[0]), shapes.get(kept)
    if out is None or operand != out or None in out or len(condition.shape) > len(out):
        return None
    return kept


def _evaluate(node: onnx.NodeProto, constants: dict[str, np.ndarray], opset: int) -> np.ndarray:
    from onnx.reference import ReferenceEvaluator

    inputs = [i for i in node.input if i]
    graph = helper.make_graph([node], "fold", [], [helper.make_tensor_value_info(node.output[0], 0, None)],
                              initializer=[numpy_helper.from_array(np.asarray(constants[i]), i) for i in inputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return np.asarray(ReferenceEvaluator(model).run(None, {})[0])


def _shape_slice(node: onnx.NodeProto, rank: int) -> slice:
    """Shape's ``start`` / ``end`` (opset 15) as a slice: negative counts from the back, clamped to [0, rank]."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}

    def clamp(v: int) -> int:
        return min(max(v + rank if v < 0 else v, 0), rank)

    return slice(clamp(int(attrs.get("start", 0))), clamp(int(attrs.get("end", rank))))


def _window_in_end_padding(node: onnx.NodeProto, shapes: dict[str, list[int | None]]) -> bool:
    """A ceil-mode pool whose last window, as onnx's inference counts them, starts past the input and its begin
    padding (onnxruntime and onnx.reference drop that window); True also where the input's size is not known."""
    if node.op_type not in _POOLS or node.domain not in ("", "ai.onnx"):
        return False
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if not attrs.get("ceil_mode", 0):
        return False
    dims = shapes.get(node.input[0])
    kernel = list(attrs.get("kernel_shape", []))
    if dims is None or len(dims) != len(kernel) + 2 or None in dims[2:] or attrs.get("auto_pad", b"NOTSET") not in (
            b"NOTSET", "NOTSET"):
        return True
    spatial = len(kernel)
    strides = list(attrs.get("strides", [1] * spatial))
    dilations = list(attrs.get("dilations", [1] * spatial))
    pads = list(attrs.get("pads", [0] * 2 * spatial))
    for axis, size in enumerate(dims[2:]):
        extent = (kernel[axis] - 1) * dilations[axis] + 1
        counted, kept = ceil_windows(size, pads[axis], pads[axis + spatial], extent, strides[axis])
        if counted != kept:
            return True
    return False


def ceil_windows(size: int, begin: int, end: int, extent: int, stride: int) -> tuple[int, int]:
    """A ceil-mode pool's windows along one axis (input ``size``, pads ``begin`` / ``end``, a window ``extent``
    positions wide): (onnx's inference's count, the runtimes' count, which drops a last window that would start in
    the end padding)."""
    counted = -(-(size + begin + end - extent) // stride) + 1
    return counted, counted - 1 if (counted - 1) * stride >= size + begin else counted
