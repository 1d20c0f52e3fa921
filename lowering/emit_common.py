"""What every emitter shares: the computation type, and small node helpers over a :class:`NodeBuilder`."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from lowering.builder import NodeBuilder

_NP_OF = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64}
# Opset from which a reduction takes ``axes`` as an input instead of an attribute.
AXES_INPUT_SINCE = {"ReduceSum": 13, "ReduceMean": 18, "ReduceSumSquare": 18, "ReduceMax": 18}


def compute_type(*types: int) -> int:
    """f64 computes in f64; everything else (f32, and f16/bf16 cast up once, rounded once) in f32."""
    return TensorProto.DOUBLE if TensorProto.DOUBLE in types else TensorProto.FLOAT


class Emitter:
    """Base of the op emitters: constants in the computation type, casts, reductions, the final write."""

    def __init__(self, b: NodeBuilder, ct: int) -> None:
        self.b = b
        self.ct = ct
        self.np_ct = _NP_OF[ct]

    def scalar(self, value: float, hint: str = "c") -> str:
        return self.b.const(np.array(value, dtype=self.np_ct), hint=hint)

    def ints(self, values, hint: str = "shape") -> str:
        return self.b.const(np.array(values, dtype=np.int64), hint=hint)

    def cast(self, name: str, from_type: int, to_type: int, output: str | None = None) -> str:
        if from_type == to_type:
            return name if output is None else self.b.op1("Identity", [name], output)
        return self.b.op1("Cast", [name], output, to=to_type)

    def up(self, name: str, from_type: int) -> str:
        """``name`` in the computation type."""
        return self.cast(name, from_type, self.ct)

    def reduce(self, op_type: str, x: str, axes: tuple[int, ...], keepdims: int = 1,
               output: str | None = None) -> str:
        """A reduction over ``axes``: an attribute before the opset that made it an input."""
        if self.b.opset < AXES_INPUT_SINCE[op_type]:
            return self.b.op1(op_type, [x], output, axes=list(axes), keepdims=keepdims)
        return self.b.op1(op_type, [x, self.ints(list(axes), "axes")], output, keepdims=keepdims)

    def finish(self, op_type: str, inputs: list[str], output: str, out_type: int) -> None:
        """The last op of a result writes the requested name, through one Cast when the types differ."""
        if out_type == self.ct:
            self.b.op1(op_type, inputs, output)
        else:
            self.b.op1("Cast", [self.b.op1(op_type, inputs)], output, to=out_type)


_INDEX_NP = {TensorProto.INT32: np.int32, TensorProto.INT64: np.int64}
_INT32_MAX = 2**31 - 1


def index_in_range(b: NodeBuilder, indices: str, index_type: int, limit: str | None, static_limit: int | None) -> str:
    """A bool tensor shaped like ``indices``: ``0 <= index < limit`` (``limit`` at run time, of ``index_type``;
    ``static_limit`` when the graph declares it, then compared as a constant and ``limit`` may be None).

    The guard in front of a Gather or Scatter whose indices are run-time values (a bad label or index must not
    reach it). tract 0.23 compares an integer with a value derived from Shape through 32 bits (2**32 + 1 < 4
    holds there), so with a run-time limit int64 indices are also compared after clamping them to int32's range
    with constants: exact in tract for limits below 2**31, and exact everywhere else."""
    np_type = _INDEX_NP[index_type]
    zero = b.const(np.array(0, np_type), hint="zero_index")
    if static_limit is not None:
        below = b.op1("Less", [indices, b.const(np.array(static_limit, np_type), hint="index_limit")])
        return b.op1("And", [b.op1("Not", [b.op1("Less", [indices, zero])]), below])
    inside = b.op1("And", [b.op1("Not", [b.op1("Less", [indices, zero])]), b.op1("Less", [indices, limit])])
    if index_type != TensorProto.INT64:
        return inside
    bounded = b.op1("Min", [b.op1("Max", [indices, b.const(np.array(-1, np_type), hint="minus_one")]),
                            b.const(np.array(_INT32_MAX, np_type), hint="int32_max")])
    return b.op1("And", [inside, b.op1("And", [b.op1("Not", [b.op1("Less", [bounded, zero])]),
                                               b.op1("Less", [bounded, limit])])])


def guarded_index(b: NodeBuilder, indices: str, index_type: int, limit: str | None,
                  static_limit: int | None) -> tuple[str, str]:
    """(indices with every one outside [0, limit) replaced by one inside, the bool mask of those inside): what
    a Gather or Scatter may take, and what says which entries count. With ``static_limit`` (> 0) the indices
    are clamped by constants and compared with their clamped value (three passes); else
    :func:`index_in_range` and a Where put 0 in place of the bad ones. (Max and Min, not one Clip: onnxruntime's
    int64 Clip takes twice as long as both, measured on MaxPoolGrad's indices.)"""
    if static_limit is not None and static_limit > 0:
        np_type = _INDEX_NP[index_type]
        low = b.const(np.array(0, np_type), hint="zero_index")
        high = b.const(np.array(static_limit - 1, np_type), hint="last_index")
        clamped = b.op1("Min", [b.op1("Max", [indices, low]), high])
        return clamped, b.op1("Equal", [clamped, indices])
    inside = index_in_range(b, indices, index_type, limit, static_limit)
    return b.op1("Where", [inside, indices, b.const(np.array(0, _INDEX_NP[index_type]), hint="zero_index")]), inside
