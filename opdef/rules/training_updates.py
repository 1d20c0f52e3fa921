"""onnxruntime-training's in-place update ops: InPlaceAccumulatorV2, AdamWOptimizer, SGDOptimizerV2.

Roles (``specs/bindings.json``): the accumulator's ``buffer, value, overwrite`` -> ``updated, buffer_out``;
the optimizers' ``lr, step (AdamW), params, gradients, first_moments, second_moments (AdamW),
update_signal`` -> ``updated, params_out, first_moments_out, second_moments_out``. The optimizers' tensor
arguments are sequences (``seq(f32)`` in their specs): their element shapes are not part of a value's
declared type, so only the one-element tensors and the flags are checked here. Constraint labels are the
specs' own (C1 ...).
"""

from __future__ import annotations

from onnx import TensorProto

from opdef.node import TensorType
from opdef.rules.base import (
    Conflict,
    NodeContext,
    RuleResult,
    bound_roles,
    format_shape,
    merge_shape,
    register_rule,
)


@register_rule("in_place_accumulator")
def in_place_accumulator(ctx: NodeContext) -> RuleResult:
    binding = ctx.binding
    buffer, value = binding.arg("buffer"), binding.arg("value")
    buffer_t, value_t = ctx.input_type(buffer), ctx.input_type(value)
    shape = None
    try:
        shape = merge_shape(buffer_t.shape if buffer_t else None, value_t.shape if value_t else None)
    except Conflict:
        raise ctx.error(f"{value} has shape {format_shape(value_t.shape)}; expected the shape of {buffer} "
                        f"{format_shape(buffer_t.shape)}", ctx.constraint_label([buffer, value])) from None
    _one_element(ctx, binding.arg("overwrite"))
    _one_element_output(ctx, binding.arg("updated"))
    out = binding.arg("buffer_out")
    current = ctx.output_type(out)
    elem = current.elem_type if current else (buffer_t.elem_type if buffer_t else None)
    ctx.set_output_type(out, TensorType(elem, shape))
    return RuleResult(roles=bound_roles(ctx))


@register_rule("adamw_optimizer")
def adamw_optimizer(ctx: NodeContext) -> RuleResult:
    binding = ctx.binding
    _one_element(ctx, binding.arg("lr"))
    step_shape = _one_element(ctx, binding.arg("step"))
    _one_element(ctx, binding.arg("update_signal"))
    mode, correct = binding.arg("adam_mode"), binding.arg("correct_bias")
    if ctx.attributes.get(mode) == 0 and ctx.attributes.get(correct) != 1:
        raise ctx.error(f"{correct} is {ctx.attributes.get(correct)!r} with {mode} 0; {mode} 0 (PyTorch's AdamW) "
                        f"needs {correct} 1", ctx.constraint_label([mode, correct]))
    ctx.set_output_type(binding.arg("updated"), TensorType(TensorProto.BOOL, step_shape))
    return RuleResult(roles=bound_roles(ctx))


@register_rule("sgd_optimizer")
def sgd_optimizer(ctx: NodeContext) -> RuleResult:
    binding = ctx.binding
    lr_shape = _one_element(ctx, binding.arg("lr"))
    _one_element(ctx, binding.arg("update_signal"))
    ctx.set_output_type(binding.arg("updated"), TensorType(TensorProto.BOOL, lr_shape))
    return RuleResult(roles=bound_roles(ctx))


def _one_element_output(ctx: NodeContext, name: str) -> None:
    """A boolean flag of one element: its rank is left open (onnxruntime's kernel writes a scalar, graphs
    declare [1]); a shape the graph declares is merged in afterwards and the lowering follows it."""
    ctx.set_output_type(name, TensorType(TensorProto.BOOL, None))


def _one_element(ctx: NodeContext, name: str | None) -> tuple | None:
    """A flag, learning rate or step: one element whatever its rank. Returns its shape when known."""
    t = ctx.input_type(name)
    if t is None or t.shape is None:
        return None
    if any(isinstance(d, int) and d != 1 for d in t.shape):  # a symbolic dim may still be 1
        raise ctx.error(f"{name} has shape {format_shape(t.shape)}; expected one element (e.g. [1])",
                        ctx.constraint_label([name], ("element",)))
    return t.shape

