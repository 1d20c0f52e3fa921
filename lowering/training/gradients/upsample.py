"""Gradient rules: Resize (nearest, linear, cubic; every coordinate transformation but tf_crop_and_resize), and
the separable linear maps Pad (reflect/edge/wrap) and AveragePool over a symbolic batch share with it.

Resize is linear in X and separable: along each resized axis, Y = A X with A an [out, in] interpolation matrix
that depends only on the sizes, the mode and the coordinate transformation. The rule builds each A as a
constant from the static sizes (the way onnxruntime's kernel maps output to input coordinates: float32
arithmetic, clamped neighbours) and sends the gradient back with the transposes: dX = A^T dY along every
resized axis (a MatMul each; identity axes skipped). onnxruntime-training's own ResizeGrad has no CPU kernel
(its runtime refuses the artifacts it writes for a torch UNet); the MatMuls run everywhere.

Where the sizes or scales are computed in the graph (torch's nn.Upsample export: a Concat of Constants), A is
built by the graph from the run's sizes with the same float32 arithmetic (Range, one-hots by Equal).

The same transposed per-axis maps give two other gradients, called from their families' rules:
:func:`pad_gradient` (Pad in reflect / edge / wrap mode, from ``shape.py``) and :func:`average_pool_gradient`
(AveragePool over a symbolic batch, from ``conv.py``: onnxruntime-training's AveragePoolGrad kernel takes dX's
whole shape from its declared type, so a symbolic batch gives it 0 rows -- its own artifacts of such a model
die with SIGFPE).
"""

from __future__ import annotations

import math

import numpy as np
import onnx

from lowering.training.gradients.context import GradientContext, node_attributes
from lowering.training.gradients.registry import gradient_rule

_TRANSFORMS = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
               "tf_half_pixel_for_nn")
_NEAREST = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def _original(x_out: np.ndarray, transform: str, scale: np.float32, n_in: int, n_out: int) -> np.ndarray:
    """Input coordinates of the output positions ``x_out`` (float32, as onnxruntime computes them)."""
    f32 = np.float32
    x = x_out.astype(f32)
    if transform == "half_pixel":
        return (x + f32(0.5)) / scale - f32(0.5)
    if transform == "half_pixel_symmetric":  # onnxruntime: the last steps in double
        adjustment = f32(n_out) / (scale * f32(n_in))
        offset = f32(f32(n_in) / f32(2) * (f32(1) - adjustment))
        return (np.float64(offset) + (x.astype(np.float64) + 0.5) / np.float64(scale) - 0.5).astype(f32)
    if transform == "pytorch_half_pixel":
        return (x + f32(0.5)) / scale - f32(0.5) if n_out > 1 else np.zeros_like(x)
    if transform == "align_corners":
        return x * f32(n_in - 1) / f32(n_out - 1) if n_out > 1 else np.zeros_like(x)
    if transform == "asymmetric":
        return x / scale
    return (x + f32(0.5)) / scale  # tf_half_pixel_for_nn


def _nearest_index(x: np.ndarray, mode: str, n_in: int) -> np.ndarray:
    x = x.astype(np.float64)
    if mode == "floor":
        idx = np.floor(x)
    elif mode == "ceil":
        idx = np.ceil(x)
    else:
        frac = x - np.floor(x)
        half = frac == 0.5
        rounded = np.floor(x + 0.5)
        idx = np.where(half, np.floor(x) if mode == "round_prefer_floor" else np.ceil(x), rounded)
    return np.clip(idx, 0, n_in - 1).astype(np.int64)


def _cubic_coefficients(ratio: float, a: float) -> np.ndarray:
    def kernel(s: float) -> float:
        s = abs(s)
        if s <= 1:
            return ((a + 2) * s - (a + 3)) * s * s + 1
        if s < 2:
            return ((a * s - 5 * a) * s + 8 * a) * s - 4 * a
        return 0.0
    return np.array([kernel(1 + ratio), kernel(ratio), kernel(1 - ratio), kernel(2 - ratio)])


