"""onnxruntime-training's activation family: the elementwise gradients ``TanhGrad``, ``LeakyReluGrad``,
``QuickGeluGrad``, ``GeluGrad``, ``FastGeluGrad``, ``DropoutGrad``, the biased ones ``BiasGeluGrad_dX`` and
``BiasFastGeluGrad_dX``, and the forward ops its rewrites put into training graphs, ``QuickGelu``, ``Gelu``
and ``BiasGelu``. Shapes and attributes only: the generic checks did the element types.

Constraint labels are the spec's own (``specs/com.microsoft/<Op>.rst``), found through the argument names a
note mentions.
"""

from __future__ import annotations

import math

from opdef.rules.base import (
    Conflict,
    NodeContext,
    RuleResult,
    bound_roles,
    format_dim,
    format_shape,
    merge_dim,
    number_attribute,
    register_rule,
)
from opdef.rules.elementwise_grad import same_shape, set_output


def _result(ctx: NodeContext, shape) -> RuleResult:
    return RuleResult(roles=bound_roles(ctx), rank=None if shape is None else len(shape))


def _finite_alpha(ctx: NodeContext) -> None:
    alpha = number_attribute(ctx, "alpha")
    if not math.isfinite(alpha):
        raise ctx.error(f"alpha is {alpha!r}; it must be finite", ctx.constraint_label(["alpha"], ("finite",)))


def _pair(first: str, second: str, out: str, *, alpha: bool = False):
    """The rule of an elementwise gradient: ``first`` and ``second`` share one shape, ``out`` has it."""
    def rule(ctx: NodeContext) -> RuleResult:
        if alpha:
            _finite_alpha(ctx)
        shape = same_shape(ctx, first, second)
        set_output(ctx, out, shape)
        return _result(ctx, shape)
    return rule


register_rule("tanh_grad")(_pair("dY", "Y", "dX"))
register_rule("leaky_relu_grad")(_pair("dY", "Y", "dX", alpha=True))
register_rule("quick_gelu_grad")(_pair("dY", "X", "dX", alpha=True))
register_rule("gelu_grad")(_pair("dY", "X", "dX"))
register_rule("fast_gelu_grad")(_pair("dY", "X", "dX"))


def _unary(ctx: NodeContext) -> RuleResult:
    t = ctx.input_type("X")
    shape = None if t is None else t.shape
    set_output(ctx, "Y", shape)
    return _result(ctx, shape)


@register_rule("quick_gelu")
def quick_gelu(ctx: NodeContext) -> RuleResult:
    _finite_alpha(ctx)
    return _unary(ctx)


register_rule("gelu")(_unary)


def bias_shape_check(ctx: NodeContext, x: str) -> None:
    """B is 1D and as long as the last axis of ``x`` (rank >= 1), as onnxruntime's kernels require."""
    label = ctx.constraint_label(["B", x])
    x_type, b_type = ctx.input_type(x), ctx.input_type("B")
    x_shape = None if x_type is None else x_type.shape
    b_shape = None if b_type is None else b_type.shape
    if x_shape is not None and len(x_shape) == 0:
        raise ctx.error(f"{x} is a scalar; expected rank 1 or more (B is added along its last axis)", label)
    if b_shape is None:
        return
    if len(b_shape) != 1:
        raise ctx.error(f"B has shape {format_shape(b_shape)}; expected a 1D tensor", label)
    if x_shape is None:
        return
    try:
        merge_dim(x_shape[-1], b_shape[0])
    except Conflict:
        raise ctx.error(f"B has shape {format_shape(b_shape)}; expected [{format_dim(x_shape[-1])}] (the last "
                        f"dimension of {x} {format_shape(x_shape)})", label) from None


@register_rule("bias_gelu")
def bias_gelu(ctx: NodeContext) -> RuleResult:
    bias_shape_check(ctx, "A")
    t = ctx.input_type("A")
    shape = None if t is None else t.shape
    set_output(ctx, "C", shape)
    return _result(ctx, shape)


def _bias_grad(ctx: NodeContext) -> RuleResult:
    bias_shape_check(ctx, "X")
    shape = same_shape(ctx, "dY", "X")
    set_output(ctx, "dX", shape)
    return _result(ctx, shape)


register_rule("bias_gelu_grad")(_bias_grad)
register_rule("bias_fast_gelu_grad")(_bias_grad)


def _one_element(ctx: NodeContext, name: str) -> None:
    t = ctx.input_type(name)
    if t is None or t.shape is None:
        return
    dims = t.shape
    if len(dims) > 1 or any(isinstance(d, int) and d != 1 for d in dims):
        raise ctx.error(f"{name} has shape {format_shape(dims)}; expected one element (a scalar or shape [1])",
                        ctx.constraint_label([name], ("element",)))


@register_rule("dropout_grad")
def dropout_grad(ctx: NodeContext) -> RuleResult:
    shape = same_shape(ctx, "dy", "mask")
    for name in ("ratio", "training_mode"):
        if ctx.has_input(name):
            _one_element(ctx, name)
    set_output(ctx, "dx", shape)
    return _result(ctx, shape)
