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
    """

    def __init__(self, opset: int, prefix: str, is_taken: Callable[[str], bool] = lambda _: False) -> None:
        self.opset = opset
        self.prefix = prefix
        self._is_taken = is_taken
        self._used: set[str] = set()
        self.nodes: list[onnx.NodeProto] = []
        self._counter = 0

    def fresh(self, hint: str) -> str:
        while True:
            self._counter += 1
            name = f"{self.prefix}/{hint}_{self._counter}"
            if name not in self._used and not self._is_taken(name):
                self._used.add(name)
                return name

    def op(self, op_type: str, inputs: Sequence[str], outputs: Sequence[str] | int = 1,
           hint: str | None = None, **attrs: Any) -> list[str]:
        """Append one default-domain node; returns its output names (fresh ones when given a count)."""
        if isinstance(outputs, int):
            outputs = [self.fresh(hint or op_type.lower()) for _ in range(outputs)]
        node = helper.make_node(op_type, list(inputs), list(outputs),
                                name=self.fresh(hint or op_type), **attrs)
        self.nodes.append(node)
        return list(outputs)

    def op1(self, op_type: str, inputs: Sequence[str], output: str | None = None,
            hint: str | None = None, **attrs: Any) -> str:
        return self.op(op_type, inputs, [output] if output else 1, hint=hint, **attrs)[0]

    def const(self, value: Any, dtype: Any = None, hint: str = "const") -> str:
        """A constant tensor as a Constant node (valid in graphs, subgraphs and functions alike)."""
        array = np.asarray(value, dtype=dtype)
        name = self.fresh(hint)
        self.nodes.append(helper.make_node("Constant", [], [name], name=self.fresh(hint + "_node"),
                                           value=numpy_helper.from_array(array, name)))
        return name
