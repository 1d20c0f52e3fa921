"""onnxruntime-training's ``ConvGrad``: the forward Conv's attributes, the shapes of dY, X and W, and the
gradients' shapes (``specs/com.microsoft/ConvGrad.rst``; its notes are C1..C6, and the errors carry them).

:func:`conv_parameters` resolves the attributes into per-axis lists (defaults applied); the lowering rule
uses the same function, so verification and lowering cannot disagree about them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opdef.node import TensorType
from opdef.rules.base import NodeContext, RuleResult, bound_roles, format_shape, per_axis_attribute, register_rule

REFUSED_AUTO_PAD = ("SAME_UPPER", "SAME_LOWER")


@dataclass(frozen=True)
class ConvParameters:
    group: int
    kernel_shape: tuple[int, ...] | None  # None: W's spatial shape, unknown here
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads: tuple[int, ...]  # all begins, then all ends

    def output_size(self, axis: int, size: int, kernel: int) -> int:
        k = len(self.strides)
        span = self.dilations[axis] * (kernel - 1) + 1
        return (size + self.pads[axis] + self.pads[axis + k] - span) // self.strides[axis] + 1


class ParameterError(ValueError):
    """An attribute that does not fit the node (message, constraint label keyword)."""


def conv_parameters(attributes: Mapping[str, Any], spatial: int, kernel: Sequence[Any] | None) -> ConvParameters:
    """Per-axis attribute lists for ``spatial`` spatial axes; ``kernel``: W's spatial dims if known."""
    def listed(name: str, default: int, per_axis: int, minimum: int) -> tuple[int, ...]:
        return per_axis_attribute(attributes, name, default, spatial, per_axis=per_axis, minimum=minimum,
                                  error=ParameterError)

    group = 1 if attributes.get("group") is None else int(attributes["group"])
    if group < 1:
        raise ParameterError(f"group is {group}; it must be positive")
    auto_pad = attributes.get("auto_pad") or "NOTSET"
    if auto_pad in REFUSED_AUTO_PAD:
        raise ParameterError(f"auto_pad is {auto_pad!r}; onnxruntime's kernel reads only pads, so only NOTSET "
                             "and VALID are supported")
    kernel_shape = None if attributes.get("kernel_shape") is None else listed("kernel_shape", 1, 1, 1)
    if kernel_shape is not None and kernel is not None:
        for a, (want, have) in enumerate(zip(kernel_shape, kernel, strict=True)):
            if isinstance(have, int) and have != want:
                raise ParameterError(f"kernel_shape is {list(kernel_shape)} but W's spatial shape is "
                                     f"{format_shape(kernel)} (axis {a + 2})")
    pads = (0,) * (2 * spatial) if auto_pad == "VALID" else listed("pads", 0, 2, 0)
    return ConvParameters(group=group, kernel_shape=kernel_shape, strides=listed("strides", 1, 1, 1),
                          dilations=listed("dilations", 1, 1, 1), pads=pads)


@register_rule("conv_grad")
def conv_grad(ctx: NodeContext) -> RuleResult:
    x_type, w_type, dy_type = ctx.input_type("X"), ctx.input_type("W"), ctx.input_type("dY")
    x = None if x_type is None else x_type.shape
    w = None if w_type is None else w_type.shape
    dy = None if dy_type is None else dy_type.shape
    rank = next((len(s) for s in (x, w, dy) if s is not None), None)
    for name, shape in (("X", x), ("W", w), ("dY", dy)):
        if shape is not None and (len(shape) != rank or len(shape) < 3):
            raise ctx.error(f"{name} has rank {len(shape)} {format_shape(shape)}; X, W and dY must share one rank "
                            f">= 3 (X {format_shape(x)}, W {format_shape(w)}, dY {format_shape(dy)})",
                            ctx.constraint_label(["X", "W", "dY"], ("rank",)))
    spatial = None if rank is None else rank - 2
    params = None
    if spatial is not None:
        try:
            params = conv_parameters(ctx.attributes, spatial, None if w is None else w[2:])
        except ParameterError as exc:
            label = ctx.constraint_label(["auto_pad"]) if "auto_pad" in str(exc) else \
                ctx.constraint_label(["group"]) if str(exc).startswith("group") else \
                ctx.constraint_label(["kernel_shape", "pads"])
            raise ctx.error(str(exc), label) from None
    _check_channels(ctx, x, w, params)
    _check_dy(ctx, x, w, dy, params)
    _set(ctx, "dX", x)
    _set(ctx, "dW", w)
    channels_out = w[0] if w is not None else dy[1] if dy is not None else None  # M
    _set(ctx, "dB", (channels_out,))
    return RuleResult(roles=bound_roles(ctx), rank=rank)


def _check_channels(ctx: NodeContext, x, w, params: ConvParameters | None) -> None:
    if params is None or x is None or w is None:
        return
    label = ctx.constraint_label(["group"])
    group, c, m, per_group = params.group, x[1], w[0], w[1]
    if isinstance(c, int) and c % group:
        raise ctx.error(f"X has {c} channels {format_shape(x)}, which group {group} does not divide", label)
    if isinstance(m, int) and m % group:
        raise ctx.error(f"W has {m} output channels {format_shape(w)}, which group {group} does not divide", label)
    if isinstance(c, int) and isinstance(per_group, int) and per_group * group != c:
        raise ctx.error(f"W has shape {format_shape(w)}; expected axis 1 = C/group = {c}/{group} = {c // group} "
                        f"(X {format_shape(x)})", label)


def _check_dy(ctx: NodeContext, x, w, dy, params: ConvParameters | None) -> None:
    if dy is None:
        return
    expected = [x[0] if x is not None else None, w[0] if w is not None else None]
    for a in range(len(dy) - 2):
        size = None if x is None else x[a + 2]
        kernel = None if w is None else w[a + 2]
        if params is not None and params.kernel_shape is not None:
            kernel = params.kernel_shape[a]
        ok = params is not None and isinstance(size, int) and isinstance(kernel, int)
        expected.append(params.output_size(a, size, kernel) if ok else None)
    for a, (want, have) in enumerate(zip(expected, dy, strict=True)):
        if isinstance(want, int) and isinstance(have, int) and want != have:
            shown = "[" + ",".join("?" if d is None else str(d) for d in expected) + "]"
            raise ctx.error(f"dY has shape {format_shape(dy)}; expected {shown} (axis {a}; the forward output of "
                            f"X {format_shape(x)} and W {format_shape(w)})", ctx.constraint_label(["dY"], ("O_i",)))


def _set(ctx: NodeContext, name: str, shape) -> None:
    if not ctx.has_output(name):
        return
    current = ctx.output_type(name)
    ctx.set_output_type(name, TensorType(None if current is None else current.elem_type,
                                         None if shape is None else tuple(shape)))
