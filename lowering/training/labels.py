"""Class labels checked against the class count before they are fed (issue 24).

A label outside [0, C) that is not ``ignore_index`` is a bad value: onnxruntime-training's kernels refuse it at
run time, a standard graph cannot, so the lowered graphs count it as ignored (docs/ops.md, "Bad values at run
time"). Where oplower feeds labels itself (``oplower train``, ``run --check``, :class:`lowering.training.Trainer`,
the train-step bundle) it refuses them first, with one line naming the input, the first bad value and its
position.

A label input is a graph input that reaches the label argument of a ``SoftmaxCrossEntropyLoss`` (ONNX) or a
``SoftmaxCrossEntropyLossGrad`` (com.microsoft) directly or through ops that keep the values (Identity, Cast,
Reshape, Squeeze, Unsqueeze, Flatten). C is the class dim (axis 1) the model declares or infers for the scores
(the log-probabilities for the gradient op); a label input whose C is not known statically is not checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from opdef.errors import OplowerError
from opdef.verify import value_types_of_graph

# (domain, op_type) -> (index of the scores / log-probabilities input, index of the label input)
_LOSSES = {("", "SoftmaxCrossEntropyLoss"): (0, 1), ("ai.onnx", "SoftmaxCrossEntropyLoss"): (0, 1),
           ("com.microsoft", "SoftmaxCrossEntropyLossGrad"): (1, 2)}
_PASS_THROUGH = frozenset({"Identity", "Cast", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})


class LabelValueError(OplowerError):
    """A class label fed to a model lies outside [0, C) and is not ignore_index."""


@dataclass(frozen=True)
class LabelInput:
    """A graph input that holds class labels, and what its values may be."""

    name: str
    classes: int
    ignore_index: int | None
    scores: str  # the value whose axis 1 gives the class count
    node: str  # the loss node, e.g. "SoftmaxCrossEntropyLoss 'sce'"

    def first_bad(self, values: np.ndarray) -> tuple[tuple[int, ...], int] | None:
        """(position, value) of the first entry (row-major) that is no class id and not ignore_index."""
        values = np.asarray(values)
        if values.dtype.kind not in "iu":
            return None  # a float label array fails elsewhere (its type), not here
        if values.size:  # every label a class id: two reductions (a step checks its batch; the masks cost 3x,
            # and on a few labels NumPy's reductions cost 2x Python's min and max of the list)
            flat = values.reshape(-1).tolist() if values.size <= 256 else None
            low, high = (min(flat), max(flat)) if flat is not None else (values.min(), values.max())
            if 0 <= low and high < self.classes:
                return None
        bad = (values < 0) | (values >= self.classes)
        if self.ignore_index is not None:
            bad &= values != self.ignore_index
        if not bad.any():
            return None
        position = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad.reshape(-1))), values.shape))
        return position, int(values[position])

    def describe_problem(self, position: tuple[int, ...], value: int, batch_axis: bool = False) -> str:
        where = "[" + ", ".join(str(i) for i in position) + "]"
        if batch_axis and position:
            where = f"{where} (batch {position[0]})"
        allowed = f"a class id in [0, {self.classes})"
        if self.ignore_index is not None:
            allowed += f" or the ignore_index {self.ignore_index}"
        return (f"label input {self.name!r} holds {value} at {where}; each label must be {allowed} ({self.classes} "
                f"classes: axis 1 of {self.scores!r}, read by {self.node})")


def label_inputs(model: onnx.ModelProto) -> tuple[LabelInput, ...]:
    """The main graph's label inputs (see the module docstring), one per input name."""
    graph = model.graph
    inputs = {i.name for i in graph.input} - {t.name for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    found: dict[str, LabelInput] = {}
    declared, inferred = value_types_of_graph(graph), None
    for node in graph.node:
        where = _LOSSES.get((node.domain, node.op_type))
        if where is None or len(node.input) <= max(where):
            continue
        source = _graph_input(node.input[where[1]], producers, inputs)
        if source is None or source in found:
            continue
        scores = node.input[where[0]]
        classes = _class_count(declared.get(scores))
        if classes is None:  # ONNX shape inference only when the model does not declare it
            inferred = _inferred_types(model) if inferred is None else inferred
            classes = _class_count(inferred.get(scores))
        if classes is None:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        ignore = attrs.get("ignore_index")
        found[source] = LabelInput(source, classes, None if ignore is None else int(ignore), scores,
                                   f"{node.op_type} '{node.name or '?'}'")
    return tuple(found.values())


def check_labels(feeds: Mapping[str, np.ndarray], labels: tuple[LabelInput, ...], source: str,
                 *, batch_axis: bool = False) -> None:
    """Raise LabelValueError for the first label input in ``feeds`` that holds a bad value. ``batch_axis``:
    the arrays carry a leading batch-index axis (``oplower train``'s data), said in the position."""
    for label in labels:
        if label.name not in feeds:
            continue
        bad = label.first_bad(feeds[label.name])
        if bad is not None:
            prefix = f"{source}: " if source else ""
            raise LabelValueError(prefix + label.describe_problem(*bad, batch_axis=batch_axis))


def _graph_input(name: str, producers: Mapping[str, onnx.NodeProto], inputs: set[str]) -> str | None:
    for _ in range(16):  # a short chain of value-keeping ops
        if name in inputs:
            return name
        node = producers.get(name)
        if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in _PASS_THROUGH or not node.input:
            return None
        name = node.input[0]
    return None


def _class_count(t) -> int | None:
    dim = t.shape[1] if t is not None and t.shape is not None and len(t.shape) > 1 else None
    return dim if isinstance(dim, int) else None


def _inferred_types(model: onnx.ModelProto) -> dict:
    """Types after ONNX shape inference, or none when it fails (e.g. a model over protobuf's 2 GiB)."""
    try:
        return value_types_of_graph(onnx.shape_inference.infer_shapes(model).graph)
    except Exception:  # noqa: BLE001 -- a model inference cannot complete is not checked
        return {}
