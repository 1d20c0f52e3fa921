"""Gradient rules: elementwise ops (arithmetic with numpy broadcasting, activations, casts).

Binary ops sum their gradient down to each input's shape (:meth:`GradientContext.sum_to`). Where
onnxruntime-training's gradient builder uses a training op (ReluGrad, SigmoidGrad, TanhGrad, LeakyReluGrad)
the rule emits it; elsewhere standard ops.
"""

from __future__ import annotations

import numpy as np
import onnx

from lowering.training.gradients.context import GradientContext
from lowering.training.gradients.registry import gradient_rule

MS = "com.microsoft"


def _scalar(ctx: GradientContext, value: float, like: str) -> str:
    return ctx.f.const(np.asarray(value, ctx.f.np_dtype(like)), hint="scalar")


@gradient_rule("Identity")
def identity(ctx: GradientContext) -> None:
    ctx.set_dx(0, ctx.dy(0))


@gradient_rule("Add", differentiable=(0, 1))
def add(ctx: GradientContext) -> None:
    dy = ctx.dy(0)
    for i in (0, 1):
        if ctx.requires(i):
            ctx.set_dx(i, ctx.sum_to(dy, ctx.x(i)))


@gradient_rule("Sub", differentiable=(0, 1))
def sub(ctx: GradientContext) -> None:
    dy = ctx.dy(0)
    if ctx.requires(0):
        ctx.set_dx(0, ctx.sum_to(dy, ctx.x(0)))
    if ctx.requires(1):
        ctx.set_dx(1, ctx.sum_to(ctx.f.node1("Neg", [dy]), ctx.x(1)))


@gradient_rule("Mul", differentiable=(0, 1))
def mul(ctx: GradientContext) -> None:
    dy, f = ctx.dy(0), ctx.f
    for i in (0, 1):
        if ctx.requires(i):
            ctx.set_dx(i, ctx.sum_to(f.node1("Mul", [dy, ctx.x(1 - i)]), ctx.x(i)))


@gradient_rule("Div", differentiable=(0, 1))
def div(ctx: GradientContext) -> None:
    dy, f = ctx.dy(0), ctx.f
    a, b = ctx.x(0), ctx.x(1)
    if ctx.requires(0):
        ctx.set_dx(0, ctx.sum_to(f.node1("Div", [dy, b]), a))
    if ctx.requires(1):
        # d(a/b)/db = -(a/b)/b = -y/b
        g = f.node1("Neg", [f.node1("Div", [f.node1("Mul", [dy, ctx.y(0)]), b])])
        ctx.set_dx(1, ctx.sum_to(g, b))


@gradient_rule("Pow", differentiable=(0, 1))
def pow_(ctx: GradientContext) -> None:
    dy, f = ctx.dy(0), ctx.f
    a, b = ctx.x(0), ctx.x(1)
    if ctx.requires(0):
        # b * a^(b-1) (b cast to a's type when it differs)
        b_a = b if f.elem_type(b) == f.elem_type(a) else f.node1("Cast", [b], to=f.elem_type(a))
        exponent = f.node1("Sub", [b_a, _scalar(ctx, 1.0, a)])
        g = f.node1("Mul", [f.node1("Mul", [f.node1("Pow", [a, exponent]), b_a]), dy])
        ctx.set_dx(0, ctx.sum_to(g, a))
    if ctx.requires(1):
        # dY * Y * log(A), 0 where A = 0 and B >= 0 (as torch: Y = 0 or 1 there, log(A) = -inf)
        g = f.node1("Mul", [f.node1("Mul", [dy, ctx.y(0)]), f.node1("Log", [a])])
        zero = _scalar(ctx, 0.0, a)
        b_a = b if f.elem_type(b) == f.elem_type(a) else f.node1("Cast", [b], to=f.elem_type(a))
        at_zero = f.node1("And", [f.node1("Equal", [a, zero]), f.node1("Not", [f.node1("Less", [b_a, zero])])])
        g = ctx.sum_to(f.node1("Where", [at_zero, zero, g]), b)
        if f.elem_type(b) != f.elem_type(a):
            g = f.node1("Cast", [g], to=f.elem_type(b))
        ctx.set_dx(1, g)


@gradient_rule("Neg")
def neg(ctx: GradientContext) -> None:
    ctx.set_dx(0, ctx.f.node1("Neg", [ctx.dy(0)]))


@gradient_rule("Abs")
def abs_(ctx: GradientContext) -> None:
    f = ctx.f
    ctx.set_dx(0, f.node1("Mul", [ctx.dy(0), f.node1("Sign", [ctx.x(0)])]))


