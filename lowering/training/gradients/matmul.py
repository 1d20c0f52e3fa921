"""Gradient rules: MatMul and Gemm."""

from __future__ import annotations

import numpy as np

from lowering.training.gradients.context import GradientContext
from lowering.training.gradients.registry import gradient_rule

MS = "com.microsoft"


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


def _same(d, s) -> bool:
    return d == s and d is not None


def _reduce_batch(ctx: GradientContext, grad: str, grad_shape, like: str) -> str:
    """``grad`` (of shape ``grad_shape``: a matrix product's broadcast batch axes, then two matrix axes) summed
    over the batch axes ``like`` (an operand of rank >= 2) was broadcast along, then shaped like it."""
    f = ctx.f
    target = f.shape(like)
    if target is None or grad_shape is None:
        return ctx.sum_to_dynamic(grad, like)
    lead = len(grad_shape) - len(target)
    if lead < 0:
        raise ctx.fail(f"cannot sum a gradient of rank {len(grad_shape)} down to rank {len(target)}")
    axes = list(range(lead))
    for i, d in enumerate(target[:-2]):
        s = grad_shape[lead + i]
        if d == 1 and s != 1:
            axes.append(lead + i)  # broadcast (or a size-1 axis, whose sum changes nothing)
        elif not _same(d, s):
            return ctx.sum_to_dynamic(grad, like)
    if axes and axes == list(range(lead)):  # only the leading axes like lacks: drop them
        return f.reduce("ReduceSum", grad, axes, keepdims=0, hint="reduce_grad")
    return ctx.reduce_to(grad, axes, lead, like)


def _unsqueeze(f, x: str, axis: int) -> str:
    """``x`` with a new axis at ``axis`` (>= 0) in the opset's spelling (axes an input from opset 13)."""
    if f.opset >= 13:
        return f.node1("Unsqueeze", [x, f.axes([axis])])
    return f.node1("Unsqueeze", [x], axes=[axis])


def _rows(ctx: GradientContext, x: str, width_of: str, axis: int) -> str:
    """``x`` reshaped to [-1, n], n = dim ``axis`` of ``width_of`` (static where known)."""
    f = ctx.f
    shape = f.static_shape(width_of)
    if shape is not None:
        target = f.const(np.asarray([-1, shape[axis]], np.int64), hint="shape_2d")
    else:
        dim = f.node1("Gather", [f.node1("Shape", [width_of]), f.const(np.asarray([axis], np.int64))], axis=0)
        target = f.node1("Concat", [f.const(np.asarray([-1], np.int64)), dim], axis=0)
    return f.node1("Reshape", [x, target])


@gradient_rule("MatMul", differentiable=(0, 1))
def matmul(ctx: GradientContext) -> None:
    """Y = A B with numpy's matmul rules: batch axes broadcast, a 1-D A is a row vector [1, K] (its axis dropped
    from Y), a 1-D B a column vector [K, 1]. As onnxruntime-training: Gemm for two matrices; for batches
    dA = dY B^T (FusedMatMul transB) and dB = A^T dY (FusedMatMul transA, or one Gemm over the flattened rows
    when B is a matrix), summed over the batch axes an operand was broadcast along. 1-D operands take the
    products without the dropped axes (an outer product is a broadcast Mul)."""
    f, dy = ctx.f, ctx.dy(0)
    a, b = ctx.x(0), ctx.x(1)
    ra, rb = f.rank(a), f.rank(b)
    if ra is None or rb is None:
        raise ctx.fail("the rank of an operand is unknown (shape inference could not tell it)")
    if ra == 0 or rb == 0:
        raise ctx.fail("MatMul of a scalar")
    need_a, need_b = ctx.requires(0), ctx.requires(1)

    def out(x: str) -> str:
        return f.fresh(f"{x}_grad")

    if ra == 1 and rb == 1:  # Y = sum_k A[k] B[k], a scalar
        if need_a:
            ctx.set_dx(0, f.node1("Mul", [dy, b], out(a)))
        if need_b:
            ctx.set_dx(1, f.node1("Mul", [dy, a], out(b)))
        return
    if ra == 1:  # A [K], B [..., K, N], Y [..., N]
        if need_a:  # dA[k] = sum_{..., n} B[..., k, n] dY[..., n]
            if rb == 2:
                ctx.set_dx(0, f.node1("MatMul", [b, dy], out(a)))
            else:
                col = f.node1("MatMul", [b, _unsqueeze(f, dy, rb - 1)])  # [..., K, 1]
                ctx.set_dx(0, f.reduce("ReduceSum", col, list(range(rb - 2)) + [rb - 1], keepdims=0,
                                       output=out(a)))
        if need_b:  # dB[..., k, n] = A[k] dY[..., n]: Y has B's batch axes
            ctx.set_dx(1, f.node1("Mul", [_unsqueeze(f, a, 1), _unsqueeze(f, dy, rb - 2)], out(b)))
        return
    if rb == 1:  # A [..., M, K], B [K], Y [..., M]
        if need_a:  # dA[..., m, k] = dY[..., m] B[k]
            ctx.set_dx(0, f.node1("Mul", [_unsqueeze(f, dy, ra - 1), b], out(a)))
        if need_b:  # dB[k] = sum_{..., m} dY[..., m] A[..., m, k]
            if ra == 2:
                ctx.set_dx(1, f.node1("MatMul", [dy, a], out(b)))
            else:
                row = f.node1("MatMul", [_unsqueeze(f, dy, ra - 2), a])  # [..., 1, K]
                ctx.set_dx(1, f.reduce("ReduceSum", row, list(range(ra - 1)), keepdims=0, output=out(b)))
        return
    if ra == 2 and rb == 2:
        if need_a:
            ctx.set_dx(0, f.node1("Gemm", [dy, b], out(a), transB=1, beta=0.0))
        if need_b:
            ctx.set_dx(1, f.node1("Gemm", [a, dy], out(b), transA=1, beta=0.0))
        return
    y_shape = f.shape(ctx.y(0))
    a_shape, b_shape = f.shape(a), f.shape(b)
    if need_a:
        grad = f.node1("FusedMatMul", [dy, b], domain=MS, transB=1)
        shape = None if y_shape is None or a_shape is None else (*y_shape[:-1], a_shape[-1])
        ctx.set_dx(0, _reduce_batch(ctx, grad, shape, a))
    if need_b:
        if rb == 2:  # one Gemm over every row of the batch: dB = A_rows^T dY_rows
            ctx.set_dx(1, f.node1("Gemm", [_rows(ctx, a, b, 0), _rows(ctx, dy, b, 1)], out(b), transA=1,
                                  beta=0.0))
        else:
            grad = f.node1("FusedMatMul", [a, dy], domain=MS, transA=1)
            shape = None if y_shape is None or b_shape is None else (*y_shape[:-2], b_shape[-2], y_shape[-1])
            ctx.set_dx(1, _reduce_batch(ctx, grad, shape, b))
