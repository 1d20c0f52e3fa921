"""Lowering of onnxruntime-training's default-domain ``MaxPoolGrad`` and ``AveragePoolGrad``
(``specs/onnx.training/``). dX's spatial dims come from the type the graph declares for dX (as in
onnxruntime's kernels); its batch and channel dims from dY at run time.

MaxPoolGrad adds every dY element at its flat index. From opset 16 that is one ScatterElements with
``reduction="add"``. Below 16 ScatterElements can only overwrite, so the outputs are split into groups whose
windows cannot overlap (output positions ``g = ceil(window span / stride)`` apart on every spatial axis, taken
as strided Slices): within a group no index repeats, and each group is added by ``ScatterElements(data,
idx, GatherElements(data, idx) + dY)``. That needs the window geometry (kernel_shape); without it the
node needs opset 16.

AveragePoolGrad: dY times a constant map of 1/n per output position (n from count_include_pad and the
window's part inside the input), spread over the windows by a ConvTranspose with a kernel of ones, one group per
channel (C symbolic: on the [N*C, 1, O...] view); where n is the same for every window the kernel is 1/n and
there is no Mul; pads / output_padding crop it to dX's spatial shape. It computes in f32 (f16 and f64
cast once and rounded once): onnxruntime's CPU provider has no f64 ConvTranspose.

The portable target (no ScatterElements with its opset-dependent reduction, no ConvTranspose with a runtime
input) spreads values back with :func:`lowering.rules.im2col.col2im`, which needs dY's spatial dims and the
kernel_shape static. MaxPoolGrad: the index's position inside its own sample's and channel's plane (``Indices``
minus the plane's first flat index, a Range over N*C at run time) compared with each kernel offset's input
position for every output position (a constant [K, O...] map, -1 in the padding) is a one-hot over the offsets:
``Where(onehot, dY, 0)`` is the per-offset piece.

Bad indices (a value MaxPool cannot produce; onnxruntime-training's kernel refuses one outside dX at run time,
a standard graph cannot): in the onnxruntime forms an index outside [0, size of dX) adds nothing and nothing is
read or written out of bounds. The scatters work on dX plus one spare element that every such index is redirected
to, cut off at the end (from opset 16 with N and C static, by one clamp to [-1, size of dX]; below 16 the indices
of a group must stay distinct); from opset 16 with N or C symbolic such an index is clamped into dX and its dY
becomes 0 before the ScatterElements (it adds 0 there). An index inside dX but outside
its window is added where it points (below opset 16, when two such indices of one group of disjoint windows
coincide, one of their sums is kept). The portable form adds an index only at a position of its own window in
its own plane: any other index, inside dX or not, adds nothing.
AveragePoolGrad: every offset's piece is dY times the 1/n map. Computed in f32 (f64
in f64), rounded once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
from onnx import TensorProto, helper

from lowering.builder import NodeBuilder
from lowering.emit_common import Emitter, compute_type, guarded_index, index_in_range
from lowering.rules import TARGETS, LoweringRequest, register_rule
from lowering.rules.elementwise_grad import input_elem
from lowering.rules.im2col import Windows, col2im
from opdef.errors import LoweringError
from opdef.rules.pool_grad import PoolParameters, pool_parameters

SUMMING_SCATTER_SINCE = 16  # ScatterElements' reduction attribute
_INT64_MAX = 2**63 - 1
# Bounds on the work one node may expand into (a corrupted kernel_shape must not make 20,000 nodes): the
# grouped form below opset 16 emits a few nodes per group, the portable forms a few per window offset.
MAX_SCATTER_GROUPS = 256
MAX_WINDOW_OFFSETS = 1024
SMALL_CLAMP = 1 << 16  # dX elements up to which MaxPoolGrad clamps its indices with one Clip (not Max and Min)


def _fail(request: LoweringRequest, problem: str) -> LoweringError:
    i = request.inference
    name = i.node_name or next((o for o in i.outputs if o), "?")
    return LoweringError(f"{i.op_type} '{name}': {problem}")


def _geometry(request: LoweringRequest) -> tuple[list[int], tuple | None, PoolParameters]:
    """(dX's static spatial dims, dY's shape, the attributes)."""
    inference = request.inference
    dy_type = inference.input_types[0]
    dx_type = inference.output_types[0]
    dx_shape = None if dx_type is None else dx_type.shape
    if dx_shape is None or len(dx_shape) < 3 or not all(isinstance(d, int) for d in dx_shape[2:]):
        shown = "unknown" if dx_shape is None else "[" + ",".join("?" if d is None else str(d) for d in dx_shape) + "]"
        raise _fail(request, f"the graph must declare dX's spatial dims (declared: {shown}); like onnxruntime's "
                             "kernel, the lowering reads the forward input's size from there")
    try:
        params = pool_parameters(inference.attributes, len(dx_shape) - 2)
    except ValueError as exc:
        raise _fail(request, str(exc)) from None
    return list(dx_shape[2:]), None if dy_type is None else dy_type.shape, params


def _full_shape(e: Emitter, dy: str, spatial: list[int]) -> str:
    """[N, C, D...]: N and C from dY at run time."""
    b = e.b
    batch_channels = b.op1("Slice", [b.op1("Shape", [dy]), e.ints([0], "starts"), e.ints([2], "ends")])
    return b.op1("Concat", [batch_channels, e.ints(spatial, "spatial")], axis=0)


@register_rule("max_pool_grad", targets=TARGETS)
def lower_max_pool_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    out = request.output("dX")
    if out is None:
        return
    io = input_elem(request, "dY")
    spatial, dy_shape, params = _geometry(request)
    e = Emitter(b, compute_type(io))
    dy = e.up(request.input("dY"), io)
    indices = request.input("Indices")
    outputs = _static_outputs(dy_shape, len(spatial))
    if params.kernel_shape is not None and outputs is not None:
        _check_window(request, spatial, outputs, params)
    if request.options.target == "portable":
        windows = _windows(request, spatial, dy_shape, params)
        within = b.op1("Sub", [indices, _plane_starts(e, dy, len(spatial), math.prod(spatial))])
        positions = windows.input_positions()  # [K, O...]

        def piece(i: int) -> str:  # dY where offset i holds the window's maximum, else 0
            onehot = b.op1("Equal", [within, b.const(positions[i], hint="positions")])
            return b.op1("Where", [onehot, dy, e.scalar(0.0, "zero")])

        _spread(e, piece, len(spatial) + 2, windows, out, io)
        return
    shape = _full_shape(e, dy, spatial)
    flat = e.ints([-1], "flat")
    static_size = None if dy_shape is None or not all(isinstance(d, int) for d in dy_shape[:2]) else \
        dy_shape[0] * dy_shape[1] * math.prod(spatial)
    if b.opset >= SUMMING_SCATTER_SINCE and static_size is not None:
        # dX's size static: every index outside dX is clamped onto one spare element past its end (-1 counts from
        # the end), cut off by the Slice, so no mask and no Where on dY: 8 -> 7 kernels, and onnxruntime's Max,
        # Min, Equal and Where over [32, 16, 32, 32] took 9.3 ms with the ScatterElements against 7.4 ms; at
        # most SMALL_CLAMP indices one Clip (1 kernel fewer; onnxruntime's int64 Clip is slower on large inputs).
        # Not MaxUnpool (one kernel where windows do not overlap): onnxruntime 1.32's refuses an index outside its
        # output and wants the output's batch and channels to be dY's (no spare element), and overwrites a repeated
        # index instead of adding; nor ScatterND with reduction "add" (no flat views of dY): its CPU kernel runs
        # the updates in a parallel loop, so the repeated indices of overlapping windows could race
        low, high = e.ints(-1, "spare_below"), e.ints(static_size, "spare_above")
        clamped = b.op1("Clip", [indices, low, high]) if static_size <= SMALL_CLAMP else \
            b.op1("Min", [b.op1("Max", [indices, low]), high])
        # zeros by ConstantOfShape, not an initializer: the model file stays small at any size (onnxruntime folds it)
        spare = b.op1("ConstantOfShape", [e.ints([static_size + 1], "zeros_and_spare")],
                      value=helper.make_tensor("zero", e.ct, [1], [0]))
        data = b.op1("ScatterElements", [spare, b.op1("Reshape", [clamped, flat]), b.op1("Reshape", [dy, flat])],
                     axis=0, reduction="add")
        data = b.op1("Slice", [data, e.ints([0], "starts"), e.ints([static_size], "size"), e.ints([0], "axes")])
        e.finish("Reshape", [data, shape], out, io)
        return
    zeros = b.op1("Reshape", [b.op1("Expand", [e.scalar(0.0, "zero"), shape]), flat])
    size = None if static_size is not None else b.op1("ReduceProd", [shape], keepdims=1)
    if b.opset >= SUMMING_SCATTER_SINCE:  # an index outside dX adds 0 at element 0
        indices, inside = guarded_index(b, indices, TensorProto.INT64, size, static_size)
        dy = b.op1("Where", [inside, dy, e.scalar(0.0, "zero")])
        data = b.op1("ScatterElements", [zeros, b.op1("Reshape", [indices, flat]), b.op1("Reshape", [dy, flat])],
                     axis=0, reduction="add")
        e.finish("Reshape", [data, shape], out, io)
        return
    # one spare element past dX's end takes every index outside dX (a group's indices must stay distinct)
    inside = index_in_range(b, indices, TensorProto.INT64, size, static_size)
    end = size if size is not None else e.ints([static_size], "size")
    data = b.op1("Concat", [zeros, b.op1("Reshape", [e.scalar(0.0, "zero"), e.ints([1], "one")])], axis=0)
    indices = b.op1("Where", [inside, indices, end])
    for steps, residue in _groups(request, params, dy_shape, len(spatial)):
        axes = list(range(2, 2 + len(spatial)))
        def part(name: str, residue=residue, steps=steps, axes=axes) -> str:
            if not any(s > 1 for s in steps):
                return b.op1("Reshape", [name, flat])
            sliced = b.op1("Slice", [name, e.ints(list(residue), "starts"),
                                     e.ints([_INT64_MAX] * len(axes), "ends"), e.ints(axes, "axes"),
                                     e.ints(list(steps), "steps")])
            return b.op1("Reshape", [sliced, flat])
        idx = part(indices)
        data = b.op1("ScatterElements", [data, idx, b.op1("Add", [b.op1("GatherElements", [data, idx], axis=0),
                                                                  part(dy)])], axis=0)
    data = b.op1("Slice", [data, e.ints([0], "starts"), end, e.ints([0], "axes")])
    e.finish("Reshape", [data, shape], out, io)


def _plane_starts(e: Emitter, dy: str, spatial: int, plane: int) -> str:
    """[N, C, 1...] int64: the flat index in dX where each (sample, channel) plane starts, N and C at run time
    (two Ranges reshaped by constant shapes: tract 0.23 loads a symbolic batch so)."""
    b = e.b
    channels = b.op1("Gather", [b.op1("Shape", [dy]), e.ints(1, "channel_axis")], axis=0)
    sample = b.op1("Mul", [channels, e.ints(plane, "plane")])
    samples = b.op1("Mul", [b.op1("Gather", [b.op1("Shape", [dy]), e.ints(0, "batch_axis")], axis=0), sample])
    units = [1] * spatial
    per_sample = b.op1("Reshape", [b.op1("Range", [e.ints(0, "zero_index"), samples, sample]),
                                   e.ints([-1, 1, *units], "sample_view")])
    per_channel = b.op1("Reshape", [b.op1("Range", [e.ints(0, "zero_index"), sample, e.ints(plane, "plane")]),
                                    e.ints([1, -1, *units], "channel_view")])
    return b.op1("Add", [per_sample, per_channel])


def _groups(request: LoweringRequest, params: PoolParameters, dy_shape, spatial: int):
    """(steps, residue) per group of outputs whose windows do not overlap."""
    if params.kernel_shape is None:
        raise _fail(request, f"the model's default opset is below {SUMMING_SCATTER_SINCE} and the node has no "
                             "kernel_shape: adding the gradients needs ScatterElements with reduction='add' "
                             f"(opset {SUMMING_SCATTER_SINCE}) or the window geometry")
    steps = []
    for a in range(spatial):
        span = params.dilations[a] * (params.kernel_shape[a] - 1) + 1
        steps.append(math.ceil(span / params.strides[a]))
    sizes = [None if dy_shape is None else dy_shape[2 + a] for a in range(spatial)]
    ranges = [range(min(s, n) if isinstance(n, int) else s) for s, n in zip(steps, sizes, strict=True)]
    groups = math.prod(len(r) for r in ranges)
    if groups > MAX_SCATTER_GROUPS:
        raise _fail(request, f"the model's default opset is below {SUMMING_SCATTER_SINCE}: adding the gradients of "
                             f"overlapping windows (kernel {list(params.kernel_shape)}, strides "
                             f"{list(params.strides)}) takes one ScatterElements per group of disjoint windows, here "
                             f"{groups} groups (more than {MAX_SCATTER_GROUPS}); convert the model to opset "
                             f"{SUMMING_SCATTER_SINCE} or newer (ScatterElements with reduction='add')")
    for residue in itertools.product(*ranges):
        yield tuple(steps), residue


@register_rule("average_pool_grad", targets=TARGETS)
def lower_average_pool_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    out = request.output("dX")
    if out is None:
        return
    io = input_elem(request, "dY")
    spatial, dy_shape, params = _geometry(request)
    k = len(spatial)
    if params.kernel_shape is None:
        raise _fail(request, "kernel_shape is missing")
    outputs = [dy_shape[2 + a] if dy_shape is not None and isinstance(dy_shape[2 + a], int) else None
               for a in range(k)]
    if None in outputs:
        raise _fail(request, f"dY's spatial dims must be static (dY {list(dy_shape) if dy_shape else 'unknown'})")
    kernel, strides, pads = params.kernel_shape, params.strides, params.pads
    _check_window(request, spatial, outputs, params)
    portable = request.options.target == "portable"
    # onnxruntime has no f64 ConvTranspose: f64 is computed in f32 too, unless portable
    e = Emitter(b, compute_type(io) if portable else TensorProto.FLOAT)
    dy = e.up(request.input("dY"), io)
    weights = _inverse_counts(spatial, outputs, params)
    channels = dy_shape[1] if isinstance(dy_shape[1], int) else None
    uniform = not portable and channels is not None and bool(np.all(weights == weights.flat[0]))
    # one 1/n for every window (no padding counted apart): the ConvTranspose's kernel carries it, dY * (1/n)
    # is then the GEMM's one product per element (fma(1/n, dy, 0), the same rounding as the Mul it replaces)
    scaled = dy if uniform else b.op1("Mul", [dy, b.const(weights.reshape((1, 1, *outputs)).astype(e.np_ct),
                                                          hint="inv_count")])
    if portable:
        _check_offsets(request, kernel)
        windows = Windows(tuple(spatial), tuple(kernel), tuple(strides), (1,) * k, tuple(pads), tuple(outputs))
        _spread(e, lambda i: scaled, k + 2, windows, out, io)
        return
    ends, output_padding = [], []
    for a in range(k):
        end = (outputs[a] - 1) * strides[a] + kernel[a] - pads[a] - spatial[a]  # what the windows reach past dX
        ends.append(max(end, 0))
        output_padding.append(max(-end, 0))  # a tail no window reaches (< stride)
    attrs = {"strides": list(strides), "pads": list(pads[:k]) + ends, "kernel_shape": list(kernel)}
    if any(output_padding):
        attrs["output_padding"] = output_padding
    if channels is not None:
        # C static: a ConvTranspose with one group per channel spreads dY [N, C, O...] into dX's shape itself, the
        # same per-plane products and sums as the [N*C, 1, O...] view (no Reshape to it nor back: cnn 4 -> 1 kernel)
        kernels = np.full((channels, 1, *kernel), weights.flat[0] if uniform else 1.0, e.np_ct)
        spread = b.op1("ConvTranspose", [scaled, b.const(kernels, hint="window")], out if io == e.ct else None,
                       group=channels, **attrs)
        if io != e.ct:
            b.op1("Cast", [spread], out, to=io)
        return
    view = b.op1("Reshape", [scaled, e.ints([-1, 1, *outputs], "plane_view")])
    ones = b.const(np.ones((1, 1, *kernel), e.np_ct), hint="window")
    spread = b.op1("ConvTranspose", [view, ones], **attrs)
    e.finish("Reshape", [spread, _full_shape(e, dy, spatial)], out, io)


def _static_outputs(dy_shape, k: int) -> list[int] | None:
    """dY's spatial dims when all are static."""
    if dy_shape is None or len(dy_shape) != k + 2 or not all(isinstance(d, int) for d in dy_shape[2:]):
        return None
    return list(dy_shape[2:])


