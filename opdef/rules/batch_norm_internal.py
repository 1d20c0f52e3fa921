"""onnxruntime-training's BatchNormInternal (batch-norm forward): attributes, shapes, output types.

Roles (``specs/bindings.json``): inputs ``src, gamma, beta, input_mean, input_var``; outputs ``dst,
running_mean, running_var, saved_mean, saved_inv_std``; attributes ``epsilon, momentum, training_mode``.
The channel axis is axis 1; every per-channel argument is [C]. Constraint labels (C1 ...) are the spec's
own, found through the names and words a constraint mentions, so the error points at the spec sentence.

``training_mode`` follows onnxruntime: 0 is inference (Y from input_mean/input_var, no other output),
any other value is training.
"""

from __future__ import annotations

from opdef.errors import SpecError
from opdef.node import Dim, TensorType
from opdef.rules.base import (
    Conflict,
    NodeContext,
    RuleResult,
    bound_roles,
    epsilon_attribute,
    format_shape,
    merge_shape,
    number_attribute,
    register_rule,
)

INPUT_ROLES = ("src", "gamma", "beta", "input_mean", "input_var")
STAT_OUTPUT_ROLES = ("running_mean", "running_var", "saved_mean", "saved_inv_std")
ATTRIBUTE_ROLES = ("epsilon", "momentum", "training_mode")
CHANNEL_AXIS = 1


@register_rule("batch_norm_internal")
def batch_norm_internal(ctx: NodeContext) -> RuleResult:
    binding = ctx.binding
    missing = [r for r in (*INPUT_ROLES, "dst", *STAT_OUTPUT_ROLES, *ATTRIBUTE_ROLES) if not binding.arg(r)]
    if missing:
        raise SpecError("bindings.json", None, f"{binding.domain}::{binding.op_type}: rule batch_norm_internal "
                                               f"needs the role(s) {missing}")
    x = binding.arg("src")
    epsilon = epsilon_attribute(ctx, binding.arg("epsilon"))
    _momentum(ctx, binding.arg("momentum"))
    training = _training_mode(ctx, binding.arg("training_mode"))

    x_type = ctx.input_type(x)
    x_shape = None if x_type is None else x_type.shape
    rank = None if x_shape is None else len(x_shape)
    _check_rank(ctx, x, x_shape)
    channels = _per_channel_inputs(ctx, x, x_shape)

    if not training:
        requested = [f"{binding.arg(r)} ('{ctx.output_value(binding.arg(r))}')" for r in STAT_OUTPUT_ROLES
                     if ctx.has_output(binding.arg(r))]
        if requested:
            name = binding.arg("training_mode")
            raise ctx.error(f"{', '.join(requested)} requested with {name} 0; inference mode produces "
                            f"{binding.arg('dst')} only", ctx.constraint_label([name]))

    _set_output(ctx, binding.arg("dst"), x_type.elem_type if x_type else None, x_shape)
    stat_type = ctx.input_type(binding.arg("input_mean"))
    for role in STAT_OUTPUT_ROLES:
        _set_output(ctx, binding.arg(role), stat_type.elem_type if stat_type else None, channels)
    reduce_axes = None if rank is None else tuple(a for a in range(rank) if a != CHANNEL_AXIS)
    return RuleResult(roles=bound_roles(ctx), rank=rank, channel_axis=None if rank is None else CHANNEL_AXIS,
                      reduce_axes=reduce_axes, epsilon=epsilon)


# -- attributes ------------------------------------------------------------------------------------

def _momentum(ctx: NodeContext, name: str) -> float:
    value = number_attribute(ctx, name)
    if not 0.0 <= value <= 1.0:  # also refuses NaN
        raise ctx.error(f"{name} is {value!r}; it must lie in [0, 1]", ctx.constraint_label([name]))
    return value


def _training_mode(ctx: NodeContext, name: str) -> bool:
    value = ctx.attributes.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ctx.error(f"{name} is {value!r}; expected an integer (0: inference, otherwise training)")
    return value != 0


# -- shapes ----------------------------------------------------------------------------------------

def _check_rank(ctx: NodeContext, x: str, x_shape) -> None:
    if x_shape is None:
        return
    binding = ctx.binding
    lo = max(2, binding.min_rank or 2)
    hi = binding.max_rank
    if len(x_shape) < lo or (hi is not None and len(x_shape) > hi):
        wanted = f">= {lo}" if hi is None else f"{lo}..{hi}"
        raise ctx.error(f"{x} has rank {len(x_shape)} {format_shape(x_shape)}; expected rank {wanted} "
                        f"(channel axis {CHANNEL_AXIS})", ctx.constraint_label([x], ("rank",)))


def _per_channel_inputs(ctx: NodeContext, x: str, x_shape) -> tuple[Dim, ...]:
    """scale, B, input_mean, input_var are each [C], C = X's axis 1; returns the merged [C]."""
    c = None if x_shape is None else x_shape[CHANNEL_AXIS]
    expected: tuple[Dim, ...] = (c,)
    origin = f"channel axis {CHANNEL_AXIS} of {x} {format_shape(x_shape)}" if isinstance(c, int) else None
    for role in INPUT_ROLES[1:]:
        name = ctx.binding.arg(role)
        t = ctx.input_type(name)
        if t is None or t.shape is None:
            continue
        label = ctx.constraint_label([name], ("1D",))
        if len(t.shape) != 1:
            raise ctx.error(f"{name} has shape {format_shape(t.shape)}; expected {format_shape(expected)} "
                            f"(one value per channel, channel axis {CHANNEL_AXIS} of {x} {format_shape(x_shape)})",
                            label)
        try:
            merged = merge_shape(expected, t.shape)
        except Conflict:
            why = f" ({origin})" if origin else ""
            raise ctx.error(f"{name} has shape {format_shape(t.shape)}; expected {format_shape(expected)}{why}",
                            label) from None
        if origin is None and isinstance(merged[0], int):
            origin = f"the shape of {name}"
        expected = merged
    return expected


def _set_output(ctx: NodeContext, name: str, elem: int | None, shape) -> None:
    if not ctx.has_output(name):
        return
    current = ctx.output_type(name)
    if current is not None and current.elem_type is not None:
        elem = current.elem_type  # what the type variables decided
    ctx.set_output_type(name, TensorType(elem, None if shape is None else tuple(shape)))
