"""Evaluate a whole model that still contains the project's custom nodes, with float64 semantics for them.

``onnx.reference.ReferenceEvaluator`` runs the standard ops; every op of the registry gets an ``OpRun``
class generated from its schema and binding (DESIGN.md section 4): node inputs/outputs are mapped to
canonical roles by the schema's argument positions, attribute defaults come from the schema, the layout
rule and statistics mode from the binding, and the math is :mod:`runtime.reference` in float64.
This is the oracle ``oplower lower --verify`` and ``oplower run`` compare the lowered graph against.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from onnx.reference.ops.op_max_pool import MaxPool as _ReferenceMaxPool

from opdef import in_place
from opdef.errors import ModelError, OplowerError, RuntimeFailure, VerificationError
from opdef.graphs import all_nodes
from opdef.registry import Entry, Registry
from opdef.rules.pool_grad import pool_parameters
from runtime import (
    reference,
    reference_activations,
    reference_normalization,
    reference_recurrent,
    reference_shape,
    reference_training,
    reference_updates,
)

SINGLE_OUTPUT_MODES = ("spec", "upstream")
# An omitted output ("") of a custom node is renamed to this prefix + a number on the evaluator's copy:
# the evaluator stores every result under its output name, and "" is its marker of an omitted input.
_OMITTED = "oplower::omitted::"
# The evaluator's copy gives a node whose output shape the graph decides (the pool gradients' dX, an update
# flag's rank) this attribute: the declared shape of that output, which an OpRun cannot see otherwise.
_DECLARED = "oplower_declared_shape"
_DECLARED_OUTPUT = {"max_pool_grad": "dX", "average_pool_grad": "dX", "in_place_accumulator": "updated"}
# ... and, to a custom node a standard op reads from (a training graph's forward BatchNormInternal feeding
# a Relu), this one: its results are rounded to their types even in exact mode, since onnx.reference's
# standard ops refuse mixed float64 / float32 inputs. Results only graph outputs read stay float64. Its value
# is each output's element type as onnx's shape inference gives it (0: unknown, then the rule's own rounding,
# which follows an input: float64 when that input is another custom node's exact result).
_ROUNDED = "oplower_rounded"


class _Node:
    """One custom node's arguments by role: what every rule's evaluation starts from."""

    def __init__(self, entry: Entry, op: OpRun, inputs: tuple, attrs: Mapping[str, Any]) -> None:
        self.entry, self.schema, self.binding = entry, entry.schema, entry.binding
        self.node = op.onnx_node
        self.label = self.node.name or (self.node.output[0] if self.node.output else "?")
        self.inputs = inputs
        self.attrs = attrs

    def fail(self, message: str) -> VerificationError:
        return VerificationError(self.binding.domain, self.binding.op_type, self.label, message)

    def _value(self, role: str, required: bool) -> Any:
        name = self.binding.arg(role)
        index = self.schema.input_index(name) if name and name in {a.name for a in self.schema.inputs} else None
        value = self.inputs[index] if index is not None and index < len(self.inputs) else None
        if value is None and required:
            raise self.fail(f"input {name or role!r} ({role}) is missing")
        return value

    def input(self, role: str, required: bool = True) -> np.ndarray | None:
        value = self._value(role, required)
        return None if value is None else np.asarray(value)

    def sequence(self, role: str) -> list[np.ndarray]:
        """A tensor-sequence input (the evaluator passes sequences as lists)."""
        return [np.asarray(v) for v in self._value(role, True)]

    def has_input(self, role: str) -> bool:
        return self.binding.arg(role) is not None

    def output_index(self, role: str) -> int | None:
        """The node's output position of a role, when the node requests that output."""
        name = self.binding.arg(role)
        if not name or name not in {a.name for a in self.schema.outputs}:
            return None
        index = self.schema.output_index(name)
        if index >= len(self.node.output) or not self.node.output[index]:
            return None
        return None if self.node.output[index].startswith(_OMITTED) else index

    def attribute(self, role: str, fallback: Any = None) -> Any:
        """The attribute bound to a role (or named ``role``): the node's value, else the schema's default."""
        return self.attribute_named(self.binding.arg(role) or role, fallback)

    def attribute_named(self, name: str, fallback: Any = None) -> Any:
        value = self.attrs.get(name)
        if value is None:
            try:
                value = self.schema.attribute(name).default
            except KeyError:
                value = None
        if isinstance(value, bytes):
            value = value.decode("utf-8")
        return fallback if value is None else value

    def results(self, values: Mapping[str, tuple[Any, np.dtype | None]]) -> tuple:
        """Outputs in the node's order: {role: (float64 value, dtype to round to or None)}; a sequence is a
        list of arrays, rounded by the caller (dtype None)."""
        out: list[Any] = [np.empty(0)] * len(self.node.output)  # placeholders for omitted outputs
        for role, (value, dtype) in values.items():
            index = self.output_index(role)
            if index is not None:
                out[index] = value if dtype is None else value.astype(dtype)
        return tuple(out)


