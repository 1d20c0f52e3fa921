"""What verification/inference returns for one node: the interface between opdef and lowering."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opdef.binding import Binding
from opdef.schema import OpSchema

Dim = int | str | None  # int: known size; str: symbolic (dim_param); None: unknown


@dataclass(frozen=True)
class TensorType:
    """What is known of a value's type: a tensor's element type and shape, or a non-tensor's kind.

    ``container`` is None for a tensor; "seq" or "optional" for a sequence or optional of tensors (then
    ``elem_type`` is the tensors' and ``shape`` None: an element's shape is not part of the type); for
    any other non-tensor (a map, a sequence of sequences ...) its ONNX spelling, ``elem_type`` None.
    """

    elem_type: int | None  # onnx.TensorProto element type; None: unknown
    shape: tuple[Dim, ...] | None  # None: unknown rank
    container: str | None = None

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)


@dataclass(frozen=True)
class NodeInference:
    """A verified node: its schema, binding, resolved attributes and inferred output types.

    Positions follow the schema's argument order. ``roles`` maps canonical role names (DESIGN.md
    section 4: src, diff_dst, mean, variance|inv_std, gamma, diff_src, diff_gamma, diff_beta) to the
    ONNX value names that are present (inputs) or requested (outputs).
    """

    domain: str
    op_type: str
    node_name: str
    schema: OpSchema
    binding: Binding
    inputs: tuple[str | None, ...]
    outputs: tuple[str | None, ...]
    attributes: Mapping[str, Any]
    input_types: tuple[TensorType | None, ...]
    output_types: tuple[TensorType | None, ...]
    type_vars: Mapping[str, int]
    roles: Mapping[str, str]
    rank: int | None = None
    channel_axis: int | None = None  # non-negative when the rank is known
    reduce_axes: tuple[int, ...] | None = None  # the axes sums run over, when decidable
    epsilon: float | None = None
