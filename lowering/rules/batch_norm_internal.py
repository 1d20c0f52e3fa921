"""Lowering of onnxruntime-training's ``com.microsoft::BatchNormInternal`` (batch-norm forward).

``emit_batch_norm_internal(b, plan)`` emits the math of ``specs/com.microsoft/BatchNormInternal.rst``:
batch mean, biased batch variance by two passes (centre first, then sum the squares: no
``E[x^2] - E[x]^2`` cancellation), ``Y``, the running-statistics update and the saved statistics. In inference
mode (``training_mode`` 0) ``Y`` is onnxruntime's BatchNormalization (the native kernel itself), or on the
portable target ``X * a + (B - mean * a)`` with ``a = scale / sqrt(var + epsilon)``, as that kernel computes it.
Only the outputs the plan names are computed. f16/bf16 are cast up to f32 once at the top and rounded
once at the end. The channel axis is axis 1.

``lower_batch_norm_internal`` is the rule registered under ``"batch_norm_internal"``; it turns a verified
node (roles from ``specs/bindings.json``) into a plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from lowering.builder import NodeBuilder
from lowering.emit_common import Emitter, compute_type
from lowering.rules import TARGETS, LoweringRequest, register_rule
from opdef.errors import LoweringError
from opdef.rules.batch_norm_internal import INPUT_ROLES

_FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)


@dataclass(frozen=True)
class BatchNormInternalPlan:
    x: str
    scale: str
    bias: str
    input_mean: str
    input_var: str
    # outputs: the value name to write, None = not computed
    y: str | None
    running_mean: str | None
    running_var: str | None
    saved_mean: str | None
    saved_inv_std: str | None
    training: bool  # training_mode != 0: batch statistics; else input_mean / input_var
    epsilon: float
    momentum: float
    io_type: int  # element type of X, scale, B, Y
    stat_type: int  # element type of input_mean, input_var and the statistics outputs
    rank: int | None  # None: unknown (viewed as [N, C, -1])
    x_shape: tuple | None = None  # static dims (int | str | None), used to fold 1/M into a constant
    portable: bool = False  # the portable target: no Conv with runtime weights (Y as Mul + Add)


class _Emitter(Emitter):
    def __init__(self, b: NodeBuilder, plan: BatchNormInternalPlan) -> None:
        super().__init__(b, compute_type(plan.io_type, plan.stat_type))
        self.p = plan

    def inv_count(self, x: str) -> str:
        """1/M (elements per channel): a constant when the reduced dims are static, else Size(x) / C.

        C is read from x's (compute-type) shape: onnxruntime has no Size kernel for bf16.
        """
        p = self.p
        if p.x_shape is not None and p.rank is not None and len(p.x_shape) == p.rank:
            reduced = [p.x_shape[a] for a in range(p.rank) if a != 1]
            if all(isinstance(d, int) for d in reduced):
                return self.scalar(1.0 / max(1, math.prod(reduced)), "inv_m")
        channels = self.b.op1("Gather", [self.b.op1("Shape", [x]), self.ints(1, "channel_axis")], axis=0)
        count = self.b.op1("Div", [self.b.op1("Size", [x]), channels])
        return self.b.op1("Reciprocal", [self.b.op1("Cast", [count], to=self.ct)])

    def kernel_applies(self) -> bool:
        """BatchNormalization in training mode: opset 14 on, the onnxruntime target, f32 computation."""
        return not self.p.portable and self.ct == TensorProto.FLOAT and self.b.opset >= 14

    def staged_shape(self) -> tuple[int, int, int] | None:
        """(N, C, M/N) when X's dims are static, the computation f32 and the target takes Conv (onnxruntime has
        no f64 Conv): the sums over a channel then go
        in stages (see :meth:`staged_sum`), else None."""
        p = self.p
        if p.portable or self.ct != TensorProto.FLOAT or p.x_shape is None or p.rank is None or p.rank < 3:
            return None
        if len(p.x_shape) != p.rank:
            return None
        if not all(isinstance(d, int) and d > 0 for d in p.x_shape):
            return None
        return p.x_shape[0], p.x_shape[1], math.prod(p.x_shape[2:])

    def staged_sum(self, op_type: str, x: str, staged: tuple[int, int, int], view_shape: list[int],
                   inv_count: str) -> str:
        """``op_type`` (ReduceSum or ReduceSumSquare) over every axis but 1, times ``inv_count``, as
        [1, C, 1, ...]: first over the contiguous last axis of an [N, C, M/N] view, then over N by a MatMul
        with a ones row. onnxruntime's reductions that keep an inner axis have no fast path (ReduceSumSquare
        over axes 0, 2, 3 of [32, 16, 32, 32]: 1.9 ms in the ResNet step); the staged sums are no less
        accurate (shorter sums)."""
        b = self.b
        n, c, rest = staged
        view = b.op1("Reshape", [x, self.ints([n, c, rest], "rows")])
        if op_type == "ReduceSumSquare":  # ReduceSumSquare over the last axis took 0.43 ms on [32, 16, 1024],
            op_type, view = "ReduceSum", b.op1("Mul", [view, view])  # Mul and ReduceSum 0.15
        rows = self.reduce(op_type, view, (2,), keepdims=0)
        total = b.op1("MatMul", [b.const(np.ones((1, n), self.np_ct), hint="ones"), rows])  # [1, C]
        return b.op1("Reshape", [b.op1("Mul", [total, inv_count]), self.ints([1, *view_shape], "stat_view")])

    # -- the lowering ----------------------------------------------------------------------------
    def emit(self) -> None:
        p, b = self.p, self.b
        for what, t in (("X", p.io_type), ("input_mean", p.stat_type)):
            if t not in _FLOAT_TYPES:
                raise LoweringError(f"BatchNormInternal: {what} has element type {t}; expected a float type")
        if p.rank is not None and p.rank < 2:
            raise LoweringError(f"BatchNormInternal: X has rank {p.rank}; expected 2 or more")
        wants_stats = any(n is not None for n in (p.running_mean, p.running_var, p.saved_mean, p.saved_inv_std))
        if not p.training and wants_stats:
            raise LoweringError("BatchNormInternal: training_mode 0 produces Y only")
        if p.y is None and not wants_stats:
            return

        x = self.up(p.x, p.io_type)
        if not p.training and not p.portable and self.ct == TensorProto.FLOAT and b.opset >= 9 \
                and p.rank is not None:
            # inference mode: onnxruntime's BatchNormInternal kernel is its BatchNormalization kernel, so Y is the
            # native kernel's bits, in one pass instead of Sub, Mul and Add (the centred form had 1.7x the
            # kernel's error on the recorded case: tests/test_accuracy_vs_native.py)
            y = b.op1("BatchNormalization", [x, *(self.up(n, t) for n, t in (
                (p.scale, p.io_type), (p.bias, p.io_type), (p.input_mean, p.stat_type), (p.input_var, p.stat_type)))],
                None if p.io_type != self.ct else p.y, epsilon=p.epsilon)
            if p.io_type != self.ct:
                b.op1("Cast", [y], p.y, to=p.io_type)
            return
        restore = None
        if p.rank is None:
            # [N, C, ...] viewed as [N, C, -1]: reduce over axes 0 and 2, per-channel vectors as [C, 1]
            restore = b.op1("Shape", [p.x])
            x = b.op1("Reshape", [x, self.ints([0, 0, -1])])
            axes, view_shape = (0, 2), [-1, 1]
        else:
            axes = (0, *range(2, p.rank))
            view_shape = [-1] + [1] * (p.rank - 2)

        def per_channel(name: str, elem_type: int) -> str:
            v = self.up(name, elem_type)
            return v if len(view_shape) == 1 else b.op1("Reshape", [v, self.ints(view_shape)])

        eps = self.scalar(p.epsilon, "epsilon")
        kernel = p.training and p.y is not None and self.kernel_applies()
        staged = self.staged_shape() if p.training and not kernel else None
        if kernel:
            # onnxruntime's BatchNormInternal kernel is its BatchNormalization kernel: run that in training
            # mode with zero running statistics and momentum 0, so its "running" outputs are the batch mean
            # and (biased) variance themselves; Y is the native kernel's, in one pass pair (the staged form
            # below took ~5x longer on [32, 16, 32, 32])
            # Its outputs 1 and 2 alias inputs 3 and 4 (the kernel writes the running statistics in place, even
            # into a buffer another node reads later), so those must be buffers of this node alone, computed each
            # run: not constants (folded into initializers, which keep a NaN batch's statistics for every later
            # run; ConstantOfShape vectors broke the recorded train steps: 1e-2 off after one step), nor one tensor
            # for both (tests/test_bn_internal_running_buffers.py). They are scale * 0 and scale * 0.5
            # (finite wherever scale is; any finite value vanishes times momentum 0; two constants, so that no
            # common-subexpression pass merges them; Mul by 1 would be removed as a no-op): two kernels, where
            # X's first element per channel times scale took four (Slice, Reshape, Mul, Mul)
            scale = self.up(p.scale, p.io_type)
            stats_in = [b.op1("Mul", [scale, self.scalar(v, h)]) for v, h in ((0.0, "zero"), (0.5, "half"))]
            y = b.fresh("y") if restore is not None or p.io_type != self.ct else p.y
            # the batch statistics are [C] already: saved_mean is the kernel's output itself (same type)
            direct = p.saved_mean if p.saved_mean is not None and p.stat_type == self.ct else None
            _, mean, variance = b.op("BatchNormalization", [x, scale, self.up(p.bias, p.io_type), *stats_in],
                                     [y, direct or b.fresh("batch_mean"), b.fresh("batch_variance")],
                                     epsilon=p.epsilon, momentum=0.0, training_mode=1)
            if restore is not None:
                y = b.op1("Reshape", [y, restore], None if p.io_type != self.ct else p.y)
            if p.io_type != self.ct:
                b.op1("Cast", [y], p.y, to=p.io_type)
            centred = None
        elif staged is not None:
            inv_m = self.inv_count(x)
            mean = self.staged_sum("ReduceSum", x, staged, view_shape, inv_m)
            centred = b.op1("Sub", [x, mean])
            variance = self.staged_sum("ReduceSumSquare", centred, staged, view_shape, inv_m)
        elif p.training:
            mean = self.reduce("ReduceMean", x, axes)  # keepdims: [1, C, 1, ...]
            centred = b.op1("Sub", [x, mean])
            variance = b.op1("Mul", [self.reduce("ReduceSumSquare", centred, axes),
                                     self.inv_count(x)])
        else:
            mean = per_channel(p.input_mean, p.stat_type)
            centred = None  # inference: Y = X * a + (B - mean * a), as onnxruntime's kernel computes it
            variance = per_channel(p.input_var, p.stat_type)
        kernel_inv_std = kernel and p.saved_inv_std is not None and p.stat_type == self.ct
        inv_std = b.op1("Reciprocal", [b.op1("Sqrt", [b.op1("Add", [variance, eps])])],
                        p.saved_inv_std if kernel_inv_std else None)

        if p.y is not None and not kernel:
            a = b.op1("Mul", [inv_std, per_channel(p.scale, p.io_type)])
            if staged is not None and p.rank > 2:
                # Y = centred * a + B as a depthwise 1x1 Conv with bias: one two-pass kernel instead of Mul and
                # Add (four passes)
                weights = b.op1("Reshape", [a, self.ints([-1] + [1] * (p.rank - 1), "depthwise_kernel")])
                bias = b.op1("Reshape", [self.up(p.bias, p.io_type), self.ints([-1], "flat")])
                conv = {"group": staged[1], "kernel_shape": [1] * (p.rank - 2)}
                if p.io_type == self.ct:
                    b.op1("Conv", [centred, weights, bias], p.y, **conv)
                else:
                    b.op1("Cast", [b.op1("Conv", [centred, weights, bias], **conv)], p.y, to=p.io_type)
                y_inputs = None
            else:
                y_inputs = [b.op1("Mul", [centred, a]), per_channel(p.bias, p.io_type)] if centred is not None else [
                    b.op1("Mul", [x, a]), b.op1("Sub", [per_channel(p.bias, p.io_type), b.op1("Mul", [mean, a])])]
            if y_inputs is None:
                pass
            elif restore is None:
                self.finish("Add", y_inputs, p.y, p.io_type)
            else:
                self.finish("Reshape", [b.op1("Add", y_inputs), restore], p.y, p.io_type)

        flat = self.ints([-1]) if wants_stats else None
        if p.saved_mean is not None and mean != p.saved_mean:
            self.finish("Reshape", [mean, flat], p.saved_mean, p.stat_type)
        if p.saved_inv_std is not None and not kernel_inv_std:
            self.finish("Reshape", [inv_std, flat], p.saved_inv_std, p.stat_type)
        if p.running_mean is None and p.running_var is None:
            return
        keep = self.scalar(p.momentum, "momentum")
        # f32: 1 - momentum in f32, as the native kernel computes it (not the decimal 1 - momentum rounded once,
        # which drifted the running statistics by about an ulp per step); f64 (no native kernel) in f64
        one_minus = 1.0 - p.momentum if self.ct == TensorProto.DOUBLE else np.float32(1) - np.float32(p.momentum)
        take = self.scalar(float(one_minus), "one_minus_momentum")
        for running, old, batch in ((p.running_mean, p.input_mean, mean), (p.running_var, p.input_var, variance)):
            if running is None:
                continue
            batch_flat = batch if kernel else b.op1("Reshape", [batch, flat])  # the kernel's are [C]
            kept = b.op1("Mul", [self.up(old, p.stat_type), keep])
            self.finish("Add", [kept, b.op1("Mul", [batch_flat, take])], running, p.stat_type)


def emit_batch_norm_internal(b: NodeBuilder, plan: BatchNormInternalPlan) -> None:
    """Emit into ``b`` the nodes computing the outputs ``plan`` names (spec: BatchNormInternal.rst)."""
    _Emitter(b, plan).emit()


# -- the registered rule -----------------------------------------------------------------------------

def _attribute(request: LoweringRequest, role: str) -> object:
    inference = request.inference
    name = inference.binding.arg(role)
    if name is None:
        raise LoweringError(f"{inference.op_type}: bindings.json names no attribute for role {role!r}")
    value = inference.attributes.get(name)
    return inference.schema.attribute(name).default if value is None else value


def _input_type(request: LoweringRequest, role: str):
    inference = request.inference
    return inference.input_types[inference.schema.input_index(inference.binding.arg(role))]


# The portable target: ReduceMean/ReduceSum, elementwise arithmetic, Reshape and Cast only (no
# BatchNormalization, no Conv). The onnxruntime target with static dims: staged sums and Y as a Conv.
@register_rule("batch_norm_internal", targets=TARGETS)
def lower_batch_norm_internal(b: NodeBuilder, request: LoweringRequest) -> None:
    """BatchNormInternal -> standard ONNX; outputs nobody consumes are not computed."""
    inference = request.inference
    inputs = {role: request.input(role) for role in INPUT_ROLES}
    missing = [role for role, name in inputs.items() if name is None]
    if missing:
        raise LoweringError(f"{inference.op_type} '{inference.node_name}': inputs for {missing} are missing")
    x_type, stat_type = _input_type(request, "src"), _input_type(request, "input_mean")
    if x_type is None or x_type.elem_type is None or stat_type is None or stat_type.elem_type is None:
        raise LoweringError(f"{inference.op_type} '{inference.node_name}': the element types of X and "
                            "input_mean must be known to lower it")
    epsilon = inference.epsilon if inference.epsilon is not None else _attribute(request, "epsilon")
    plan = BatchNormInternalPlan(
        x=inputs["src"], scale=inputs["gamma"], bias=inputs["beta"],
        input_mean=inputs["input_mean"], input_var=inputs["input_var"],
        y=request.output("dst"), running_mean=request.output("running_mean"),
        running_var=request.output("running_var"), saved_mean=request.output("saved_mean"),
        saved_inv_std=request.output("saved_inv_std"),
        training=int(_attribute(request, "training_mode")) != 0,
        epsilon=float(epsilon), momentum=float(_attribute(request, "momentum")),
        io_type=x_type.elem_type, stat_type=stat_type.elem_type,
        rank=inference.rank if inference.rank is not None else x_type.rank,
        x_shape=x_type.shape, portable=request.options.target == "portable",
    )
    emit_batch_norm_internal(b, plan)
