"""NodeBuilder: what a lowering rule emits into. Rules call it; the pass owns naming and placement."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper


class NodeBuilder:
    """Collects the standard-ONNX nodes and constant tensors one rule application emits.

    ``fresh(hint)`` returns value names that collide with nothing in the model (the pass supplies the
    predicate for names already taken); ``opset`` is the model's default-domain opset version, which
    decides e.g. whether ReduceSum takes ``axes`` as an attribute (< 13) or an input (>= 13).

    The pass may hand in ``into``, the node list of the graph being rebuilt (nodes are created in place
    there, never copied), and ``constants``, the graph's Constant nodes so far by value: a constant
    another node of the graph already emitted is reused, not emitted again.
    """

    def __init__(self, opset: int, prefix: str, is_taken: Callable[[str], bool] = lambda _: False, *,
                 into: Any = None, constants: dict[tuple, str] | None = None, prefix_free: bool = False,
                 first_index: int = 0) -> None:
        self.opset = opset
        self.prefix = prefix
        self._is_taken = is_taken
        # The pass may promise that no name in the model reads "<prefix>/<anything without a slash>" and that
        # earlier builders with this prefix numbered up to ``first_index``: then the counter alone makes a
        # name unique, nothing is looked up, and ``used_names`` stays empty.
        self.prefix_free = prefix_free
        self.used_names: set[str] = set()
        self._into = into if into is not None else onnx.GraphProto().node
        self.nodes: list[onnx.NodeProto] = []
        # (inputs, outputs) of each node as emitted: the pass checks and prunes without reading protos back
        self.signatures: list[tuple[list[str], list[str]]] = []
        self.constants = constants if constants is not None else {}
        self.new_constants: dict[str, tuple] = {}  # value name -> key, for the constants this builder emitted
        self._counter = first_index

    def is_taken(self, name: str) -> bool:
        """Whether ``name`` is in use (a builder for a subgraph's nodes shares the predicate)."""
        return self._is_taken(name) or name in self.used_names

    @property
    def last_index(self) -> int:
        """The counter after the last name handed out (a later builder with the same prefix starts there)."""
        return self._counter

    def fresh(self, hint: str) -> str:
        if "/" in hint:
            hint = hint.replace("/", "_")  # a name's prefix is everything before its last slash
        if self.prefix_free:
            self._counter += 1
            return f"{self.prefix}/{hint}_{self._counter}"
        while True:
            self._counter += 1
            name = f"{self.prefix}/{hint}_{self._counter}"
            if name not in self.used_names and not self._is_taken(name):
                self.used_names.add(name)
                return name

    def fresh_names(self, hints: Sequence[str]) -> list[str]:
        """``[self.fresh(h) for h in hints]`` (hints already free of slashes), one list at once where the
        prefix is free."""
        if not self.prefix_free:
            return [self.fresh(h) for h in hints]
        first, prefix = self._counter + 1, self.prefix
        self._counter += len(hints)
        return [f"{prefix}/{hint}_{i}" for i, hint in enumerate(hints, first)]

    def op(self, op_type: str, inputs: Sequence[str], outputs: Sequence[str] | int = 1,
           hint: str | None = None, **attrs: Any) -> list[str]:
        """Append one default-domain node; returns its output names (fresh ones when given a count)."""
        if isinstance(outputs, int):
            value_hint = hint or op_type.lower()
            outputs = [self.fresh(value_hint) for _ in range(outputs)]
        else:
            outputs = list(outputs)
        inputs = list(inputs)
        node = self._into.add(op_type=op_type, input=inputs, output=outputs, name=self.fresh(hint or op_type))
        if attrs:
            for key, value in sorted(attrs.items()):
                if value is not None:
                    _add_attribute(node, key, value)
        self.nodes.append(node)
        # a subgraph (Scan/Loop body) may read the outer graph's values by name: they count as the node's
        # inputs for the pass's liveness, or the nodes producing them would be pruned
        graphs = [v for v in attrs.values() if isinstance(v, onnx.GraphProto)]
        self.signatures.append((inputs + [n for g in graphs for n in outer_reads(g)], outputs))
        return outputs

    def op1(self, op_type: str, inputs: Sequence[str], output: str | None = None,
            hint: str | None = None, **attrs: Any) -> str:
        return self.op(op_type, inputs, [output] if output else 1, hint=hint, **attrs)[0]

    def const(self, value: Any, dtype: Any = None, hint: str = "const") -> str:
        """A constant tensor as a Constant node (valid in graphs, subgraphs and functions alike); one node
        per distinct value."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        name = self.constants.get(key)
        if name is None:
            name = self.fresh(hint)
            self.op("Constant", [], [name], hint=hint + "_node", value=numpy_helper.from_array(array, name))
            self.constants[key] = name
            self.new_constants[name] = key
        return name


def outer_reads(graph: onnx.GraphProto) -> list[str]:
    """The names ``graph`` (and the subgraphs in it) reads but does not define: values of an enclosing graph."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    reads: list[str] = []
    for node in graph.node:
        for name in node.input:
            if name and name not in defined:
                reads.append(name)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                reads.extend(n for n in outer_reads(sub) if n not in defined)
        defined.update(node.output)
    return list(dict.fromkeys(reads))


def _add_attribute(node: onnx.NodeProto, key: str, value: Any) -> None:
    """``node.attribute.append(helper.make_attribute(key, value))``, the kinds rules use most set directly."""
    kind = type(value)
    if kind is int:
        node.attribute.add(name=key, type=onnx.AttributeProto.INT, i=value)
    elif kind is float:
        node.attribute.add(name=key, type=onnx.AttributeProto.FLOAT, f=value)
    elif kind is onnx.TensorProto:
        node.attribute.add(name=key, type=onnx.AttributeProto.TENSOR, t=value)
    else:
        node.attribute.append(helper.make_attribute(key, value))
