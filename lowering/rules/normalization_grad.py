"""Lowering of onnxruntime-training's softmax and normalization ops (``specs/com.microsoft/SoftmaxGrad.rst``,
``SoftmaxGrad_13.rst``, ``LogSoftmaxGrad.rst``, ``LogSoftmaxGrad_13.rst``, ``LayerNormalizationGrad.rst``,
``SimplifiedLayerNormalizationGrad.rst``, ``specs/onnx.training/SimplifiedLayerNormalization.rst``).

- SoftmaxGrad*: ``Y * (dY - ReduceSum(dY * Y))``; LogSoftmaxGrad*: ``dY - Exp(X) * ReduceSum(dY)``. The binding's
  options say which: ``log``, and ``reduce`` = ``trailing`` (the pre-13 ops: every axis from ``axis`` on, what
  the forward op's 2D view normalized) or ``axis`` (the ``_13`` ops: that axis alone).
- LayerNormalizationGrad / SimplifiedLayerNormalizationGrad: on the centred, normalized ``xhat = (X - mean) * r``
  (``X * r``), from the forward node's statistics as given: ``bias_grad = ReduceSum_rows(dY)``,
  ``scale_grad = ReduceSum_rows(dY * xhat)``, ``X_grad = r * (g - mean(g) - xhat * mean(g * xhat))`` with
  ``g = dY * scale`` (no ``mean(g)`` term for the simplified one). Nothing raw is subtracted from anything raw,
  so a row whose mean is far from 0 loses no digits (DESIGN.md section 5).
- SimplifiedLayerNormalization: ``r = 1 / Sqrt(ReduceMean(X * X) + epsilon)``, ``Y = X * r * scale``.

f16/bf16 are cast up to f32 once and rounded once; f64 computes in f64. One form for both targets: elementwise
ops, Reduce*, Shape/Slice/Concat/Reshape (lowering.rules.PORTABLE_OPS). Only requested outputs are computed.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from lowering.builder import NodeBuilder
from lowering.emit_common import Emitter, compute_type
from lowering.rules import TARGETS, LoweringRequest, register_rule
from lowering.rules.elementwise_grad import input_elem


def _rank_and_axis(request: LoweringRequest) -> tuple[int, int]:
    rank = request.inference.rank
    if rank is None:
        raise request.error("the rank of X must be known to lower it (the reduced axes depend on it)")
    return rank, int(request.inference.attributes.get("axis", -1)) % rank


@register_rule("softmax_grad", targets=TARGETS)
def lower_softmax_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    out = request.output("dX")
    if out is None:
        return
    binding = request.inference.binding
    options = dict(binding.options)
    axis = int(request.inference.attributes.get("axis", -1))
    if options.get("reduce") == "trailing":
        rank, axis = _rank_and_axis(request)
        axes = tuple(range(axis, rank))
    else:
        axes = (axis,)  # a negative axis is fine for ReduceSum: no rank needed
    io = input_elem(request, "dY")
    e = Emitter(b, compute_type(io))
    dy, y = e.up(request.input("dY"), io), e.up(request.input("Y"), io)
    if options.get("log"):
        total = e.reduce("ReduceSum", dy, axes)
        e.finish("Sub", [dy, b.op1("Mul", [b.op1("Exp", [y]), total])], out, io)
    else:
        total = e.reduce("ReduceSum", b.op1("Mul", [dy, y]), axes)
        e.finish("Mul", [y, b.op1("Sub", [dy, total])], out, io)


def _per_row(e: Emitter, request: LoweringRequest, role: str, x: str, rank: int, axis: int) -> str:
    """A per-row statistic in the computation type, shaped [rows..., 1, ...] to broadcast against X."""
    name = request.input(role)
    inference = request.inference
    spec_name = inference.binding.arg(role)
    value = e.up(name, input_elem(request, spec_name))
    declared = inference.input_types[inference.schema.input_index(spec_name)]
    if declared is not None and declared.shape is not None and len(declared.shape) == rank:
        return value  # already [rows..., 1, ...]
    b = e.b
    rows = b.op1("Slice", [b.op1("Shape", [x]), e.ints([0], "start"), e.ints([axis], "row_end")])
    shape = b.op1("Concat", [rows, e.ints([1] * (rank - axis), "ones")], axis=0)
    return b.op1("Reshape", [value, shape])


def _sum_rows(e: Emitter, value: str, axis: int, out: str, io: int) -> None:
    """Sum over the row axes (none when axis is 0: the value itself), written to ``out`` in type ``io``."""
    total = value if axis == 0 else e.reduce("ReduceSum", value, tuple(range(axis)), keepdims=0)
    e.cast(total, e.ct, io, out)


@register_rule("layer_norm_grad", targets=TARGETS)
def lower_layer_norm_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    outputs = {role: request.output(role) for role in ("dX", "dscale", "dbias")}
    if not any(outputs.values()):
        return
    rank, axis = _rank_and_axis(request)
    norm = tuple(range(axis, rank))
    io = input_elem(request, "X")
    e = Emitter(b, compute_type(io))
    x, dy = e.up(request.input("X"), io), e.up(request.input("dY"), io)
    inv = _per_row(e, request, "inv_std", x, rank, axis)
    simplified = request.inference.binding.arg("mean") is None
    centred = x if simplified else b.op1("Sub", [x, _per_row(e, request, "mean", x, rank, axis)])
    xhat = b.op1("Mul", [centred, inv])
    if outputs["dbias"]:
        _sum_rows(e, dy, axis, outputs["dbias"], io)
    if outputs["dscale"]:
        _sum_rows(e, b.op1("Mul", [dy, xhat]), axis, outputs["dscale"], io)
    if outputs["dX"]:
        g = b.op1("Mul", [dy, e.up(request.input("scale"), io)])
        projection = e.reduce("ReduceMean", b.op1("Mul", [g, xhat]), norm)
        inner = b.op1("Sub", [g, b.op1("Mul", [xhat, projection])])
        if not simplified:
            inner = b.op1("Sub", [inner, e.reduce("ReduceMean", g, norm)])
        e.finish("Mul", [inv, inner], outputs["dX"], io)


@register_rule("simplified_layer_norm", targets=TARGETS)
def lower_simplified_layer_norm(b: NodeBuilder, request: LoweringRequest) -> None:
    y_out, inv_out = request.output("Y"), request.output("saved_inv_std")
    if y_out is None and inv_out is None:
        return
    rank, axis = _rank_and_axis(request)
    io = input_elem(request, "X")
    e = Emitter(b, compute_type(io))
    x = e.up(request.input("X"), io)
    epsilon = float(np.float32(request.inference.attributes.get("epsilon", 1e-5)))
    mean_square = e.reduce("ReduceMean", b.op1("Mul", [x, x]), tuple(range(axis, rank)))
    inv = b.op1("Reciprocal", [b.op1("Sqrt", [b.op1("Add", [mean_square, e.scalar(epsilon, "epsilon")])])])
    if inv_out:
        e.cast(inv, e.ct, TensorProto.FLOAT, inv_out)
    if y_out:
        e.finish("Mul", [b.op1("Mul", [x, inv]), e.up(request.input("scale"), io)], y_out, io)
