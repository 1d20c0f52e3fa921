"""Batch-norm training backward (DESIGN.md section 4): epsilon, channel axis, shapes, output types.

Canonical roles: ``src, diff_dst, mean, variance | inv_std, gamma?`` -> ``diff_src, diff_gamma?, diff_beta?``;
the binding maps them onto the spec's argument names. Layout (``binding.layout``):

- ``data_format``: the layout attribute; ``NCX`` -> channel axis 1, ``NXC`` -> the last axis;
- ``channel_first``: axis 1;
- ``stats_broadcast``: the statistics keep src's rank, every dim 1 or src's; sums run over the axes
  where they are 1 (DirectML).

Ranks: the spec's own limits on an argument, the binding's ``min_rank``/``max_rank``, and what the
layout needs — a channel axis 1 needs rank >= 2; ``NXC`` and ``stats_broadcast`` work from rank 1. No
upper limit unless the spec or binding states one: the math is the same at any rank.

What cannot be decided statically is not an error: with src's rank unknown, ``NXC`` leaves
``channel_axis`` and ``reduce_axes`` None; two different symbolic dims may well be equal at run time.
"""

from __future__ import annotations

from collections.abc import Sequence

from opdef.errors import SpecError
from opdef.node import Dim, TensorType
from opdef.rules.base import (
    Conflict,
    NodeContext,
    RuleResult,
    bound_roles,
    epsilon_attribute,
    format_elem,
    format_shape,
    merge_shape,
    register_rule,
)

DATA_FORMATS = ("NCX", "NXC")
REQUIRED_ROLES = ("src", "diff_dst", "mean", "diff_src", "epsilon")


@register_rule("batch_norm_backward")
def batch_norm_backward(ctx: NodeContext) -> RuleResult:
    binding = ctx.binding
    missing = [r for r in (*REQUIRED_ROLES, binding.stat_input) if not binding.arg(r)]
    if missing:
        raise SpecError("bindings.json", None, f"{binding.domain}::{binding.op_type}: rule batch_norm_backward "
                                               f"needs the role(s) {missing}")
    src, diff_dst = binding.arg("src"), binding.arg("diff_dst")
    epsilon = epsilon_attribute(ctx, binding.arg("epsilon"))

    _same_element_type(ctx, [src, diff_dst])
    data_shape = _data_shape(ctx, src, diff_dst)
    rank = None if data_shape is None else len(data_shape)
    layout = _layout(ctx)
    _check_rank(ctx, src, data_shape, layout)

    stats = _statistics(ctx)
    _same_element_type(ctx, stats)
    if layout is None:
        stat_shape, rank = _broadcast_stats(ctx, stats, src, data_shape)
        channel_axis = None
        reduce_axes = None if stat_shape is None else _keep_rank_reduce_axes(stat_shape, data_shape)
        if reduce_axes is not None:
            kept = [i for i in range(len(stat_shape)) if i not in reduce_axes]
            channel_axis = kept[0] if len(kept) == 1 else None
        if data_shape is None and stat_shape is not None:
            data_shape = (None,) * len(stat_shape)
    else:
        channel_axis = 1 if layout == "first" else None if rank is None else rank - 1
        stat_shape = _channel_stats(ctx, stats, src, data_shape, channel_axis)
        reduce_axes = None if rank is None else tuple(i for i in range(rank) if i != channel_axis)

    if binding.paired_param_grads:
        _both_or_neither(ctx, binding.arg("diff_gamma"), binding.arg("diff_beta"))

    src_elem = _elem(ctx, src, diff_dst)
    stat_elem = _elem(ctx, *stats)
    _set_output(ctx, binding.arg("diff_src"), src_elem, data_shape)
    for role in ("diff_gamma", "diff_beta"):
        _set_output(ctx, binding.arg(role), stat_elem, stat_shape)

    return RuleResult(roles=bound_roles(ctx), rank=rank, channel_axis=channel_axis,
                      reduce_axes=reduce_axes, epsilon=epsilon)


# -- attributes ------------------------------------------------------------------------------------

