"""The one-node com.microsoft models the op-family tests build, verify and check: the model builder, shape
inference with its one-line refusal, the relative-error comparison and finite differences."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from opdef.errors import VerificationError
from opdef.node import TensorType
from opdef.verify import infer_node

MS = "com.microsoft"
F32, F16, BF16, F64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE
I32, I64, BOOL = TensorProto.INT32, TensorProto.INT64, TensorProto.BOOL
TOL = {F32: 2e-6, F16: 2e-3, BF16: 1.6e-2, F64: 1e-12, I32: 0, I64: 0, BOOL: 0}  # of the output's largest magnitude
vi = helper.make_tensor_value_info


def one_node_model(node, inputs, outputs, opset=17):
    """``node`` alone in a graph of ``(name, elem_type, shape)`` inputs and outputs, importing ("", opset) and
    com.microsoft 1."""
    graph = helper.make_graph([node], "g", [vi(n, t, s) for n, t, s in inputs], [vi(n, t, s) for n, t, s in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


def verify(node, types):
    """The output types ``node`` infers from ``{input name: (elem_type, shape)}``."""
    return infer_node(node, {k: TensorType(t, s) for k, (t, s) in types.items()})


def verification_error(node, types) -> str:
    """The VerificationError ``verify`` raises, asserted to be one line that names the node."""
    with pytest.raises(VerificationError) as info:
        verify(node, types)
    message = str(info.value)
    assert "\n" not in message and f"'{node.name}'" in message
    return message


def close(got, want, elem_type, what="", scale=0.0):
    """Within TOL of the largest entry of ``want`` (or of ``scale`` where that is larger: a result that is a small
    difference of larger terms carries their rounding)."""
    got, want = np.asarray(got).astype(np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if want.size == 0:
        return
    err = float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), scale, 1e-30)
    assert err <= TOL[elem_type], f"{what}: relative error {err:.3g} > {TOL[elem_type]}"


def numeric_gradient(f, x, direction_count=6, eps=1e-6, seed=0):
    """Directional derivatives of the scalar f at x along a few random directions (float64)."""
    rng = np.random.default_rng(seed)
    for _ in range(direction_count):
        v = rng.standard_normal(x.shape)
        yield v, (f(x + eps * v) - f(x - eps * v)) / (2 * eps)
