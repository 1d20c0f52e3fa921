"""onnxruntime-training's elementwise training ops: ``ReluGrad`` (dX = dY where X > 0), ``SigmoidGrad``
(dX = dY * Y * (1 - Y), from the forward output Y), ``DivGrad`` (Div's gradients, each summed back to its
input's shape) and ``Scale`` (input times or over a one-element scale). Shapes only: the generic checks did
the types.

Constraint labels are the spec's own (``specs/com.microsoft/ReluGrad.rst``, ``Scale.rst``), found through
the argument names a note mentions.
"""

from __future__ import annotations

import math

from opdef.node import TensorType
from opdef.rules.base import (
    Conflict,
    NodeContext,
    RuleResult,
    bound_roles,
    format_shape,
    merge_dim,
    merge_shape,
    register_rule,
)


def same_shape(ctx: NodeContext, first: str, second: str) -> tuple | None:
    """The merged shape of two inputs that must have one shape (error naming both otherwise)."""
    a, b = ctx.input_type(first), ctx.input_type(second)
    a_shape = None if a is None else a.shape
    b_shape = None if b is None else b.shape
    try:
        return merge_shape(a_shape, b_shape)
    except Conflict:
        raise ctx.error(f"{second} has shape {format_shape(b_shape)}; expected {format_shape(a_shape)} "
                        f"(the shape of {first})", ctx.constraint_label([first, second], ("shape",))) from None


def set_output(ctx: NodeContext, name: str, shape) -> None:
    """Give output ``name`` a shape, keeping the element type its type variable decided."""
    if not ctx.has_output(name):
        return
    current = ctx.output_type(name)
    elem = None if current is None else current.elem_type
    ctx.set_output_type(name, TensorType(elem, None if shape is None else tuple(shape)))


@register_rule("relu_grad")
def relu_grad(ctx: NodeContext) -> RuleResult:
    shape = same_shape(ctx, "dY", "X")
    set_output(ctx, "dX", shape)
    return RuleResult(roles=bound_roles(ctx), rank=None if shape is None else len(shape))


@register_rule("sigmoid_grad")
def sigmoid_grad(ctx: NodeContext) -> RuleResult:
    shape = same_shape(ctx, "dY", "Y")
    set_output(ctx, "dX", shape)
    return RuleResult(roles=bound_roles(ctx), rank=None if shape is None else len(shape))


def broadcast_shape(ctx: NodeContext, first: str, second: str, label: str | None) -> tuple | None:
    """The numpy broadcast of two inputs' shapes (None when either is unknown); error naming both otherwise."""
    a, b = ctx.input_type(first), ctx.input_type(second)
    if a is None or a.shape is None or b is None or b.shape is None:
        return None
    out = []
    for i in range(1, max(len(a.shape), len(b.shape)) + 1):
        x = a.shape[-i] if i <= len(a.shape) else 1
        y = b.shape[-i] if i <= len(b.shape) else 1
        if x == 1 or y == 1:
            out.append(y if x == 1 else x)
            continue
        try:
            out.append(merge_dim(x, y))
        except Conflict:
            raise ctx.error(f"{first} {format_shape(a.shape)} and {second} {format_shape(b.shape)} do not broadcast "
                            f"(axis {-i}: {x} against {y})", label) from None
    return tuple(reversed(out))


@register_rule("div_grad")
def div_grad(ctx: NodeContext) -> RuleResult:
    label = ctx.constraint_label(["A", "B", "dY"], ("broadcast",))
    shape = broadcast_shape(ctx, "A", "B", label)
    dy = ctx.input_type("dY")
    dy_shape = None if dy is None else dy.shape
    try:
        shape = merge_shape(dy_shape, shape)
    except Conflict:
        a, b = ctx.input_type("A").shape, ctx.input_type("B").shape
        raise ctx.error(f"dY has shape {format_shape(dy_shape)}; expected {format_shape(shape)} (A {format_shape(a)} "
                        f"broadcast with B {format_shape(b)})", label) from None
    for grad, source in (("dA", "A"), ("dB", "B")):
        t = ctx.input_type(source)
        set_output(ctx, grad, None if t is None else t.shape)
    return RuleResult(roles=bound_roles(ctx), rank=None if shape is None else len(shape))


@register_rule("scale")
def scale(ctx: NodeContext) -> RuleResult:
    scale_type = ctx.input_type("scale")
    if scale_type is not None and scale_type.shape is not None:
        dims = scale_type.shape
        if any(isinstance(d, int) and d != 1 for d in dims):
            count = math.prod(d for d in dims if isinstance(d, int))
            raise ctx.error(f"scale has shape {format_shape(dims)} ({count} elements); expected exactly one "
                            "element", ctx.constraint_label(["scale"], ("element",)))
    shape = None if ctx.input_type("input") is None else ctx.input_type("input").shape
    set_output(ctx, "output", shape)
    return RuleResult(roles=bound_roles(ctx), rank=None if shape is None else len(shape))
