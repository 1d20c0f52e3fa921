"""Emit batch-norm training backward as standard ONNX ops (DESIGN.md section 4 math, section 5 rules).

``emit_batch_norm_backward(b, plan)`` is the one entry point; the plan says everything the emitter needs
(value names, layout, types, statistics kind) so the function never looks at a graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, numpy_helper

from lowering.builder import NodeBuilder
from lowering.emit_common import Emitter, compute_type
from opdef.errors import LoweringError

_LOW_PRECISION = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


@dataclass(frozen=True)
class BatchNormBackwardPlan:
    src: str
    diff_dst: str
    mean: str
    stat: str
    gamma: str | None
    diff_src: str | None  # None = not requested: not computed
    diff_gamma: str | None
    diff_beta: str | None
    rank: int | None  # None = unknown rank
    channel_axis: int | None  # non-negative when the rank is known; None for NXC of unknown rank
    reduce_axes: tuple[int, ...] | None  # axes the sums run over; None = every axis but channel_axis
    stats_keep_rank: bool  # DirectML: stats and parameter gradients have src's rank, 1 on reduced axes
    statistics: str  # "batch" | "frozen"
    stat_input: str  # "variance" | "inv_std"
    epsilon: float
    io_type: int  # TensorProto elem type of src, diff_dst, diff_src (T1)
    stat_type: int  # elem type of mean, stat, gamma, diff_gamma, diff_beta (T2)
    src_shape: tuple | None = None  # static dims (int | str | None) for choosing formulations
    channel_last: bool = False  # layout hint when the rank is unknown (NXC)
    diff_src_internal: bool = False  # diff_src is no graph output: only nodes of the graph read it


class _Emitter(Emitter):
    def __init__(self, b: NodeBuilder, plan: BatchNormBackwardPlan) -> None:
        super().__init__(b, compute_type(plan.io_type))
        self.p = plan

    def reduce_sum(self, x: str, axes: tuple[int, ...], keepdims: int = 1, output: str | None = None) -> str:
        return self.reduce("ReduceSum", x, axes, keepdims, output)

    # -- the lowering ----------------------------------------------------------------------------
    def emit(self) -> None:
        p, b = self.p, self.b
        if p.statistics not in ("batch", "frozen"):
            raise LoweringError(f"statistics must be 'batch' or 'frozen', not {p.statistics!r}")
        if p.stat_input not in ("variance", "inv_std"):
            raise LoweringError(f"stat_input must be 'variance' or 'inv_std', not {p.stat_input!r}")
        wants_dx, wants_dg, wants_db = p.diff_src is not None, p.diff_gamma is not None, p.diff_beta is not None
        if not (wants_dx or wants_dg or wants_db):
            return
        layout = self.fast_layout()
        if layout is not None:
            self.fast(layout).emit()
            return
        frozen = p.statistics == "frozen"

        x = self.cast(p.src, p.io_type, self.ct)
        dy = self.cast(p.diff_dst, p.io_type, self.ct)
        axes, stat_shape, restore = self.view(x, dy)
        x, dy = self.x_view, self.dy_view

        def per_channel(name: str | None) -> str | None:
            if name is None:
                return None
            v = self.cast(name, p.stat_type, self.ct)
            return v if stat_shape is None else b.op1("Reshape", [v, self.ints(stat_shape)])

        mean = per_channel(p.mean)
        stat = per_channel(p.stat)
        gamma = per_channel(p.gamma)
        if p.stat_input == "inv_std":
            inv = stat
        else:
            inv = b.op1("Reciprocal", [b.op1("Sqrt", [b.op1("Add", [stat, self.scalar(p.epsilon, "eps")])])])

        need_sums = wants_dg or wants_db or (wants_dx and not frozen)
        sum_dy = sum_dyxc = xc = None
        if need_sums:
            if wants_db or (wants_dx and not frozen):
                sum_dy = self.reduce_sum(dy, axes)
            if wants_dg or (wants_dx and not frozen):
                xc = b.op1("Sub", [x, mean])
                sum_dyxc = self.reduce_sum(b.op1("Mul", [dy, xc]), axes)
        # parameter gradients: keepdims sums have the broadcast shape; outputs want the stats' shape
        out_shape = None if p.stats_keep_rank else self.ints([-1])
        if wants_db:
            self.finish_param("Identity", [sum_dy], out_shape, p.diff_beta)
        dgamma = b.op1("Mul", [inv, sum_dyxc]) if sum_dyxc is not None else None
        if wants_dg:
            self.finish_param("Identity", [dgamma], out_shape, p.diff_gamma)
        if not wants_dx:
            return
        scale = inv if gamma is None else b.op1("Mul", [gamma, inv])
        if frozen:
            dx_inputs = ["Mul", [dy, scale]]
        else:
            inv_m = self.inv_count(x)
            # dx = scale * (dy - sum_dy/M - xc * inv*dgamma/M)
            mean_dy = b.op1("Mul", [sum_dy, inv_m])
            k = b.op1("Mul", [b.op1("Mul", [inv, dgamma]), inv_m])
            inner = b.op1("Sub", [b.op1("Sub", [dy, mean_dy]), b.op1("Mul", [xc, k])])
            dx_inputs = ["Mul", [inner, scale]]
        if restore is None:
            self.finish(dx_inputs[0], dx_inputs[1], p.diff_src, p.io_type)
        else:
            dx = b.op1(dx_inputs[0], dx_inputs[1])
            self.finish("Reshape", [dx, restore], p.diff_src, p.io_type)

    def fast(self, layout: str) -> _Fast:
        """The formulation for a per-channel layout (the portable emitter substitutes its own)."""
        return _Fast(self, layout)

    def fast_layout(self) -> str | None:
        """'NCX' / 'NXC' when the tuned formulations apply (per-channel [C] stats, channel axis 1 or last)."""
        p = self.p
        if p.src_shape is not None and p.channel_axis is not None and p.rank == len(p.src_shape) \
                and p.src_shape[p.channel_axis] == 0:
            return None  # no channels: the views of the tuned forms would need a 0 in a Reshape target
        if p.stats_keep_rank or p.reduce_axes is not None and p.rank is not None and tuple(sorted(
                p.reduce_axes)) != tuple(a for a in range(p.rank) if a != p.channel_axis):
            return None
        if p.rank is None:
            return "NXC" if p.channel_last or p.channel_axis is None else ("NCX" if p.channel_axis == 1 else None)
        if p.rank >= 2 and p.channel_axis == p.rank - 1:
            return "NXC"
        if p.rank >= 3 and p.channel_axis == 1:
            return "NCX"
        return None

    def finish_param(self, op_type: str, inputs: list[str], out_shape: str | None, output: str) -> None:
        if out_shape is not None:
            op_type, inputs = "Reshape", [inputs[0], out_shape]
        self.finish(op_type, inputs, output, self.p.stat_type)

    def view(self, x: str, dy: str):
        """Decide the reduce axes, how per-channel vectors broadcast, and how dx gets src's shape back.

        Returns ``(axes, stat_shape, restore)``: the sums' axes in the viewed tensors, the Reshape target
        for per-channel vectors (None: they already broadcast), the shape tensor to Reshape dx back with
        (None: dx already has src's shape). Sets ``x_view`` and ``dy_view``.
        """
        p, b = self.p, self.b
        self.x_view, self.dy_view = x, dy
        if p.rank is not None:
            if p.stats_keep_rank:  # the statistics broadcast as they are; the reduce axes decide
                if p.reduce_axes is None:
                    raise LoweringError("statistics that keep the input's rank need their reduce axes")
                return tuple(p.reduce_axes), None, None
            ch = p.channel_axis
            if ch is None or not 0 <= ch < p.rank:
                raise LoweringError(f"channel axis {ch} is out of range for rank {p.rank}")
            axes = p.reduce_axes if p.reduce_axes is not None else tuple(a for a in range(p.rank) if a != ch)
            return tuple(axes), [-1] + [1] * (p.rank - 1 - ch), None
        if p.stats_keep_rank:
            raise LoweringError("statistics that keep the input's rank need a known rank")
        restore = b.op1("Shape", [p.src])
        if p.channel_last or p.channel_axis is None:
            # [..., C] -> [M, C]; C read from mean's shape
            shape = b.op1("Concat", [self.ints([-1]), b.op1("Shape", [p.mean])], axis=0)
            self.x_view = b.op1("Reshape", [x, shape])
            self.dy_view = b.op1("Reshape", [dy, shape])
            return (0,), None, restore
        if p.channel_axis != 1:
            raise LoweringError(f"channel axis {p.channel_axis} needs a known rank")
        shape = self.ints([0, 0, -1])
        self.x_view = b.op1("Reshape", [x, shape])
        self.dy_view = b.op1("Reshape", [dy, shape])
        return (0, 2), [-1, 1], restore

    def inv_count(self, x: str) -> str:
        """1/M, M = elements per channel: static when the dims are known, else Size(x)/Size(mean)."""
        p, b = self.p, self.b
        dims = p.src_shape
        if dims is not None and p.rank is not None and len(dims) == p.rank:
            axes = p.reduce_axes
            if axes is None:
                axes = tuple(a for a in range(p.rank) if a != p.channel_axis)
            if all(isinstance(dims[a], int) for a in axes):
                m = math.prod(dims[a] for a in axes)
                return self.scalar(1.0 / max(m, 1), "inv_m")  # (no elements: the sums are 0 anyway)
        mean = self.cast(p.mean, p.stat_type, self.ct)
        return b.op1("Reciprocal", [b.op1("Cast", [self.count(x, mean)], to=self.ct)])

    def count(self, x: str, mean: str) -> str:
        """Elements per channel at run time: Size(x) / Size(mean), as 1 when there are no channels."""
        b = self.b
        channels = b.op1("Max", [b.op1("Size", [mean]), b.const(np.array(1, np.int64), hint="one_i64")])
        return b.op1("Max", [b.op1("Div", [b.op1("Size", [x]), channels]), b.const(np.array(1, np.int64),
                                                                                   hint="one_i64")])


class _Fast:
    """The tuned formulation for per-channel [C] statistics with the channel axis second (NCX) or last (NXC).

    The tensors are viewed as [M, C] (NXC), or [N, C, X] (NCX of unknown rank; NCX of known rank is used as it
    is); Reshape aliases, so views cost nothing.
    With xc = x - mean (centred before any product: exact when |mean| >> std) and per-channel vectors
    S1 = sum(dy), S2 = sum(dy*xc):  diff_beta = S1, diff_gamma = inv*S2 and
    diff_src = a*dy + b*xc + c with a = gamma*inv, b = -a*inv*diff_gamma/M, c = -a*S1/M.
    Passes over tensor-sized data (read + write counts, f32 units), batch statistics:
    Sub xc 2, Mul dy*xc 3, the two sums 1 + 1 (ReduceSums for NCX; MatMuls with ones rows for NXC, where a
    ReduceSum that keeps the last axis is slow; in stages for long sums, see channel_sum), or for NCX with
    static dims and >= CONV_MIN_SPATIAL elements per (sample, channel) S2 as a grouped Conv reading dy and
    xc (2, see conv_dot), then diff_src:
    "affine": BatchNormalization (mean 0, variance 1, epsilon 0) as the per-channel affine b*xc + c 2,
    Mul a*dy 2, Add 3 -> 14 in all (the literal formula of DESIGN.md section 4 makes 16);
    "muladd": Mul 2, Mul 2, Add 3, Add 2 -> 16. Frozen statistics: one Mul (2).
    f16/bf16 add a Cast per input and one for diff_src (1.5 each in f32 units): 18.5. For NCX with
    >= CONV_MIN_SPATIAL elements per (sample, channel) where the sum is no graph output (f16/bf16, or diff_src
    read by other nodes), b*xc + c is a depthwise 1x1 Conv with bias that onnxruntime fuses with the Add
    into one FusedConv working in place (3 instead of 5; BatchNormalization is single-threaded there). There
    with diff_src a graph output (f32): a*(dy + Conv(xc; b/a, c/a)), a FusedConv that copies dy first, then
    Mul by a into the output (7 like "affine", but on two threads).
    Measured (2 cores, see ``oplower bench``) "affine" beat "muladd" in both layouts; DX_FORM keeps the choice.
    """

    def __init__(self, e: _Emitter, layout: str, dx_form: str | None = None) -> None:
        self.e, self.b, self.p = e, e.b, e.p
        self.vt = TensorProto.DOUBLE  # per-channel vectors (see wide)
        self.layout = layout
        self.dx_form = dx_form or DX_FORM.get(layout, "muladd")

    def static_dim(self, axis: int | None) -> int | None:
        p = self.p
        if p.src_shape is None or p.rank is None or axis is None or len(p.src_shape) != p.rank:
            return None
        d = p.src_shape[axis]
        return d if isinstance(d, int) and d > 0 else None

    def static_count(self) -> int | None:
        p = self.p
        if p.rank is None or p.src_shape is None or len(p.src_shape) != p.rank:
            return None
        dims = [p.src_shape[a] for a in range(p.rank) if a != p.channel_axis]
        if not all(isinstance(d, int) and d >= 0 for d in dims):
            return None
        return math.prod(dims)

    def views(self):
        """src and diff_dst as [N, C, X] / [M, C] (before any Cast: Reshape takes bf16 and aliases).

        NCX of known rank needs no view: ReduceSum over axes 2, 3 ... and then 0 works on src's own shape,
        and per-channel vectors broadcast as [C, 1, 1 ...]; that saves four Reshape nodes per lowering (the
        views and the way back). NXC is [M, C] (BatchNormalization's channel axis is 1).
        """
        p, b, e = self.p, self.b, self.e
        ncx = self.layout == "NCX"
        if p.rank == 2 and not ncx or ncx and p.rank is not None:
            return p.src, p.diff_dst, None
        if ncx:
            shape = e.ints([0, 0, -1])
        else:
            c = self.static_dim(p.channel_axis)
            shape = e.ints([-1, c]) if c else b.op1("Concat", [e.ints([-1]), b.op1("Shape", [p.mean])], axis=0)
        restore = self.static_shape()
        restore = b.op1("Shape", [p.src]) if restore is None else e.ints(restore)
        return b.op1("Reshape", [p.src, shape]), b.op1("Reshape", [p.diff_dst, shape]), restore

    def static_shape(self) -> list[int] | None:
        """src's shape when every dim is known (a shared constant then replaces a Shape node per lowering)."""
        p = self.p
        if p.src_shape is None or p.rank is None or len(p.src_shape) != p.rank:
            return None
        if not all(isinstance(d, int) and d > 0 for d in p.src_shape):
            return None
        return list(p.src_shape)

    def channel_sum(self, t: str, rows: list[tuple[str, str | None]] | None) -> str:
        """Per-channel sum of a viewed tensor as a [C] vector, in stages along the axes, never one long
        running sum (where the count per channel reaches STAGED_SUMS_FROM).

        NCX: ReduceSum over the last row :func:`_cut` makes of the spatial axes, then over the rest. NXC: a
        MatMul with a ones row (``rows``, from :meth:`ones_row`; a ReduceSum that keeps the last axis is
        slow), then ReduceSum over what is left. Measured on products like dy*xc at
        32x112x112x64 against float64: one ReduceSum over axes 0, 2, 3 / one MatMul over all N*H*W rows left
        9e-7 / 8e-6 of the result's scale, the stages 2e-7, and ran as fast or faster.

        Only the first stage (over the whole tensor) runs in the computation type; the partial sums it leaves
        (a row's worth smaller) are summed on in the vector type (f64, :meth:`wide`): cheap, and the short
        first stage is then the only f32 summation error. With every stage in f32 the 7x7 to 28x28 layers'
        sums were off by 2-3x torch's own error (torch accumulates in double). Returns the sum in the vector
        type.
        """
        b, e = self.b, self.e
        if self.layout == "NXC":
            if rows[0][1] is None:  # one MatMul over [M, C]
                return self.wide(b.op1("Reshape", [b.op1("MatMul", [rows[0][0], t]), e.ints([-1])]))
            ones, shape = rows[0]
            t = self.wide(b.op1("MatMul", [ones, b.op1("Reshape", [t, shape])]))
            p, m = self.p, self.static_count()
            if m is not None and p.rank is not None:  # every dim static: [m / k, 1, C] partials
                k = _cut([self.static_dim(a) for a in range(1 if p.rank >= 3 else 0, p.rank - 1)])[-1]
                return self.sum_rows(b.op1("Reshape", [t, e.ints([m // k, -1])]), m // k)
            return self.wide_sum(t, (0, 1))
        p = self.p
        rank = p.rank or 3
        spatial = [self.static_dim(a) for a in range(2, rank)] if p.rank is not None else [None]
        # static spatial dims: the first stage sums a whole row (_cut) even for short sums. Summing only the
        # last axis (7 elements at 7x7) left a partial tensor 7x larger to cast and sum again: NCX 2048x7x7
        # ran 1.3x faster with one ReduceSum over the 49 (A/B, onnxruntime 1.32, 2 cores)
        if None in spatial:  # the last axis, then the others
            per_row = self.wide(e.reduce_sum(t, (rank - 1,), keepdims=0))
            return self.wide_sum(per_row, (0,) + tuple(range(2, rank - 1)))
        factors = _cut(spatial)
        if len(factors) == 1:  # one row per (sample, channel): ReduceSum over the spatial axes as they are, no
            # Reshape to [N, C, X] first (onnxruntime merges contiguous reduced axes: the same sums, one kernel
            # fewer per sum)
            t = self.wide(e.reduce_sum(t, tuple(range(2, rank)), keepdims=0))
        else:
            if factors != spatial:
                t = b.op1("Reshape", [t, e.ints([0, 0] + factors)])
            t = self.wide(e.reduce_sum(t, (1 + len(factors),), keepdims=0))
        if len(factors) == 1 and self.static_dim(0) is not None:  # [N, C] partials
            return self.sum_rows(t, self.static_dim(0))
        return self.wide_sum(t, (0,) + tuple(range(2, 1 + len(factors))))

    def wide(self, t: str) -> str:
        """``t`` in the vector type: per-channel partials and coefficients go in f64 where the tensors are in
        f32 (they are a row's worth smaller than the tensors, so the extra precision costs next to nothing)."""
        return self.e.cast(t, self.e.ct, self.vt)

    def sum_rows(self, t: str, rows: int) -> str:
        """Column sums of [rows, C] partials (in the vector type) as a [C] vector: a MatMul with a ones vector.
        onnxruntime's ReduceSum over the leading axis of a small f64 matrix (it keeps the last axis) took
        0.15 ms at [32, 2048], the MatMul 0.07 ms: on the 7x7 layers every such op counts."""
        ones = self.b.const(np.ones(rows, np.float64), hint="ones_rows")
        return self.b.op1("MatMul", [ones, t])

    def wide_sum(self, t: str, axes: tuple[int, ...]) -> str:
        """ReduceSum of partials (already in the vector type) over ``axes``, dims dropped."""
        return self.e.reduce_sum(t, axes, keepdims=0) if axes else t

    def dot_pieces(self) -> int | None:
        """For sum(dy*xc) as a Conv (see conv_dot): into how many rows of at most DOT_ROW_MAX elements each
        sample's channel is cut; None where it does not pay (or cannot be written): not NCX with every dim
        static, not computed in f32, fewer than CONV_MIN_SPATIAL elements per (sample, channel), no divisor
        giving rows of DOT_ROW_MAX or less within 64 pieces."""
        shape = self.static_shape()
        if self.layout != "NCX" or shape is None or self.e.ct != TensorProto.FLOAT:
            return None  # (onnxruntime has no double Conv)
        x = math.prod(shape[2:])
        if x < CONV_MIN_SPATIAL:
            return None
        return _pieces(x)

    def conv_dot(self, dy: str, xc: str, pieces: int) -> str:
        """sum(dy*xc) per channel without writing the product: each (sample, channel) cut into ``pieces``
        rows, dy's rows as the channels of a 1-D input and xc's as the kernels of a Conv with one group per
        row ([1, rows, 1]: the dot products), then ReduceSum over the samples and pieces. Reads two tensors
        and writes none where Mul + ReduceSum reads three and writes one: 2x faster at 56x56 and 112x112
        (onnxruntime 1.32, 2 cores); rows of at most DOT_ROW_MAX keep the error near 2e-7 of the scale."""
        b, e = self.b, self.e
        shape = self.static_shape()
        n, c = shape[0], shape[1]
        rows, length = n * c * pieces, math.prod(shape[2:]) // pieces
        data = b.op1("Reshape", [dy, e.ints([1, rows, length])])
        kernels = b.op1("Reshape", [xc, e.ints([rows, 1, length])])
        dots = b.op1("Conv", [data, kernels], group=rows)
        if pieces == 1:
            return self.sum_rows(self.wide(b.op1("Reshape", [dots, e.ints([n, c])])), n)
        return self.wide_sum(self.wide(b.op1("Reshape", [dots, e.ints([n, c, pieces])])), (0, 2))

    def staged_sums(self) -> bool:
        """Whether the sums go in stages: unless the count per channel is known and below STAGED_SUMS_FROM
        (short sums are exact enough in one go, and one ReduceSum / MatMul is faster on small layers)."""
        m = self.static_count()
        return m is None or m >= STAGED_SUMS_FROM

    def ones_row(self) -> list[tuple[str, str | None]] | None:
        """For the NXC sums, the one MatMul stage over the tensor: a [1, k] ones row and the [rows, k, C]
        shape to view the tensor as (channel_sum sums the [rows, 1, C] it leaves in f64). Static dims (the
        batch may be symbolic): the last row :func:`_cut` makes of D1 .. Dk (rank 2: of M). Other dynamic
        dims: [N, D1 * .. * Dk, C]. Rank 2 with fewer than STAGED_SUMS_FROM rows, or of unknown M: [1, M]
        over the [M, C] tensor or view itself (shape None)."""
        if self.layout != "NXC":
            return None
        b, e, p = self.b, self.e, self.p

        def ones(k: int) -> str:
            return b.const(np.ones((1, k)), e.np_ct, "ones")

        def ones_like(count: str) -> str:
            one = numpy_helper.from_array(np.ones(1, dtype=e.np_ct), "one")
            return b.op1("ConstantOfShape", [b.op1("Concat", [e.ints([1]), count], axis=0)], value=one)

        dims = [self.static_dim(a) for a in range(p.rank)] if p.rank is not None else [None, None]
        rows_of_samples = p.rank is not None and p.rank >= 3 and None not in dims[1:]
        if p.rank == 2 and self.static_count() is None or not self.staged_sums() and not rows_of_samples:
            m = self.static_count()  # one MatMul over [M, C]
            return [(ones(m) if m is not None else ones_like(
                b.op1("Slice", [b.op1("Shape", [p.src]), e.ints([0]), e.ints([1])])), None)]
        if None not in dims[1:]:  # static but maybe for the batch (left as -1)
            # the first stage sums the last row _cut makes of a sample's (rank >= 3) or the rows' dims; the
            # rest goes on in f64 (channel_sum): also for short sums, where one f32 MatMul over every row of
            # a 32x7x7 or 32x14x14 batch was off by 4e-7 to 1e-6 of the scale
            c = dims[-1]
            k = _cut(dims[1:-1] if p.rank >= 3 else dims[:1])[-1]
            return [(ones(k), e.ints([-1, k, c]))]
        # unknown dims (or rank: src may have rank 2, then each of its M rows is a "sample" of one row)
        src_shape = b.op1("Shape", [p.src])
        x = b.op1("ReduceProd", [b.op1("Slice", [src_shape, e.ints([1]), e.ints([-1])])], keepdims=1)
        n = b.op1("Slice", [src_shape, e.ints([0]), e.ints([1])])
        return [(ones_like(x), b.op1("Concat", [n, x, b.op1("Shape", [p.mean])], axis=0))]

    def emit(self) -> None:
        p, b, e = self.p, self.b, self.e
        ct, low = e.ct, p.io_type != e.ct
        frozen = p.statistics == "frozen"
        wants_dx, wants_dg, wants_db = p.diff_src is not None, p.diff_gamma is not None, p.diff_beta is not None
        need_s1 = wants_db or (wants_dx and not frozen)
        need_s2 = wants_dg or (wants_dx and not frozen)
        vt = self.vt
        if wants_dx and not frozen and self.f32_channels() is not None:
            self.emit_f32()
            return

        x_view, dy_view, restore = self.views()
        dy = e.cast(dy_view, p.io_type, ct)

        def vec(name: str | None, to: int = vt) -> str | None:
            return None if name is None else e.cast(name, p.stat_type, to)

        def narrow(v: str) -> str:  # a per-channel coefficient for the tensor ops
            return e.cast(v, vt, ct)

        bcast = self.bcast

        stat = vec(p.stat)
        gamma = None if p.gamma is None else vec(p.gamma)
        if p.stat_input == "inv_std":
            inv = stat
        else:
            eps = b.const(np.array(p.epsilon, dtype=np.float64), hint="eps")
            inv = b.op1("Reciprocal", [b.op1("Sqrt", [b.op1("Add", [stat, eps])])])
        a = inv if gamma is None else b.op1("Mul", [gamma, inv])
        if wants_dx and not frozen and self.stacked_channels() is not None:
            self.emit_stacked(dy, inv, a)
            return

        rows = self.ones_row() if (need_s1 or need_s2) else None
        s1 = s2 = xc = x = mean = dgamma = None
        if need_s1:
            s1 = self.channel_sum(dy, rows)
            if wants_db:
                e.cast(s1, vt, p.stat_type, p.diff_beta)
        if need_s2:
            x = e.cast(x_view, p.io_type, ct)
            mean = vec(p.mean, ct)
            small = self.small_channels()
            if small is not None:  # x - mean with mean [C] as it is: no Reshape (see small_channels)
                xc = b.op1("BatchNormalization", [x, self.per_channel(1.0, small), self.per_channel(0.0, small),
                                                  mean, self.per_channel(1.0, small)], epsilon=0.0)
            else:
                xc = b.op1("Sub", [x, bcast(mean)])
            pieces = self.dot_pieces()
            if pieces is not None:
                s2 = self.conv_dot(dy, xc, pieces)
            else:
                s2 = self.channel_sum(b.op1("Mul", [dy, xc]), rows)
            dgamma = b.op1("Mul", [inv, s2])
            if wants_dg:
                e.cast(dgamma, vt, p.stat_type, p.diff_gamma)
        if not wants_dx:
            return
        if frozen:
            self.final(restore, low, "Mul", [(dy, True), (narrow(a), False)])
            return
        m = self.static_count()
        if m is not None:
            neg_inv_m = b.const(np.array(-1.0 / max(m, 1), dtype=np.float64), hint="neg_inv_m")
        else:
            count = e.count(x, mean)
            neg_inv_m = b.op1("Neg", [b.op1("Reciprocal", [b.op1("Cast", [count], to=vt)])])
        channels = self.conv_channels()
        if channels is not None and not (low or p.diff_src_internal):
            # f32 diff_src as a graph output: a*(dy + (b/a)*xc + c/a) with b/a = -inv*diff_gamma/M and
            # c/a = -S1/M (no division). The depthwise 1x1 Conv with bias and the Add of dy become one
            # multi-threaded FusedConv (it copies dy into its own buffer, then accumulates in place), the Mul
            # by a writes the output: the same 7 passes as BatchNormalization + Mul + Add, 1-6% faster on the
            # >= 14x14 layers (A/B against the peer, 2 cores) since BatchNormalization runs on one thread
            w = b.op1("Reshape", [narrow(b.op1("Mul", [b.op1("Mul", [neg_inv_m, inv]), dgamma])),
                                  e.ints([-1] + [1] * (p.rank - 1))])
            u = b.op1("Add", [b.op1("Conv", [xc, w, narrow(b.op1("Mul", [neg_inv_m, s1]))], group=channels), dy])
            self.final(restore, low, "Mul", [(u, True), (narrow(a), False)])
            return
        # b = -a*inv*diff_gamma/M, c = -a*S1/M (in the vector type, rounded once to the computation type)
        a_m = b.op1("Mul", [a, neg_inv_m])
        coef_b = narrow(b.op1("Mul", [b.op1("Mul", [a_m, inv]), dgamma]))
        coef_c = narrow(b.op1("Mul", [a_m, s1]))
        small = self.small_channels()
        if small is not None:  # a*dy with a [C] as it is: no Reshape (see small_channels)
            zeros = self.per_channel(0.0, small)
            ady = b.op1("BatchNormalization", [dy, narrow(a), zeros, zeros, self.per_channel(1.0, small)],
                        epsilon=0.0)
        else:
            ady = b.op1("Mul", [dy, bcast(narrow(a))])
        if channels is not None:
            # b*xc + c as a 1x1 depthwise Conv with bias; onnxruntime fuses it with the Add that follows into
            # one FusedConv writing into ady's buffer in place (BatchNormalization runs on one thread). Where
            # the Add's result is no graph output (f16/bf16: the Cast reads it; diff_src_internal).
            w = b.op1("Reshape", [coef_b, e.ints([-1] + [1] * (p.rank - 1))])
            v = b.op1("Conv", [xc, w, coef_c], group=channels)
            self.final(restore, low, "Add", [(ady, True), (v, True)])
        elif self.dx_form == "affine":
            channels = self.static_dim(p.channel_axis)  # the per-channel vectors are [C]
            if channels is not None:  # BatchNormalization's mean 0 and variance 1 as constants: 2 kernels fewer
                zeros, ones = self.per_channel(0.0, channels), self.per_channel(1.0, channels)
            else:  # of C's run-time length
                zeros = b.op1("Sub", [coef_c, coef_c])
                ones = b.op1("Add", [zeros, e.scalar(1.0, "one")])
            v = b.op1("BatchNormalization", [xc, coef_b, coef_c, zeros, ones], epsilon=0.0)
            self.final(restore, low, "Add", [(ady, True), (v, True)])
        else:
            v = b.op1("Mul", [xc, bcast(coef_b)])
            self.final(restore, low, "Add", [(b.op1("Add", [ady, v]), True), (coef_c, False)])

    def stacked_channels(self) -> int | None:
        """C where diff_src and both sums of batch statistics take the stacked small form (emit_stacked): where
        small_channels applies (its BatchNormalizations take [C] vectors as they are, a sum is one ReduceSum
        and one ones MatMul) and the parameter gradients have the computation type (they come out of the one
        Split of the stacked vectors)."""
        channels = self.small_channels()
        return channels if channels is not None and self.p.stat_type == self.e.ct else None

    def emit_stacked(self, dy: str, inv: str, a: str) -> None:
        """diff_src (batch statistics) and the parameter gradients of a small NCX tensor with the per-channel
        vectors stacked, for fewer kernels (each costs ~0.5-1.5 us before it does any work at these sizes):
        the same operations on the same values as the unstacked form, so the same bits.

        dy and dy*xc are concatenated along the channels, one ReduceSum over the spatial axes (no view: the
        same row sums) and one ones MatMul over the batch give [S1 | S2] in f64; every per-channel vector
        then is one element-wise product X * Y of stacked vectors: X = [S1 | S2 | S1 | S2 | a] * [1 | inv |
        1 | 1 | 1] (diff_gamma = inv*S2 rounded first, as before), Y = [1 | 1 | ka | ka*inv | 1] with
        ka = -a/M, giving [diff_beta | diff_gamma | c | b | a], rounded to f32 by one Cast and cut by one
        Split (1-D, so the pieces are [C]). 21 kernels per node instead of 26 (cnn 52 -> 42 per step).
        The row sums are the same bits where C * spatial is a multiple of 16 (the rows keep their SIMD
        alignment in the concatenation); else each row sum may round differently, as accurate."""
        b, e, p = self.b, self.e, self.p
        channels, vt = self.stacked_channels(), self.vt
        shape = self.static_shape()
        x = e.cast(p.src, p.io_type, e.ct)
        mean = e.cast(p.mean, p.stat_type, e.ct)
        ones, zeros = self.per_channel(1.0, channels), self.per_channel(0.0, channels)
        xc = b.op1("BatchNormalization", [x, ones, zeros, mean, ones], epsilon=0.0)
        both = b.op1("Concat", [dy, b.op1("Mul", [dy, xc])], axis=1)
        sums = self.sum_rows(self.wide(e.reduce_sum(both, tuple(range(2, p.rank)), keepdims=0)), shape[0])

        def wide_ones(count: int) -> str:
            return b.op1("ConstantOfShape", [e.ints([count], "channels")], hint="ones",
                         value=numpy_helper.from_array(np.ones(1, np.float64), "value"))

        one = wide_ones(channels)
        d = b.op1("Mul", [sums, b.op1("Concat", [one, inv], axis=0)])  # [diff_beta | diff_gamma]
        neg_inv_m = b.const(np.array(-1.0 / max(math.prod(shape) // channels, 1), np.float64), hint="neg_inv_m")
        ka = b.op1("Mul", [a, neg_inv_m])
        stack_x = b.op1("Concat", [d, d, a], axis=0)
        stack_y = b.op1("Concat", [wide_ones(2 * channels), ka, b.op1("Mul", [ka, inv]), one], axis=0)
        stacked = e.cast(b.op1("Mul", [stack_x, stack_y]), vt, e.ct)
        names = [p.diff_beta or b.fresh("diff_beta"), p.diff_gamma or b.fresh("diff_gamma"), b.fresh("coef_c"),
                 b.fresh("coef_b"), b.fresh("a")]
        if b.opset >= 13:
            b.op("Split", [stacked, e.ints([channels] * 5, "split")], names, axis=0)
        else:
            b.op("Split", [stacked], names, axis=0, split=[channels] * 5)
        _, _, coef_c, coef_b, a_ct = names
        ady = b.op1("BatchNormalization", [dy, a_ct, zeros, zeros, ones], epsilon=0.0)
        v = b.op1("BatchNormalization", [xc, coef_b, coef_c, zeros, ones], epsilon=0.0)
        self.final(None, p.io_type != e.ct, "Add", [(ady, True), (v, True)])

    def f32_channels(self) -> int | None:
        """C where diff_src and the parameter gradients of batch statistics take the f32 form (emit_f32): NCX
        with every dim static, at most SMALL_TENSOR elements and F32_SUMS_UPTO a channel, tensors and statistics
        in f32 and the statistic inv_std (onnxruntime-training's dialect, whose own kernel works in f32)."""
        p, e, shape = self.p, self.e, self.static_shape()
        if self.layout != "NCX" or shape is None or p.stat_input != "inv_std" \
                or not e.ct == p.io_type == p.stat_type == TensorProto.FLOAT:
            return None
        if math.prod(shape) > SMALL_TENSOR or math.prod(shape) // shape[1] > F32_SUMS_UPTO:
            return None
        return shape[1]

    def emit_f32(self) -> None:
        """diff_src (batch statistics) and the parameter gradients of a small NCX tensor with the per-channel
        math in f32, in onnxruntime-training's kernel's order: 12 kernels per node instead of emit_stacked's 21
        (and the Conv forms' 28 from CONV_MIN_SPATIAL elements a row).

        xc = x - mean and xhat = xc * inv (BatchNormalizations with constant [C] vectors: the Sub's and Mul's
        bits, no Reshape), diff_beta = S1 = sum(dy) and diff_gamma = sum(dy * xhat) (the kernel's sum of (x -
        mean) * inv_std * dy: the same products; its bits wherever onnxruntime's ReduceSum adds in the kernel's
        order), then diff_src = a * (dy - (xhat * diff_gamma + S1) / M) with a = gamma * inv (the kernel: a / M *
        (dy * M - S1 - xc * diff_gamma * inv)): w = xhat * diff_gamma + S1 a BatchNormalization, its 1/M one Mul
        (exact for M a power of 2), a Sub, and the product with a a BatchNormalization. Error against float64
        over 40 seeds (mean, units of 1e-8 of the largest entry; diff_src, diff_gamma, diff_beta): [4, 16, 4, 4]
        7.1 6.7 7.3 (the stacked f64 form 7.5 5.4 6.3, the kernel 8.0 6.7 7.3), [16, 16, 8, 8] 8.3 11.1 13.1
        (8.1 4.4 9.0; kernel 9.6 11.1 13.1).

        Each sum is a ReduceSum over the spatial axes and one over the batch: one ReduceSum over axes (0, 2, 3)
        (2 kernels fewer a node, the same bits) hands its few rows to a second thread, 11 us where the two take
        4 (one node at [4, 16, 4, 4], 2 threads, CPU clock: 28.3 against 15.8 us; 1 thread 14.8 against 15.6)."""
        b, e, p = self.b, self.e, self.p
        channels = self.f32_channels()
        spatial = tuple(range(2, p.rank))
        ones, zeros = self.per_channel(1.0, channels), self.per_channel(0.0, channels)
        xc = b.op1("BatchNormalization", [p.src, ones, zeros, p.mean, ones], epsilon=0.0)
        inv = p.stat
        xhat = b.op1("BatchNormalization", [xc, inv, zeros, zeros, ones], epsilon=0.0)
        s1 = e.reduce_sum(e.reduce_sum(p.diff_dst, spatial, keepdims=0), (0,), keepdims=0, output=p.diff_beta)
        dgamma = e.reduce_sum(e.reduce_sum(b.op1("Mul", [p.diff_dst, xhat]), spatial, keepdims=0), (0,), keepdims=0,
                              output=p.diff_gamma)
        a = inv if p.gamma is None else b.op1("Mul", [p.gamma, inv])
        w = b.op1("BatchNormalization", [xhat, dgamma, s1, zeros, ones], epsilon=0.0)
        z = b.op1("Mul", [w, e.scalar(1.0 / max(self.static_count(), 1), "inv_m")])
        s = b.op1("Sub", [p.diff_dst, z])
        b.op1("BatchNormalization", [s, a, zeros, zeros, ones], p.diff_src, epsilon=0.0)

    def per_channel(self, value: float, channels: int) -> str:
        """A [C] vector of ``value`` in the computation type: a ConstantOfShape of the constant [C], which
        onnxruntime folds into an initializer when it loads the model (no kernel runs), while the model holds
        8 bytes per node instead of C elements (a model of many layers with many channels stays small). One per
        value and node."""
        made = self.__dict__.setdefault("_per_channel", {})
        if (value, channels) not in made:
            made[value, channels] = self.b.op1(
                "ConstantOfShape", [self.e.ints([channels], "channels")], hint="ones" if value == 1 else "zeros",
                value=numpy_helper.from_array(np.array([value], self.e.np_ct), "value"))
        return made[value, channels]

    def small_channels(self) -> int | None:
        """C where the tensors are small enough (at most SMALL_TENSOR elements, NCX, every dim static, f32, fewer
        than CONV_MIN_SPATIAL elements per sample and channel: ``b*xc + c`` is the affine form's BatchNormalization)
        for ``x - mean`` and ``a * dy`` to be BatchNormalizations with constant [C] vectors (scale 1, bias 0, mean,
        variance 1, epsilon 0: x*1 + (0 - mean*1) = x - mean and dy*a + 0, the same bits as Sub and Mul): no
        Reshape of the [C] vector to [C, 1, ...] first, one kernel each fewer. Larger tensors keep Sub and Mul:
        BatchNormalization runs on one thread."""
        shape = self.static_shape()
        if self.layout != "NCX" or shape is None or self.e.ct != TensorProto.FLOAT or math.prod(shape) > SMALL_TENSOR:
            return None
        if math.prod(shape[2:]) >= CONV_MIN_SPATIAL or self.dx_form != "affine":  # the Conv forms' sizes
            return None
        return shape[1]

    def conv_channels(self) -> int | None:
        """C when diff_src's affine part is best done as a depthwise Conv (see emit; its form depends on whether
        diff_src is a graph output): NCX of static rank 3 to 5 (Conv's 1 to 3 spatial axes), computed in f32,
        static C, at least CONV_MIN_SPATIAL elements per channel and sample; else None."""
        p = self.p
        if self.layout != "NCX" or p.rank is None or not 3 <= p.rank <= 5 or self.e.ct != TensorProto.FLOAT:
            return None  # (onnxruntime has no double Conv)
        channels = self.static_dim(1)
        spatial = [self.static_dim(a) for a in range(2, p.rank)]
        if channels is None or None in spatial or math.prod(spatial) < CONV_MIN_SPATIAL:
            return None
        return channels

    def final(self, restore: str | None, low: bool, op_type: str, inputs: list[tuple[str, bool]]) -> None:
        """diff_src's last op writes the requested name. ``inputs`` are (name, tensor-sized?) pairs; the
        others are [C] vectors.

        The views are reshaped back to src's shape *before* the last op: a Reshape of an intermediate
        aliases its buffer, while a Reshape into a graph output copies the whole tensor (~15% of the time).
        """
        b, p, e = self.b, self.p, self.e
        # (only where it is read: an unused constant makes onnxruntime warn at load)
        for_src = self.vector_shape_for_src() if restore is not None and not low else None
        if for_src is not None:
            args = [b.op1("Reshape", [n, restore if full else for_src]) for n, full in inputs]
            b.op1(op_type, args, p.diff_src)
            return
        args = [n if full else self.bcast(n) for n, full in inputs]
        t = b.op1(op_type, args, p.diff_src if not low and restore is None else None)
        if restore is not None:
            t = b.op1("Reshape", [t, restore], None if low else p.diff_src)
        if low:
            e.cast(t, e.ct, p.io_type, p.diff_src)

    def bcast(self, v: str) -> str:
        """A [C] vector shaped to broadcast against the tensors as viewed: [C, 1 ...] for NCX (rank - 2
        ones; one for the [N, C, X] view of unknown rank), as it is for NXC."""
        if self.layout != "NCX":
            return v
        return self.b.op1("Reshape", [v, self.e.ints([-1] + [1] * ((self.p.rank or 3) - 2))])

    def vector_shape_for_src(self) -> str | None:
        """Shape that makes a [C] vector broadcast against src itself (None when the rank is unknown)."""
        if self.layout == "NXC":
            return self.e.ints([-1])
        if self.p.rank is None:
            return None
        return self.e.ints([-1] + [1] * (self.p.rank - 2))


# per-channel counts from which the sums go in stages (_Fast.channel_sum): one MatMul over 100,352 NXC rows was
# off by 2x the f32 tolerance; one ReduceSum / MatMul over up to 6,272 was faster on the 7x7 and 14x14 layers
STAGED_SUMS_FROM = 16384
# the longest row conv_dot lets one dot product run over: 112x112 in one row was off by 7.6e-7 of the scale,
# in rows of 1,568 by 2e-7, at the same speed
DOT_ROW_MAX = 2048
# diff_src formulation per layout, chosen by measurement (see _Fast)
DX_FORM = {"NCX": "affine", "NXC": "affine"}
# NCX with at least this many elements per (sample, channel) use the depthwise Conv for b*xc + c where the
# sum is no graph output: f16/bf16 10-23% faster at 112x112 to 14x14, f32 feeding another node 18-31% faster
# (2 cores, onnxruntime 1.32); slower at 7x7
CONV_MIN_SPATIAL = 196
# the largest tensors (elements) whose x - mean and a*dy are BatchNormalizations with constant vectors, which
# run on one thread (see _Fast.small_channels): where a kernel's fixed cost outweighs the threads
SMALL_TENSOR = 1 << 15
# the longest per-channel sums (elements) the small form takes in f32 (_Fast.emit_f32): onnxruntime-training's
# kernel sums in f32 too, and its error grows with the length (diff_gamma at [16, 16, 8, 8], 1,024 a channel, 2.5x
# the f64 form's; at 1,568, the 7x7 layers of batch 32, diff_beta reached 3.05e-7 of the scale over 30 seeds)
F32_SUMS_UPTO = 1024


def _cut(dims: list[int]) -> list[int]:
    """The axes a sum runs over, as rows of at most DOT_ROW_MAX elements: each dim longer than that split
    into (d / k, k), k its largest divisor up to DOT_ROW_MAX, as often as it takes (a dim without one, such
    as a large prime, stays whole), then neighbours merged from the last while their product fits."""
    cut: list[int] = []
    for d in dims:
        inner: list[int] = []
        while d > DOT_ROW_MAX:
            k = next((k for k in range(DOT_ROW_MAX, 1, -1) if d % k == 0), None)
            if k is None:
                break
            inner.insert(0, k)
            d //= k
        cut += [d, *inner]
    merged: list[int] = []
    for d in reversed(cut):
        if merged and merged[-1] * d <= DOT_ROW_MAX:
            merged[-1] *= d
        else:
            merged.append(d)
    return merged[::-1]


def _pieces(length: int) -> int | None:
    """The fewest equal rows (at most 64) of at most DOT_ROW_MAX elements ``length`` splits into."""
    return next((k for k in range(1, 65) if length % k == 0 and length // k <= DOT_ROW_MAX), None)


def emit_batch_norm_backward(b: NodeBuilder, plan: BatchNormBackwardPlan) -> None:
    """Emit nodes into ``b`` computing the requested outputs of ``plan`` (DESIGN.md section 4)."""
    _Emitter(b, plan).emit()
