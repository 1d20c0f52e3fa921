"""Verify every custom node of a model: main graph, If/Loop/Scan bodies and model-local functions, with
value types from the model and onnx shape inference (the registry's ops made known to onnx first).

Per-node verification is :mod:`opdef.verify`; registering the ops with ``onnx.defs`` is
:mod:`opdef.onnx_defs` (which uses :mod:`opdef.verify` for its inference functions). This module sits
above both, so neither imports the other in a cycle.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx

from opdef.errors import ModelError, OplowerError, VerificationError
from opdef.graphs import subgraphs
from opdef.node import NodeInference, TensorType
from opdef.onnx_defs import lenient_inference, register_onnx_schemas
from opdef.registry import Registry, load_schemas
from opdef.verify import infer_node, value_types_of_graph

__all__ = ["InvalidNodes", "infer_shapes", "verify_model"]


class InvalidNodes(OplowerError):
    """Several invalid nodes (``verify_model(all_errors=True)``): ``errors`` lists each, ``results``
    holds the nodes that verified."""

    def __init__(self, errors: list[VerificationError], results: list[NodeInference]):
        self.errors = errors
        self.results = results
        lines = "; ".join(str(e) for e in errors)
        super().__init__(f"{len(errors)} invalid node{'s' if len(errors) != 1 else ''}: {lines}")


def verify_model(model: onnx.ModelProto, registry: Registry | None = None, *,
                 all_errors: bool = False) -> list[NodeInference]:
    """Verify every custom node (main graph, subgraphs, model-local functions), in graph order.

    Returns the NodeInference of each. Raises the first VerificationError; with ``all_errors``,
    raises :class:`InvalidNodes` carrying every error and the nodes that did verify.
    """
    registry = registry if registry is not None else load_schemas()
    inferred = infer_shapes(model, registry)
    walker = _Walker(registry, all_errors, {(f.domain, f.name) for f in model.functions})
    walker.graph(inferred.graph, {})
    for function in inferred.functions:
        walker.nodes(function.node, value_types_of_graph(function))
    if walker.errors:
        raise InvalidNodes(walker.errors, walker.results)
    return walker.results


def infer_shapes(model: onnx.ModelProto, registry: Registry) -> onnx.ModelProto:
    """onnx shape inference on ``model`` (a copy comes back), the registry's ops known to onnx and inferred
    leniently; raises ModelError when onnx fails."""
    register_onnx_schemas(registry)
    with lenient_inference():
        try:
            return onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
        except OplowerError:
            raise
        except Exception as exc:  # onnx's InferenceError, ValidationError, RuntimeError ...
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelError(f"onnx shape inference failed: {first}") from None


class _Walker:
    def __init__(self, registry: Registry, all_errors: bool, functions: set[tuple[str, str]] = frozenset()):
        self.registry = registry
        self.all_errors = all_errors
        self.functions = functions  # (domain, name) of the model-local functions: calls are not ops
        self.results: list[NodeInference] = []
        self.errors: list[VerificationError] = []

    def graph(self, graph: onnx.GraphProto, outer: Mapping[str, TensorType | None]) -> None:
        self.nodes(graph.node, value_types_of_graph(graph, outer))

    def nodes(self, nodes, types: dict[str, TensorType | None]) -> None:
        for node in nodes:
            if self.registry.handles(node.domain, node.op_type) and (node.domain, node.op_type) not in self.functions:
                self._verify(node, types)
            for sub in subgraphs(node):
                self.graph(sub, types)

    def _verify(self, node: onnx.NodeProto, types: dict[str, TensorType | None]) -> None:
        try:
            inference = infer_node(node, types, self.registry)
        except VerificationError as exc:
            if not self.all_errors:
                raise
            self.errors.append(exc)
            return
        self.results.append(inference)
        for value, t in zip(inference.outputs, inference.output_types, strict=True):
            if value is not None and t is not None:
                types[value] = t