def interpolation_matrix(n_in: int, n_out: int, scale: float, attrs: dict) -> np.ndarray:
    """A [n_out, n_in] (float64) with y = A x along one axis of Resize with ``attrs``."""
    mode = attrs.get("mode", "nearest")
    transform = attrs.get("coordinate_transformation_mode", "half_pixel")
    x = _original(np.arange(n_out), transform, np.float32(scale), n_in, n_out)
    a = np.zeros((n_out, n_in))
    rows = np.arange(n_out)
    if mode == "nearest":
        a[rows, _nearest_index(x, attrs.get("nearest_mode", "round_prefer_floor"), n_in)] = 1.0
        return a
    if mode == "linear":
        xc = np.clip(x.astype(np.float64), 0, n_in - 1)
        lo = np.floor(xc).astype(np.int64)
        hi = np.minimum(lo + 1, n_in - 1)
        w = xc - lo
        np.add.at(a, (rows, lo), 1.0 - w)
        np.add.at(a, (rows, hi), w)
        return a
    # cubic: four neighbours around floor(x), clamped to the edge (or dropped and renormalised)
    coeff_a = float(attrs.get("cubic_coeff_a", -0.75))
    exclude = int(attrs.get("exclude_outside", 0))
    for r in range(n_out):
        xr = float(x[r])
        base = math.floor(xr)
        c = _cubic_coefficients(xr - base, coeff_a)
        idx = np.arange(base - 1, base + 3)
        if exclude:
            inside = (idx >= 0) & (idx < n_in)
            c = np.where(inside, c, 0.0)
            c = c / c.sum()
        np.add.at(a[r], np.clip(idx, 0, n_in - 1), c)
    return a


def _known_scales(ctx: GradientContext, attrs: dict, in_shape, out_shape) -> list[float | None]:
    """Each axis's scale as the kernel uses it (float32 values), None where only the run knows it: the scales
    input where it is given (a constant), else sizes / in (stretch; onnxruntime divides in float32)."""
    f = ctx.f
    rank = len(in_shape)
    axes = attrs.get("axes")
    axes = [a % rank for a in axes] if axes else list(range(rank))
    scales_name = ctx.x(2) if len(ctx.node.input) > 2 else ""
    sizes_name = ctx.x(3) if len(ctx.node.input) > 3 else ""
    scales_in = f.constant(scales_name) if scales_name else None
    sizes_in = f.constant(sizes_name) if sizes_name else None
    out: list[float | None] = [1.0] * rank
    if scales_in is not None and scales_in.size:
        for a, v in zip(axes, scales_in.reshape(-1).tolist(), strict=True):
            out[a] = float(np.float32(v))
        return out
    if scales_name and scales_in is None and not sizes_name:
        return [None] * rank  # scales computed in the graph: read at run time
    policy = attrs.get("keep_aspect_ratio_policy", "stretch")
    if sizes_in is not None and policy != "stretch":
        if not all(isinstance(in_shape[a], int) for a in axes):
            raise ctx.fail(f"keep_aspect_ratio_policy {policy}: the resized axes' input sizes must be static")
        ratios = [float(np.float32(v) / np.float32(in_shape[a]))
                  for a, v in zip(axes, sizes_in.reshape(-1).tolist(), strict=True)]
        common = min(ratios) if policy == "not_larger" else max(ratios)
        for a in axes:
            out[a] = common
        return out
    if policy != "stretch":
        raise ctx.fail(f"keep_aspect_ratio_policy {policy} with sizes computed in the graph has no gradient here")
    targets = dict(zip(axes, sizes_in.reshape(-1).tolist(), strict=True)) if sizes_in is not None else {}
    for a in axes:
        n_in, n_out = in_shape[a], targets.get(a, out_shape[a])
        if isinstance(n_in, int) and isinstance(n_out, int) and n_in > 0:
            out[a] = float(np.float32(n_out) / np.float32(n_in))
        else:
            out[a] = None
    return out