def _batch_norm_backward(n: _Node, exact: bool, single_output: str) -> tuple:
    binding = n.binding
    src, diff_dst, mean = n.input("src"), n.input("diff_dst"), n.input("mean")
    stat_role = binding.stat_input if n.has_input(binding.stat_input) else "variance"
    stat = n.input(stat_role)
    gamma = n.input("gamma", required=False)
    wanted = [r for r in ("diff_src", "diff_gamma", "diff_beta") if n.output_index(r) is not None]
    requested_params = any(n.output_index(r) is not None for r in ("diff_gamma", "diff_beta"))
    statistics = binding.statistics
    if n.entry.binding.paired_param_grads and not requested_params:
        gamma = None  # the spec: gamma is ignored when neither parameter gradient is requested
        if single_output == "upstream":
            statistics = "frozen"
    rank = src.ndim
    if binding.layout == "stats_broadcast":
        if mean.ndim != rank:
            raise n.fail(f"mean has rank {mean.ndim}; expected the input's rank {rank} (statistics keep the rank)")
        reduce_axes = tuple(a for a in range(rank) if mean.shape[a] == 1)
    else:
        if rank < 2:
            raise n.fail(f"src has rank {rank}; expected 2 or more")
        channel_axis = 1
        if binding.layout == "data_format":
            data_format = str(n.attribute_named(binding.layout_attribute)).upper()  # default: the schema's
            channel_axis = 1 if data_format == "NCX" else rank - 1
        reduce_axes = tuple(a for a in range(rank) if a != channel_axis)
    epsilon = n.attribute("epsilon")
    if epsilon is None:
        raise n.fail("no epsilon")
    try:
        grads = reference.batch_norm_backward(src, diff_dst, mean, stat, gamma, epsilon=float(epsilon),
                                              reduce_axes=reduce_axes, statistics=statistics,
                                              stat_input=binding.stat_input,
                                              outputs=wanted)
    except ValueError as exc:
        raise n.fail(str(exc)) from None
    param_dtype = (gamma if gamma is not None else mean).dtype
    dtypes = {"diff_src": src.dtype, "diff_gamma": param_dtype, "diff_beta": param_dtype}
    return n.results({role: (value, None if exact else dtypes[role]) for role, value in grads.items()})


def _batch_norm_internal(n: _Node, exact: bool, single_output: str) -> tuple:
    del single_output
    x, scale, bias = n.input("src"), n.input("gamma"), n.input("beta")
    input_mean, input_var = n.input("input_mean"), n.input("input_var")
    values = {role: n.attribute(role) for role in ("epsilon", "momentum", "training_mode")}  # schema defaults
    missing = [role for role, value in values.items() if value is None]
    if missing:
        raise n.fail(f"no value and no default for {', '.join(missing)}")
    epsilon, momentum = float(values["epsilon"]), float(values["momentum"])
    training = int(values["training_mode"]) != 0
    if x.ndim < 2:
        raise n.fail(f"X has rank {x.ndim}; expected 2 or more")
    try:
        values = reference.batch_norm_internal(x, scale, bias, input_mean, input_var, epsilon=epsilon,
                                               momentum=momentum, training=training)
    except ValueError as exc:
        raise n.fail(str(exc)) from None
    roles = {"Y": "dst", "running_mean": "running_mean", "running_var": "running_var",
             "saved_mean": "saved_mean", "saved_inv_std": "saved_inv_std"}
    stat_dtype = input_mean.dtype
    return n.results({roles[k]: (v, None if exact else (x.dtype if k == "Y" else stat_dtype))
                      for k, v in values.items()})