def _layout(ctx: NodeContext) -> str | None:
    """Where the channel axis is: "first" (axis 1), "last", or None when the statistics decide (stats_broadcast)."""
    binding = ctx.binding
    if binding.layout == "channel_first":
        return "first"
    if binding.layout == "stats_broadcast":
        return None
    attr = binding.layout_attribute
    value = ctx.attributes.get(attr)
    if value not in DATA_FORMATS:
        raise ctx.error(f"{attr} is {value!r}; expected one of {', '.join(DATA_FORMATS)}")
    return "first" if value == "NCX" else "last"


def _check_rank(ctx: NodeContext, src: str, data_shape, layout: str | None) -> None:
    if data_shape is None:
        return
    rank = len(data_shape)
    binding = ctx.binding
    limits = []
    if layout == "first":
        limits.append((2, None, "channel axis 1 needs rank >= 2"))
    else:
        limits.append((1, None, "a channel axis needs rank >= 1"))
    limits.append((binding.min_rank, binding.max_rank, f"binding of {binding.domain}::{binding.op_type}"))
    for lo, hi, why in limits:
        if (lo is not None and rank < lo) or (hi is not None and rank > hi):
            wanted = f"{lo}..{hi}" if lo is not None and hi is not None else (f">= {lo}" if lo is not None
                                                                                 else f"<= {hi}")
            raise ctx.error(f"{src} has rank {rank} {format_shape(data_shape)}; expected rank {wanted} ({why})",
                            ctx.constraint_label([src], ("rank",)))


# -- shapes ----------------------------------------------------------------------------------------

def _data_shape(ctx: NodeContext, src: str, diff_dst: str) -> tuple[Dim, ...] | None:
    src_shape = _shape(ctx, src)
    dd_shape = _shape(ctx, diff_dst)
    try:
        return merge_shape(src_shape, dd_shape)
    except Conflict:
        raise ctx.error(f"{diff_dst} has shape {format_shape(dd_shape)}; expected {src}'s shape "
                        f"{format_shape(src_shape)}",
                        ctx.constraint_label([src, diff_dst], ("size", "shape"))) from None


def _statistics(ctx: NodeContext) -> list[str]:
    """mean, variance|inv_std, gamma, plus any unbound input documented with mean's shape (nGraph's beta)."""
    binding = ctx.binding
    names = [binding.arg("mean"), binding.arg(binding.stat_input), binding.arg("gamma")]
    names = [n for n in names if n and ctx.has_input(n)]
    bound = set(binding.role_map.values())
    mean_doc = _documented_shape(ctx, binding.arg("mean"))
    if mean_doc:
        names += [a.name for a in ctx.input_args
                  if a.name not in bound and a.shape == mean_doc and ctx.has_input(a.name)]
    return names


def _channel_stats(ctx: NodeContext, stats: Sequence[str], src: str, data_shape, channel_axis):
    """Each statistic is [C]; returns the merged [C]."""
    c = None if data_shape is None or channel_axis is None else data_shape[channel_axis]
    expected: tuple[Dim, ...] = (c,)
    source = (f"channel axis {channel_axis} of {src} {format_shape(_shape(ctx, src) or data_shape)}"
              if isinstance(c, int) else None)
    source_name = src
    for name in stats:
        shape = _shape(ctx, name)
        if shape is None:
            continue
        why = f" ({source})" if source else ""
        if len(shape) != 1:
            axis = f"channel axis {channel_axis}" if channel_axis is not None else "the channel axis"
            raise ctx.error(f"{name} has shape {format_shape(shape)}; expected {format_shape(expected)} "
                            f"(one value per channel, {axis} of {src} {format_shape(data_shape)})",
                            ctx.constraint_label([name], ("[c]", "1d", "1-d")))
        try:
            merged = merge_shape(expected, shape)
        except Conflict:
            label = (ctx.constraint_label([source_name, name], ("size", "shape"))
                     or ctx.constraint_label([name], ("[c]",)))
            raise ctx.error(f"{name} has shape {format_shape(shape)}; expected {format_shape(expected)}{why}",
                            label) from None
        if source is None and isinstance(merged[0], int):
            source, source_name = f"the shape of {name}", name
        expected = merged
    return expected


