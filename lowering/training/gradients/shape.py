"""Gradient rules: reshaping, indexing and reductions."""

from __future__ import annotations

import numpy as np

from lowering.training.gradients.context import GradientContext
from lowering.training.gradients.registry import gradient_rule


def _reduce_axes(ctx: GradientContext) -> list[int] | None:
    """The reduced axes (normalised, sorted) of a ReduceMean/ReduceSum node, or None for all axes."""
    f = ctx.f
    rank = f.rank(ctx.x(0))
    axes = ctx.attr("axes")
    if axes is None and len(ctx.node.input) > 1 and ctx.x(1):
        value = f.constant(ctx.x(1))
        if value is None:
            raise ctx.fail("the reduction axes are not a constant")
        axes = value.ravel().tolist()
    if axes is None or len(axes) == 0:
        if ctx.attr("noop_with_empty_axes", 0) and axes is not None:
            return []
        return None
    if rank is None:
        raise ctx.fail("the input's rank is unknown")
    return sorted(int(a) % rank for a in axes)


def _broadcast_back(ctx: GradientContext, dy: str) -> str:
    """``dy`` (the reduction's output) unsqueezed where keepdims=0 dropped axes, expanded to the input's shape."""
    f = ctx.f
    axes = _reduce_axes(ctx)
    rank = f.rank(ctx.x(0))
    if not ctx.attr("keepdims", 1):
        if axes is None:
            if rank is None:
                raise ctx.fail("the input's rank is unknown")
            axes = list(range(rank))
        if axes:
            dy = f.node1("Unsqueeze", [dy, f.axes(axes)]) if f.opset >= 13 else f.node1("Unsqueeze", [dy], axes=axes)
    return f.node1("Expand", [dy, f.node1("Shape", [ctx.x(0)])])


@gradient_rule("ReduceSum")
def reduce_sum(ctx: GradientContext) -> None:
    ctx.set_dx(0, _broadcast_back(ctx, ctx.dy(0)))


@gradient_rule("ReduceMean")
def reduce_mean(ctx: GradientContext) -> None:
    f = ctx.f
    x = ctx.x(0)
    shape = f.static_shape(x)
    axes = _reduce_axes(ctx)
    if shape is not None:
        count = int(np.prod([shape[a] for a in (range(len(shape)) if axes is None else axes)], dtype=np.int64))
        scale = f.const(np.asarray(count, f.np_dtype(x)), hint="reduce_count")
    else:
        scale = f.node1("Cast", [f.node1("Div", [f.node1("Size", [x]), f.node1("Size", [ctx.y(0)])])],
                        to=f.elem_type(x))
    ctx.set_dx(0, _broadcast_back(ctx, f.node1("Div", [ctx.dy(0), scale])))