RULES = {"batch_norm_backward": _batch_norm_backward, "batch_norm_internal": _batch_norm_internal}


# -- onnxruntime-training's gradient ops (runtime.reference_training); the pool gradients' dX shape is the
# -- graph's declared one (_DECLARED, set by _prepared_copy), as onnxruntime's kernels take it

def _rounded(n: _Node, exact: bool, values: Mapping[str, np.ndarray], dtype: np.dtype) -> tuple:
    return n.results({role: (value, None if exact else dtype) for role, value in values.items()})


def _relu_grad(n: _Node, exact: bool, single_output: str) -> tuple:
    dy = n.input("dY")
    return _rounded(n, exact, {"dX": reference_training.relu_grad(dy, n.input("X"))}, dy.dtype)


def _sigmoid_grad(n: _Node, exact: bool, single_output: str) -> tuple:
    dy = n.input("dY")
    return _rounded(n, exact, {"dX": reference_training.sigmoid_grad(dy, n.input("Y"))}, dy.dtype)


def _div_grad(n: _Node, exact: bool, single_output: str) -> tuple:
    dy = n.input("dY")
    da, db = reference_training.div_grad(dy, n.input("A"), n.input("B"))
    return _rounded(n, exact, {"dA": da, "dB": db}, dy.dtype)


def _scale(n: _Node, exact: bool, single_output: str) -> tuple:
    values = n.input("input")
    result = reference_training.scale(values, n.input("scale"), int(n.attribute("scale_down", 0)))
    return _rounded(n, exact, {"output": result}, values.dtype)


def _conv_grad(n: _Node, exact: bool, single_output: str) -> tuple:
    dy, x, w = n.input("dY"), n.input("X"), n.input("W")
    spatial = x.ndim - 2
    pads = n.attribute("pads") if str(n.attribute("auto_pad", "NOTSET")) != "VALID" else [0] * (2 * spatial)
    dx, dw, db = reference_training.conv_grad(dy, x, w, group=int(n.attribute("group", 1)),
                                              strides=n.attribute("strides"), dilations=n.attribute("dilations"),
                                              pads=pads)
    return _rounded(n, exact, {"dX": dx, "dW": dw, "dB": db}, dy.dtype)


def _softmax_cross_entropy_loss_grad(n: _Node, exact: bool, single_output: str) -> tuple:
    log_prob = n.input("log_prob")
    ignore_index = n.attribute("ignore_index")
    d_logits = reference_training.softmax_cross_entropy_loss_grad(
        n.input("dY"), log_prob, n.input("label"), n.input("weight", required=False),
        reduction=str(n.attribute("reduction", "mean")),
        ignore_index=None if ignore_index is None else int(ignore_index))
    return _rounded(n, exact, {"d_logits": d_logits}, log_prob.dtype)


def _declared_shape(n: _Node) -> tuple[int, ...] | None:
    """The declared shape of the node's _DECLARED_OUTPUT role, when the graph gives a static one."""
    value = n.attrs.get(_DECLARED)
    return None if value is None else tuple(int(d) for d in value)


def _pool_dx_shape(n: _Node) -> tuple[int, ...]:
    shape = _declared_shape(n)
    if shape is None:
        raise n.fail("the graph declares no static shape for dX (its spatial dims are not computable from dY)")
    return shape


def _max_pool_grad(n: _Node, exact: bool, single_output: str) -> tuple:
    dy = n.input("dY")
    dx = reference_training.max_pool_grad(dy, n.input("Indices"), _pool_dx_shape(n))
    return _rounded(n, exact, {"dX": dx}, dy.dtype)


def _average_pool_grad(n: _Node, exact: bool, single_output: str) -> tuple:
    dy = n.input("dY")
    shape = _pool_dx_shape(n)
    try:
        params = pool_parameters({k: n.attribute_named(k) for k in ("kernel_shape", "strides", "dilations", "pads",
                                                                    "auto_pad", "count_include_pad")},
                                 len(shape) - 2)
    except ValueError as exc:
        raise n.fail(str(exc)) from None
    if params.kernel_shape is None:
        raise n.fail("kernel_shape is missing")
    dx = reference_training.average_pool_grad(dy, shape, params.kernel_shape, params.strides, params.pads,
                                              int(params.count_include_pad))
    return _rounded(n, exact, {"dX": dx}, dy.dtype)


