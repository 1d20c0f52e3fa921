"""onnxruntime-training's ``SoftmaxCrossEntropyLossGrad``: shapes of log_prob, label, weight and dY
(``specs/com.microsoft/SoftmaxCrossEntropyLossGrad.rst``, notes C1..C4)."""

from __future__ import annotations

from opdef.node import TensorType
from opdef.rules.base import Conflict, NodeContext, RuleResult, bound_roles, format_shape, merge_shape, register_rule

CLASS_AXIS = 1


@register_rule("softmax_cross_entropy_loss_grad")
def softmax_cross_entropy_loss_grad(ctx: NodeContext) -> RuleResult:
    lp_type, label_type = ctx.input_type("log_prob"), ctx.input_type("label")
    log_prob = None if lp_type is None else lp_type.shape
    label = None if label_type is None else label_type.shape
    if log_prob is not None and len(log_prob) < 2:
        raise ctx.error(f"log_prob has rank {len(log_prob)} {format_shape(log_prob)}; expected rank >= 2 "
                        f"(class axis {CLASS_AXIS})", ctx.constraint_label(["log_prob"], ("rank",)))
    expected_label = None if log_prob is None else log_prob[:CLASS_AXIS] + log_prob[CLASS_AXIS + 1:]
    try:
        label = merge_shape(expected_label, label)
    except Conflict:
        raise ctx.error(f"label has shape {format_shape(label)}; expected {format_shape(expected_label)} "
                        f"(log_prob {format_shape(log_prob)} without its class axis {CLASS_AXIS})",
                        ctx.constraint_label(["log_prob", "label"])) from None
    classes = None if log_prob is None else log_prob[CLASS_AXIS]
    weight_type = ctx.input_type("weight") if ctx.has_input("weight") else None
    if weight_type is not None and weight_type.shape is not None:
        try:
            merge_shape((classes,), weight_type.shape)
        except Conflict:
            raise ctx.error(f"weight has shape {format_shape(weight_type.shape)}; expected [{classes}] (one per "
                            f"class, axis {CLASS_AXIS} of log_prob {format_shape(log_prob)})"
                            if classes is not None else
                            f"weight has shape {format_shape(weight_type.shape)}; expected a 1D tensor",
                            ctx.constraint_label(["weight"])) from None
    dy_type = ctx.input_type("dY")
    dy = None if dy_type is None else dy_type.shape
    reduction = ctx.attributes.get("reduction", "mean")
    if dy is not None:
        if reduction == "none":
            try:
                merge_shape(label, dy)
            except Conflict:
                raise ctx.error(f"dY has shape {format_shape(dy)}; with reduction 'none' expected "
                                f"{format_shape(label)} (the shape of label)", ctx.constraint_label(["dY"])) from None
        elif any(isinstance(d, int) and d != 1 for d in dy) or len(dy) > 1:
            raise ctx.error(f"dY has shape {format_shape(dy)}; with reduction {reduction!r} expected a scalar",
                            ctx.constraint_label(["dY"]))
    if ctx.has_output("d_logits"):
        current = ctx.output_type("d_logits")
        ctx.set_output_type("d_logits", TensorType(None if current is None else current.elem_type, log_prob))
    return RuleResult(roles=bound_roles(ctx), rank=None if log_prob is None else len(log_prob))