def _broadcast_stats(ctx: NodeContext, stats: Sequence[str], src: str, data_shape):
    """Statistics keep src's rank, each dim 1 or src's, and all share one shape. Returns (shape, rank)."""
    rank = None if data_shape is None else len(data_shape)
    merged = None
    first = None
    for name in stats:
        shape = _shape(ctx, name)
        if shape is None:
            continue
        if rank is not None and len(shape) != rank:
            raise ctx.error(f"{name} has rank {len(shape)} {format_shape(shape)}; expected {src}'s rank {rank} "
                            f"{format_shape(data_shape)} (statistics keep the input's rank)",
                            ctx.constraint_label([src, name], ("dimensioncount", "rank")))
        if data_shape is not None:
            for axis, (d, x) in enumerate(zip(shape, data_shape, strict=True)):
                if isinstance(d, int) and d != 1 and isinstance(x, int) and d != x:
                    raise ctx.error(f"{name} has shape {format_shape(shape)}; every dim must be 1 or {src}'s "
                                    f"{format_shape(data_shape)}: axis {axis} is {d}, not 1 or {x}")
        try:
            merged = merge_shape(merged, shape)
        except Conflict:
            raise ctx.error(f"{name} has shape {format_shape(shape)}; expected {first}'s shape "
                            f"{format_shape(merged)}", ctx.constraint_label([first, name], ("size",))) from None
        first = first or name
        rank = len(shape)
    if merged is None and rank is not None:
        merged = (None,) * rank
    return merged, rank


def _keep_rank_reduce_axes(stat_shape, data_shape) -> tuple[int, ...] | None:
    """The axes keep-rank statistics reduce: where their dim is 1. A dim equal to src's (the same size or
    the same symbol) is kept, even if it turns out to be 1 at run time (a sum over one element changes
    nothing). None when a symbolic or unknown dim could be either 1 or src's: only run time would tell."""
    reduced = []
    for axis, d in enumerate(stat_shape):
        x = None if data_shape is None else data_shape[axis]
        if d == 1:
            reduced.append(axis)
        elif not isinstance(d, int) and (d is None or d != x):
            return None
    return tuple(reduced)


# -- outputs and types -----------------------------------------------------------------------------

def _both_or_neither(ctx: NodeContext, a: str | None, b: str | None) -> None:
    if not a or not b:
        return
    if ctx.has_output(a) == ctx.has_output(b):
        return
    label = ctx.constraint_label([a, b])
    given, missing = (a, b) if ctx.has_output(a) else (b, a)
    raise ctx.error(f"{given} is requested but {missing} is not; request both or neither", label)


def _same_element_type(ctx: NodeContext, names: Sequence[str]) -> None:
    first = None
    for name in names:
        t = ctx.input_type(name)
        if t is None or t.elem_type is None:
            continue
        if first is None:
            first = (name, t.elem_type)
        elif t.elem_type != first[1]:
            raise ctx.error(f"{name} has element type {format_elem(t.elem_type)}; expected {first[0]}'s "
                            f"{format_elem(first[1])}",
                            ctx.constraint_label([first[0], name], ("type",)))


def _elem(ctx: NodeContext, *names: str) -> int | None:
    for name in names:
        t = ctx.input_type(name)
        if t is not None and t.elem_type is not None:
            return t.elem_type
    return None


def _set_output(ctx: NodeContext, name: str | None, elem: int | None, shape) -> None:
    if not name or not ctx.has_output(name):
        return
    current = ctx.output_type(name)
    if current is not None and current.elem_type is not None:
        elem = current.elem_type  # what the type variables decided
    ctx.set_output_type(name, TensorType(elem, None if shape is None else tuple(shape)))


def _shape(ctx: NodeContext, name: str | None):
    t = ctx.input_type(name)
    return None if t is None else t.shape


def _documented_shape(ctx: NodeContext, name: str | None) -> str | None:
    for a in ctx.input_args:
        if a.name == name:
            return a.shape
    return None