@gradient_rule("Resize")
def resize(ctx: GradientContext) -> None:
    f, x, y, dy = ctx.f, ctx.x(0), ctx.y(0), ctx.dy(0)
    attrs = node_attributes(ctx.node)
    if f.opset < 11:
        raise ctx.fail("Resize before opset 11 (no coordinate transformation attribute) is not differentiated; "
                       "export at opset 11 or later")
    mode = attrs.get("mode", "nearest")
    transform = attrs.get("coordinate_transformation_mode", "half_pixel")
    if mode not in ("nearest", "linear", "cubic"):
        raise ctx.fail(f"mode {mode!r} is unknown")
    if transform not in _TRANSFORMS:
        raise ctx.fail(f"coordinate_transformation_mode {transform!r} has no gradient here (tf_crop_and_resize "
                       "reads a region of interest)")
    if mode == "nearest" and attrs.get("nearest_mode", "round_prefer_floor") not in _NEAREST:
        raise ctx.fail(f"nearest_mode {attrs.get('nearest_mode')!r} is unknown")
    in_shape = f.shape(x)
    if in_shape is None:
        raise ctx.fail("the rank of X is unknown (shape inference could not tell it)")
    rank = len(in_shape)
    out_shape = f.shape(y)
    if out_shape is None or len(out_shape) != rank:
        out_shape = (None,) * rank
    scales = _known_scales(ctx, attrs, in_shape, out_shape)
    plan: list[tuple[int, np.ndarray | None]] = []  # a constant matrix, or None: built at run time
    for axis in range(rank):
        n_in, n_out, scale = in_shape[axis], out_shape[axis], scales[axis]
        if isinstance(n_in, int) and n_out is None and scale is not None:
            n_out = int(np.float32(n_in) * np.float32(scale))  # the kernel's output size: floor(in * scale)
        static = isinstance(n_in, int) and isinstance(n_out, int) and scale is not None
        same = (scale == 1.0 and n_out in (None, n_in)) or (scale is None and isinstance(n_in, str) and n_in == n_out)
        if not static and transform != "tf_half_pixel_for_nn" and same:
            continue  # the same size at scale 1: the transformation maps each position onto itself
        if int(attrs.get("antialias", 0)) and mode != "nearest" and not (isinstance(n_in, int) and
                                                                          isinstance(n_out, int) and n_out >= n_in):
            raise ctx.fail("antialias=1 when (possibly) downsampling has no gradient here")
        if static:
            matrix = interpolation_matrix(n_in, n_out, scale, attrs)
            if n_in == n_out and np.array_equal(matrix, np.eye(n_in)):
                continue
            plan.append((axis, matrix))
        else:
            plan.append((axis, None))
    ctx.set_dx(0, transposed_maps(ctx, dy, [(a, m if m is not None else _runtime_matrix(ctx, a, attrs, scales[a]))
                                           for a, m in plan], rank))


def transposed_maps(ctx: GradientContext, dy: str, maps: list[tuple[int, np.ndarray | str]], rank: int) -> str:
    """dX of Y = X mapped along each listed axis by A (``[out, in]``: a constant array, or a float32 graph value):
    dY through every A^T, a MatMul per axis (a Transpose pair around it for the axes before the last two)."""
    f, x = ctx.f, ctx.x(0)
    dtype = f.np_dtype(x)
    g = dy
    for axis, matrix in reversed(maps):
        if isinstance(matrix, str):
            weights = matrix if dtype == np.float32 else f.node1("Cast", [matrix], to=f.elem_type(x))
            weights_t = f.node1("Transpose", [weights], perm=[1, 0]) if axis == rank - 2 else None
        else:
            weights = f.const(matrix.astype(dtype), hint="map_weights")
            weights_t = f.const(np.ascontiguousarray(matrix.T).astype(dtype), hint="map_weights_t") \
                if axis == rank - 2 else None
        if axis == rank - 1:
            g = f.node1("MatMul", [g, weights])
        elif axis == rank - 2:
            g = f.node1("MatMul", [weights_t, g])
        else:
            perm = list(range(rank))
            perm[axis], perm[-1] = perm[-1], perm[axis]
            moved = f.node1("Transpose", [g], perm=perm)
            g = f.node1("Transpose", [f.node1("MatMul", [moved, weights])], perm=perm)
    return f.node1("Identity", [dy]) if g == dy else g  # nothing mapped: Y is X


# -- other separable linear maps: Pad's reflect/edge/wrap modes, AveragePool over a symbolic batch ---------------

