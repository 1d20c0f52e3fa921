"""Standard ONNX ops that some runtimes lack, spelled out in :data:`lowering.rules.PORTABLE_OPS` for the
portable target of whole training graphs (the train-step model): ``SoftmaxCrossEntropyLoss`` (tract 0.23
has none), the forward loss of every CrossEntropyLoss artifact; a training-mode ``Dropout`` (OpenVINO 2025's ONNX
frontend refuses ``training_mode`` true), spelled out with :data:`RANDOM_OPS` (see :func:`_training_dropout`).

``log_prob = x - max - log(sum(exp(x - max)))`` along axis 1; the loss per element is ``-w·log_prob`` at the
label (a one-hot by Equal with the class ids), ``w`` the class weight at the label (1 without weights), 0
where the label is ``ignore_index``; ``mean`` divides the sum by the sum of ``w`` (as ONNX defines it),
``sum`` sums, ``none`` keeps the per-element losses. A label outside [0, C) (a bad value: ONNX leaves it
undefined, onnxruntime refuses it at run time) counts as ignored, exactly as in the lowered
SoftmaxCrossEntropyLossGrad: loss 0, weight 0, never used as a Gather index. An ``ignore_index`` the label's
type cannot hold equals no label.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from lowering.builder import NodeBuilder
from lowering.emit_common import Emitter
from lowering.graphs import constant_values, default_opset
from lowering.rules.softmax_cross_entropy_loss_grad import counted_labels
from opdef.verify import value_types_of_graph

_INT_NP = {TensorProto.INT32: np.int32, TensorProto.INT64: np.int64}
# what a spelled-out training-mode Dropout needs beyond PORTABLE_OPS: a random draw has no computed input
# (RandomUniform, static shapes; tract 0.23 builds no RandomUniformLike) or one that only gives its shape
RANDOM_OPS = frozenset({"RandomUniform", "RandomUniformLike"})


def spell_out_for_portable(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose main-graph SoftmaxCrossEntropyLoss nodes of known input rank, and Dropout nodes
    with a constant true training_mode and a known input type, are spelled out (the others stay as they are)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = value_types_of_graph(inferred.graph)
    opset = default_opset(model.opset_import) or 13
    taken = {o for n in model.graph.node for o in n.output} | {vi.name for vi in model.graph.input} \
        | {t.name for t in model.graph.initializer}
    constants = constant_values(model.graph)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    for index, node in enumerate(model.graph.node):
        scores = types.get(node.input[0]) if node.input else None
        standard = node.domain in ("", "ai.onnx")
        if standard and node.op_type == "SoftmaxCrossEntropyLoss" and scores is not None \
                and scores.shape is not None and types.get(node.input[1]) is not None:
            b = NodeBuilder(opset, f"sce_{index}", lambda name: name in taken, into=out.graph.node)
            _softmax_cross_entropy_loss(b, node, scores.elem_type, scores.shape, types[node.input[1]].elem_type)
            taken.update(b.used_names)
        elif standard and node.op_type == "Dropout" and scores is not None and _training(node, constants):
            b = NodeBuilder(opset, f"dropout_{index}", lambda name: name in taken, into=out.graph.node)
            _training_dropout(b, node, scores.elem_type, scores.shape)
            taken.update(b.used_names)
        else:
            out.graph.node.append(node)
    return out


def _training(node: onnx.NodeProto, constants: dict[str, np.ndarray]) -> bool:
    """A Dropout whose training_mode is a constant true (the only kind that drops; a computed one stays)."""
    mode = node.input[2] if len(node.input) > 2 else ""
    return bool(mode) and mode in constants and bool(np.asarray(constants[mode]).reshape(-1)[0])


def _training_dropout(b: NodeBuilder, node: onnx.NodeProto, elem: int, shape) -> None:
    """``keep = not (u < ratio)`` for ``u`` uniform in [0, 1) (so P(keep) = 1 - ratio), ``y = keep ? x / (1 - ratio)
    : 0`` (ratio 1 gives zeros, not 0 * inf), ``mask = keep``. Another runtime draws other numbers than
    onnxruntime: results agree only where no draw matters (ratio 0: every element kept)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    x = node.input[0]
    seed = {"seed": float(attrs["seed"])} if "seed" in attrs else {}
    if shape is not None and all(isinstance(d, int) for d in shape):
        draw = b.op1("RandomUniform", [], hint="uniform", shape=list(shape), dtype=elem, **seed)
    else:
        draw = b.op1("RandomUniformLike", [x], hint="uniform", dtype=elem, **seed)
    ratio = node.input[1] if len(node.input) > 1 and node.input[1] else b.const(np.array(0.5, np.float32),
                                                                               hint="default_ratio")
    ratio = b.op1("Cast", [ratio], hint="ratio", to=elem)  # Cast, not CastLike: that needs opset 15
    keep = b.op1("Not", [b.op1("Less", [draw, ratio])], node.output[1] if len(node.output) > 1 and node.output[1]
                 else None, hint="keep")
    one = b.op1("Cast", [b.const(np.array(1.0, np.float32), hint="one")], hint="one", to=elem)
    scaled = b.op1("Div", [x, b.op1("Sub", [one, ratio])], hint="scaled")
    zero = b.op1("Sub", [one, one], hint="zero")
    b.op1("Where", [keep, scaled, zero], node.output[0])


