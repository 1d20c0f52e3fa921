"""Lowering of onnxruntime-training's ``SoftmaxCrossEntropyLossGrad``
(``specs/com.microsoft/SoftmaxCrossEntropyLossGrad.rst``).

``d_logits = g * w * (exp(log_prob) - onehot(label))`` with the class axis 1: the one-hot is an Equal of
the label against the class indices (a Range), the per-sample weight a Gather of ``weight`` at the label.
A label counts when it lies in [0, C) and is not ``ignore_index``; any other label (``ignore_index``, and a
bad value such as -1 or C, which onnxruntime-training's kernel refuses at run time but a standard graph
cannot) is ignored: replaced by a class id before the Gather (so nothing is read out of bounds) and weighted 0. An
``ignore_index`` the label's type cannot hold (2**31 for int32 labels) equals no label: it is lowered as no
ignore_index at all. For reduction ``mean`` g is dY over the sum of the counted labels' weights (over their
number without weight), left undivided when that sum is 0.
Without class weights, where log_prob's shape is static and small, the labels' weights are the one-hot's sum over
the class axis instead (:func:`_counted_by_onehot`: the same values in 5 kernels fewer); elsewhere without class
weights, the guard runs on the one-hot's [N, 1, ...] view of the labels (:func:`_counted_by_guard`: 2 fewer).
One form for both targets: Range, Equal, Gather, Where and elementwise arithmetic take runtime tensors
everywhere (lowering.rules.PORTABLE_OPS).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from lowering.builder import NodeBuilder
from lowering.emit_common import Emitter, compute_type, guarded_index
from lowering.rules import TARGETS, LoweringRequest, register_rule
from lowering.rules.elementwise_grad import input_elem

_INT_NP = {TensorProto.INT32: np.int32, TensorProto.INT64: np.int64}
# log_prob elements up to which the labels' weights are summed out of the one-hot (_counted_by_onehot): 5 kernels
# fewer, one pass over [N, C] more. One node, onnxruntime, 1 thread, onehot/guarded time: [32, 10] 0.73, [64, 256]
# 0.89, [128, 256] 0.94, [128, 512] 1.02, [1024, 4096] 1.23
ONEHOT_WEIGHTS_LIMIT = 1 << 15


def _holds(label_type: int, value: int) -> bool:
    limits = np.iinfo(_INT_NP[label_type])
    return int(limits.min) <= value <= int(limits.max)


def counted_labels(b: NodeBuilder, label: str, label_type: int, classes: str, static_classes,
                   ignore_index: int | None) -> tuple[str, str]:
    """(the labels with every one outside [0, C) replaced by a class id, the bool mask of the labels that
    count: class ids other than ``ignore_index``), both shaped like ``label``. ``classes``: C as an int64
    scalar at run time; ``static_classes``: C when the graph declares it. A negative ``ignore_index`` is out
    of range anyway."""
    int_np = _INT_NP[label_type]
    static = static_classes if isinstance(static_classes, int) else None
    safe, kept = guarded_index(b, label, label_type, None if static is not None else
                               b.op1("Cast", [classes], to=label_type), static)
    if ignore_index is not None and ignore_index >= 0:
        ignored = b.op1("Equal", [label, b.const(np.array(ignore_index, int_np), hint="ignore_index")])
        kept = b.op1("And", [kept, b.op1("Not", [ignored])])
    return safe, kept


def _unsqueeze(e: Emitter, name: str, axis: int) -> str:
    if e.b.opset < 13:
        return e.b.op1("Unsqueeze", [name], axes=[axis])
    return e.b.op1("Unsqueeze", [name, e.ints([axis], "axes")])


@register_rule("softmax_cross_entropy_loss_grad", targets=TARGETS)
def lower_softmax_cross_entropy_loss_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    out = request.output("d_logits")
    if out is None:
        return
    io, label_type = input_elem(request, "log_prob"), input_elem(request, "label")
    e = Emitter(b, compute_type(io))
    attributes = request.inference.attributes
    reduction = attributes.get("reduction") or "mean"
    ignore_index = attributes.get("ignore_index")
    if ignore_index is not None and not _holds(label_type, ignore_index):
        ignore_index = None  # no label can equal it
    label = request.input("label")
    log_prob = e.up(request.input("log_prob"), io)
    rank = request.inference.rank
    shape = request.inference.input_types[request.inference.schema.input_index("log_prob")]
    static_classes = shape.shape[1] if shape is not None and shape.shape is not None and len(shape.shape) > 1 \
        else None
    dy = e.up(request.input("dY"), io)
    dy_type = request.inference.input_types[request.inference.schema.input_index("dY")]
    if reduction != "none" and (dy_type is None or dy_type.shape is None or len(dy_type.shape) != 0):
        dy = b.op1("Reshape", [dy, e.ints([], "scalar_shape")])  # a [1] dY as the scalar it stands for
    static = isinstance(static_classes, int) and all(isinstance(d, int) for d in shape.shape)
    if (static and request.input("weight") is None and 0 < int(np.prod(shape.shape)) <= ONEHOT_WEIGHTS_LIMIT
            and (ignore_index is None or not 0 <= ignore_index < static_classes)):
        _counted_by_onehot(e, label, label_type, log_prob, dy, static_classes, rank, reduction, out, io)
        return

    classes = b.op1("Gather", [b.op1("Shape", [log_prob]), e.ints(1, "class_axis")], axis=0)
    class_ids = b.op1("Range", [b.const(np.array(0, _INT_NP[label_type]), hint="zero_label"),
                                b.op1("Cast", [classes], to=label_type),
                                b.const(np.array(1, _INT_NP[label_type]), hint="one_label")])
    if rank is not None and rank > 2:  # classes along axis 1, then one unit axis per trailing label axis
        class_ids = b.op1("Reshape", [class_ids, e.ints([-1] + [1] * (rank - 2), "class_view")])
    target = _unsqueeze(e, label, 1)
    onehot = b.op1("Cast", [b.op1("Equal", [target, class_ids])], to=e.ct)
    diff = b.op1("Sub", [b.op1("Exp", [log_prob]), onehot])
    if request.input("weight") is None:
        _counted_by_guard(e, target, label_type, classes, static_classes, ignore_index, diff, dy, reduction, out,
                          io)
        return

    # the per-sample factor g * w, shaped like label
    safe_label, kept = counted_labels(b, label, label_type, classes, static_classes, ignore_index)
    weights = b.op1("Cast", [kept], to=e.ct)
    if request.input("weight") is not None:
        weights = b.op1("Mul", [b.op1("Gather", [e.up(request.input("weight"), io), safe_label], axis=0), weights])
    if reduction == "mean":
        total = e.reduce("ReduceSum", weights, tuple(range(rank - 1)), keepdims=0) if rank is not None else \
            b.op1("ReduceSum", [b.op1("Reshape", [weights, e.ints([-1], "flat")])] +
                  ([] if b.opset < 13 else [e.ints([0], "axes")]), keepdims=0)
        zero = b.op1("Equal", [total, e.scalar(0.0, "zero")])
        total = b.op1("Where", [zero, e.scalar(1.0, "one"), total])  # nothing counted: dY undivided
        dy = b.op1("Div", [dy, total])
    e.finish("Mul", [diff, _unsqueeze(e, b.op1("Mul", [weights, dy]), 1)], out, io)


def _counted_by_guard(e: Emitter, target: str, label_type: int, classes: str, static_classes, ignore_index: int | None,
                      diff: str, dy: str, reduction: str, out: str, io: int) -> None:
    """Without class weights, where the one-hot's sums are not taken: each label's weight 1 or 0 from the guard of
    the one-hot's own [N, 1, ...] view of the labels (already shaped to broadcast against the logits: no
    Unsqueeze of the factor), and for ``mean`` their count summed over every axis (whole numbers: any order sums
    them exactly) with ``Max(total, 1)`` as the Where that leaves dY undivided when it is 0. The same values as
    the weighted form's in 2 kernels fewer (vit_dyn's symbolic batch: 15 -> 13)."""
    b = e.b
    _, kept = counted_labels(b, target, label_type, classes, static_classes, ignore_index)
    weights = b.op1("Cast", [kept], to=e.ct)
    if reduction == "mean":
        total = b.op1("ReduceSum", [weights], keepdims=0)
        dy = b.op1("Div", [dy, b.op1("Max", [total, e.scalar(1.0, "one")])])
    elif reduction == "none":  # dY shaped like label
        dy = _unsqueeze(e, dy, 1)
    e.finish("Mul", [diff, b.op1("Mul", [weights, dy])], out, io)


def _counted_by_onehot(e: Emitter, label: str, label_type: int, log_prob: str, dy: str, classes: int, rank: int,
                       reduction: str, out: str, io: int) -> None:
    """Without class weights, log_prob's shape static and small (ONEHOT_WEIGHTS_LIMIT) and ``ignore_index`` no
    class id: the one-hot of the labels against the constant class ids (shaped [N, C, ...]) says both what to
    subtract and, summed over the class axis (a row holds one 1 for a label in [0, C), none for any other), the
    weight 1 or 0 of every label, already shaped [N, 1, ...] to broadcast against the logits. The same values as
    the clamp-and-compare guard, its Cast and the Unsqueeze of the factor (3 + 1 + 1 kernels) give, in one
    ReduceSum; the count of the labels that count is a whole number, so ``Max(total, 1)`` is the Where that leaves
    dY undivided when it is 0. Constant class ids: nothing derived from Shape is compared with a label (tract
    compares those through 32 bits). Kernels per step of a committed artifact's SoftmaxCrossEntropyLossGrad (mean,
    int64 labels): 15 -> 10."""
    b = e.b
    class_ids = b.const(np.arange(classes, dtype=_INT_NP[label_type]).reshape([classes] + [1] * (rank - 2)),
                        hint="class_ids")
    onehot = b.op1("Cast", [b.op1("Equal", [_unsqueeze(e, label, 1), class_ids])], to=e.ct)
    diff = b.op1("Sub", [b.op1("Exp", [log_prob]), onehot])
    weights = e.reduce("ReduceSum", onehot, (1,))
    if reduction == "mean":
        total = e.reduce("ReduceSum", weights, tuple(range(rank)), keepdims=0)
        dy = b.op1("Div", [dy, b.op1("Max", [total, e.scalar(1.0, "one")])])
    elif reduction == "none":  # dY shaped like label
        dy = _unsqueeze(e, dy, 1)
    e.finish("Mul", [diff, b.op1("Mul", [weights, dy])], out, io)