def _check_window(request: LoweringRequest, spatial: list[int], outputs: list[int], params: PoolParameters) -> None:
    """C2: dY must be the forward output of dX's declared shape (floor or ceil rounding), as onnxruntime's
    kernels assume; a window wider than dX and its pads is refused."""
    k = len(spatial)
    kernel, strides, pads, dilations = params.kernel_shape, params.strides, params.pads, params.dilations
    for a in range(k):
        span = dilations[a] * (kernel[a] - 1) + 1
        reach = spatial[a] + pads[a] + pads[a + k] - span
        floor_size = reach // strides[a] + 1
        ceil_size = -(-reach // strides[a]) + 1
        if (ceil_size - 1) * strides[a] >= spatial[a] + pads[a]:  # a last window starting in the end padding
            ceil_size -= 1
        dilated = f" dilation {dilations[a]}," if dilations[a] != 1 else ""
        window = f"kernel {kernel[a]},{dilated} stride {strides[a]} and pads {pads[a]}+{pads[a + k]}"
        if reach < 0:
            raise _fail(request, f"dY has {outputs[a]} positions on axis {a + 2}, but the window ({window}) is "
                                 f"wider than dX's {spatial[a]} with its pads")
        if outputs[a] not in (floor_size, ceil_size):
            raise _fail(request, f"dY has {outputs[a]} positions on axis {a + 2}; the forward output of dX's "
                                 f"{spatial[a]} with {window} has {floor_size} (or {ceil_size} with ceil_mode)")


def _check_offsets(request: LoweringRequest, kernel) -> None:
    """The portable forms emit a few nodes per window offset: bounded."""
    offsets = math.prod(kernel)
    if offsets > MAX_WINDOW_OFFSETS:
        raise _fail(request, f"the portable form spreads each of the window's {offsets} window offsets separately "
                             f"(kernel {list(kernel)}; at most {MAX_WINDOW_OFFSETS}); the onnxruntime target "
                             "(--target onnxruntime) has no such limit")


def _inverse_counts(spatial: list[int], outputs: list[int], params: PoolParameters) -> np.ndarray:
    """1/n for every output position (float64), n as the spec document defines it."""
    per_axis = []
    for a, (size, count) in enumerate(zip(spatial, outputs, strict=True)):
        starts = np.arange(count) * params.strides[a] - params.pads[a]
        inside = np.minimum(starts + params.kernel_shape[a], size) - np.maximum(starts, 0)
        per_axis.append(np.full(count, params.kernel_shape[a]) if params.count_include_pad else inside)
    counts = per_axis[0].astype(np.float64)
    for axis in per_axis[1:]:
        counts = np.multiply.outer(counts, axis)
    return 1.0 / counts


def _windows(request: LoweringRequest, spatial: list[int], dy_shape, params: PoolParameters) -> Windows:
    """The window geometry the portable form needs static: kernel_shape and dY's spatial dims."""
    k = len(spatial)
    outputs = [None if dy_shape is None else dy_shape[2 + a] for a in range(k)]
    if params.kernel_shape is None or not all(isinstance(o, int) for o in outputs):
        shown = "unknown" if dy_shape is None else "[" + ",".join("?" if d is None else str(d) for d in dy_shape) + "]"
        raise _fail(request, "the portable lowering needs kernel_shape and dY's spatial dims static (kernel_shape "
                             f"{list(params.kernel_shape) if params.kernel_shape else 'missing'}, dY {shown}): it "
                             "spreads dY over the windows with a static window geometry")
    _check_offsets(request, params.kernel_shape)
    return Windows(tuple(spatial), tuple(params.kernel_shape), tuple(params.strides), tuple(params.dilations),
                   tuple(params.pads), tuple(outputs))


def _spread(e: Emitter, piece: Callable[[int], str], rank: int, windows: Windows, out: str, io: int) -> None:
    """col2im into ``out``: written by its last op, or through one Cast to the output type."""
    if io == e.ct:
        col2im(e, piece, rank, windows, output=out)
    else:
        e.b.op1("Cast", [col2im(e, piece, rank, windows)], out, to=io)