RULES |= {"relu_grad": _relu_grad, "sigmoid_grad": _sigmoid_grad, "div_grad": _div_grad, "scale": _scale,
          "conv_grad": _conv_grad, "softmax_cross_entropy_loss_grad": _softmax_cross_entropy_loss_grad,
          "max_pool_grad": _max_pool_grad, "average_pool_grad": _average_pool_grad}


# -- onnxruntime-training's in-place update ops (runtime.reference_updates): their results; the
# -- '<input>.updated' graph outputs are added by _prepared_copy (opdef.in_place), as by the lowering

def _flag(value: bool, shape: tuple[int, ...]) -> np.ndarray:
    return np.full(shape, value, dtype=bool)


def _optional_bool(n: _Node, role: str) -> bool | None:
    value = n.input(role, required=False) if n.has_input(role) else None
    return None if value is None or value.size == 0 else bool(value.reshape(-1)[0])


def _in_place_accumulator(n: _Node, exact: bool, single_output: str) -> tuple:
    buffer = n.input("buffer")
    flag, new = reference_updates.in_place_accumulator(buffer, n.input("value"), _optional_bool(n, "overwrite"))
    shape = _declared_shape(n) or ()
    return n.results({"updated": (_flag(flag, shape), None),
                      "buffer_out": (new, None if exact else buffer.dtype)})


def _rounded_list(values: list[np.ndarray], like: list[np.ndarray], exact: bool) -> list[np.ndarray]:
    return values if exact else [v.astype(w.dtype) for v, w in zip(values, like, strict=True)]


def _sgd_optimizer(n: _Node, exact: bool, single_output: str) -> tuple:
    lr = n.input("lr")
    weights = n.sequence("params")
    flag, new = reference_updates.sgd_optimizer(float(lr.reshape(-1)[0]), weights, n.sequence("gradients"),
                                                _optional_bool(n, "update_signal"))
    return n.results({"updated": (_flag(flag, lr.shape), None),
                      "params_out": (_rounded_list(new, weights, exact), None)})


def _adamw_optimizer(n: _Node, exact: bool, single_output: str) -> tuple:
    step = n.input("step")
    weights, m1, m2 = (n.sequence(r) for r in ("params", "first_moments", "second_moments"))
    f32 = np.float32  # the graph stores the hyper-parameters as float attributes
    hyper = {r: float(f32(n.attribute(r))) for r in ("alpha", "beta", "epsilon", "weight_decay")}
    flag, w, new_m1, new_m2 = reference_updates.adamw_optimizer(
        float(n.input("lr").reshape(-1)[0]), int(step.reshape(-1)[0]), weights, n.sequence("gradients"), m1, m2,
        **hyper, adam_mode=int(n.attribute("adam_mode")), correct_bias=int(n.attribute("correct_bias")),
        update_signal=_optional_bool(n, "update_signal"))
    return n.results({"updated": (_flag(flag, step.shape), None),
                      "params_out": (_rounded_list(w, weights, exact), None),
                      "first_moments_out": (_rounded_list(new_m1, m1, exact), None),
                      "second_moments_out": (_rounded_list(new_m2, m2, exact), None)})


RULES |= {"in_place_accumulator": _in_place_accumulator, "sgd_optimizer": _sgd_optimizer,
          "adamw_optimizer": _adamw_optimizer}


# -- onnxruntime-training's softmax and normalization ops (runtime.reference_normalization); the binding's
# -- options say log-softmax or softmax and over which axes the pre-13 and 13 forms sum

def _softmax_grad(n: _Node, exact: bool, single_output: str) -> tuple:
    dy, y = n.input("dY"), n.input("Y")
    options = dict(n.binding.options)
    grad = reference_normalization.log_softmax_grad if options.get("log") else reference_normalization.softmax_grad
    dx = grad(dy, y, int(n.attribute("axis")), trailing=options.get("reduce") == "trailing")
    return _rounded(n, exact, {"dX": dx}, dy.dtype)


