"""Gradient rules: normalization and its neighbours (BatchNormalization, LayerNormalization, Softmax, LogSoftmax,
Dropout)."""

from __future__ import annotations

import numpy as np
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


# -- Softmax, LogSoftmax ----------------------------------------------------------------------------------------

def _softmax_axis(ctx: GradientContext) -> int:
    """The node's axis (opset 13 on: default -1, one axis; before: default 1, the axes from there on)."""
    return int(ctx.attr("axis", -1 if ctx.f.opset >= 13 else 1))


@gradient_rule("Softmax")
def softmax(ctx: GradientContext) -> None:
    """dX = Y (dY - sum(dY Y)) as onnxruntime-training writes it: SoftmaxGrad_13 (opset 13 on, one axis) or
    SoftmaxGrad (the coerced-2D form before)."""
    op = "SoftmaxGrad_13" if ctx.f.opset >= 13 else "SoftmaxGrad"
    ctx.set_dx(0, ctx.f.node1(op, [ctx.dy(0), ctx.y(0)], ctx.f.fresh(f"{ctx.x(0)}_grad"), domain=MS,
                              axis=_softmax_axis(ctx)))


@gradient_rule("LogSoftmax")
def log_softmax(ctx: GradientContext) -> None:
    """dX = dY - exp(Y) sum(dY): LogSoftmaxGrad_13 (opset 13 on) or LogSoftmaxGrad (before)."""
    op = "LogSoftmaxGrad_13" if ctx.f.opset >= 13 else "LogSoftmaxGrad"
    ctx.set_dx(0, ctx.f.node1(op, [ctx.dy(0), ctx.y(0)], ctx.f.fresh(f"{ctx.x(0)}_grad"), domain=MS,
                              axis=_softmax_axis(ctx)))


# -- LayerNormalization -----------------------------------------------------------------------------------------

def _stash_elem(node: onnx.NodeProto) -> int:
    """The element type of Mean and InvStdDev: stash_type (default 1, float)."""
    return int(_attr(node, "stash_type", 1)) or onnx.TensorProto.FLOAT


def _layer_norm_stats(node: onnx.NodeProto, f: ForwardContext) -> list[onnx.NodeProto] | None:
    """torch exports LayerNormalization with Y only; its gradient reads the optional Mean and InvStdDev outputs
    (one value per row, the normalized axes kept as size 1): name them."""
    outputs = list(node.output) + [""] * (3 - len(node.output))
    if outputs[1] and outputs[2]:
        return None
    y = outputs[0]
    x_shape = f.shape(node.input[0])
    axis = int(_attr(node, "axis", -1))
    stats_shape = None
    if x_shape is not None:
        axis %= len(x_shape)
        stats_shape = list(x_shape[:axis]) + [1] * (len(x_shape) - axis)
    for i, suffix in ((1, "mean"), (2, "inv_std_dev")):
        if not outputs[i]:
            outputs[i] = f.fresh(f"{y}.{suffix}")
            f.types[outputs[i]] = helper.make_tensor_type_proto(_stash_elem(node), stats_shape)
    new = onnx.NodeProto()
    new.CopyFrom(node)
    del new.output[:]
    new.output.extend(outputs)
    return [new]


@gradient_rule("LayerNormalization", differentiable=(0, 1, 2), prepare=_layer_norm_stats)
def layer_normalization(ctx: GradientContext) -> None:
    """LayerNormalizationGrad(dY, X, scale, Mean, InvStdDev) -> dX, dScale, dB with the forward node's axis,
    epsilon and stash_type, as onnxruntime-training writes it (all three outputs: its schema requires them)."""
    f = ctx.f
    if ctx.dy(1) is not None or ctx.dy(2) is not None:
        raise ctx.fail("a gradient flows into the Mean or InvStdDev output, which has no gradient rule")
    if not ctx.y(1) or not ctx.y(2):
        raise ctx.fail("the node has no Mean/InvStdDev outputs (the prepare step adds them)")
    names = [f.fresh(f"{ctx.x(i) or ctx.y(0) + '_bias'}_grad") for i in range(3)]
    f.node("LayerNormalizationGrad", [ctx.dy(0), ctx.x(0), ctx.x(1), ctx.y(1), ctx.y(2)], names, domain=MS,
           axis=int(ctx.attr("axis", -1)), epsilon=float(ctx.attr("epsilon", 1e-5)),
           stash_type=int(ctx.attr("stash_type", 1)))
    for i, name in enumerate(names):
        ctx.set_dx(i, name)


# -- Dropout ----------------------------------------------------------------------------------------------------

def _dropout_mode(node: onnx.NodeProto, f: ForwardContext) -> str:
    """"train" (training_mode a constant true), "inference" (absent, a constant false, or an opset before 12,
    whose Dropout onnxruntime runs as an identity) or "dynamic" (a runtime value)."""
    if f.opset < 12 or len(node.input) < 3 or not node.input[2]:
        return "inference"
    value = f.constant(node.input[2])
    if value is None:
        return "dynamic"
    return "train" if bool(np.asarray(value).ravel()[0]) else "inference"


def _dropout_mask(node: onnx.NodeProto, f: ForwardContext) -> list[onnx.NodeProto] | None:
    """A training-mode Dropout's gradient reads its mask output: name it where the node has none."""
    if _dropout_mode(node, f) == "inference" or (len(node.output) > 1 and node.output[1]):
        return None
    new = onnx.NodeProto()
    new.CopyFrom(node)
    while len(new.output) < 2:
        new.output.append("")
    new.output[1] = f.fresh(f"{node.output[0]}.mask")
    f.types[new.output[1]] = helper.make_tensor_type_proto(onnx.TensorProto.BOOL, f.shape(node.input[0]))
    return [new]


def _dropout_eval(node: onnx.NodeProto, f: ForwardContext) -> list[onnx.NodeProto] | None:
    """Inference mode in the eval model: the training_mode input dropped (Dropout(data, ratio) is the identity)."""
    if len(node.input) < 3 or not node.input[2]:
        return None
    new = onnx.NodeProto()
    new.CopyFrom(node)
    del new.input[2:]
    while new.input and not new.input[-1]:
        del new.input[-1]
    return [new]


@gradient_rule("Dropout", prepare=_dropout_mask, eval_form=_dropout_eval)
def dropout(ctx: GradientContext) -> None:
    """Training mode: DropoutGrad(dY, mask, ratio, training_mode) as onnxruntime-training writes it (dY scaled
    by 1/(1-ratio) where the mask kept the input). Inference mode (no training_mode, as nn.MultiheadAttention's
    attention dropout exports, or a constant false): the node is the identity and so is its gradient -- where
    onnxruntime-training would scale by 1/(1-ratio) a value its forward never scaled. A runtime training_mode
    chooses between the two with Where."""
    f = ctx.f
    mode = _dropout_mode(ctx.node, f)
    dy = ctx.dy(0)
    if mode == "inference":
        ctx.set_dx(0, dy)
        return
    if not ctx.y(1):
        raise ctx.fail("the training-mode Dropout has no mask output (the prepare step adds it)")
    inputs = [dy, ctx.y(1), *ctx.node.input[1:]]
    while inputs and not inputs[-1]:
        inputs.pop()
    if mode == "train":
        ctx.set_dx(0, f.node1("DropoutGrad", inputs, f.fresh(f"{ctx.x(0)}_grad"), domain=MS))
        return
    grad = f.node1("DropoutGrad", inputs, domain=MS)
    ctx.set_dx(0, f.node1("Where", [ctx.x(2), grad, dy], f.fresh(f"{ctx.x(0)}_grad")))
