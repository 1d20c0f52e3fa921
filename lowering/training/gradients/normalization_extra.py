"""Gradient rules: InstanceNormalization (torch's InstanceNorm1d/2d/3d, and GroupNorm, which torch exports as
Reshape -> InstanceNormalization(scale 1, bias 0) -> Reshape -> Mul -> Add).

onnxruntime-training has no gradient for it (its generator stops: "The gradient builder has not been
registered: InstanceNormalization"), so the rule is standard ops. The forward node stays as it is (the eval
model too); the backward recomputes the statistics over the spatial axes of each (n, c) plane the way the
kernel does (mean, then the mean of the centred squares: no E[x^2] - E[x]^2 cancellation):

    x_hat = (x - mean) / sqrt(var + epsilon)
    dB = sum(dY), dScale = sum(dY * x_hat)                    over the batch and spatial axes
    dX = (g - mean(g) - x_hat * mean(g * x_hat)) / sqrt(var + epsilon),  g = dY * scale, means over the plane
"""

from __future__ import annotations

import numpy as np

from lowering.training.gradients.context import GradientContext
from lowering.training.gradients.registry import gradient_rule


@gradient_rule("InstanceNormalization", differentiable=(0, 1, 2))
def instance_normalization(ctx: GradientContext) -> None:
    f, x, scale, dy = ctx.f, ctx.x(0), ctx.x(1), ctx.dy(0)
    rank = f.rank(x) or f.rank(ctx.y(0))
    if rank is None or rank < 3:
        raise ctx.fail("the input's rank is unknown or below 3 (InstanceNormalization normalises [N, C, D1, ...])")
    spatial = list(range(2, rank))
    dtype = f.np_dtype(x)
    epsilon = float(ctx.attr("epsilon", 1e-5))
    if ctx.requires(2):
        ctx.set_dx(2, f.reduce("ReduceSum", dy, [0, *spatial], keepdims=0, hint="instnorm_dbias"))
    if not (ctx.requires(0) or ctx.requires(1)):
        return
    mean = f.reduce("ReduceMean", x, spatial, keepdims=1, hint="instnorm_mean")
    centred = f.node1("Sub", [x, mean])
    var = f.reduce("ReduceMean", f.node1("Mul", [centred, centred]), spatial, keepdims=1, hint="instnorm_var")
    inv_std = f.node1("Reciprocal", [f.node1("Sqrt", [f.node1("Add", [var, f.const(np.asarray(epsilon, dtype),
                                                                                    hint="epsilon")])])])
    x_hat = f.node1("Mul", [centred, inv_std], hint="instnorm_xhat")
    if ctx.requires(1):
        ctx.set_dx(1, f.reduce("ReduceSum", f.node1("Mul", [dy, x_hat]), [0, *spatial], keepdims=0,
                               hint="instnorm_dscale"))
    if ctx.requires(0):
        per_channel = f.node1("Reshape", [scale, f.const(np.array([-1] + [1] * len(spatial), np.int64),
                                                         hint="channel_shape")])
        g = f.node1("Mul", [dy, per_channel])
        mean_g = f.reduce("ReduceMean", g, spatial, keepdims=1)
        mean_gx = f.reduce("ReduceMean", f.node1("Mul", [g, x_hat]), spatial, keepdims=1)
        inner = f.node1("Sub", [f.node1("Sub", [g, mean_g]), f.node1("Mul", [x_hat, mean_gx])])
        ctx.set_dx(0, f.node1("Mul", [inner, inv_std], hint="instnorm_dx"))