def _layer_norm_grad(n: _Node, exact: bool, single_output: str) -> tuple:
    dy, x, scale, inv = n.input("dY"), n.input("X"), n.input("scale"), n.input("inv_std")
    axis = int(n.attribute("axis"))
    if n.has_input("mean"):
        dx, dscale, dbias = reference_normalization.layer_norm_grad(dy, x, scale, n.input("mean"), inv, axis)
        return _rounded(n, exact, {"dX": dx, "dscale": dscale, "dbias": dbias}, dy.dtype)
    dx, dscale = reference_normalization.simplified_layer_norm_grad(dy, x, scale, inv, axis)
    return _rounded(n, exact, {"dX": dx, "dscale": dscale}, dy.dtype)


def _simplified_layer_norm(n: _Node, exact: bool, single_output: str) -> tuple:
    x = n.input("X")
    y, inv = reference_normalization.simplified_layer_norm(x, n.input("scale"), int(n.attribute("axis")),
                                                           float(n.attribute("epsilon")))
    return n.results({"Y": (y, None if exact else x.dtype), "saved_inv_std": (inv, None if exact else np.float32)})


RULES |= {"softmax_grad": _softmax_grad, "layer_norm_grad": _layer_norm_grad,
          "simplified_layer_norm": _simplified_layer_norm}
# -- the shape and matmul ops of onnxruntime-training's graphs (runtime.reference_shape); ConcatTraining's
# -- inputs and SplitTraining's outputs are variadic: every position, in order

def _fused_matmul(n: _Node, exact: bool, single_output: str) -> tuple:
    a = n.input("A")
    flags = {key: int(n.attribute(role, 0)) for key, role in (("trans_a", "transA"), ("trans_b", "transB"),
                                                              ("trans_batch_a", "transBatchA"),
                                                              ("trans_batch_b", "transBatchB"))}
    try:
        y = reference_shape.fused_matmul(a, n.input("B"), alpha=float(n.attribute("alpha", 1.0)), **flags)
    except ValueError as exc:
        raise n.fail(str(exc)) from None
    return _rounded(n, exact, {"Y": y}, a.dtype)


def _gather_grad(n: _Node, exact: bool, single_output: str) -> tuple:
    dy = n.input("dY")
    try:
        dx = reference_shape.gather_grad(n.input("shape"), n.input("indices"), dy, int(n.attribute("axis", 0)))
    except ValueError as exc:
        raise n.fail(str(exc)) from None
    return _rounded(n, exact, {"dX": dx}, dy.dtype)


def _slice_grad(n: _Node, exact: bool, single_output: str) -> tuple:
    dy = n.input("dY")
    try:
        dx = reference_shape.slice_grad(dy, n.input("shape"), n.input("starts"), n.input("ends"),
                                        n.input("axes", required=False), n.input("steps", required=False))
    except ValueError as exc:
        raise n.fail(str(exc)) from None
    return _rounded(n, exact, {"dX": dx}, dy.dtype)


def _concat_training(n: _Node, exact: bool, single_output: str) -> tuple:
    del exact  # a concatenation is exact in any type
    values, lengths = reference_shape.concat_training([np.asarray(v) for v in n.inputs], int(n.attribute("axis")))
    return n.results({"concat_result": (values, None), "per_input_length": (lengths, None)})


def _split_training(n: _Node, exact: bool, single_output: str) -> tuple:
    del exact
    try:
        pieces = reference_shape.split_training(n.input("input"), n.input("split"), int(n.attribute("axis", 0)),
                                                len(n.node.output))
    except ValueError as exc:
        raise n.fail(str(exc)) from None
    if len(pieces) != len(n.node.output):
        raise n.fail(f"split has {len(pieces)} entries for {len(n.node.output)} outputs")
    return tuple(pieces)  # an omitted output's piece is computed and dropped, as any unread value


RULES |= {"fused_matmul": _fused_matmul, "gather_grad": _gather_grad, "slice_grad": _slice_grad,
          "concat_training": _concat_training, "split_training": _split_training}
# -- onnxruntime-training's activation family (runtime.reference_activations): one output each, rounded to the
# -- type of the first input

def _activation(function, inputs: tuple[str, ...], output: str, alpha: bool = False):
    def evaluate(n: _Node, exact: bool, single_output: str) -> tuple:
        values = [n.input(role) for role in inputs]
        extra = {"alpha": float(n.attribute("alpha"))} if alpha else {}
        return _rounded(n, exact, {output: function(*values, **extra)}, values[0].dtype)
    return evaluate


