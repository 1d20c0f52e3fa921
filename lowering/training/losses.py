"""The loss blocks onnxruntime-training 1.19.2 puts on top of a forward model, built the same way.

Each block appends its nodes (and its label input, when the model has no value of that name) to the forward
graph and returns the name of the loss value. Node and value names follow onnxblock's scheme
``onnx::<token>::<n>`` with one counter per generated artifact set (what onnxblock gives in a fresh process).

- ``CrossEntropyLoss``: ``SoftmaxCrossEntropyLoss`` (reduction mean) of the scores and ``labels`` (int64, the
  scores' shape without its last axis);
- ``MSELoss``: ReduceMean((output - target)^2); ``L1Loss``: ReduceMean(|output - target|);
- ``BCEWithLogitsLoss``: ReduceMean(-(log(sigmoid(x)) * t + log(1 - sigmoid(x)) * (1 - t)));
- ``none``: the model's first output is the loss (a custom loss written in the forward model).
"""

from __future__ import annotations

import copy
from enum import Enum

import numpy as np
import onnx
from onnx import helper, numpy_helper

from lowering.training.gradients.context import GradientError


class LossType(Enum):
    """The loss block to put on the forward model (``generate_artifacts``' ``loss``); values as onnxruntime's."""

    MSELoss = 1
    CrossEntropyLoss = 2
    BCEWithLogitsLoss = 3
    L1Loss = 4


LABEL_INPUT = {LossType.CrossEntropyLoss: "labels", LossType.MSELoss: "target", LossType.BCEWithLogitsLoss: "target",
               LossType.L1Loss: "target"}


class Tokens:
    """onnxblock's graph names: ``onnx::<token>::<n>``, n counting up from 1 for one artifact set."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, token: str) -> str:
        self.count += 1
        return f"onnx::{token}::{self.count}"


def _value_info(model: onnx.ModelProto, name: str) -> onnx.ValueInfoProto:
    for vi in list(model.graph.output) + list(model.graph.value_info) + list(model.graph.input):
        if vi.name == name:
            return vi
    raise GradientError(f"the loss input {name!r} has no known type (not a graph output or inferred value)")


def _exists(model: onnx.ModelProto, name: str) -> bool:
    return any(name in n.input or name in n.output for n in model.graph.node) or \
        any(vi.name == name for vi in model.graph.input)


def _binary(model, tokens: Tokens, op: str, a: str, b: str) -> str:
    out = tokens(f"{op.lower()}_output")
    model.graph.node.append(helper.make_node(op, [a, b], [out], name=tokens(op)))
    return out


def _unary(model, tokens: Tokens, op: str, x: str, **attrs) -> str:
    out = tokens(f"{op.lower()}_output")
    model.graph.node.append(helper.make_node(op, [x], [out], tokens(op), **attrs))
    return out


def _target_like(model: onnx.ModelProto, like: str, name: str) -> str:
    if not _exists(model, name):
        vi = copy.deepcopy(_value_info(model, like))
        vi.name = name
        model.graph.input.append(vi)
    return name


def add_loss(model: onnx.ModelProto, loss: LossType | None, inputs: list[str], tokens: Tokens) -> str:
    """Append ``loss``'s block to ``model`` (shape-inferred, so the loss input's type is known); returns the
    loss value's name. ``inputs``: the values the block reads (the model's outputs, or ``loss_input_names``)."""
    if not inputs:
        raise GradientError("the model has no output to compute the loss from")
    x = inputs[0]
    if loss is None:
        return x
    if loss is LossType.CrossEntropyLoss:
        weight_name = tokens("celoss.weight")  # noqa: F841 -- onnxblock draws a token for the (absent) weight
        labels = inputs[1] if len(inputs) > 1 else "labels"
        if not _exists(model, labels):
            vi = copy.deepcopy(_value_info(model, x))
            vi.name = labels
            tt = vi.type.tensor_type
            tt.elem_type = onnx.TensorProto.INT64
            if tt.HasField("shape"):
                if not tt.shape.dim:
                    raise GradientError(f"CrossEntropyLoss: the scores {x!r} are a scalar (expected [N, C] or "
                                        "[N, C, d1, ...])")
                del tt.shape.dim[-1]
            model.graph.input.append(vi)
        out, log_prob = tokens("loss"), tokens("log_prob")
        model.graph.node.append(helper.make_node("SoftmaxCrossEntropyLoss", [x, labels], [out, log_prob],
                                                 name=tokens("SoftmaxCrossEntropyLoss"), reduction="mean"))
        return out
    target = inputs[1] if len(inputs) > 1 else "target"
    if loss is LossType.MSELoss:
        target = _target_like(model, x, target)
        diff = _binary(model, tokens, "Sub", x, target)
        exponent = tokens("pow_exponent")
        model.graph.initializer.append(numpy_helper.from_array(np.array([2.0], np.float32), exponent))
        squared = tokens("pow_output")
        model.graph.node.append(helper.make_node("Pow", [diff, exponent], [squared], name=tokens("Pow")))
        return _unary(model, tokens, "ReduceMean", squared, keepdims=0)
    if loss is LossType.L1Loss:
        target = _target_like(model, x, target)
        diff = _binary(model, tokens, "Sub", x, target)
        return _unary(model, tokens, "ReduceMean", _unary(model, tokens, "Abs", diff), keepdims=0)
    if loss is LossType.BCEWithLogitsLoss:
        tokens("bceloss.pos_weight")
        tokens("bceloss.weight")
        ones = []
        for _ in range(2):
            name = tokens("bceloss.sub_ones")
            model.graph.initializer.append(numpy_helper.from_array(np.array([1.0], np.float32), name))
            ones.append(name)
        target = _target_like(model, x, target)
        sig = _unary(model, tokens, "Sigmoid", x)
        first = _binary(model, tokens, "Mul", _unary(model, tokens, "Log", sig), target)
        log_rest = _unary(model, tokens, "Log", _binary(model, tokens, "Sub", ones[0], sig))
        second = _binary(model, tokens, "Mul", log_rest, _binary(model, tokens, "Sub", ones[1], target))
        return _unary(model, tokens, "ReduceMean", _unary(model, tokens, "Neg", _binary(model, tokens, "Add", first,
                                                                                        second)), keepdims=0)
    raise GradientError(f"unknown loss {loss!r}")