def pad_gradient(ctx: GradientContext, mode: str, pads: list[int] | None, axes: list[int] | None) -> str:
    """dX of Pad in mode reflect, edge or wrap: each padded axis maps output position o to one input index
    (mirrored without the edge, clamped, or modulo the size), so A has one 1 per row and dX sums the copies."""
    f, x = ctx.f, ctx.x(0)
    shape = f.shape(x)
    if pads is None or axes is None or shape is None:
        raise ctx.fail(f"mode {mode!r}: the pads must be constants and X's rank known")
    k = len(axes)
    maps = []
    for j, axis in enumerate(axes):
        begin, end = pads[j], pads[j + k]
        if begin == 0 and end == 0:
            continue
        n = shape[axis]
        if not isinstance(n, int):
            raise ctx.fail(f"mode {mode!r}: padded axis {axis} must have a static size (it is {n})")
        source = np.arange(n + begin + end) - begin
        if mode == "reflect":
            if n < 2 and (begin > 0 or end > 0):
                raise ctx.fail(f"mode 'reflect' on axis {axis} of size {n}")
            period = 2 * (n - 1)
            source = np.abs((source + period * (1 + abs(int(source.min())) // period)) % period)
            source = np.where(source > n - 1, period - source, source)
        elif mode == "edge":
            source = np.clip(source, 0, n - 1)
        elif mode == "wrap":
            source = source % n
        else:
            raise ctx.fail(f"mode {mode!r} is unknown")
        matrix = np.zeros((n + begin + end, n))
        matrix[np.arange(len(source)), source] = 1.0
        maps.append((axis, matrix))
    return transposed_maps(ctx, ctx.dy(0), maps, len(shape))


def average_pool_gradient(ctx: GradientContext, attrs: dict, spatial: tuple) -> str:
    """dX of AveragePool (explicit pads, no dilation) as one map per spatial axis (a constant, or built by the graph
    where the axis's length is symbolic): output o averages the inputs of
    its window [o s - pad_begin, o s - pad_begin + k), divided by the inputs it covers (count_include_pad 0) or by
    its part inside the padded input (1); both divisors are products over the axes, so the map is separable.
    Used where X's batch or channels are symbolic: AveragePoolGrad's kernel reads dX's whole shape from its
    declared type, and onnxruntime-training's then makes 0 rows (its own artifacts stop with SIGFPE)."""
    f = ctx.f
    k = len(spatial)
    kernel = list(attrs["kernel_shape"])
    strides = list(attrs.get("strides") or [1] * k)
    pads = list(attrs.get("pads") or [0] * 2 * k)
    include = int(attrs.get("count_include_pad", 0))
    y = f.shape(ctx.y(0))
    maps: list[tuple[int, np.ndarray | str]] = []
    for a, n in enumerate(spatial):
        if not isinstance(n, int):  # a length only the run knows: the map built by the graph
            maps.append((2 + a, _runtime_pool_matrix(ctx, 2 + a, kernel[a], strides[a], pads[a], pads[a + k],
                                                     include)))
            continue
        out = y[2 + a] if y is not None and isinstance(y[2 + a], int) else _pool_size(n, kernel[a], strides[a],
                                                                                      pads[a], pads[a + k], attrs)
        matrix = np.zeros((out, n))
        for o in range(out):
            start = o * strides[a] - pads[a]
            lo, hi = max(start, 0), min(start + kernel[a], n)
            count = hi - lo if not include else min(start + kernel[a], n + pads[a + k]) - max(start, -pads[a])
            if hi > lo:
                matrix[o, lo:hi] = 1.0 / count
        maps.append((2 + a, matrix))
    return transposed_maps(ctx, ctx.dy(0), maps, 2 + k)


def _runtime_pool_matrix(ctx: GradientContext, axis: int, kernel: int, stride: int, begin: int, end: int,
                         include: int) -> str:
    """The [out, in] averaging map of one axis from the run's sizes (float32): row o is 1/count over the inputs
    of window [o stride - begin, o stride - begin + kernel)."""
    f = ctx.f
    f32 = onnx.TensorProto.FLOAT
    index = f.const(np.asarray(axis, np.int64), hint="axis")
    n_in = f.node1("Gather", [f.node1("Shape", [ctx.x(0)]), index], axis=0)
    n_out = f.node1("Gather", [f.node1("Shape", [ctx.dy(0)]), index], axis=0)

    def c(v: int) -> str:
        return f.const(np.asarray(v, np.int64), hint="int")

    start = f.node1("Sub", [f.node1("Mul", [f.node1("Range", [c(0), n_out, c(1)]), c(stride)]), c(begin)])
    stop = f.node1("Add", [start, c(kernel)])
    rows, columns = f.node1("Unsqueeze", [start, f.axes([1])]), f.node1("Range", [c(0), n_in, c(1)])
    inside = f.node1("And", [f.node1("GreaterOrEqual", [columns, rows]),
                             f.node1("Less", [columns, f.node1("Unsqueeze", [stop, f.axes([1])])])])
    if include:
        last = f.node1("Add", [n_in, c(end)])
        count = f.node1("Sub", [f.node1("Min", [stop, last]), f.node1("Max", [start, c(-begin)])])
    else:
        count = f.node1("Sub", [f.node1("Min", [stop, n_in]), f.node1("Max", [start, c(0)])])
    share = f.node1("Div", [f.const(np.asarray(1.0, np.float32), hint="one"),
                            f.node1("Cast", [f.node1("Max", [count, c(1)])], to=f32)])
    return f.node1("Where", [inside, f.node1("Unsqueeze", [share, f.axes([1])]),
                             f.const(np.asarray(0.0, np.float32), hint="zero")])


def _pool_size(n: int, kernel: int, stride: int, begin: int, end: int, attrs: dict) -> int:
    span = n + begin + end - kernel
    if int(attrs.get("ceil_mode", 0)):
        count = -(-span // stride) + 1
        return count - 1 if (count - 1) * stride >= n + begin else count
    return span // stride + 1


# -- the interpolation matrix at run time (sizes or scales only the run knows) --------------------------------

def _runtime_matrix(ctx: GradientContext, axis: int, attrs: dict, scale: float | None) -> str:
    """A [n_out, n_in] float32 matrix computed by the graph with onnxruntime's float32 coordinate arithmetic."""
    f, x, dy = ctx.f, ctx.x(0), ctx.dy(0)
    rank = len(f.shape(x))
    f32 = onnx.TensorProto.FLOAT
    index = f.const(np.asarray(axis, np.int64), hint="axis")

    def size(name: str, static) -> str:
        if isinstance(static, int):
            return f.const(np.asarray(static, np.int64), hint="size")
        return f.node1("Gather", [f.node1("Shape", [name]), index], axis=0)

    def c(v: float) -> str:
        return f.const(np.asarray(v, np.float32), hint="scalar")

    n_in = size(x, f.shape(x)[axis])
    out_shape = f.shape(ctx.y(0))
    n_out = size(dy, out_shape[axis] if out_shape is not None and len(out_shape) == rank else None)
    n_in_f, n_out_f = f.node1("Cast", [n_in], to=f32), f.node1("Cast", [n_out], to=f32)
    if scale is not None:
        s = c(scale)
    elif len(ctx.node.input) > 3 and ctx.x(3):  # sizes: out / in in float32
        s = f.node1("Div", [n_out_f, n_in_f])
    else:  # the scales input, at this axis's position
        axes = attrs.get("axes")
        position = [a % rank for a in axes].index(axis) if axes else axis
        s = f.node1("Gather", [ctx.x(2), f.const(np.asarray(position, np.int64), hint="axis")], axis=0)
    zero_i, one_i = f.const(np.asarray(0, np.int64), hint="zero"), f.const(np.asarray(1, np.int64), hint="one")
    pos = f.node1("Cast", [f.node1("Range", [zero_i, n_out, one_i])], to=f32)
    transform = attrs.get("coordinate_transformation_mode", "half_pixel")
    half = c(0.5)
    if transform in ("half_pixel", "pytorch_half_pixel"):
        coord = f.node1("Sub", [f.node1("Div", [f.node1("Add", [pos, half]), s]), half])
        if transform == "pytorch_half_pixel":
            coord = f.node1("Where", [f.node1("Greater", [n_out, one_i]), coord, c(0.0)])
    elif transform == "align_corners":
        num = f.node1("Mul", [pos, f.node1("Sub", [n_in_f, c(1.0)])])
        coord = f.node1("Div", [num, f.node1("Sub", [n_out_f, c(1.0)])])
        coord = f.node1("Where", [f.node1("Equal", [n_out, one_i]), c(0.0), coord])
    elif transform == "asymmetric":
        coord = f.node1("Div", [pos, s])
    elif transform == "tf_half_pixel_for_nn":
        coord = f.node1("Div", [f.node1("Add", [pos, half]), s])
    else:  # half_pixel_symmetric
        adjustment = f.node1("Div", [n_out_f, f.node1("Mul", [s, n_in_f])])
        offset = f.node1("Mul", [f.node1("Div", [n_in_f, c(2.0)]), f.node1("Sub", [c(1.0), adjustment])])
        coord = f.node1("Add", [offset, f.node1("Sub", [f.node1("Div", [f.node1("Add", [pos, half]), s]), half])])
    last_f = f.node1("Sub", [n_in_f, c(1.0)])
    columns = f.node1("Range", [zero_i, n_in, one_i])

    def one_hot(idx_f: str) -> str:  # rows picking column idx (a float holding an integer)
        idx = f.node1("Cast", [idx_f], to=onnx.TensorProto.INT64)
        hit = f.node1("Equal", [f.node1("Unsqueeze", [idx, f.axes([1])]), columns])
        return f.node1("Cast", [hit], to=f32)

    def column(v: str) -> str:
        return f.node1("Unsqueeze", [v, f.axes([1])])

    mode = attrs.get("mode", "nearest")
    if mode == "nearest":
        nearest = attrs.get("nearest_mode", "round_prefer_floor")
        if nearest == "floor":
            idx = f.node1("Floor", [coord])
        elif nearest == "ceil":
            idx = f.node1("Ceil", [coord])
        elif nearest == "round_prefer_ceil":
            idx = f.node1("Floor", [f.node1("Add", [coord, half])])
        else:
            idx = f.node1("Ceil", [f.node1("Sub", [coord, half])])
        return one_hot(f.node1("Clip", [idx, c(0.0), last_f]))
    if mode == "linear":
        xc = f.node1("Clip", [coord, c(0.0), last_f])
        lo = f.node1("Floor", [xc])
        hi = f.node1("Min", [f.node1("Add", [lo, c(1.0)]), last_f])
        w = f.node1("Sub", [xc, lo])
        return f.node1("Add", [f.node1("Mul", [one_hot(lo), column(f.node1("Sub", [c(1.0), w]))]),
                               f.node1("Mul", [one_hot(hi), column(w)])])
    a = float(attrs.get("cubic_coeff_a", -0.75))
    base = f.node1("Floor", [coord])
    r = f.node1("Sub", [coord, base])

    def inner(v: str) -> str:  # ((a+2)|s| - (a+3)) s^2 + 1 for |s| <= 1
        t = f.node1("Sub", [f.node1("Mul", [c(a + 2), v]), c(a + 3)])
        return f.node1("Add", [f.node1("Mul", [t, f.node1("Mul", [v, v])]), c(1.0)])

    def outer(v: str) -> str:  # ((a|s| - 5a)|s| + 8a)|s| - 4a for 1 < |s| < 2
        t = f.node1("Sub", [f.node1("Mul", [c(a), v]), c(5 * a)])
        t = f.node1("Add", [f.node1("Mul", [t, v]), c(8 * a)])
        return f.node1("Sub", [f.node1("Mul", [t, v]), c(4 * a)])

    one = c(1.0)
    coefficients = [outer(f.node1("Add", [one, r])), inner(r), inner(f.node1("Sub", [one, r])),
                    outer(f.node1("Sub", [c(2.0), r]))]
    raw = [f.node1("Add", [base, c(float(k - 1))]) for k in range(4)]
    if int(attrs.get("exclude_outside", 0)):
        inside = [f.node1("Cast", [f.node1("And", [f.node1("GreaterOrEqual", [i, c(0.0)]),
                                                    f.node1("LessOrEqual", [i, last_f])])], to=f32) for i in raw]
        coefficients = [f.node1("Mul", [k, m]) for k, m in zip(coefficients, inside, strict=True)]
        total = f.node1("Sum", coefficients)
        coefficients = [f.node1("Div", [k, total]) for k in coefficients]
    terms = [f.node1("Mul", [one_hot(f.node1("Clip", [i, c(0.0), last_f])), column(k)])
             for i, k in zip(raw, coefficients, strict=True)]
    return f.node1("Sum", terms)
