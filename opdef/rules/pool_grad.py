"""onnxruntime-training's default-domain pooling gradients, ``MaxPoolGrad`` and ``AveragePoolGrad``
(``specs/onnx.training/``): attribute lengths, the shapes of dY (and Indices), dX's shape.

Neither op has the forward input among its inputs: like onnxruntime's kernels, dX's spatial dims come from
the type the graph declares for dX (the pass merges it in after this rule); the rule gives dX the batch and
channel dims of dY and the rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opdef.node import TensorType
from opdef.rules.base import (
    Conflict,
    NodeContext,
    RuleResult,
    bound_roles,
    format_shape,
    merge_shape,
    per_axis_attribute,
    register_rule,
)


@dataclass(frozen=True)
class PoolParameters:
    kernel_shape: tuple[int, ...] | None
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads: tuple[int, ...]  # all begins, then all ends
    count_include_pad: bool


def pool_parameters(attributes: Mapping[str, Any], spatial: int) -> PoolParameters:
    """Per-axis lists with defaults applied; raises ValueError naming the attribute that does not fit."""
    def listed(name: str, default: int | None, per_axis: int, minimum: int) -> tuple[int, ...] | None:
        return per_axis_attribute(attributes, name, default, spatial, per_axis=per_axis, minimum=minimum)

    auto_pad = attributes.get("auto_pad") or "NOTSET"
    if auto_pad not in ("NOTSET", "VALID"):
        raise ValueError(f"auto_pad is {auto_pad!r}; onnxruntime's kernel reads only pads, so only NOTSET and "
                         "VALID are supported")
    pads = (0,) * (2 * spatial) if auto_pad == "VALID" else listed("pads", 0, 2, 0)
    return PoolParameters(kernel_shape=listed("kernel_shape", None, 1, 1),
                          strides=listed("strides", 1, 1, 1), dilations=listed("dilations", 1, 1, 1),
                          pads=pads, count_include_pad=bool(attributes.get("count_include_pad") or 0))


def _common(ctx: NodeContext, dy_shape, max_rank: int | None) -> PoolParameters | None:
    if dy_shape is None:
        return None
    rank = len(dy_shape)
    if rank < 3 or (max_rank is not None and rank > max_rank):
        wanted = ">= 3" if max_rank is None else f"3..{max_rank}"
        raise ctx.error(f"dY has rank {rank} {format_shape(dy_shape)}; expected rank {wanted} (N, C and one or "
                        "more spatial axes)", ctx.constraint_label(["dY"], ("rank",)))
    try:
        return pool_parameters(ctx.attributes, rank - 2)
    except ValueError as exc:
        raise ctx.error(str(exc), ctx.constraint_label(["auto_pad"] if "auto_pad" in str(exc) else
                                                       ["kernel_shape", "pads"])) from None


def _set_dx(ctx: NodeContext, dy_shape) -> None:
    if not ctx.has_output("dX") or dy_shape is None:
        return
    current = ctx.output_type("dX")
    shape = (dy_shape[0], dy_shape[1]) + (None,) * (len(dy_shape) - 2)
    ctx.set_output_type("dX", TensorType(None if current is None else current.elem_type, shape))


@register_rule("max_pool_grad")
def max_pool_grad(ctx: NodeContext) -> RuleResult:
    dy_type, indices_type = ctx.input_type("dY"), ctx.input_type("Indices")
    dy = None if dy_type is None else dy_type.shape
    indices = None if indices_type is None else indices_type.shape
    try:
        dy = merge_shape(dy, indices)
    except Conflict:
        raise ctx.error(f"Indices has shape {format_shape(indices)}; expected {format_shape(dy)} (the shape of dY)",
                        ctx.constraint_label(["dY", "Indices"])) from None
    _common(ctx, dy, None)
    _set_dx(ctx, dy)
    return RuleResult(roles=bound_roles(ctx), rank=None if dy is None else len(dy))


@register_rule("average_pool_grad")
def average_pool_grad(ctx: NodeContext) -> RuleResult:
    dy_type = ctx.input_type("dY")
    dy = None if dy_type is None else dy_type.shape
    params = _common(ctx, dy, 5)
    if params is not None and any(d != 1 for d in params.dilations):
        raise ctx.error(f"dilations is {list(params.dilations)}; onnxruntime's kernel has no dilation, only 1s "
                        "are supported", ctx.constraint_label(["dilations"]))
    _set_dx(ctx, dy)
    return RuleResult(roles=bound_roles(ctx), rank=None if dy is None else len(dy))