def _dropout_grad(n: _Node, exact: bool, single_output: str) -> tuple:
    dy = n.input("dy")
    ratio = n.input("ratio", required=False) if n.has_input("ratio") else None
    dx = reference_activations.dropout_grad(dy, n.input("mask"), None if ratio is None or ratio.size == 0 else ratio)
    return _rounded(n, exact, {"dx": dx}, dy.dtype)


_ACT = reference_activations
RULES |= {"tanh_grad": _activation(_ACT.tanh_grad, ("dY", "Y"), "dX"),
          "leaky_relu_grad": _activation(_ACT.leaky_relu_grad, ("dY", "Y"), "dX", alpha=True),
          "quick_gelu": _activation(_ACT.quick_gelu, ("X",), "Y", alpha=True),
          "quick_gelu_grad": _activation(_ACT.quick_gelu_grad, ("dY", "X"), "dX", alpha=True),
          "gelu_grad": _activation(_ACT.gelu_grad, ("dY", "X"), "dX"),
          "fast_gelu_grad": _activation(_ACT.fast_gelu_grad, ("dY", "X"), "dX"),
          "gelu": _activation(_ACT.gelu, ("X",), "Y"),
          "bias_gelu": _activation(_ACT.bias_gelu, ("A", "B"), "C"),
          "bias_gelu_grad": _activation(_ACT.bias_gelu_grad, ("dY", "X", "B"), "dX"),
          "bias_fast_gelu_grad": _activation(_ACT.bias_fast_gelu_grad, ("dY", "X", "B"), "dX"),
          "dropout_grad": _dropout_grad}


# -- onnxruntime-training's recurrent ops (runtime.reference_recurrent)

def _lstm_training(n: _Node, exact: bool, single_output: str) -> tuple:
    x = n.input("X")
    values = reference_recurrent.lstm_training(
        x, n.input("W"), n.input("R"), *(n.input(r, required=False) for r in
                                         ("B", "sequence_lengths", "initial_h", "initial_c", "P")),
        direction=str(n.attribute("direction", "forward")))
    return _rounded(n, exact, values, x.dtype)


def _lstm_grad(n: _Node, exact: bool, single_output: str) -> tuple:
    x = n.input("X")
    optional = [n.input(r, required=False) for r in ("sequence_lengths", "initial_h", "initial_c")]
    grads = [n.input(r, required=False) for r in ("dHAll", "dHFinal", "dCFinal")]
    values = reference_recurrent.lstm_grad(x, n.input("W"), n.input("R"), *optional, n.input("HAll"),
                                           n.input("CAll"), n.input("iofc"), *grads,
                                           direction=str(n.attribute("direction", "forward")))
    return _rounded(n, exact, values, x.dtype)


def _gru_training(n: _Node, exact: bool, single_output: str) -> tuple:
    x = n.input("X")
    values = reference_recurrent.gru_training(
        x, n.input("W"), n.input("R"), *(n.input(r, required=False) for r in ("B", "sequence_lengths", "initial_h")),
        direction=str(n.attribute("direction", "forward")),
        linear_before_reset=int(n.attribute("linear_before_reset", 0)))
    return _rounded(n, exact, values, x.dtype)


def _gru_grad(n: _Node, exact: bool, single_output: str) -> tuple:
    x = n.input("X")
    optional = [n.input(r, required=False) for r in ("B", "sequence_lengths", "initial_h")]
    grads = [n.input(r, required=False) for r in ("dHAll", "dHFinal")]
    values = reference_recurrent.gru_grad(x, n.input("W"), n.input("R"), *optional, n.input("HAll"), n.input("ZRH"),
                                          *grads, direction=str(n.attribute("direction", "forward")),
                                          linear_before_reset=int(n.attribute("linear_before_reset", 0)))
    return _rounded(n, exact, values, x.dtype)


RULES |= {"lstm_training": _lstm_training, "lstm_grad": _lstm_grad, "gru_training": _gru_training,
          "gru_grad": _gru_grad}


