"""Gradient rules: MatMul and Gemm."""

from __future__ import annotations

import numpy as np

from lowering.training.gradients.context import GradientContext
from lowering.training.gradients.registry import gradient_rule


@gradient_rule("Gemm", differentiable=(0, 1, 2))
def gemm(ctx: GradientContext) -> None:
    """Y = alpha * A' B' + beta * C (A' = A or A^T by transA, B' likewise)."""
    f, dy = ctx.f, ctx.dy(0)
    a, b = ctx.x(0), ctx.x(1)
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    ta, tb = int(ctx.attr("transA", 0)), int(ctx.attr("transB", 0))
    if ctx.requires(0):
        # dA' = dY B'^T
        if not ta:
            da = f.node1("Gemm", [dy, b], transA=0, transB=0 if tb else 1, alpha=alpha, beta=0.0,
                         output=f.fresh(f"{a}_grad"))
        else:  # dA = (dY B'^T)^T = B' dY^T
            da = f.node1("Gemm", [b, dy], transA=1 if tb else 0, transB=1, alpha=alpha, beta=0.0,
                         output=f.fresh(f"{a}_grad"))
        ctx.set_dx(0, da)
    if ctx.requires(1):
        # dB' = A'^T dY
        if not tb:
            db = f.node1("Gemm", [a, dy], transA=0 if ta else 1, transB=0, alpha=alpha, beta=0.0,
                         output=f.fresh(f"{b}_grad"))
        else:  # dB = dY^T A'
            db = f.node1("Gemm", [dy, a], transA=1, transB=1 if ta else 0, alpha=alpha, beta=0.0,
                         output=f.fresh(f"{b}_grad"))
        ctx.set_dx(1, db)
    if ctx.requires(2):
        dc = ctx.sum_to(dy, ctx.x(2))
        if beta != 1.0:
            dc = f.node1("Mul", [dc, f.const(np.asarray(beta, f.np_dtype(ctx.x(2))))])
        ctx.set_dx(2, dc)
