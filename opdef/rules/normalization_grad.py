"""onnxruntime-training's softmax and normalization ops: ``SoftmaxGrad``, ``SoftmaxGrad_13``, ``LogSoftmaxGrad``,
``LogSoftmaxGrad_13`` (rule ``softmax_grad``), ``LayerNormalizationGrad`` and ``SimplifiedLayerNormalizationGrad``
(``layer_norm_grad``; the simplified one has no ``mean`` role) and the forward ``SimplifiedLayerNormalization``
(``simplified_layer_norm``). Shapes and the axis; the generic checks did the types and ranks.

Constraint labels are the specs' own (``specs/com.microsoft/SoftmaxGrad.rst``, ``LayerNormalizationGrad.rst``,
``specs/onnx.training/SimplifiedLayerNormalization.rst`` ...), found through the argument names a note mentions.
"""

from __future__ import annotations

from onnx import TensorProto

from opdef.node import TensorType
from opdef.rules.base import (
    Conflict,
    NodeContext,
    RuleResult,
    bound_roles,
    epsilon_attribute,
    format_shape,
    merge_dim,
    merge_shape,
    register_rule,
)
from opdef.rules.elementwise_grad import same_shape, set_output


def normalized_axis(ctx: NodeContext, rank: int | None) -> int | None:
    """The ``axis`` attribute (its spec default applied) as a non-negative axis of a rank-``rank`` tensor."""
    name = ctx.binding.arg("axis") if ctx.binding else "axis"
    axis = int(ctx.attributes.get(name, -1))
    if rank is None:
        return None
    if not -rank <= axis < rank:
        raise ctx.error(f"{name} is {axis}; expected a value in [{-rank}, {rank - 1}] for rank {rank}",
                        ctx.constraint_label([name]))
    return axis % rank


def _shape(ctx: NodeContext, name: str) -> tuple | None:
    t = ctx.input_type(name)
    return None if t is None else t.shape


@register_rule("softmax_grad")
def softmax_grad(ctx: NodeContext) -> RuleResult:
    dy, y = ctx.binding.arg("dY"), ctx.binding.arg("Y")
    shape = same_shape(ctx, dy, y)
    normalized_axis(ctx, None if shape is None else len(shape))
    set_output(ctx, ctx.binding.arg("dX"), shape)
    return RuleResult(roles=bound_roles(ctx), rank=None if shape is None else len(shape))


def check_scale(ctx: NodeContext, x: tuple | None, axis: int | None) -> None:
    """``scale`` has the normalized dims of ``X`` (its dims from ``axis`` on)."""
    scale = _shape(ctx, "scale")
    if x is None or axis is None or scale is None:
        return
    try:
        merge_shape(x[axis:], scale)
    except Conflict:
        raise ctx.error(f"scale has shape {format_shape(scale)}; expected {format_shape(x[axis:])} (the dims of X "
                        f"{format_shape(x)} from axis {axis} on)", ctx.constraint_label(["scale"])) from None


def check_row_stats(ctx: NodeContext, name: str, x: tuple | None, axis: int | None) -> None:
    """A per-row statistic: X's dims before ``axis``, optionally followed by size 1 dims up to X's rank."""
    stats = _shape(ctx, name)
    if x is None or axis is None or stats is None:
        return
    fits = axis <= len(stats) <= len(x) and all(d is None or not isinstance(d, int) or d == 1 for d in stats[axis:])
    if fits:
        try:
            for a, b in zip(x[:axis], stats[:axis], strict=True):
                merge_dim(a, b)
        except Conflict:
            fits = False
    if not fits:
        kept = format_shape(x[:axis] + (1,) * (len(x) - axis))
        raise ctx.error(f"{name} has shape {format_shape(stats)}; expected {format_shape(x[:axis])} or {kept} (the "
                        f"dims of X {format_shape(x)} before axis {axis}, one value per row)",
                        ctx.constraint_label([name]))


@register_rule("layer_norm_grad")
def layer_norm_grad(ctx: NodeContext) -> RuleResult:
    x = same_shape(ctx, "X", "Y_grad")
    rank = None if x is None else len(x)
    axis = normalized_axis(ctx, rank)
    check_scale(ctx, x, axis)
    for role in ("mean", "inv_std"):
        name = ctx.binding.arg(role)
        if name is not None:
            check_row_stats(ctx, name, x, axis)
    set_output(ctx, "X_grad", x)
    scale = _shape(ctx, "scale")
    if scale is None and x is not None and axis is not None:
        scale = x[axis:]
    for name in ("scale_grad", "bias_grad"):
        set_output(ctx, name, scale)
    return RuleResult(roles=bound_roles(ctx), rank=rank)


@register_rule("simplified_layer_norm")
def simplified_layer_norm(ctx: NodeContext) -> RuleResult:
    x = _shape(ctx, "X")
    rank = None if x is None else len(x)
    axis = normalized_axis(ctx, rank)
    check_scale(ctx, x, axis)
    epsilon = epsilon_attribute(ctx, "epsilon")
    set_output(ctx, "Y", x)
    if ctx.has_output("inv_std_var"):
        stats = None if x is None or axis is None else x[:axis] + (1,) * (len(x) - axis)
        current = ctx.output_type("inv_std_var")
        elem = TensorProto.FLOAT if current is None or current.elem_type is None else current.elem_type
        ctx.set_output_type("inv_std_var", TensorType(elem, stats))
    return RuleResult(roles=bound_roles(ctx), rank=rank, epsilon=epsilon)