def _softmax_cross_entropy_loss(b: NodeBuilder, node: onnx.NodeProto, elem: int, shape: tuple, label_type: int) -> None:
    rank, static_classes = len(shape), shape[1] if len(shape) > 1 else None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    reduction = attrs.get("reduction", b"mean").decode()
    ignore_index = attrs.get("ignore_index")
    limits = np.iinfo(_INT_NP[label_type])
    if ignore_index is not None and not int(limits.min) <= ignore_index <= int(limits.max):
        ignore_index = None  # no label can equal it
    e = Emitter(b, elem)
    scores, label = node.input[0], node.input[1]
    weight = node.input[2] if len(node.input) > 2 and node.input[2] else None
    loss_out = node.output[0]
    log_prob_out = node.output[1] if len(node.output) > 1 and node.output[1] else None

    shifted = b.op1("Sub", [scores, e.reduce("ReduceMax", scores, (1,))], hint="shifted")
    log_sum = b.op1("Log", [e.reduce("ReduceSum", b.op1("Exp", [shifted]), (1,))], hint="log_sum")
    log_prob = b.op1("Sub", [shifted, log_sum], log_prob_out, hint="log_prob")

    int_np = _INT_NP[label_type]
    classes = b.op1("Gather", [b.op1("Shape", [scores]), e.ints(1, "class_axis")], axis=0)
    class_ids = b.op1("Range", [b.const(np.array(0, int_np), hint="zero_label"),
                                b.op1("Cast", [classes], to=label_type), b.const(np.array(1, int_np), hint="one")])
    if rank > 2:
        class_ids = b.op1("Reshape", [class_ids, e.ints([-1] + [1] * (rank - 2), "class_view")])
    label_axis = b.op1("Unsqueeze", [label], axes=[1]) if b.opset < 13 else \
        b.op1("Unsqueeze", [label, e.ints([1], "axes")])
    onehot = b.op1("Cast", [b.op1("Equal", [label_axis, class_ids])], to=elem)
    picked = e.reduce("ReduceSum", b.op1("Mul", [log_prob, onehot]), (1,), keepdims=0)
    per_element = b.op1("Neg", [picked], hint="nll")

    safe_label, kept = counted_labels(b, label, label_type, classes, static_classes, ignore_index)
    weights = b.op1("Cast", [kept], to=elem)
    if weight is not None:
        weights = b.op1("Mul", [b.op1("Gather", [weight, safe_label], axis=0), weights])
    per_element = b.op1("Mul", [per_element, weights])
    if reduction == "none":
        b.op1("Identity", [per_element], loss_out)
        return
    axes = tuple(range(rank - 1))
    total = e.reduce("ReduceSum", per_element, axes, keepdims=0)
    if reduction == "sum":
        b.op1("Identity", [total], loss_out)
    else:
        b.op1("Div", [total, e.reduce("ReduceSum", weights, axes, keepdims=0)], loss_out)
