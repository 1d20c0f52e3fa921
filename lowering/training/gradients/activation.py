"""Gradient rules: activations (Clip, LeakyRelu, Tanh, HardSigmoid, HardSwish, Elu, Selu, Celu, Softplus,
Softsign, PRelu, ThresholdedRelu).

Where onnxruntime-training's gradient builder uses a training op the rule emits it: Tanh -> ``TanhGrad(dY, Y)``,
LeakyRelu -> ``LeakyReluGrad(dY, Y)`` (for a positive slope; Y's sign is X's only then). Everything else is
standard ops in the forward type.

At the kinks the gradient is torch's (these activations come from torch exports): Clip is 0 at exactly min and
max (torch's hardtanh / ReLU6; onnxruntime-training passes the gradient there), HardSigmoid 0 at the ends of its
linear part, HardSwish 0 at -3 and 1 at 3, Elu / Selu / Celu and PRelu / LeakyRelu take the negative branch
at 0, ThresholdedRelu 0 at alpha.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from lowering.training.gradients.context import GradientContext
from lowering.training.gradients.registry import gradient_rule

MS = "com.microsoft"
SELU_ALPHA = 1.67326319217681884765625  # the ONNX defaults (float32 values)
SELU_GAMMA = 1.05070102214813232421875
_MASK_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16})


def _scalar(ctx: GradientContext, value: float, hint: str = "scalar") -> str:
    return ctx.f.const(np.asarray(value, ctx.f.np_dtype(ctx.x(0))), hint=hint)


def _where(ctx: GradientContext, cond: str, a: str, b: str) -> str:
    """Where(cond, a, b); where b is a constant 0 in float, double or float16 (a masked gradient), a * Cast(cond)
    instead: onnxruntime's CPU Where is ~7x slower than Cast + Mul (2.3-2.8 ns more per element on 2 threads, some
    60 ms of a MobileNetV2 CIFAR step at batch 32 with its 35 ReLU6), the choice the ReluGrad lowering made too."""
    f = ctx.f
    elem = f.elem_type(ctx.x(0))
    zero = next((t for t in f.initializers if t.name == b), None)
    if elem in _MASK_TYPES and zero is not None and zero.data_type == elem and \
            not np.any(numpy_helper.to_array(zero)):
        return f.node1("Mul", [a, f.node1("Cast", [cond], to=elem)])
    return f.node1("Where", [cond, a, b])


def _negative_branch_exp(ctx: GradientContext, scale: float | None = None) -> str:
    """exp(min(X, 0) * scale): the exponential of the negative branch, never overflowing on the positive side."""
    f = ctx.f
    x = f.node1("Min", [ctx.x(0), _scalar(ctx, 0.0, "zero")])
    if scale is not None and scale != 1.0:
        x = f.node1("Mul", [x, _scalar(ctx, scale)])
    return f.node1("Exp", [x])


@gradient_rule("Tanh")
def tanh(ctx: GradientContext) -> None:
    ctx.set_dx(0, ctx.f.node1("TanhGrad", [ctx.dy(0), ctx.y(0)], domain=MS))


@gradient_rule("LeakyRelu")
def leaky_relu(ctx: GradientContext) -> None:
    f, dy = ctx.f, ctx.dy(0)
    alpha = float(ctx.attr("alpha", 0.01))
    if alpha > 0:
        ctx.set_dx(0, f.node1("LeakyReluGrad", [dy, ctx.y(0)], domain=MS, alpha=alpha))
        return
    # a slope <= 0 makes Y's sign differ from X's: the mask from X
    positive = f.node1("Greater", [ctx.x(0), _scalar(ctx, 0.0, "zero")])
    ctx.set_dx(0, _where(ctx, positive, dy, f.node1("Mul", [dy, _scalar(ctx, alpha, "alpha")])))


@gradient_rule("Clip")
def clip(ctx: GradientContext) -> None:
    """dY where min < X < max (a bound that is absent does not mask), 0 elsewhere (also at exactly min or max,
    as torch's hardtanh and ReLU6)."""
    f, x, dy = ctx.f, ctx.x(0), ctx.dy(0)
    bounds = []
    for i, name, op in ((1, "min", "Greater"), (2, "max", "Less")):
        value = ctx.x(i)
        if not value:
            attr = ctx.attr(name)  # opset < 11: attributes
            if attr is None:
                continue
            if abs(float(attr)) >= float(np.finfo(np.float32).max):  # the old defaults: no bound
                continue
            value = _scalar(ctx, float(attr), name)
        bounds.append(f.node1(op, [x, value]))
    if not bounds:
        ctx.set_dx(0, dy)
        return
    inside = bounds[0] if len(bounds) == 1 else f.node1("And", bounds)
    ctx.set_dx(0, _where(ctx, inside, dy, _scalar(ctx, 0.0, "zero")))


@gradient_rule("HardSigmoid")
def hard_sigmoid(ctx: GradientContext) -> None:
    """Y = max(0, min(1, alpha X + beta)): alpha dY strictly inside the linear part (torch: -3 < X < 3)."""
    f, x, dy = ctx.f, ctx.x(0), ctx.dy(0)
    alpha, beta = float(ctx.attr("alpha", 0.2)), float(ctx.attr("beta", 0.5))
    if alpha == 0.0:
        ctx.set_dx(0, f.node1("Mul", [dy, _scalar(ctx, 0.0, "zero")]))
        return
    ends = sorted(((0.0 - beta) / alpha, (1.0 - beta) / alpha))
    inside = f.node1("And", [f.node1("Greater", [x, _scalar(ctx, ends[0], "low")]),
                             f.node1("Less", [x, _scalar(ctx, ends[1], "high")])])
    ctx.set_dx(0, _where(ctx, inside, f.node1("Mul", [dy, _scalar(ctx, alpha, "alpha")]),
                         _scalar(ctx, 0.0, "zero")))


@gradient_rule("HardSwish")
def hard_swish(ctx: GradientContext) -> None:
    """Y = X max(0, min(1, X/6 + 1/2)): 0 for X <= -3, dY (X/3 + 1/2) inside, dY for X >= 3 (torch's)."""
    f, x, dy = ctx.f, ctx.x(0), ctx.dy(0)
    slope = f.node1("Add", [f.node1("Div", [x, _scalar(ctx, 3.0, "three")]), _scalar(ctx, 0.5, "half")])
    inner = _where(ctx, f.node1("Greater", [x, _scalar(ctx, -3.0, "minus_three")]), f.node1("Mul", [dy, slope]),
                   _scalar(ctx, 0.0, "zero"))
    ctx.set_dx(0, _where(ctx, f.node1("Less", [x, _scalar(ctx, 3.0, "three")]), inner, dy))


@gradient_rule("Elu")
def elu(ctx: GradientContext) -> None:
    """dY for X > 0, dY alpha exp(X) otherwise (not Y + alpha, which cancels)."""
    f, dy = ctx.f, ctx.dy(0)
    alpha = float(ctx.attr("alpha", 1.0))
    negative = f.node1("Mul", [dy, f.node1("Mul", [_negative_branch_exp(ctx), _scalar(ctx, alpha, "alpha")])])
    ctx.set_dx(0, _where(ctx, f.node1("Greater", [ctx.x(0), _scalar(ctx, 0.0, "zero")]), dy, negative))


@gradient_rule("Selu")
def selu(ctx: GradientContext) -> None:
    f, dy = ctx.f, ctx.dy(0)
    alpha, gamma = float(ctx.attr("alpha", SELU_ALPHA)), float(ctx.attr("gamma", SELU_GAMMA))
    positive = f.node1("Mul", [dy, _scalar(ctx, gamma, "gamma")])
    negative = f.node1("Mul", [dy, f.node1("Mul", [_negative_branch_exp(ctx),
                                                  _scalar(ctx, gamma * alpha, "gamma_alpha")])])
    ctx.set_dx(0, _where(ctx, f.node1("Greater", [ctx.x(0), _scalar(ctx, 0.0, "zero")]), positive, negative))


@gradient_rule("Celu")
def celu(ctx: GradientContext) -> None:
    """Y = max(0, X) + min(0, alpha (exp(X / alpha) - 1)): dY for X > 0, dY exp(X / alpha) otherwise."""
    f, dy = ctx.f, ctx.dy(0)
    alpha = float(ctx.attr("alpha", 1.0))
    negative = f.node1("Mul", [dy, _negative_branch_exp(ctx, 1.0 / alpha)])
    ctx.set_dx(0, _where(ctx, f.node1("Greater", [ctx.x(0), _scalar(ctx, 0.0, "zero")]), dy, negative))


@gradient_rule("ThresholdedRelu")
def thresholded_relu(ctx: GradientContext) -> None:
    f = ctx.f
    alpha = float(ctx.attr("alpha", 1.0))
    above = f.node1("Greater", [ctx.x(0), _scalar(ctx, alpha, "alpha")])
    ctx.set_dx(0, _where(ctx, above, ctx.dy(0), _scalar(ctx, 0.0, "zero")))


@gradient_rule("Softplus")
def softplus(ctx: GradientContext) -> None:
    """d log(1 + exp(X)) = sigmoid(X)."""
    f = ctx.f
    ctx.set_dx(0, f.node1("Mul", [ctx.dy(0), f.node1("Sigmoid", [ctx.x(0)])]))


@gradient_rule("Softsign")
def softsign(ctx: GradientContext) -> None:
    """d X / (1 + |X|) = 1 / (1 + |X|)^2."""
    f = ctx.f
    t = f.node1("Add", [f.node1("Abs", [ctx.x(0)]), _scalar(ctx, 1.0, "one")])
    ctx.set_dx(0, f.node1("Div", [ctx.dy(0), f.node1("Mul", [t, t])]))


@gradient_rule("PRelu", differentiable=(0, 1))
def prelu(ctx: GradientContext) -> None:
    """Y = X for X > 0, slope X otherwise (slope broadcast to X): dX = dY or slope dY; dslope = dY X where
    X <= 0, summed down to the slope's shape."""
    f, x, slope, dy = ctx.f, ctx.x(0), ctx.x(1), ctx.dy(0)
    positive = f.node1("Greater", [x, _scalar(ctx, 0.0, "zero")])
    if ctx.requires(0):
        ctx.set_dx(0, _where(ctx, positive, dy, f.node1("Mul", [dy, slope])))
    if ctx.requires(1):
        g = _where(ctx, positive, _scalar(ctx, 0.0, "zero"), f.node1("Mul", [dy, x]))
        ctx.set_dx(1, ctx.sum_to(g, slope))