@gradient_rule("Relu")
def relu(ctx: GradientContext) -> None:
    ctx.set_dx(0, ctx.f.node1("ReluGrad", [ctx.dy(0), ctx.y(0)], domain=MS))


@gradient_rule("Sigmoid")
def sigmoid(ctx: GradientContext) -> None:
    ctx.set_dx(0, ctx.f.node1("SigmoidGrad", [ctx.dy(0), ctx.y(0)], domain=MS))


@gradient_rule("Log")
def log(ctx: GradientContext) -> None:
    ctx.set_dx(0, ctx.f.node1("Div", [ctx.dy(0), ctx.x(0)]))


@gradient_rule("Exp")
def exp(ctx: GradientContext) -> None:
    ctx.set_dx(0, ctx.f.node1("Mul", [ctx.dy(0), ctx.y(0)]))


@gradient_rule("Cast")
def cast(ctx: GradientContext) -> None:
    f = ctx.f
    elem = f.elem_type(ctx.x(0)) or onnx.TensorProto.FLOAT
    dy = ctx.dy(0)
    ctx.set_dx(0, dy if f.elem_type(ctx.y(0)) == elem else f.node1("Cast", [dy], to=elem))


@gradient_rule("Sqrt")
def sqrt(ctx: GradientContext) -> None:
    """dX = dY * 0.5 / Y (onnxruntime-training's form; infinite at X = 0, as the derivative)."""
    f = ctx.f
    ctx.set_dx(0, f.node1("Mul", [ctx.dy(0), f.node1("Div", [_scalar(ctx, 0.5, ctx.y(0)), ctx.y(0)])]))


@gradient_rule("Reciprocal")
def reciprocal(ctx: GradientContext) -> None:
    """dX = -dY Y^2, as (dY Y) Y: no intermediate Y^2 to overflow where dY is small."""
    f, y = ctx.f, ctx.y(0)
    ctx.set_dx(0, f.node1("Neg", [f.node1("Mul", [f.node1("Mul", [ctx.dy(0), y]), y])]))


@gradient_rule("Erf")
def erf(ctx: GradientContext) -> None:
    """dX = dY * 2/sqrt(pi) * exp(-X^2)."""
    f, x = ctx.f, ctx.x(0)
    density = f.node1("Exp", [f.node1("Neg", [f.node1("Mul", [x, x])])])
    ctx.set_dx(0, f.node1("Mul", [ctx.dy(0), f.node1("Mul", [density, _scalar(ctx, 2.0 / np.sqrt(np.pi), x)])]))


VARIADIC = tuple(range(2048))  # Sum, Mean, Max, Min: every input position


@gradient_rule("Sum", differentiable=VARIADIC)
def sum_(ctx: GradientContext) -> None:
    dy = ctx.dy(0)
    for i in range(len(ctx.node.input)):
        if ctx.requires(i):
            ctx.set_dx(i, ctx.sum_to(dy, ctx.x(i)))


@gradient_rule("Mean", differentiable=VARIADIC)
def mean(ctx: GradientContext) -> None:
    f = ctx.f
    n = len(ctx.node.input)
    scaled = f.node1("Div", [ctx.dy(0), _scalar(ctx, float(n), ctx.y(0))]) if n > 1 else ctx.dy(0)
    for i in range(n):
        if ctx.requires(i):
            ctx.set_dx(i, ctx.sum_to(scaled, ctx.x(i)))


def _max_min(ctx: GradientContext) -> None:
    """Each input equal to the result gets dY shared evenly among the inputs that tie there (torch's
    maximum/minimum and amax/amin: half each for two), as onnxruntime-training's Min/Max gradient."""
    f, y = ctx.f, ctx.y(0)
    n = len(ctx.node.input)
    if n == 1:
        ctx.set_dx(0, ctx.dy(0))
        return
    elem = f.elem_type(y)
    masks = [f.node1("Cast", [f.node1("Equal", [ctx.x(i), y])], to=elem) for i in range(n)]
    share = f.node1("Div", [ctx.dy(0), f.node1("Sum", masks)])
    for i in range(n):
        if ctx.requires(i):
            ctx.set_dx(i, ctx.sum_to(f.node1("Mul", [share, masks[i]]), ctx.x(i)))


gradient_rule("Max", differentiable=VARIADIC)(_max_min)
gradient_rule("Min", differentiable=VARIADIC)(_max_min)
