"""Shape arithmetic folded where shapes are static: ``Shape`` and ``Size`` of a tensor whose shape is known when
the model is lowered become constants.

Training graphs carry such chains: onnxruntime-training's gradient builder writes ReduceMean's gradient as
``Size(x) / Size(y)`` and ``Expand(.., Shape(x))``, torch exports ``Shape -> Gather -> Concat -> Reshape``. Each
is a kernel per step. onnxruntime folds a ``Shape`` of a statically shaped input when it loads a model, but not a
``Size`` (the held-out ConvNeXt's step ran 10 of them), and it only knows the shapes its own inference found,
without onnx's data propagation (a shape that flows through ``Shape -> Expand`` stays unknown to it). Once the
``Shape``/``Size`` nodes are constants, the rest of each chain (Div, Gather, Concat ...) has constant inputs
only, and every runtime folds it when it loads the model.

Shapes come from onnx's shape inference with data propagation, the same functions onnxruntime trusts when it
folds a ``Shape``. One place where onnx's inference is known to disagree with the runtimes: a ceil-mode pool
whose last window starts in the end padding (onnx counts that window, onnxruntime and onnx.reference drop it). A
model with such a pool (or a ceil-mode pool of an input shape not known) is left as it is.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

_POOLS = ("AveragePool", "MaxPool", "LpPool")


def fold_static_shapes(model: onnx.ModelProto) -> int:
    """Replace, in ``model``'s main graph, each ``Shape`` / ``Size`` whose value the inferred shapes fix (every
    dim a ``Size`` multiplies, or a ``Shape`` reads with its start / end: [1:] of [batch, 8] is [8]) by a
    ``Constant`` of it (same output name); returns how many were folded. Subgraphs are left alone."""
    graph = model.graph
    if not any(n.op_type in ("Shape", "Size") for n in graph.node):
        return 0
    shapes = static_shapes(model)
    if any(_window_in_end_padding(n, shapes) for n in graph.node):
        return 0
    folded = 0
    for index, node in enumerate(graph.node):
        if node.op_type not in ("Shape", "Size") or node.domain not in ("", "ai.onnx") or not node.input:
            continue
        dims = shapes.get(node.input[0])
        if dims is not None and node.op_type == "Shape":
            dims = dims[_shape_slice(node, len(dims))]
        if dims is None or None in dims:
            continue
        value = np.array(math.prod(dims) if node.op_type == "Size" else dims, np.int64)
        constant = helper.make_node("Constant", [], [node.output[0]], name=node.name,
                                    value=numpy_helper.from_array(value, node.output[0]))
        graph.node[index].CopyFrom(constant)
        folded += 1
    return folded


def static_shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """The inferred shapes (onnx's inference with data propagation) of main-graph values of known rank: a dim's
    size, or None where it is not static."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 -- a model onnx's inference cannot read: nothing is known
        return {}
    shapes = {t.name: list(t.dims) for t in inferred.graph.initializer}
    for value in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        tensor = value.type.tensor_type
        if value.type.HasField("tensor_type") and tensor.HasField("shape"):
            shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    return shapes


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
        begin, end = pads[axis], pads[axis + spatial]
        extent = (kernel[axis] - 1) * dilations[axis] + 1
        windows = -(-(size + begin + end - extent) // strides[axis]) + 1  # ceil
        if (windows - 1) * strides[axis] >= size + begin:
            return True
    return False
