"""Lowering of onnxruntime-training's ``ConvGrad`` (``specs/com.microsoft/ConvGrad.rst``).

- ``dX``: ConvTranspose of dY with the forward kernels (same group, strides, dilations and pads); the
  ``output_padding`` that the strides' floor division dropped is restored, so dX gets X's spatial shape. At
  stride 1, for depthwise kernels up to 3x3 and 1x1 kernels: a Conv of dY with the kernels flipped and in/out
  channels swapped.
- ``dW``: the windows of X (a grouped Conv with constant one-hot kernels, one output channel per input
  channel and kernel offset; up to PLANE_POSITIONS output positions, X's planes [n*C, 1, ...] through one Conv
  with the K one-hot kernels) times dY, a batched MatMul per image and group, summed over the images
  (depthwise: a batched matrix-vector MatMul per image and channel, or where small or the kernel 5x5 and up a
  Conv correlating X's planes with dY's, one group per image and channel; a 1x1 kernel without padding reads X
  itself at stride 1, its strided subsample by a 1x1 AveragePool otherwise; one output position per image: the
  outer products of dY and the windows, a Mul, summed by one ReduceSum); see :func:`_kernel_gradient` for the
  measurements against the single Conv that correlates X with dY, the form before.
- ``dB``: dY summed over every axis but 1 (static N and M: over the positions per image, then over the
  images by a ones MatMul; one position per image: one ReduceSum).

f16 and f64 are computed in f32 (cast once, rounded once): onnxruntime's CPU provider has no f64 Conv or
ConvTranspose, and not every build has f16 ones.

The portable target (no Conv/ConvTranspose whose weights are runtime tensors) uses the im2col form of
:mod:`lowering.rules.im2col`: with ``cols`` = [N, C, K, O...] (what each of the K kernel offsets reads) viewed
per group and image as [g, N, O, C/g*K] and dY as [g, N, M/g, O], dW is one batched MatMul summed over
the images (per image first, as the kernel sums); dX is the col2im of W^T times dY. It needs X's spatial dims
static (the slices are static). f16 computes in f32, f64 in f64.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from lowering.builder import NodeBuilder
from lowering.emit_common import Emitter, compute_type
from lowering.rules import TARGETS, LoweringRequest, register_rule
from lowering.rules.elementwise_grad import input_elem
from lowering.rules.im2col import Windows, col2im, im2col
from opdef.rules.conv_grad import ConvParameters, ParameterError, conv_parameters

WINDOWS_LIMIT = 8 << 20  # bytes of dW's windows written at once (see _kernel_gradient)
# a small depthwise dW correlates X's planes with dY's (see _kernel_gradient): up to 36 output positions per image
# and 65,536 products (one node, 1 thread, dX and dW, correlation/windows time: [4, 8, 4^2] 0.86, [4, 16, 4^2]
# stride 2 0.67, [4, 32, 4^2] 0.81, [4, 16, 6^2] 0.95, [4, 16, 8^2] 1.20)
CORRELATION_POSITIONS = 36
CORRELATION_PRODUCTS = 1 << 16
# a depthwise kernel of at least WIDE_DEPTHWISE offsets (5x5 and up) takes the correlation at any size (one part), and
# dX by ConvTranspose at stride 1 (see _kernel_gradient and _input_gradient)
WIDE_DEPTHWISE = 25
SMALL_POSITIONS = 128  # output positions per image up to which dW's per-image products come in W's layout
# up to 8 * SMALL_POSITIONS, W's layout also where onnxruntime's GEMM blocks the positions alike in both orientations
# (the same bits, see _same_gemm_blocks) and the windows have at most SMALL_WINDOWS elements
SMALL_WINDOWS = 1 << 16
# up to PLANE_POSITIONS output positions per image (2-D and up, kernels of 9 offsets and more), dW's windows come from
# X's planes ([n*C, 1, ...]) by one Conv with K one-hot kernels instead of the grouped Conv: onnxruntime runs that
# Conv in NCHWc (its kernel for a 1-channel input, K padded to the block) and adds a ReorderOutput, so 2 kernels more
# (the planes' Reshape), less time (3x3, the windows Conv and its views, 1 thread, planes/grouped: [4, 8, 8^2] 0.76,
# [4, 16, 4^2] 0.58, [4, 64, 8^2] 0.69, [4, 3, 16^2] stride 2 0.71, [32, 64, 8^2] 0.59 (2 threads 0.89),
# [32, 32, 16^2] stride 2 0.74 at 2 threads; 256 positions at stride 1: [4, 16, 16^2] 1.09, [32, 32, 16^2] 1.20 at
# 2 threads; [32, 16, 32^2] stride 2 1.13. Without NCHWc (graph optimizations at "extended") 0.78-1.11: the gain is
# the NCHWc kernel's)
PLANE_POSITIONS = 64
# ... and windows of at most PLANE_WINDOWS elements: the NCHWc Conv's output and its ReorderOutput are a second
# buffer of the windows' size, which at full size grew the step (MobileNetV2-CIFAR b32: 317 -> 341 MB, 1.04x
# onnxruntime-training's growth) for no measured gain there (resnet_cifar 0.92-1.01, mobilenet_v2_cifar 0.94-0.97)
PLANE_WINDOWS = 1 << 20


def _shape(request: LoweringRequest, name: str):
    t = request.inference.input_types[request.inference.schema.input_index(name)]
    return None if t is None else t.shape


@register_rule("conv_grad", targets=TARGETS)
def lower_conv_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    dx_out, dw_out, db_out = request.output("dX"), request.output("dW"), request.output("dB")
    if dx_out is None and dw_out is None and db_out is None:
        return
    io = input_elem(request, "dY")
    x_shape, w_shape = _shape(request, "X"), _shape(request, "W")
    rank = request.inference.rank
    if rank is None or w_shape is None or not all(isinstance(d, int) for d in w_shape):
        raise request.error("ConvGrad needs W's shape static to be lowered "
                            f"(W {w_shape if w_shape is not None else 'of unknown shape'})")
    spatial = rank - 2
    try:
        params = conv_parameters(request.inference.attributes, spatial, w_shape[2:])
    except ParameterError as exc:
        raise request.error(str(exc)) from None
    portable = request.options.target == "portable"
    e = Emitter(b, compute_type(io) if portable else TensorProto.FLOAT)
    dy = e.up(request.input("dY"), io)
    if db_out is not None:
        _final(e, db_out, io, lambda target: _bias_gradient(e, dy, request, rank, portable, target))
    if portable:
        if dx_out is not None or dw_out is not None:
            _portable_gradients(e, request, params, dy, x_shape, w_shape, dx_out, dw_out, io)
        return
    if dx_out is not None:
        _input_gradient(e, request, params, dy, x_shape, w_shape, dx_out, io)
    if dw_out is not None:
        _kernel_gradient(e, request, params, dy, x_shape, w_shape, dw_out, io)


def _bias_gradient(e: Emitter, dy: str, request: LoweringRequest, rank: int, portable: bool,
                   target: str | None) -> str:
    """dB: dY summed over every axis but 1. With N and M static (onnxruntime target): per image and channel
    over the contiguous positions, then over the images by a MatMul with a ones row, as the kernel
    accumulates image by image (ReduceSum over axes 0, 2, ... had up to 1.8x its error on the recorded cases,
    and no fast path)."""
    shape = _shape(request, "dY")
    n, m = (shape[0], shape[1]) if shape is not None and len(shape) == rank else (None, None)
    if portable or not isinstance(n, int) or not isinstance(m, int):
        return e.reduce("ReduceSum", dy, (0, *range(2, rank)), keepdims=0, output=target)
    if all(d == 1 for d in shape[2:]):
        # one position per image (an SE block's 1x1 convs): dY's images summed by one ReduceSum (the unit axes
        # reduce nothing). It adds them one by one in order, as onnxruntime-training's kernel does (bit-equal to it
        # at 4, 8 and 16 images; the ones MatMul below is too up to 5 images, not from 6 on): 2 -> 1 kernel
        return e.reduce("ReduceSum", dy, (0, *range(2, rank)), keepdims=0, output=target)
    b = e.b
    # the trailing axes at once: onnxruntime's ReduceSum merges contiguous reduced axes, so this is the sum over
    # the [N, M, P] view's last axis (bit-identical) without the Reshape to it
    rows = e.reduce("ReduceSum", dy, tuple(range(2, rank)), keepdims=0)  # [N, M]
    # a 1-D ones vector: MatMul computes it as the [1, N] row (the same products and sums) and drops the 1
    return b.op1("MatMul", [b.const(np.ones(n, e.np_ct), hint="ones_vector"), rows], target)  # [M]


def _final(e: Emitter, out: str, io: int, emit) -> None:
    """``emit(target)`` writes the result: straight into ``out``, or into a fresh value cast to it once."""
    if io == e.ct:
        emit(out)
    else:
        e.b.op1("Cast", [emit(None)], out, to=io)


def _input_gradient(e: Emitter, request: LoweringRequest, params: ConvParameters, dy: str, x_shape, w_shape,
                    out: str, io: int) -> None:
    spatial = len(w_shape) - 2
    w = e.up(request.input("W"), io)
    output_padding = []
    for a in range(spatial):
        size = None if x_shape is None else x_shape[a + 2]
        span = params.dilations[a] * (w_shape[a + 2] - 1) + 1
        if not isinstance(size, int):
            if params.strides[a] == 1:  # nothing can be dropped by the floor division
                output_padding.append(0)
                continue
            raise request.error(f"dX needs X's spatial size on axis {a + 2} with stride {params.strides[a]} "
                                f"(X {list(x_shape) if x_shape is not None else 'of unknown shape'})")
        output_padding.append((size + params.pads[a] + params.pads[a + spatial] - span) % params.strides[a])
    kernel = list(w_shape[2:])
    reach = [params.dilations[a] * (kernel[a] - 1) for a in range(spatial)]
    flipped_pads = [reach[a % spatial] - params.pads[a] for a in range(2 * spatial)]
    one_term_sums = math.prod(kernel) == 1 or w_shape[0] == params.group  # 1x1, or one dY channel per dX channel
    # a depthwise kernel of 5x5 and up: the ConvTranspose, 1 kernel instead of Slice + Conv and faster (one node, 1
    # thread, ConvTranspose/Conv time: 7x7 [4, 16, 4^2] 0.75, [4, 8, 8^2] 0.77, [4, 16, 16^2] 0.79, [4, 64, 4^2] 0.74,
    # [32, 96, 8^2] 0.76; 5x5 [4, 16, 4^2] 0.82, [4, 8, 8^2] 0.80; 3x3 [4, 16, 4^2] 1.07-1.10, so 3x3 keeps the Conv);
    # its per-offset products summed offset by offset are onnxruntime-training's kernel's own bits
    wide = w_shape[1] == 1 and w_shape[0] == params.group and math.prod(kernel) >= WIDE_DEPTHWISE
    if e.b.opset >= 10 and one_term_sums and not wide and all(s == 1 for s in params.strides) and \
            all(q >= 0 for q in flipped_pads):
        # stride 1: dX is the correlation of dY with the kernels flipped and their in/out channels swapped per
        # group, a Conv, which onnxruntime runs 1.4-15x faster than the ConvTranspose (one-op models, batch 32,
        # 2 threads: depthwise 3x3 48 channels at 32^2 1.84 against 4.27 ms, 576 at 4^2 0.34 against 5.05; 1x1
        # 96->16 at 16^2 0.29 against 0.72). Only where each dX element sums over the kernel offsets or over the
        # channels, not both: for a full 3x3 kernel the Conv (also 2.5-3x faster) sums all M*K products in one
        # dot product and had up to 2.9x the native kernel's error on the recorded cases, where ConvTranspose
        # (and the kernel) sums M products per offset, then the K offsets
        _final(e, out, io, lambda target: e.b.op1("Conv", [dy, _flipped_kernels(e, w, w_shape, params.group)],
                                                   target, group=params.group, dilations=list(params.dilations),
                                                   pads=flipped_pads, kernel_shape=kernel))
        return
    attrs = {"group": params.group, "strides": list(params.strides), "dilations": list(params.dilations),
             "pads": list(params.pads), "kernel_shape": kernel}
    if any(output_padding):
        attrs["output_padding"] = output_padding
    _final(e, out, io, lambda target: e.b.op1("ConvTranspose", [dy, w], target, **attrs))


def _flipped_kernels(e: Emitter, w: str, w_shape, group: int) -> str:
    """W [M, C/g, k...] as the kernels of dX's Conv: [C, M/g, k...], each group's in/out channels swapped and
    every spatial axis reversed (no Transpose where a side is 1-wide, no reversal of 1-wide axes)."""
    b = e.b
    m, per_group, kernel = w_shape[0], w_shape[1], list(w_shape[2:])
    spatial = len(kernel)
    flip = [a + 2 for a in range(spatial) if kernel[a] > 1]
    if flip:
        w = b.op1("Slice", [w, e.ints([-1] * len(flip), "last"), e.ints([-(2 ** 63)] * len(flip), "before_first"),
                            e.ints(flip, "spatial_axes"), e.ints([-1] * len(flip), "backwards")], hint="flipped")
    if per_group == 1 and m == group:  # depthwise, one output per channel: [C, 1, k...] already
        return w
    if group == 1:  # one Transpose swaps the channels (mobilenet's 1x1 nodes: 4 kernels -> 2 with the Conv)
        return b.op1("Transpose", [w], perm=[1, 0, *range(2, 2 + spatial)])
    grouped = b.op1("Reshape", [w, e.ints([group, m // group, per_group, *kernel], "kernel_groups")])
    swapped = b.op1("Transpose", [grouped], perm=[0, 2, 1, *range(3, 3 + spatial)])
    return b.op1("Reshape", [swapped, e.ints([group * per_group, m // group, *kernel], "dx_kernels")])


def _kernel_gradient(e: Emitter, request: LoweringRequest, params: ConvParameters, dy: str, x_shape, w_shape,
                     out: str, io: int) -> None:
    """dW from the windows: a grouped Conv with constant one-hot kernels writes what each kernel offset reads
    (``cols`` = [N, C*K, P], P the output positions); per group, ``cols @ dY^T`` per image summed over the
    images is dW^T. Depthwise, the per-group products are matrix-vector ones ([K, P] @ [P, 1] per image and
    channel). A 1x1 kernel at stride 1 without padding reads X itself: no windows.

    Measured against the single Conv correlating X with dY (onnxruntime 1.32 CPU, 2 threads, 3x3 pad 1):
    batch 32 at 16x32^2 / 32x16^2 / 3x32^2, 15-31 / 22 / 0.9 ms against 29-74 / 32-35 / 2.0-9.0 ms; batch
    128 at 16x32^2, 90 against 224-261 ms (a loaded machine, paired runs). The Conv with dY as its kernel
    has no fast path in onnxruntime; the one-hot Conv and the batched MatMul do."""
    b = e.b
    group, per_group, m = params.group, w_shape[1], w_shape[0]
    kernel = tuple(w_shape[2:])
    k = math.prod(kernel)
    channels, rank = group * per_group, len(w_shape)
    x = e.up(request.input("X"), io)
    images = x_shape[0] if x_shape is not None else None
    depthwise = per_group == 1 and m == group
    dy_shape = _shape(request, "dY")
    positions = math.prod(dy_shape[2:]) if dy_shape is not None and all(isinstance(d, int) for d in dy_shape) else None
    chunks = 1
    if isinstance(images, int) and positions is not None:
        # the windows ([n, C*K, P]: K times X's size) and the per-image products ([n, C*K, M/g]: larger than the
        # windows where M/g > P, as in a 1x1 conv to many channels at 4x4) are made for a few images at a time
        # past WINDOWS_LIMIT bytes (onnxruntime frees each part after its sum): MobileNetV2 (CIFAR, batch 32) step
        # memory growth 445 MB without, 391 with 32 MiB parts, 376 with 8 MiB (the native step's: 329 MB); step
        # time unchanged (B/A 0.99, 8 rounds)
        per_image = channels * k * max(positions, m // group) * 4
        chunks = min(images, -(-images * per_image // WINDOWS_LIMIT))
    sizes = [images // chunks + (i < images % chunks) for i in range(chunks)] if chunks > 1 else None
    xs = b.op("Split", [x, e.ints(sizes, "image_parts")], [b.fresh("x_part") for _ in sizes], axis=0) \
        if sizes and b.opset >= 13 else [x]
    dys = b.op("Split", [dy, e.ints(sizes, "image_parts")], [b.fresh("dy_part") for _ in sizes], axis=0) \
        if len(xs) > 1 else [dy]
    # at most SMALL_POSITIONS positions per image, dY times the windows' transpose, as the kernel multiplies (its
    # GEMM's operands and shape; onnxruntime fuses the Transpose into a FusedMatMul): the per-image products come
    # in W's own layout, [n, g, M/g, C/g*K], so the image sum is reshaped into dW itself (no Transpose of the sum
    # nor the Reshape before it: cnn's 3x3 nodes 9 -> 7 kernels). The same bits as the windows times dY's transpose
    # while onnxruntime's GEMM sums the positions in one block (<= 128 in either orientation)
    weight_layout = depthwise or (positions is not None and positions <= SMALL_POSITIONS)
    if not weight_layout and positions is not None and positions <= 8 * SMALL_POSITIONS and \
            isinstance(images, int) and images * channels * k * positions <= SMALL_WINDOWS:
        # more positions, small windows (a first conv at 16^2: [4, 3, 16^2] 3x3 2 kernels fewer, 0.95 of the time):
        # W's layout where onnxruntime's GEMM blocks the positions alike in both orientations (the same bits)
        weight_layout = _same_gemm_blocks(per_group * k, m // group, positions)
    lead = [0, group] if group > 1 else [0]  # group 1: [n, C*K, P] and [n, M, P], as a 1-D conv gives them
    # few positions per image: the windows of X's planes (see _windows), whose batch axis is n*C, so their views
    # name the images by -1 and the positions
    planes = rank > 3 and k >= 9 and positions is not None and positions <= PLANE_POSITIONS and \
        x_shape is not None and all(isinstance(d, int) for d in x_shape[2:]) and isinstance(images, int) and \
        images * channels * k * positions <= PLANE_WINDOWS
    col_lead, col_positions = ([-1, *lead[1:]], positions) if planes else (lead, -1)

    correlation = _depthwise_correlation(params, x_shape, dy_shape, kernel) if depthwise and len(xs) == 1 else None
    outer = positions == 1 and group == 1 and correlation is None  # one position per image: outer products

    def per_image(i: int) -> str:
        if correlation is not None:
            # small and depthwise: per image and channel, X's plane correlated with dY's plane (a Conv with one
            # group per image and channel, dY's planes its kernels): [1, n*C, k...], memory [n, C*K]
            n_c = images * channels
            x_planes = b.op1("Reshape", [xs[i], e.ints([1, n_c, *x_shape[2:]], "x_planes")])
            dy_kernels = b.op1("Reshape", [dys[i], e.ints([n_c, 1, *dy_shape[2:]], "dy_kernels")])
            return b.op1("Conv", [x_planes, dy_kernels], group=n_c, kernel_shape=list(dy_shape[2:]),
                         strides=list(params.dilations), dilations=list(params.strides), pads=correlation)
        cols = _windows(e, xs[i], channels, kernel, k, params, x_shape[2:] if planes else None)
        if outer:
            # one position per image (an SE block's 1x1 convs): each image's product is the outer product of its dY
            # and window columns, a Mul of dY [n, M, 1...] with the columns as [n, 1, C*K, 1...] (one view, no
            # MatMul; round(dy * x) as the MatMul's one product per element), summed over the images below
            cols = b.op1("Reshape", [cols, e.ints([col_lead[0], 1, channels * k, *[1] * (rank - 3)], "col_row")])
            return b.op1("Mul", [dys[i], cols])  # [n, M, C*K, 1...]
        if depthwise:  # per image and channel, the K windows times dY's plane
            cols = b.op1("Reshape", [cols, e.ints([col_lead[0], channels, k, col_positions], "cols")])  # [n, C, K, P]
            dy_planes = b.op1("Reshape", [dys[i], e.ints([0, channels, -1, 1], "dy_planes")])  # [n, C, P, 1]
            # a batched matrix-vector MatMul reads the windows once (Mul + ReduceSum wrote them again and read
            # them twice: 13.2 against 7.9 ms at 32x48x32^2, 3.4 against 2.7 at 32x192x8^2)
            return b.op1("MatMul", [cols, dy_planes])  # [n, C, K, 1]
        if weight_layout:
            cols = _view(e, cols, rank, [*col_lead, per_group * k, col_positions], "col_groups")  # [n, (g,) C/g*K, P]
            dy_v = _view(e, dys[i], rank, [*lead, m // group, -1], "dy_groups")  # [n, (g,) M/g, P]
            cols_t = b.op1("Transpose", [cols], perm=[*range(len(lead)), len(lead) + 1, len(lead)])
            return b.op1("MatMul", [dy_v, cols_t])  # [n, (g,) M/g, C/g*K]
        cols = b.op1("Reshape", [cols, e.ints([col_lead[0], group, per_group * k, col_positions], "col_groups")])
        dy_t = b.op1("Transpose", [b.op1("Reshape", [dys[i], e.ints([0, group, m // group, -1], "dy_groups")])],
                     perm=[0, 1, 3, 2])  # [n, g, P, M/g]
        return b.op1("MatMul", [cols, dy_t])  # [n, g, C/g*K, M/g]

    def total(target: str | None) -> str:
        """The per-image products summed over every image: dW's shape (W's layout), else [g, C/g*K, M/g]."""
        shape = list(w_shape) if weight_layout else [group, per_group * k, m // group]
        if outer and len(xs) == 1:
            # the outer products [n, M, C*K, 1...] summed by one ReduceSum over the images, in image order as
            # onnxruntime-training's kernel adds them (bit-equal to it at 4, 8 and 16 images; the ones MatMul of
            # _image_sum is too up to 5 images, not from 6 on): no Reshape to rows, 1 kernel fewer
            summed = e.reduce("ReduceSum", per_image(0), (0,), keepdims=0)  # [M, C*K, 1...]
            return b.op1("Reshape", [summed, e.ints(shape, "summed")], target)
        sums = [_image_sum(e, per_image(i), sizes[i] if len(xs) > 1 else images, shape,
                           target if len(xs) == 1 else None) for i in range(len(xs))]
        return sums[0] if len(sums) == 1 else b.op1("Sum", sums, target)

    if weight_layout:
        _final(e, out, io, total)
        return
    w_t = b.op1("Transpose", [total(None)], perm=[0, 2, 1])  # [g, M/g, C/g*K]
    _final(e, out, io, lambda target: b.op1("Reshape", [w_t, e.ints(list(w_shape), "w_shape")], target))


def _depthwise_correlation(params: ConvParameters, x_shape, dy_shape, kernel) -> list[int] | None:
    """The pads of the Conv correlating X's planes with dY's for a small depthwise dW (None: not taken): the
    forward pads, less at the end by what no window reaches (it has to fit in the end pad)."""
    if x_shape is None or dy_shape is None or not all(isinstance(d, int) for d in (*x_shape, *dy_shape)):
        return None
    positions = math.prod(dy_shape[2:])
    # a kernel of 5x5 and up at any size: its windows cost more than the correlation (one node, 1 thread, dX+dW,
    # correlation/windows time: 7x7 [4, 8, 8^2] 0.59-0.66, [4, 8, 16^2] 0.46, [4, 32, 8^2] 0.40-0.52, [4, 8, 32^2]
    # 0.49-0.52; 5x5 [4, 8, 8^2] 0.72-0.76; 3x3 [4, 16, 8^2] 1.18, so 3x3 keeps the limits)
    if math.prod(kernel) < WIDE_DEPTHWISE and (positions > CORRELATION_POSITIONS or
                                               x_shape[0] * x_shape[1] * math.prod(kernel) * positions >
                                               CORRELATION_PRODUCTS):
        return None
    spatial = len(kernel)
    ends = []
    for a in range(spatial):
        reach = params.strides[a] * (dy_shape[a + 2] - 1) + params.dilations[a] * (kernel[a] - 1) + 1
        unread = x_shape[a + 2] + params.pads[a] + params.pads[a + spatial] - reach
        if unread > params.pads[a + spatial]:
            return None
        ends.append(params.pads[a + spatial] - unread)
    return [*params.pads[:spatial], *ends]


def _gemm_k_block(columns: int, depth: int) -> int:
    """How many of its ``depth`` products onnxruntime's f32 GEMM (MLAS) sums in one block for an output of
    ``columns`` columns, the blocks then added in order: MlasSgemmOperation's StrideK, 128 to start, halved with
    StrideN doubled while at least twice the depth where columns >= depth, else doubled with StrideN halved while
    StrideN stays above 16 and at least twice the columns."""
    stride_n, stride_k = 128, 128
    if columns >= depth:
        while stride_k // 2 >= depth:
            stride_k, stride_n = stride_k // 2, stride_n * 2
    else:
        while stride_n > 16 and stride_n // 2 >= columns:
            stride_k, stride_n = stride_k * 2, stride_n // 2
    return stride_k


def _same_gemm_blocks(window_columns: int, outputs: int, positions: int) -> bool:
    """Whether dY [M/g, P] times the windows' transpose (``window_columns`` = C/g*K output columns) sums the
    positions in the same blocks as the windows [C/g*K, P] times dY's transpose (M/g columns), so gives the same
    bits: one block each, or blocks of one size (checked on 384 shapes, P 100-2048)."""
    a, b = _gemm_k_block(window_columns, positions), _gemm_k_block(outputs, positions)
    return a == b or min(a, b) >= positions


def _view(e: Emitter, name: str, rank: int, shape: list[int], hint: str) -> str:
    """``name`` (rank ``rank``, its first two axes kept) as ``shape``: no op where it has that shape already."""
    if rank == len(shape) == 3:
        return name
    return e.b.op1("Reshape", [name, e.ints(shape, hint)])


def _windows(e: Emitter, x: str, channels: int, kernel: tuple[int, ...], k: int, params: ConvParameters,
             planes: tuple[int, ...] | None = None) -> str:
    """What each kernel offset reads, [n, C*K, O...]: a grouped Conv with constant one-hot kernels; a 1x1
    kernel without padding reads X itself at stride 1, else X's strided subsample by a 1x1 AveragePool. With
    ``planes`` (X's spatial sizes): X's planes as [n*C, 1, ...] through one group of K one-hot kernels, [n*C, K,
    O...] (the same memory as [n, C*K, O...])."""
    if k == 1 and not any(params.pads):
        if all(s == 1 for s in params.strides):
            return x
        # a 1x1 AveragePool is x / 1: the one-hot Conv's values (x * 1 summed from zero) in 1 kernel where
        # onnxruntime ran that Conv as NCHWc between a ReorderInput and a ReorderOutput (3 kernels; resnet_basic's
        # and regnet's stride-2 shortcut: 7 -> 5 kernels a node), and faster at every size tried (one node, 1
        # thread, AveragePool/Conv time: [4, 8, 8^2] 0.80, [4, 32, 8^2] 0.93, [4, 64, 8^2] 0.91, [32, 16, 32^2]
        # 0.98, [32, 64, 8^2] 0.92; a strided Slice was 1.09-1.78 from 16 channels up)
        return e.b.op1("AveragePool", [x], kernel_shape=list(kernel), strides=list(params.strides), hint="windows")
    if planes is not None:
        # up to PLANE_POSITIONS output positions per image: the planes' one Conv with 1 input channel runs faster
        # than the grouped one (one Reshape more; see PLANE_POSITIONS)
        x = e.b.op1("Reshape", [x, e.ints([-1, 1, *planes], "x_planes")])
        return e.b.op1("Conv", [x, e.b.const(np.eye(k, dtype=np.float32).reshape(k, 1, *kernel), hint="offsets")],
                       kernel_shape=list(kernel), strides=list(params.strides), dilations=list(params.dilations),
                       pads=list(params.pads), hint="windows")
    onehot = np.zeros((channels * k, 1, *kernel), np.float32)  # channel c, offset i -> output channel c*K + i
    for c in range(channels):
        onehot[c * k + np.arange(k), 0, ...] = np.eye(k, dtype=np.float32).reshape(k, *kernel)
    return e.b.op1("Conv", [x, e.b.const(onehot, hint="window_offsets")], group=channels, kernel_shape=list(kernel),
                   strides=list(params.strides), dilations=list(params.dilations), pads=list(params.pads),
                   hint="windows")


def _image_sum(e: Emitter, per_image: str, images, shape: list[int], output: str | None = None) -> str:
    """``per_image`` ([N, ...]) summed over the images, as ``shape`` (written to ``output`` when given). With N
    static a MatMul with a ones row (onnxruntime's ReduceSum over axis 0 took 6.2 ms on [32, 576, 64] in the
    ResNet step, the MatMul 1.7). The ones a 1-D vector: MatMul computes it as the [1, N] row (the same products
    and sums) and its result is 1-D, which the train step's flat gradient takes as it is (its Reshape to
    ``shape`` then goes unread: one kernel fewer a dW)."""
    b = e.b
    if isinstance(images, int):
        flat = b.op1("Reshape", [per_image, e.ints([images, -1], "per_image_rows")])
        return b.op1("Reshape", [b.op1("MatMul", [b.const(np.ones(images, np.float32), hint="ones_vector"), flat]),
                                 e.ints(shape, "summed")], output)
    return b.op1("Reshape", [e.reduce("ReduceSum", per_image, (0,), keepdims=0), e.ints(shape, "summed")], output)


def _portable_gradients(e: Emitter, request: LoweringRequest, params: ConvParameters, dy: str, x_shape, w_shape,
                        dx_out: str | None, dw_out: str | None, io: int) -> None:
    """dX and dW with Pad/Slice/Concat/Reshape/Transpose/MatMul only (the module docstring's im2col form)."""
    b = e.b
    spatial = len(w_shape) - 2
    rank = spatial + 2
    if x_shape is None or not all(isinstance(d, int) for d in x_shape[2:]):
        raise request.error("the portable lowering needs X's spatial dims static (its windows are static "
                            f"slices); X {list(x_shape) if x_shape is not None else 'of unknown shape'}")
    sizes = tuple(x_shape[2:])
    kernel = tuple(w_shape[2:])
    outputs = tuple(params.output_size(a, sizes[a], kernel[a]) for a in range(spatial))
    if min(outputs) < 1:
        raise request.error(f"the kernel {list(kernel)} does not fit X's padded spatial dims {list(sizes)}")
    windows = Windows(sizes, kernel, tuple(params.strides), tuple(params.dilations), tuple(params.pads), outputs)
    group, per_group, m = params.group, w_shape[1], w_shape[0]
    channels, k, p = group * per_group, math.prod(kernel), math.prod(outputs)
    if per_group == 1 and m == group:
        _portable_depthwise(e, request, windows, dy, w_shape, dx_out, dw_out, io)
        return
    dy_groups = b.op1("Reshape", [dy, e.ints([-1, group, m // group, p], "dy_groups")])  # [N, g, M/g, P]
    if dw_out is not None:
        cols = im2col(e, e.up(request.input("X"), io), rank, windows)  # [N, C, K, O...]
        cols = b.op1("Reshape", [cols, e.ints([-1, group, per_group * k, p], "col_groups")])
        cols = b.op1("Transpose", [cols], perm=[1, 0, 3, 2])  # [g, N, P, C/g*K]
        dy_rows = b.op1("Transpose", [dy_groups], perm=[1, 0, 2, 3])  # [g, N, M/g, P]
        # per image, then over the images, as the kernel sums: one MatMul summing all N*P products at once had
        # 1.3-2.5x the kernel's error on the recorded cases (tests/test_accuracy_vs_native.py)
        product = e.reduce("ReduceSum", b.op1("MatMul", [dy_rows, cols]), (1,), keepdims=0)  # [g, M/g, C/g*K]
        _final(e, dw_out, io, lambda target: b.op1("Reshape", [product, e.ints(list(w_shape), "w_shape")], target))
    if dx_out is not None:
        # offsets first, so each offset's piece is one contiguous Gather: W as [K, 1, g, C/g, M/g] times dY's
        # [N, g, M/g, P] (MatMul broadcasts the batch axes) is [K, N, g, C/g, P]
        w = b.op1("Reshape", [e.up(request.input("W"), io), e.ints([group, m // group, per_group, k], "w_groups")])
        w_t = b.op1("Reshape", [b.op1("Transpose", [w], perm=[3, 0, 2, 1]),
                                e.ints([k, 1, group, per_group, m // group], "w_offsets")])
        dcols = b.op1("Reshape", [b.op1("MatMul", [w_t, dy_groups]), e.ints([k, -1, channels, *outputs], "dcols")])
        _final(e, dx_out, io, lambda target: col2im(e, _offset_of(e, dcols), rank, windows, output=target))


def _offset_of(e: Emitter, dcols: str):
    """The pieces of col2im: offset i's [N, C, O...] of the [K, N, C, O...] columns."""
    return lambda i: e.b.op1("Gather", [dcols, e.ints(i, "offset")], axis=0)


def _portable_depthwise(e: Emitter, request: LoweringRequest, windows: Windows, dy: str, w_shape,
                        dx_out: str | None, dw_out: str | None, io: int) -> None:
    """Depthwise (one input and one output channel per group): the per-group products are 1-wide, so Mul and
    ReduceSum replace the batched MatMuls (which would run C products of width 1)."""
    b = e.b
    rank = windows.rank + 2
    channels, k, p = w_shape[0], math.prod(windows.kernel), math.prod(windows.outputs)
    dy_planes = b.op1("Reshape", [dy, e.ints([-1, channels, 1, p], "dy_planes")])  # [N, C, 1, P]
    dy_flat = b.op1("Reshape", [dy, e.ints([-1, channels, p], "dy_flat")])  # [N, C, P]
    if dw_out is not None:
        cols = im2col(e, e.up(request.input("X"), io), rank, windows)  # [N, C, K, O...]
        cols = b.op1("Reshape", [cols, e.ints([-1, channels, k, p], "cols")])
        product = e.reduce("ReduceSum", b.op1("Mul", [cols, dy_planes]), (0, 3), keepdims=0)  # [C, K]
        _final(e, dw_out, io, lambda target: b.op1("Reshape", [product, e.ints(list(w_shape), "w_shape")], target))
    if dx_out is not None:
        w = b.op1("Reshape", [e.up(request.input("W"), io), e.ints([channels, k], "w_columns")])
        w = b.op1("Reshape", [b.op1("Transpose", [w], perm=[1, 0]), e.ints([k, 1, channels, 1], "w_offsets")])
        dcols = b.op1("Reshape", [b.op1("Mul", [w, dy_flat]), e.ints([k, -1, channels, *windows.outputs],
                                                                      "dcols")])  # [K, N, C, O...]
        _final(e, dx_out, io, lambda target: col2im(e, _offset_of(e, dcols), rank, windows, output=target))
