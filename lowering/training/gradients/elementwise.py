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
        g = f.node1("Mul", [f.node1("Mul", [dy, ctx.y(0)]), f.node1("Log", [a])])
        ctx.set_dx(1, ctx.sum_to(g, b))


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
