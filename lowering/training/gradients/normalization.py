"""Gradient rules: normalization and its neighbours (BatchNormalization, ...)."""

from __future__ import annotations

import onnx
from onnx import helper

from lowering.training.gradients.context import ForwardContext, GradientContext
from lowering.training.gradients.registry import gradient_rule

MS = "com.microsoft"


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _batch_norm_internal(node: onnx.NodeProto, f: ForwardContext) -> list[onnx.NodeProto]:
    """Every BatchNormalization trains with batch statistics, as onnxruntime-training's generator makes it (also
    one exported in inference mode): BatchNormInternal with training_mode 1 and the saved statistics its
    gradient reads."""
    outputs = list(node.output) + [""] * (3 - len(node.output))
    y = outputs[0]
    running = [o or f.fresh(f"{y}_running_{k}") for o, k in zip(outputs[1:3], ("mean", "var"), strict=True)]
    saved = [f.fresh(f"{y}_saved_mean"), f.fresh(f"{y}_saved_inv_std")]
    new = helper.make_node("BatchNormInternal", list(node.input), [y, *running, *saved],
                           name=f"{node.name}_BatchNormInternal" if node.name else f.fresh("BatchNormInternal"),
                           domain=MS, epsilon=float(_attr(node, "epsilon", 1e-5)),
                           momentum=float(_attr(node, "momentum", 0.9)), training_mode=1)
    return [new]


def _batch_norm_eval(node: onnx.NodeProto, f: ForwardContext) -> list[onnx.NodeProto]:
    """Inference mode in the eval model: the running statistics, one output (valid ONNX, also where
    onnxruntime-training's eval model keeps three outputs and fails to load)."""
    new = helper.make_node("BatchNormalization", list(node.input), [node.output[0]], name=node.name,
                           epsilon=float(_attr(node, "epsilon", 1e-5)), momentum=float(_attr(node, "momentum", 0.9)))
    return [new]


@gradient_rule("BatchNormInternal", domain=MS, differentiable=(0, 1, 2))
def batch_norm_internal(ctx: GradientContext) -> None:
    f = ctx.f
    outs = [f.fresh(f"{ctx.x(i)}_grad") if ctx.requires(i) else "" for i in range(3)]
    while outs and not outs[-1]:
        outs.pop()
    f.node("BatchNormalizationGrad", [ctx.dy(0), ctx.x(0), ctx.x(1), ctx.y(3), ctx.y(4)], outs, domain=MS,
           epsilon=float(ctx.attr("epsilon", 1e-5)))
    for i, name in enumerate(outs):
        if name:
            ctx.set_dx(i, name)


@gradient_rule("BatchNormalization", differentiable=(0, 1, 2), prepare=_batch_norm_internal,
               eval_form=_batch_norm_eval)
def batch_norm_frozen(ctx: GradientContext) -> None:
    """A BatchNormalization kept in inference mode (``keep_inference_batch_norm``): frozen statistics,
    Y = scale * (X - mean) / sqrt(var + eps) + B."""
    f = ctx.f
    eps = float(ctx.attr("epsilon", 1e-5))
    x, scale, mean, var = ctx.x(0), ctx.x(1), ctx.x(3), ctx.x(4)
    rank = f.rank(x)
    if rank is None:
        raise ctx.fail("the input's rank is unknown")
    axes = [0] + list(range(2, rank))
    dtype = f.np_dtype(var)
    import numpy as np  # noqa: PLC0415

    inv = f.node1("Reciprocal", [f.node1("Sqrt", [f.node1("Add", [var, f.const(np.asarray(eps, dtype))])])])
    shape = f.const(np.asarray([-1] + [1] * (rank - 2), np.int64), hint="channel_shape")
    dy = ctx.dy(0)
    if ctx.requires(0):
        ctx.set_dx(0, f.node1("Mul", [dy, f.node1("Reshape", [f.node1("Mul", [scale, inv]), shape])]))
    if ctx.requires(1):
        xhat = f.node1("Mul", [f.node1("Sub", [x, f.node1("Reshape", [mean, shape])]),
                               f.node1("Reshape", [inv, shape])])
        ctx.set_dx(1, f.reduce("ReduceSum", f.node1("Mul", [dy, xhat]), axes, keepdims=0))
    if ctx.requires(2):
        ctx.set_dx(2, f.reduce("ReduceSum", dy, axes, keepdims=0))