def op_classes(registry: Registry, *, exact: bool = False, single_output: str = "spec") -> list[type[OpRun]]:
    """One ``OpRun`` subclass per registry entry whose rule has a float64 evaluation."""
    if single_output not in SINGLE_OUTPUT_MODES:
        raise ValueError(f"single_output must be one of {SINGLE_OUTPUT_MODES}, not {single_output!r}")
    classes = []
    for entry in registry:
        evaluate_rule = RULES.get(entry.binding.rule)
        if evaluate_rule is None:
            continue

        def _run(self, *inputs, _entry=entry, _rule=evaluate_rule, **attrs):
            rounded = attrs.get(_ROUNDED)
            results = _rule(_Node(_entry, self, inputs, attrs), exact and not rounded, single_output)
            return _as_declared(results, rounded) if rounded else results

        classes.append(type(entry.binding.op_type, (OpRun,), {
            "op_domain": entry.binding.domain,
            "op_schema": None,  # never borrow an ai.onnx schema of the same name
            "_run": _run,
            "__doc__": f"float64 reference of {entry.binding.domain}::{entry.binding.op_type}",
        }))
    return classes


def _as_declared(results: tuple, elem_types) -> tuple:
    """Float results cast to the element types a standard consumer expects (``_ROUNDED``'s value)."""
    if not isinstance(elem_types, list | tuple):
        return results
    out = list(results)
    for i, (value, elem) in enumerate(zip(results, elem_types, strict=False)):
        if elem and isinstance(value, np.ndarray) and value.dtype.kind == "f":
            dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
            if dtype.kind == "f" and value.dtype != dtype:
                out[i] = value.astype(dtype)
    return tuple(out)


