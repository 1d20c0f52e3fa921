"""The lowering pass: replace every custom node the registry knows by standard ONNX nodes.

The pass does the matching, verification, rewiring and cleanup; the rule registered for the node's
``binding.rule`` only emits nodes (:mod:`lowering.rules`). It runs on onnx-ir models in place
(:class:`LowerCustomOpsPass`, for pass pipelines); :func:`lower_model` wraps it for ``onnx.ModelProto``
(a new model; the caller's is never touched) and for ``onnx_ir.Model``.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import onnx
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from lowering import graphs
from lowering.builder import NodeBuilder
from lowering.compat import runtime_ir_version
from lowering.modelio import check_structure
from lowering.rules import LoweringOptions, LoweringRequest, rule_for
from opdef.errors import LoweringError
from opdef.node import TensorType
from opdef.registry import Registry, load_schemas

DEFAULT_OPSET = 17  # declared when a model imports no default-domain opset at all
MIN_OPSET = 12  # ReduceSum & co. as the rules emit them; onnxruntime-training writes opset 12

ModelT = TypeVar("ModelT", onnx.ModelProto, ir.Model)


@dataclass
class LoweringReport:
    """What one run of the pass did: nodes lowered per ``domain::op_type``, node counts (all graphs)."""

    lowered: Counter = field(default_factory=Counter)
    nodes_before: int = 0
    nodes_after: int = 0

    def summary(self) -> str:
        per_op = ", ".join(f"{n} x {op}" for op, n in sorted(self.lowered.items())) or "no custom nodes"
        return f"lowered {per_op}; nodes {self.nodes_before} -> {self.nodes_after}"


class LowerCustomOpsPass(InPlacePass):
    """onnx-ir pass: lower every registered custom node, in the main graph, subgraphs and functions.

    ``modified`` is True when at least one node was lowered (or the IR version / opsets had to change).
    After a call, ``self.report`` holds the :class:`LoweringReport`.
    """

    def __init__(self, registry: Registry | None = None, *, onednn_single_output: str = "spec") -> None:
        super().__init__()
        self.registry = registry
        self.options = LoweringOptions(onednn_single_output=onednn_single_output)
        self.report = LoweringReport()

    def call(self, model: ir.Model) -> PassResult:
        registry = self.registry if self.registry is not None else load_schemas()
        self.report = LoweringReport()
        with _collector_paused():
            modified = _Lowering(model, registry, self.options, self.report).run()
        return PassResult(model, modified)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector: the pass allocates ~100 objects per emitted node and frees
    none, so the collector's generation scans (which grow with the heap) cost a third of the pass."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def lower_model(model: ModelT, *, registry: Registry | None = None, onednn_single_output: str = "spec") -> ModelT:
    """Lower every custom node of ``model``: ``onnx.ModelProto`` in, a new ``ModelProto`` out (the input
    is not modified); ``onnx_ir.Model`` in, the same ``onnx_ir.Model`` out, lowered in place."""
    return lower_model_with_report(model, registry=registry, onednn_single_output=onednn_single_output)[0]


def lower_model_with_report(model: ModelT, *, registry: Registry | None = None,
                            onednn_single_output: str = "spec") -> tuple[ModelT, LoweringReport]:
    lowering_pass = LowerCustomOpsPass(registry, onednn_single_output=onednn_single_output)
    if isinstance(model, ir.Model):
        lowering_pass(model)
        return model, lowering_pass.report
    if not isinstance(model, onnx.ModelProto):
        raise TypeError(f"lower_model takes an onnx.ModelProto or an onnx_ir.Model, not {type(model).__name__}")
    check_structure(model)  # a broken graph gets a precise ModelError, not onnx-ir's deserialization failure
    with _collector_paused():
        try:
            ir_model = ir.from_proto(model)  # wraps the caller's tensors read-only; externally stored ones stay so
        except Exception as exc:  # noqa: BLE001 -- a malformed model is the user's input, not our bug
            raise LoweringError(f"cannot read the model: {exc}") from None
        lowering_pass(ir_model)
        lowered = ir.to_proto(ir_model)
        graphs.restore_trailing_outputs(ir_model, lowered)
    return lowered, lowering_pass.report


class _Lowering:
    """One run of the pass over one model."""

    def __init__(self, model: ir.Model, registry: Registry, options: LoweringOptions, report: LoweringReport):
        self.model = model
        self.registry = registry
        self.options = options
        self.report = report
        self.types: dict[ir.Value, TensorType] = {}  # known beyond what the values declare
        self._inferred: dict[str, TensorType] | None = None
        self._taken: set[str] = set()
        # Per graph, built once and kept up to date: where each value sits in the graph's outputs, and the
        # lowered nodes to remove at the end (onnx-ir's remove and graph-output replacement scan all
        # outputs on every call, which made the pass quadratic).
        self._output_positions: dict[ir.Graph, dict[ir.Value, list[int]]] = {}
        self._dead: dict[ir.Graph, list[ir.Node]] = {}

    def run(self) -> bool:
        model = self.model
        targets = [(fn, node) for fn, node in graphs.all_nodes(model) if (node.domain, node.op_type) in self.registry]
        self.report.nodes_before = self.report.nodes_after = sum(1 for _ in graphs.all_nodes(model))
        modified = False
        if "" not in model.opset_imports and "ai.onnx" not in model.opset_imports:
            model.opset_imports[""] = DEFAULT_OPSET
            modified = True
        if targets:
            opset = self._default_opset(model.opset_imports, "the model")
            self._taken = graphs.names_in_use(model)
            graphs.call_site_input_types(model, self.types)
            current_function = None
            for function, node in targets:
                if function is not None and function is not current_function:
                    # Call sites (main graph, earlier functions) may have been lowered: their argument
                    # types are final once we reach a function, so once per function is enough.
                    graphs.call_site_input_types(model, self.types)
                    current_function = function
                if function is not None:
                    if "" not in function.opset_imports and "ai.onnx" not in function.opset_imports:
                        function.opset_imports[""] = opset
                    node_opset = self._default_opset(function.opset_imports, f"function {function.name!r}")
                else:
                    node_opset = opset
                self._lower_node(node, node_opset, in_function=function is not None)
            for graph, dead in self._dead.items():
                graph.remove(dead, safe=True)
            graphs.drop_unused_opsets(model, self.registry.domains)
            modified = True
            self.report.nodes_after = sum(1 for _ in graphs.all_nodes(model))
        ir_version = runtime_ir_version(model.ir_version, model.opset_imports)
        if ir_version != model.ir_version:
            model.ir_version = ir_version
            modified = True
        return modified

    @staticmethod
    def _default_opset(opset_imports: dict[str, int], where: str) -> int:
        version = opset_imports.get("", opset_imports.get("ai.onnx"))
        if version < MIN_OPSET:
            raise LoweringError(f"{where} imports default opset {version}; lowering needs {MIN_OPSET} or newer "
                                "(convert it first, e.g. onnx.version_converter.convert_version)")
        return version

    # -- one node --------------------------------------------------------------------------------
    def _lower_node(self, node: ir.Node, opset: int, *, in_function: bool) -> None:
        from opdef.verify import infer_node  # the colleague-owned verifier; imported late (layering, cost)

        label = f"{node.domain}::{node.op_type}"
        value_types = self._value_types(node)
        inference = infer_node(ir.serde.serialize_node(node), value_types, registry=self.registry)
        wanted = frozenset(v.name for v in node.outputs if v.name and graphs.is_consumed(v))
        request = LoweringRequest(inference, wanted, self.options)
        prefix = node.name or node.op_type
        builder = NodeBuilder(opset, prefix, is_taken=self._taken.__contains__)
        rule_for(inference.binding.rule)(builder, request)
        self._splice(node, builder.nodes, wanted, inference.output_types, in_function=in_function)
        self.report.lowered[label] += 1

    def _value_types(self, node: ir.Node) -> dict[str, TensorType]:
        found: dict[str, TensorType] = {}
        for value in [*node.inputs, *node.outputs]:
            if value is None or not value.name:
                continue
            t = self.types.get(value) or graphs.tensor_type(value)
            if (t is None or t.elem_type is None) and value in node.inputs and value.graph is not None:
                t = self._inferred_types().get(value.name, t)
            if t is not None:
                found[value.name] = t
        return found

    def _inferred_types(self) -> dict[str, TensorType]:
        if self._inferred is None:
            self._inferred = graphs.inferred_types(self.model)
        return self._inferred

    def _splice(self, node: ir.Node, emitted: list[onnx.NodeProto], wanted: frozenset[str],
                output_types: tuple[TensorType | None, ...], *, in_function: bool) -> None:
        """Put the rule's nodes where ``node`` was; its consumers and graph outputs now read them."""
        label = f"{node.domain} {node.op_type} '{node.name or '?'}'"
        scope = {v.name: v for v in node.inputs if v is not None and v.name}
        old_outputs = {v.name: (i, v) for i, v in enumerate(node.outputs) if v.name}
        new_nodes = []
        produced: dict[str, ir.Value] = {}
        for proto in _live(emitted, wanted):
            inputs = []
            for name in proto.input:
                if not name:
                    inputs.append(None)
                elif name in produced:
                    inputs.append(produced[name])
                elif name in scope:
                    inputs.append(scope[name])
                else:
                    raise LoweringError(f"{label}: the lowering rule reads {name!r}, which is neither an input "
                                        "of the node nor produced before (a bug in the rule)")
            outputs = [ir.Value(name=name) for name in proto.output]
            for value in outputs:
                if value.name in produced or value.name in scope:
                    raise LoweringError(f"{label}: the lowering rule writes {value.name!r} twice (a bug in the rule)")
                produced[value.name] = value
                self._taken.add(value.name)
            attributes = [ir.serde.deserialize_attribute(a) for a in proto.attribute]
            new_nodes.append(ir.Node(proto.domain, proto.op_type, inputs, attributes, outputs=outputs,
                                     name=proto.name or None))
            if proto.name:
                self._taken.add(proto.name)
        missing = sorted(wanted - produced.keys())
        if missing:
            raise LoweringError(f"{label}: the lowering rule did not produce {missing} (a bug in the rule)")
        graph = node.graph
        if new_nodes:
            graph.insert_before(node, new_nodes)
        for name in sorted(wanted):
            index, old = old_outputs[name]
            new = produced[name]
            if not in_function:  # keep the declared type (functions declare none; IR < 10 may not)
                new.type, new.shape = old.type, old.shape
                if new.type is None and index < len(output_types):
                    graphs.set_tensor_type(new, output_types[index])
            if old in self.types:
                self.types[new] = self.types[old]
            elif index < len(output_types) and output_types[index] is not None:
                self.types[new] = output_types[index]
            if old.is_graph_output():
                self._replace_graph_output(graph, old, new)
            old.replace_all_uses_with(new)
            old.name = None
            new.name = name
        for i in range(len(node.inputs)):
            node.replace_input_with(i, None)  # no longer a user of its inputs; removed in one go at the end
        self._dead.setdefault(graph, []).append(node)

    def _replace_graph_output(self, graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
        positions = self._output_positions.get(graph)
        if positions is None:
            positions = self._output_positions[graph] = {}
            for i, value in enumerate(graph.outputs):
                positions.setdefault(value, []).append(i)
        indices = positions.pop(old)
        for i in indices:
            graph.outputs[i:i + 1] = [new]  # a slice: onnx-ir's index path runs a slow Protocol isinstance
        positions.setdefault(new, []).extend(indices)


def _live(emitted: list[onnx.NodeProto], wanted: frozenset[str]) -> list[onnx.NodeProto]:
    """The emitted nodes that contribute to a wanted output (a rule may emit a little more than needed)."""
    needed = set(wanted)
    keep = []
    for proto in reversed(emitted):
        if needed.intersection(proto.output):
            keep.append(proto)
            needed.update(proto.input)
    return keep[::-1]
