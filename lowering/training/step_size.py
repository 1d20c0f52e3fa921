"""How much arithmetic one train step does, to choose onnxruntime's settings for it.

A step of a tiny network (a classifier head, a sensor LSTM, a MobileNet at a few samples) is hundreds of kernels
of a few microseconds each; a second intra-op thread only adds the cost of handing work to it, and the memory
pattern (one block planned from the first run) saves an allocation per kernel. Measured on the committed tiny
artifacts (`tools/ab_train_step.py`, docs/performance.md "Small steps"): 1 thread with the memory pattern is
0.53-0.86x of the 2-thread step; from a ResNet-CIFAR at batch 4 (198M multiply-accumulates) or a BERT-mini at
batch 1 (82M) on, 2 threads win, and at full size the memory pattern only raises the peak. The count is the
multiply-accumulates of the Conv, ConvTranspose, MatMul and Gemm kernels of the lowered step, from its static
shapes (None where a shape is not static: the batch is then unknown and nothing is assumed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import onnx

from lowering.static_shapes import fold_static_shapes, static_shapes

SMALL_STEP_MACS = 16_000_000  # below the smallest measured step where a second thread paid (50M: 1 thread 0.66x)
_COUNTED = ("Conv", "ConvTranspose", "MatMul", "Gemm", "FusedMatMul")


def multiply_accumulates(model: onnx.ModelProto, limit: int | None = None) -> int | None:
    """The multiply-accumulates of the model's Conv/ConvTranspose/MatMul/Gemm nodes (main graph), None when one
    of their shapes is not static. Stops counting above ``limit``."""
    shapes = static_shapes(model)
    total = 0
    for node in model.graph.node:
        if node.op_type not in _COUNTED or len(node.input) < 2:
            continue
        out, a, b = (shapes.get(n) for n in (node.output[0], node.input[0], node.input[1]))
        if not out or not a or not b or None in out or None in a or None in b:
            return None
        total += math.prod(out) * _reduced_length(node, a, b)
        if limit is not None and total > limit:
            return total
    return total


def _reduced_length(node: onnx.NodeProto, a: list[int], b: list[int]) -> int:
    """How many products each output element sums."""
    if node.op_type == "Conv":
        return math.prod(b[1:])  # C/group x kernel
    if node.op_type == "ConvTranspose":
        group = next((x.i for x in node.attribute if x.name == "group"), 1)
        return b[0] // max(group, 1) * math.prod(b[2:])
    if node.op_type == "Gemm":
        trans_a = next((x.i for x in node.attribute if x.name == "transA"), 0)
        return a[0] if trans_a else a[-1]
    if node.op_type == "FusedMatMul":
        trans_a = next((x.i for x in node.attribute if x.name == "transA"), 0)
        return a[-2] if trans_a and len(a) > 1 else a[-1]
    return a[-1]  # MatMul


def is_small_step(model: onnx.ModelProto) -> bool:
    """At most SMALL_STEP_MACS multiply-accumulates, every counted shape static."""
    return step_is_small(model) is True


def step_is_small(model: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]] | None = None) -> bool | None:
    """Whether the step is small (at most SMALL_STEP_MACS multiply-accumulates); None when a counted shape is not
    static. ``input_shapes`` fix graph inputs' dims first (a symbolic batch: the shapes of the batch at hand)."""
    if input_shapes:  # the dims fixed, the shape arithmetic on them is folded as lowering folds a static graph's
        model = with_input_shapes(model, input_shapes)
        fold_static_shapes(model)
    count = multiply_accumulates(model, limit=SMALL_STEP_MACS)
    return None if count is None else count <= SMALL_STEP_MACS


def with_input_shapes(model: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph inputs named in ``input_shapes`` declare those dims (same rank only)."""
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for value in fixed.graph.input:
        shape = input_shapes.get(value.name)
        dims = value.type.tensor_type.shape.dim
        if shape is None or not value.type.tensor_type.HasField("shape") or len(dims) != len(shape):
            continue
        for dim, size in zip(dims, shape, strict=True):
            dim.Clear()
            dim.dim_value = int(size)
    return fixed
