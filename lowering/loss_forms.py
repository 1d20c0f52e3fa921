"""The forward ``SoftmaxCrossEntropyLoss`` of a training graph in fewer kernels than onnxruntime's own expansion.

onnxruntime runs the standard SoftmaxCrossEntropyLoss (opset 13 on) by inlining its ONNX function, whose
NegativeLogLikelihoodLoss is a function too: 11 kernels a step without ``ignore_index`` (Unsqueeze, Shape,
Reshape, LogSoftmax, Reshape, GatherElements, Neg, Slice, Squeeze, ReduceMean, Identity) and 21 with it (torch's
default -100), where onnxruntime-training's own kernel is one. Half of them move data that needs no moving: the
[N, C, D] view of the scores and back, the Slice of the one-column gather, the Squeezes, the Identity to
log_prob, a Sub making the label type's zero. :func:`shorten_cross_entropy` writes the same operations on the
same values without them:

- ``log_prob = LogSoftmax(scores, axis=1)`` on the scores as they are (the function's [N, C, D] view runs the
  kernel over the same rows of C in the same order);
- ``g = GatherElements(log_prob, Unsqueeze(label, 1), axis=1)`` (the function's own gather, [N, 1, ...]);
- without ``ignore_index``: ``Neg(g)`` then ReduceMean / ReduceSum over every axis (the function's Neg, its
  reduction over the same elements in the same order: the Squeeze of the unit axis moves no element), or
  ``Squeeze(Neg(g), 1)`` for ``none``;
- with it: ``mask = Equal(Unsqueeze(label, 1), ignore_index)``, the gather at ``Where(mask, 0, label)``,
  ``Neg(Where(mask, 0, g))``; the function then multiplies by its weight ``Where(mask, 0, 1)``, which leaves
  every element as it is (``-g * 1`` is ``-g``, NaN included; an ignored element is ``-0 * 0 = -0`` either
  way), so no Mul; ``mean`` divides that sum by the sum of the weights, as the function does.

Kernels a step: 11 -> 5 (mean, no ignore_index), 21 -> 11 (mean, ignore_index); the label's Unsqueeze is the
one the lowered SoftmaxCrossEntropyLossGrad makes too (onnxruntime's common-subexpression pass keeps one).
Taken only where every piece is the function's: no class weights (the function's weighted gather and its
weighted mean stay), opset 13 on (SoftmaxCrossEntropyLoss-12's LogSoftmax flattens its trailing axes), an
``ignore_index`` the label type holds (the function compares through int64), and log_prob read by another
node -- a training graph, whose gradient reads it; an evaluation graph keeps its loss node, which
:func:`lowering.training.workflow.load_eval_model` reads the scores and labels off. Labels outside [0, C) (not
``ignore_index``) are an error in both (GatherElements' bounds check; [-C, 0) counts from the end in both).
tests/test_loss_forms.py compares loss and log_prob bit for bit with the function's.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from lowering.builder import NodeBuilder
from lowering.graphs import default_opset, names_in_use
from opdef.verify import value_types_of_graph

_INT_NP = {TensorProto.INT32: np.int32, TensorProto.INT64: np.int64}
_FLOAT_NP = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64}


def shorten_cross_entropy(model: onnx.ModelProto) -> int:
    """Rewrite in place every main-graph SoftmaxCrossEntropyLoss that :mod:`this module <lowering.loss_forms>`
    takes; returns how many."""
    graph = model.graph
    opset = default_opset(model.opset_import)
    if opset is None or opset < 13 or not any(_is_loss(n) for n in graph.node):
        return 0
    read = {name for n in graph.node for name in n.input}  # by a node: a graph output is no gradient
    types = value_types_of_graph(graph)
    if any(_is_loss(n) and types.get(n.input[0]) is None for n in graph.node):
        types = _inferred_types(model)  # the scores are an intermediate value: their type is inferred
    taken = names_in_use(model)
    nodes = list(graph.node)
    del graph.node[:]
    done = 0
    for index, node in enumerate(nodes):
        form = _form(node, read, types) if _is_loss(node) else None
        if form is None:
            graph.node.append(node)
            continue
        b = NodeBuilder(opset, node.name or f"SoftmaxCrossEntropyLoss_{index}", lambda n: n in taken,
                        into=graph.node)
        _emit(b, node, *form)
        if node.name:  # the loss node keeps the name: a standard node of the model, not a lowered training op
            b.nodes[-1].name = node.name
        taken.update(b.used_names)
        done += 1
    return done


def _inferred_types(model: onnx.ModelProto) -> dict:
    try:
        return value_types_of_graph(onnx.shape_inference.infer_shapes(model, strict_mode=False).graph)
    except Exception:  # noqa: BLE001 -- a model onnx's inference cannot read: only what it declares is known
        return value_types_of_graph(model.graph)


def _is_loss(node: onnx.NodeProto) -> bool:
    return node.op_type == "SoftmaxCrossEntropyLoss" and node.domain in ("", "ai.onnx")


def _form(node: onnx.NodeProto, read: set[str], types: dict) -> tuple[str, int | None, type, type] | None:
    """(reduction, ignore_index or None, the scores' and the label's NumPy types) where the short form is taken."""
    if len(node.input) > 2 and node.input[2]:
        return None  # class weights
    if len(node.output) < 2 or not node.output[1] or node.output[1] not in read:
        return None  # no gradient reads log_prob: not a training graph
    scores, label = types.get(node.input[0]), types.get(node.input[1])
    if scores is None or scores.elem_type not in _FLOAT_NP or label is None or label.elem_type not in _INT_NP:
        return None
    rank = len(scores.shape) if scores.shape is not None else None if label.shape is None else len(label.shape) + 1
    if rank not in (2, 3):
        return None  # the function's [N, C, D] view is the scores themselves (or [N, C, 1]) only there
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    reduction = attrs.get("reduction", b"mean").decode()
    if reduction not in ("mean", "sum", "none"):
        return None
    ignore_index = attrs.get("ignore_index")
    int_np = _INT_NP[label.elem_type]
    if ignore_index is not None and not np.iinfo(int_np).min <= ignore_index <= np.iinfo(int_np).max:
        return None  # the function's int64 comparison: no label equals it, but its weights and Where still run
    return reduction, ignore_index, _FLOAT_NP[scores.elem_type], int_np


def _emit(b: NodeBuilder, node: onnx.NodeProto, reduction: str, ignore_index: int | None, float_np: type,
          int_np: type) -> None:
    scores, label = node.input[0], node.input[1]
    loss, log_prob = node.output[0], node.output[1]
    axis = b.const(np.array([1], np.int64), hint="axis")
    target = b.op1("Unsqueeze", [label, axis], hint="target")
    b.op1("LogSoftmax", [scores], log_prob, hint="log_prob", axis=1)
    mask = None
    if ignore_index is not None:
        mask = b.op1("Equal", [target, b.const(np.array(ignore_index, int_np), hint="ignore_index")], hint="mask")
        target = b.op1("Where", [mask, b.const(np.array(0, int_np), hint="zero_label"), target], hint="target")
    picked = b.op1("GatherElements", [log_prob, target], hint="picked", axis=1)
    if mask is None:
        nll = b.op1("Neg", [picked], hint="nll")
        if reduction == "none":
            b.op1("Squeeze", [nll, axis], loss, hint="loss")
        else:
            b.op1("ReduceSum" if reduction == "sum" else "ReduceMean", [nll], loss, hint="loss", keepdims=0)
        return
    zero = b.const(np.array(0, float_np), hint="zero")
    nll = b.op1("Neg", [b.op1("Where", [mask, zero, picked], hint="picked")], hint="nll")
    if reduction == "none":
        b.op1("Squeeze", [nll, axis], loss, hint="loss")
    elif reduction == "sum":
        b.op1("ReduceSum", [nll], loss, hint="loss", keepdims=0)
    else:
        weights = b.op1("Where", [mask, zero, b.const(np.array(1, float_np), hint="one")], hint="weights")
        counted = b.op1("ReduceSum", [weights], hint="counted", keepdims=0)
        b.op1("Div", [b.op1("ReduceSum", [nll], hint="total", keepdims=0), counted], loss, hint="loss")