class _MaxPoolWithIndices(_ReferenceMaxPool):
    """onnx.reference's MaxPool, except for the Indices of an undilated, row-major MaxPool: onnx.reference
    computes them wrong where the pool has pads (onnx 1.23: negative or shifted indices), and the
    training graphs' MaxPoolGrad reads them; there the float64 max_pool of runtime.reference_training
    (onnxruntime's first-maximum rule, flat positions in the whole input) gives both outputs."""

    def _run(self, x, auto_pad=None, ceil_mode=None, dilations=None, kernel_shape=None, pads=None,
             storage_order=None, strides=None):
        spatial = x.ndim - 2
        plain = (len(self.onnx_node.output) > 1 and self.onnx_node.output[1] and not storage_order
                 and all(d == 1 for d in (dilations or [1] * spatial))
                 and (auto_pad in (None, "NOTSET", b"NOTSET", "VALID", b"VALID")))
        if not plain:
            return super()._run(x, auto_pad=auto_pad, ceil_mode=ceil_mode, dilations=dilations,
                                kernel_shape=kernel_shape, pads=pads, storage_order=storage_order, strides=strides)
        valid = auto_pad in ("VALID", b"VALID")
        pads = [0] * (2 * spatial) if valid or pads is None else list(pads)
        strides = list(strides or [1] * spatial)
        out = []
        for a in range(spatial):
            span = x.shape[2 + a] + pads[a] + pads[spatial + a] - kernel_shape[a]
            size = (-(-span // strides[a]) if ceil_mode else span // strides[a]) + 1
            if ceil_mode and (size - 1) * strides[a] >= x.shape[2 + a] + pads[a]:
                size -= 1  # a last window that would start in the end padding is dropped
            out.append(size)
        y, indices = reference_training.max_pool(x, kernel_shape, strides, pads, out)
        return y.astype(x.dtype), indices


_MaxPoolWithIndices.__name__ = "MaxPool"  # the evaluator keys new_ops by (op_domain, class name)
_MaxPoolWithIndices.op_domain = ""


def _prepared_copy(model: onnx.ModelProto, registry: Registry) -> onnx.ModelProto:
    """A copy the evaluator can run: omitted outputs of custom nodes named, every used domain imported, and
    the in-place contract applied to the main graph as the lowering applies it (``<input>.updated`` graph
    outputs, opdef.in_place), so that the reference has every output the lowered model has."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    taken = {name for node in all_nodes(graph) for name in (*node.input, *node.output)}
    taken |= {v.name for v in (*graph.input, *graph.output)} | {t.name for t in graph.initializer}
    declared = {v.name: v.type.tensor_type.shape for v in (*graph.value_info, *graph.output)
                if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")}
    read_by_standard = {name for node in all_nodes(graph) if registry.get(node.domain, node.op_type) is None
                        for name in node.input}
    inferred = _inferred_elem_types(model) if read_by_standard else {}
    nodes = []
    for node in graph.node:
        entry = registry.get(node.domain, node.op_type)
        role = None if entry is None else _DECLARED_OUTPUT.get(entry.binding.rule)
        if role is not None:
            index = entry.schema.output_index(entry.binding.arg(role))
            shape = declared.get(node.output[index]) if index < len(node.output) else None
            if shape is not None and all(d.HasField("dim_value") for d in shape.dim):
                node.attribute.append(onnx.helper.make_attribute(_DECLARED, [d.dim_value for d in shape.dim],
                                                                 attr_type=onnx.AttributeProto.INTS))
        if entry is not None and read_by_standard.intersection(node.output):
            elem_types = [inferred.get(name, 0) for name in node.output]
            node.attribute.append(onnx.helper.make_attribute(_ROUNDED, elem_types if any(elem_types) else 1))
        node, _, joins = in_place.expose(node, registry, graph, taken, {})
        nodes.append(node)
        nodes += [onnx.helper.make_node("Identity", [produced], [exposed]) for produced, exposed in joins]
    del graph.node[:]
    graph.node.extend(nodes)
    counter = 0
    for owner, body in ((copy, copy.graph), *((f, f) for f in copy.functions)):
        domains = set()
        for node in all_nodes(body):
            domains.add(node.domain)
            if (node.domain, node.op_type) in registry:
                for i, name in enumerate(node.output):
                    if not name:
                        node.output[i] = f"{_OMITTED}{counter}"
                        counter += 1
        have = {o.domain for o in owner.opset_import}
        for domain in sorted(domains - have - {"ai.onnx"}):
            owner.opset_import.append(onnx.helper.make_opsetid(domain, 1))
    return copy


def _inferred_elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every main-graph value onnx's shape inference (which knows the registry's ops) finds."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 -- inference is a help here, never a requirement
        return {}
    graph = inferred.graph
    return {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info, *graph.output)
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type}


def reference_evaluator(model: onnx.ModelProto | str | Path, *, registry: Registry | None = None,
                        exact: bool = False, single_output: str = "spec") -> ReferenceEvaluator:
    """A ``ReferenceEvaluator`` over the model that knows every op of the registry.

    ``exact=True`` leaves the custom nodes' results in float64 (the oracle); by default they are rounded
    once to the element types the op produces (src's for diff_src, the statistics' for the rest), like
    the real op. ``single_output`` is the oneDNN single-output reading ("spec" or "upstream").
    """
    if registry is None:
        from opdef.registry import load_schemas  # noqa: PLC0415 (parses specs/ on first use)

        registry = load_schemas()
    if not isinstance(model, onnx.ModelProto):
        try:
            model = onnx.load(str(model))
        except Exception as exc:
            raise ModelError(f"{model}: not a readable ONNX model ({type(exc).__name__})") from None
    model = _prepared_copy(model, registry)
    classes = [*op_classes(registry, exact=exact, single_output=single_output), _MaxPoolWithIndices]
    try:
        # Built from the graph, not the model: ReferenceEvaluator gives a model's functions no new_ops.
        functions: list[ReferenceEvaluator] = []
        for function in model.functions:
            functions.append(ReferenceEvaluator(function, functions=list(functions), new_ops=classes))
        opsets = {o.domain: o.version for o in model.opset_import}
        return ReferenceEvaluator(model.graph, opsets=opsets, functions=functions, new_ops=classes)
    except OplowerError:
        raise
    except Exception as exc:
        raise RuntimeFailure(f"the reference evaluator cannot load the model: {_one_line(exc)}") from None


def evaluate(model: onnx.ModelProto | str | Path, feeds: Mapping[str, np.ndarray],
             output_names: Iterable[str] | None = None, *, registry: Registry | None = None,
             exact: bool = False, single_output: str = "spec") -> dict[str, np.ndarray]:
    """Run the model with ``onnx.reference`` (custom nodes in float64); returns {output name: array}."""
    evaluator = reference_evaluator(model, registry=registry, exact=exact, single_output=single_output)
    names = list(evaluator.output_names if output_names is None else output_names)
    try:
        values = evaluator.run(names, dict(feeds))
    except OplowerError:
        raise
    except Exception as exc:
        raise RuntimeFailure(f"the reference evaluator failed: {_one_line(exc)}") from None
    return dict(zip(names, values, strict=True))


def _one_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0].strip()}" if lines else type(exc).__name__
