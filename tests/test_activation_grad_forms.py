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


def _gelu_grad(op_type: str, shape: list) -> onnx.ModelProto:
    names = ["dY", "X"] + (["B"] if op_type == "BiasGeluGrad_dX" else [])
    node = helper.make_node(op_type, names, ["dX"], domain="com.microsoft", name="gg")
    inputs = [helper.make_tensor_value_info("dY", TensorProto.FLOAT, shape),
              helper.make_tensor_value_info("X", TensorProto.FLOAT, shape)]
    if op_type == "BiasGeluGrad_dX":
        inputs.append(helper.make_tensor_value_info("B", TensorProto.FLOAT, [shape[-1]]))
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("dX", TensorProto.FLOAT, shape)])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


@pytest.mark.parametrize("op_type", ["GeluGrad", "BiasGeluGrad_dX"])
@pytest.mark.parametrize("shape", [[3, 5], [4, 16, 32], [2, 7, 3, 9]])
def test_gelu_grad_cdf_one_batch_normalization(op_type: str, shape: list) -> None:
    """``0.5 * (Erf(..) + 1)`` as one BatchNormalization on the onnxruntime target (one kernel fewer a node), byte-equal
    to the portable target's Add + Mul on X over Erf's whole range, with NaN, infinities, signed zeros and
    subnormals."""
    model = _gelu_grad(op_type, shape)
    ours, portable = lower_model(model), lower_model(model, target="portable")
    ops, portable_ops = [n.op_type for n in ours.graph.node], [n.op_type for n in portable.graph.node]
    assert ops.count("BatchNormalization") == 1 and "BatchNormalization" not in portable_ops
    assert ops.count("Add") == portable_ops.count("Add") - 1 and ops.count("Mul") == portable_ops.count("Mul") - 1
    rng = np.random.default_rng(len(shape))
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]) for m in (ours, portable)]
    for scale in (1e-40, 1e-3, 1.0, 4.0, 1e3):
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        x.reshape(-1)[:7] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -5.9]
        feeds = {"dY": rng.standard_normal(shape).astype(np.float32), "X": x}
        if op_type == "BiasGeluGrad_dX":
            feeds["B"] = rng.standard_normal(shape[-1]).astype(np.float32)
        with np.errstate(all="ignore"):
            got, want = (s.run(None, feeds)[0] for s in run)
        assert got.tobytes() == want.tobytes()


def test_gelu_grad_symbolic_axis_1_keeps_add_mul() -> None:
    ops = [n.op_type for n in lower_model(_gelu_grad("GeluGrad", ["batch", "seq", 8])).graph.node]
    assert "BatchNormalization" not in ops
