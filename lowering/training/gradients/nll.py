"""Gradient rule: NegativeLogLikelihoodLoss (what torch exports for ``F.nll_loss`` on anything but a
``log_softmax`` output, e.g. ``nll_loss(log(softmax(x) + eps))``, with ``loss=None``).

onnxruntime-training has no gradient for it ("The gradient builder has not been registered:
NegativeLogLikelihoodLoss"). Standard ops: with w the class weights (1 without), m the mask of targets that are
not ``ignore_index``, the loss is -sum(w[t] m x[n, t]) over the positions, divided by sum(w[t] m) for
``mean``; so dX is zero except at each position's target class, where it is -w[t] m dL (/ sum(w[t] m) for
``mean``), placed by comparing the class axis with the target (no scatter).
"""

from __future__ import annotations

import numpy as np
import onnx

from lowering.training.gradients.context import GradientContext
from lowering.training.gradients.registry import gradient_rule


@gradient_rule("NegativeLogLikelihoodLoss", differentiable=(0,))
def negative_log_likelihood_loss(ctx: GradientContext) -> None:
    f, x, target, dy = ctx.f, ctx.x(0), ctx.x(1), ctx.dy(0)
    weight = ctx.x(2) if len(ctx.node.input) > 2 else ""
    reduction = ctx.attr("reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    ignore_index = ctx.attr("ignore_index")
    rank = f.rank(x)
    if rank is None:
        raise ctx.fail("the rank of the input is unknown (shape inference could not tell it)")
    elem = f.elem_type(x)
    safe = target
    mask = None
    if ignore_index is not None:
        keep = f.node1("Not", [f.node1("Equal", [target, f.const(np.asarray(ignore_index, f.np_dtype(target)),
                                                                            hint="ignore_index")])])
        safe = f.node1("Where", [keep, target, f.const(np.asarray(0, f.np_dtype(target)), hint="zero")])
        mask = f.node1("Cast", [keep], to=elem)
    coef = None  # w[t] * m per position, None = all ones
    if weight:
        coef = f.node1("Gather", [weight, safe], axis=0)
    if mask is not None:
        coef = mask if coef is None else f.node1("Mul", [coef, mask])
    if reduction == "mean":
        if coef is None:
            count = f.node1("Cast", [f.node1("Size", [target])], to=elem)
            scale = f.node1("Div", [dy, count])
        else:
            scale = f.node1("Div", [dy, f.node1("ReduceSum", [coef], keepdims=0)])
    elif reduction in ("sum", "none"):
        scale = dy
    else:
        raise ctx.fail(f"reduction {reduction!r} is unknown")
    per_position = scale if coef is None else f.node1("Mul", [coef, scale])
    if coef is None and reduction != "none":  # a scalar: spread over the target's shape
        per_position = f.node1("Expand", [per_position, f.node1("Shape", [target])])
    negated = f.node1("Neg", [per_position])
    shape = f.static_shape(x)
    classes = f.const(np.asarray(shape[1], np.int64), hint="classes") if shape is not None else \
        f.node1("Gather", [f.node1("Shape", [x]), f.const(np.asarray(1, np.int64), hint="axis")], axis=0)
    class_range = f.node1("Range", [f.const(np.asarray(0, np.int64), hint="zero"), classes,
                                    f.const(np.asarray(1, np.int64), hint="one")])
    along_axis1 = f.node1("Reshape", [class_range, f.const(np.array([-1] + [1] * (rank - 2), np.int64),
                                                           hint="class_axis")])
    safe64 = safe if f.elem_type(safe) == onnx.TensorProto.INT64 else f.node1("Cast", [safe],
                                                                                to=onnx.TensorProto.INT64)
    hit = f.node1("Cast", [f.node1("Equal", [_unsqueeze1(ctx, safe64), along_axis1])], to=elem)
    ctx.set_dx(0, f.node1("Mul", [hit, _unsqueeze1(ctx, negated)], hint="nll_dx"))


def _unsqueeze1(ctx: GradientContext, name: str) -> str:
    """``name`` with a new axis 1 (the class axis), in the opset's spelling."""
    f = ctx.f
    if f.opset >= 13:
        return f.node1("Unsqueeze", [name, f.axes([1])])
    return f.node1("Unsqueeze", [name], axes=[1])
