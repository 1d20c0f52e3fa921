"""Lowering of onnxruntime-training's in-place update ops: InPlaceAccumulatorV2, AdamWOptimizer,
SGDOptimizerV2 (the math of their documents in ``specs/com.microsoft/``).

Each computes the updated values as new tensors; which of them the pass also returns as
``<input>.updated`` graph outputs is binding data (:mod:`opdef.in_place`). The optimizers take tensor
sequences: a Loop over ``SequenceLength(weights)`` reads the i-th tensors with SequenceAt, updates them and
appends the results with SequenceInsert to loop-carried sequences that start empty. Per-step scalars (the
learning rate, the bias corrections) are scalars computed in the loop body. The arithmetic is f32, as
onnxruntime-training's kernels compute it; a false ``update_signal`` leaves every value as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from lowering.builder import NodeBuilder
from lowering.rules import TARGETS, LoweringRequest, register_rule
from opdef.errors import LoweringError
from opdef.node import NodeInference
from opdef.types import ONNX_ELEM_TYPE, sequence_element

LOOP_CARRIES_SEQUENCES_SINCE = 13  # Loop-11's loop-carried values are tensors only


@register_rule("in_place_accumulator", targets=TARGETS)  # one form: portable ops only
def lower_in_place_accumulator(b: NodeBuilder, request: LoweringRequest) -> None:
    buffer, value = request.input("buffer"), request.input("value")
    out = request.output("buffer_out")
    if out:
        total = b.op1("Add", [buffer, value], hint="sum")
        overwrite = request.input("overwrite")
        if overwrite:  # lazy_reset_grad: the first gradient after an optimizer step replaces the buffer
            flag = b.op1("Reshape", [overwrite, b.const(np.array([], np.int64), hint="scalar_shape")], hint="flag")
            b.op1("Where", [flag, value, total], out)
        else:
            b.op1("Identity", [total], out)
    updated = request.output("updated")
    if updated:  # a scalar, as onnxruntime's kernel writes it, unless the graph declares a shape
        t = request.inference.output_types[request.inference.outputs.index(updated)]
        rank = 0 if t is None or t.shape is None else len(t.shape)
        b.op1("Identity", [b.const(np.ones((1,) * rank, bool), hint="true")], updated)


@register_rule("sgd_optimizer", targets=TARGETS)  # one form: portable ops only
def lower_sgd_optimizer(b: NodeBuilder, request: LoweringRequest) -> None:
    def step(body: NodeBuilder, w: str, tensors: dict[str, str]) -> dict[str, str]:
        return {"params_out": sgd_update(body, _scalar(body, request.input("lr"), "lr"), w, tensors["gradients"])}

    _sequence_loop(b, request, ("gradients",), ("params_out",), step)
    _flag(b, request, request.input("lr"))


@register_rule("adamw_optimizer", targets=TARGETS)  # one form: portable ops only
def lower_adamw_optimizer(b: NodeBuilder, request: LoweringRequest) -> None:
    settings = AdamW.of(request.inference)

    def step(body: NodeBuilder, w: str, tensors: dict[str, str]) -> dict[str, str]:
        # Everything the loop body uses is emitted into it (a subgraph may read the outer graph's values,
        # but the pass keeps only the outer nodes whose outputs outer nodes read); the per-step scalars are
        # a handful of scalar ops per parameter.
        lr = _scalar(body, request.input("lr"), "lr")
        scalars = settings.step_scalars(body, lr, _scalar(body, request.input("step"), "step"))
        w, m1, m2 = settings.update(body, scalars, w, tensors["gradients"], tensors["first_moments"],
                                    tensors["second_moments"])
        return {"params_out": w, "first_moments_out": m1, "second_moments_out": m2}

    _sequence_loop(b, request, ("gradients", "first_moments", "second_moments"),
                   ("params_out", "first_moments_out", "second_moments_out"), step)
    _flag(b, request, request.input("step"))


# -- the update of one tensor (the optimizers' Loop bodies and the unrolled train-step model) ------------

def sgd_update(b: NodeBuilder, lr: str, w: str, g: str) -> str:
    """``w - lr * g`` (``lr`` a scalar, or [1] against a tensor of rank 1 or more). One Sub, not an Add of
    ``(-lr) * g``: negation is exact and ``w + -y`` is ``w - y`` in IEEE arithmetic, so the same bits with one
    kernel (the Neg) fewer."""
    return b.op1("Sub", [w, b.op1("Mul", [lr, g])], hint="w")


@dataclass(frozen=True)
class AdamW:
    """AdamWOptimizer's attributes (as f32, the kernel's arithmetic) and its update of one tensor."""

    alpha: float
    beta: float
    epsilon: float
    weight_decay: float
    adam_mode: int
    correct_bias: int

    @classmethod
    def of(cls, inference: NodeInference) -> AdamW:
        attrs, binding = inference.attributes, inference.binding
        f32 = np.float32
        mode = int(attrs[binding.arg("adam_mode")])
        if mode not in (0, 1):
            raise LoweringError(f"AdamWOptimizer '{inference.node_name}': adam_mode {mode} is not 0 or 1")
        return cls(*(float(f32(attrs[binding.arg(r)])) for r in ("alpha", "beta", "epsilon", "weight_decay")),
                   mode, int(attrs[binding.arg("correct_bias")]))

    def step_scalars(self, b: NodeBuilder, lr: str, step: str, *, stacked: bool = False,
                     portable: bool = False, split: bool = False) -> StepScalars:
        """The per-step scalars of :meth:`update` for the learning rate ``lr`` and the optimizer step ``step``
        (int64): shared by every parameter of one step. ``stacked``: ``lr`` and ``step`` are [1] (what the
        train-step model is fed; [1]-shaped results broadcast against any parameter of rank 1 or more without
        changing its shape) and both bias corrections come from one Pow over [alpha, beta], one Cast, one Sub
        and two Slices instead of a Pow, Cast and Sub each: the same double pow of the same values, so the
        same bits. The onnxruntime target gives Pow the int64 step as its exponent (its Pow computes the same
        double pow as of the step cast to double, checked for steps 0..20000 and 5000 random ones up to 1e9:
        no Cast); ``portable`` keeps the Cast, a mixed-type Pow being rare outside onnxruntime. ``split``
        (stacked, not portable): the two corrections by one Split (one kernel) instead of two Slices: 9 -> 8
        kernels per step, the same values."""
        f32 = np.float32
        one = b.const(np.array(1.0, f32), hint="one")
        if not self.correct_bias:
            c1 = c2 = one
        elif stacked:
            # 1 - a^t: the power in f64, rounded to f32 once, as onnxruntime-training's kernel does
            t = step if not portable else b.op1("Cast", [step], to=TensorProto.DOUBLE)
            bases = b.const(np.array([f32(self.alpha), f32(self.beta)], np.float64), hint="bases")
            corrections = b.op1("Sub", [one, b.op1("Cast", [b.op1("Pow", [bases, t])], to=TensorProto.FLOAT)],
                                hint="corrections")
            names = [b.fresh(h) for h in ("alpha_correction", "beta_correction")]
            if split and not portable:
                if b.opset < 13:  # the sizes an attribute
                    b.op("Split", [corrections], names, hint="corrections", axis=0, split=[1, 1])
                else:
                    b.op("Split", [corrections, b.const(np.array([1, 1], np.int64), hint="sizes")], names,
                         hint="corrections", axis=0)
            else:
                # two Slices where a Split is not wanted: the portable target has none, and the train-step model's
                # per-parameter form keeps its Splits those that cut the parameters and moments
                for i, name in enumerate(names):
                    b.op1("Slice", [corrections, b.const(np.array([i], np.int64), hint="start"),
                                    b.const(np.array([i + 1], np.int64), hint="end")], name, hint="correction")
            c1, c2 = names
        else:
            t = b.op1("Cast", [step], to=TensorProto.DOUBLE)
            c1, c2 = (b.op1("Sub", [one, b.op1("Cast", [b.op1(
                          "Pow", [b.const(np.array(float(f32(x)), np.float64), hint="base"), t])],
                          to=TensorProto.FLOAT)], hint=h)
                      for x, h in ((self.alpha, "alpha_correction"), (self.beta, "beta_correction")))
        lr_corrected = lr
        if self.adam_mode == 1 and self.correct_bias:
            # lr * (sqrt(c2) / c1), in the kernel's order (lr_corrected *= sqrt(c2) / c1); without bias
            # correction the factor is sqrt(1) / 1 = 1 and lr * 1 is lr itself
            lr_corrected = b.op1("Mul", [lr, b.op1("Div", [b.op1("Sqrt", [c2]), c1])], hint="lr_corrected")
        lr_decay = b.op1("Mul", [lr, b.const(np.array(self.weight_decay, f32), hint="weight_decay")], hint="lr_decay")
        return StepScalars(lr, c1, c2, lr_corrected, lr_decay)

    def computed_fields(self) -> tuple[str, ...]:
        """The :class:`StepScalars` fields :meth:`step_table` lets a caller compute instead of the graph (the
        learning rate is fed anyway; without bias correction the corrections are the constant 1)."""
        corrections = ("alpha_correction", "beta_correction") if self.correct_bias else ()
        corrected = ("lr_corrected",) if self.correct_bias and self.adam_mode == 1 else ()
        return (*corrections, *corrected, "lr_decay")

    def step_table(self, steps: np.ndarray) -> dict[str, list[float]]:
        """The learning-rate-free parts of :meth:`step_scalars` for each of ``steps`` (int64), as Python floats
        holding f32 values: ``alpha_correction``, ``beta_correction`` and (adam_mode 1) ``ratio`` = sqrt(c2) / c1,
        so that lr_corrected is f32(lr * ratio) and lr_decay f32(lr * weight_decay), each one product of two
        f32 values, exact in a double and rounded to f32 once. The same operations on the same values as the
        graph's, so the same bits: the power is the C library's double ``pow`` (what onnxruntime's Pow calls;
        NumPy's vectorised power may not be), the rest f32 array arithmetic, correctly rounded."""
        f32 = np.float32
        table: dict[str, list[float]] = {}
        if not self.correct_bias:
            return table
        c1, c2 = (f32(1.0) - np.array([math.pow(float(f32(base)), float(t)) for t in steps.tolist()]).astype(f32)
                  for base in (self.alpha, self.beta))
        table["alpha_correction"], table["beta_correction"] = c1.tolist(), c2.tolist()
        if self.adam_mode == 1:
            table["ratio"] = (np.sqrt(c2) / c1).tolist()
        return table

    def update(self, b: NodeBuilder, scalars: StepScalars, w: str, g: str, m1: str, m2: str
               ) -> tuple[str, str, str]:
        """The updated (weight, first moment, second moment) of one tensor."""
        def c(value: float, hint: str = "c") -> str:
            return b.const(np.array(value, np.float32), hint=hint)

        lr, c1, c2, lr_decay = scalars.lr, scalars.alpha_correction, scalars.beta_correction, scalars.lr_decay
        alpha, beta, eps = self.alpha, self.beta, self.epsilon
        m1 = b.op1("Add", [b.op1("Mul", [c(alpha, "alpha"), m1]), b.op1("Mul", [c(1 - alpha), g])], hint="m1")
        g2 = b.op1("Mul", [b.op1("Mul", [c(1 - beta), g]), g])
        m2 = b.op1("Add", [b.op1("Mul", [c(beta, "beta"), m2]), g2], hint="m2")
        if self.adam_mode == 0:  # PyTorch: decay first, then the bias-corrected step
            w = b.op1("Sub", [w, b.op1("Mul", [w, lr_decay])], hint="decayed")
            denom = b.op1("Add", [b.op1("Sqrt", [b.op1("Div", [m2, c2])]), c(eps, "epsilon")])
            w = b.op1("Sub", [w, b.op1("Div", [b.op1("Mul", [lr, m1]), b.op1("Mul", [c1, denom])])], hint="w")
        else:  # Hugging Face: the learning rate corrected, decay last
            denom = b.op1("Add", [b.op1("Sqrt", [m2]), c(eps, "epsilon")])
            w = b.op1("Sub", [w, b.op1("Div", [b.op1("Mul", [scalars.lr_corrected, m1]), denom])], hint="stepped")
            # kept when weight_decay is 0: onnxruntime-training's kernel computes it too (w - (lr * 0) * w turns
            # an infinite weight into NaN and -0 into +0)
            w = b.op1("Sub", [w, b.op1("Mul", [lr_decay, w])], hint="w")
        return w, m1, m2


@dataclass(frozen=True)
class StepScalars:
    """:meth:`AdamW.step_scalars`: the learning rate, the bias corrections 1 - alpha^t and 1 - beta^t, the
    learning rate corrected by them (adam_mode 1; the learning rate itself otherwise) and lr * weight_decay."""

    lr: str
    alpha_correction: str
    beta_correction: str
    lr_corrected: str
    lr_decay: str


# -- shared pieces ---------------------------------------------------------------------------------

def _scalar(b: NodeBuilder, one_element: str, hint: str) -> str:
    """A one-element tensor ([1] in the optimizer model) as a scalar: it broadcasts to any parameter's
    shape without changing it, rank-0 parameters included."""
    return b.op1("Reshape", [one_element, b.const(np.array([], np.int64), hint="scalar_shape")], hint=hint)


def _flag(b: NodeBuilder, request: LoweringRequest, shaped_like: str) -> None:
    """The update flag: ``update_signal`` when given, else true; shaped like ``shaped_like`` (step or lr)."""
    updated = request.output("updated")
    if not updated:
        return
    signal = request.input("update_signal")
    shape = b.op1("Shape", [shaped_like], hint="flag_shape")
    if signal:
        b.op1("Reshape", [signal, shape], updated)
    else:
        b.op1("ConstantOfShape", [shape], updated, value=helper.make_tensor("true", TensorProto.BOOL, [1], [True]))


def _sequence_loop(b: NodeBuilder, request: LoweringRequest, read_roles: tuple[str, ...],
                   out_roles: tuple[str, ...], step) -> None:
    """A Loop over the parameters: ``step(body, w_i, {role: tensor_i})`` returns the updated tensors by
    output role, each appended to its loop-carried sequence; the final sequences are the outputs."""
    outputs = [request.output(r) for r in out_roles]
    if not any(outputs):
        return
    if b.opset < LOOP_CARRIES_SEQUENCES_SINCE:
        raise LoweringError(f"{request.inference.op_type} '{request.inference.node_name}': updating tensor sequences "
                            f"needs default opset {LOOP_CARRIES_SEQUENCES_SINCE} or newer (a Loop carries sequences "
                            f"from then on); the model imports opset {b.opset}")
    params = request.input("params")
    elem = _sequence_elem_type(request)
    seq_type = helper.make_sequence_type_proto(helper.make_tensor_type_proto(elem, None))
    starts = [b.op1("SequenceEmpty", [], hint="empty", dtype=elem) for _ in out_roles]
    count = b.op1("SequenceLength", [params], hint="count")

    body = onnx.GraphProto(name=b.fresh("update_each_parameter"))
    sub = NodeBuilder(b.opset, b.fresh("body"), b.is_taken, into=body.node)
    index, cond = sub.fresh("index"), sub.fresh("cond")
    carried = [sub.fresh("carried") for _ in out_roles]
    body.input.extend([helper.make_tensor_value_info(index, TensorProto.INT64, []),
                       helper.make_tensor_value_info(cond, TensorProto.BOOL, []),
                       *(helper.make_value_info(n, seq_type) for n in carried)])
    w = sub.op1("SequenceAt", [params, index], hint="w")
    tensors = {r: sub.op1("SequenceAt", [request.input(r), index], hint=r) for r in read_roles}
    new = step(sub, w, tensors)
    signal = request.input("update_signal")
    if signal:  # a false signal keeps every value: Where picks the old tensor
        flag = sub.op1("Reshape", [signal, sub.const(np.array([], np.int64), hint="scalar_shape")], hint="signal")
        old = {"params_out": w, "first_moments_out": tensors.get("first_moments"),
               "second_moments_out": tensors.get("second_moments")}
        new = {r: sub.op1("Where", [flag, new[r], old[r]], hint="kept") for r in out_roles}
    cond_out = sub.op1("Identity", [cond], hint="cond_out")
    results = [sub.op1("SequenceInsert", [seq, new[r]], hint="appended") for seq, r in zip(carried, out_roles,
                                                                                            strict=True)]
    body.output.extend([helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []),
                        *(helper.make_value_info(n, seq_type) for n in results)])
    final = [o or b.fresh("unused") for o in outputs]
    # cond given (true) rather than omitted: onnx.reference's Loop runs no iteration without one
    keep_going = b.const(np.array(True), hint="true")
    b.op("Loop", [count, keep_going, *starts], final, hint="update_loop", body=body)


def _sequence_elem_type(request: LoweringRequest) -> int:
    """The parameters' element type, from the spec's ``seq(<type>)`` for the weights (one type there)."""
    schema = request.inference.schema
    arg = schema.input(request.inference.binding.arg("params"))
    allowed = {sequence_element(t) for t in schema.type_constraint_map.get(arg.type_var or "", ())}
    if len(allowed) != 1 or next(iter(allowed)) not in ONNX_ELEM_TYPE:
        raise LoweringError(f"{schema.name}: the spec's {arg.name} type must be one seq(<type>), not {allowed}")
    return ONNX_ELEM_TYPE[allowed.pop()]
