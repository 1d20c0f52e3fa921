"""Kernel counts of the activation family's lowered forms (lowering/rules/activation_grad.py) and their bits against
the forms they replaced."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from lowering.passes import lower_model

SHAPE = [4, 5, 3]


def _dropout_grad(ratio: float, *, constant: bool, elem: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """DropoutGrad of dy and mask with the ratio an initializer (``constant``, as every exported Dropout has it) or
    a graph input."""
    node = helper.make_node("DropoutGrad", ["dy", "mask", "ratio"], ["dx"], domain="com.microsoft", name="dg")
    inputs = [helper.make_tensor_value_info("dy", elem, SHAPE),
              helper.make_tensor_value_info("mask", TensorProto.BOOL, SHAPE)]
    initializers = []
    if constant:
        initializers.append(numpy_helper.from_array(np.array(ratio, np.float32), "ratio"))
    else:
        inputs.append(helper.make_tensor_value_info("ratio", TensorProto.FLOAT, []))
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("dx", elem, SHAPE)], initializers)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _optimized_kernels(model: onnx.ModelProto, tmp_path) -> list[str]:
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node]


def _old_form(dy: np.ndarray, mask: np.ndarray, ratio: float) -> np.ndarray:
    """The previous lowering, ``dy / Where(mask or ratio == 0, 1 - ratio, inf)``, in NumPy (f32 throughout)."""
    keep = mask | (np.float32(ratio) == 0)
    return dy / np.where(keep, np.float32(1) - np.float32(ratio), np.float32(np.inf))


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("constant", [True, False])
def test_dropout_grad_no_or(ratio: float, constant: bool, tmp_path) -> None:
    """No Or of the mask: a constant ratio leaves onnxruntime a Where and a Div (3 kernels before); the values are
    the previous form's bit for bit (dy with infinities, NaN and signed zeros)."""
    lowered = lower_model(_dropout_grad(ratio, constant=constant))
    assert "Or" not in [n.op_type for n in lowered.graph.node]
    if constant:
        assert sorted(_optimized_kernels(lowered, tmp_path)) == ["Div", "Where"]
    rng = np.random.default_rng(int(ratio * 10))
    dy = rng.standard_normal(SHAPE).astype(np.float32)
    dy.reshape(-1)[:6] = [np.inf, -np.inf, np.nan, 0.0, -0.0, -1.0]
    mask = rng.random(SHAPE) >= ratio
    mask.reshape(-1)[:6] = [False, True, False, False, False, False]
    feeds = {"dy": dy, "mask": mask} | ({} if constant else {"ratio": np.array(ratio, np.float32)})
    got = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    with np.errstate(invalid="ignore", divide="ignore"):
        want = _old_form(dy, mask, ratio)
    assert got.tobytes() == want.tobytes()
