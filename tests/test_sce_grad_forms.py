"""SoftmaxCrossEntropyLossGrad without class weights where the one-hot's sums are not taken (a symbolic batch or
class count): the guard on the one-hot's [N, 1, ...] view of the labels (_counted_by_guard), its node count and
its bits against the one-hot form of the same inputs at static shapes."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from lowering.passes import lower_model


def _model(shape: tuple, symbolic: int | None, reduction: str, ignore_index: int | None,
           dy_shape: list) -> onnx.ModelProto:
    attrs = {"reduction": reduction} | ({} if ignore_index is None else {"ignore_index": ignore_index})
    node = helper.make_node("SoftmaxCrossEntropyLossGrad", ["dy", "lp", "y"], ["dl"], domain="com.microsoft",
                            name="sg", **attrs)
    dims = list(shape)
    if symbolic is not None:
        dims[symbolic] = "batch" if symbolic == 0 else "classes"
    label_dims = [dims[0], *dims[2:]]
    inputs = [helper.make_tensor_value_info("dy", TensorProto.FLOAT, label_dims if reduction == "none" else dy_shape),
              helper.make_tensor_value_info("lp", TensorProto.FLOAT, dims),
              helper.make_tensor_value_info("y", TensorProto.INT64, label_dims)]
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("dl", TensorProto.FLOAT, dims)])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    return ort.InferenceSession(lower_model(model).SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_symbolic_batch_kernels(tmp_path) -> None:
    """vit_dyn's loss gradient ([batch, 4], mean): 14 kernels after onnxruntime's optimization besides the class
    ids' Shape, Gather, Range (16 before): one Unsqueeze of the labels, Max instead of Equal + Where."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(lower_model(_model((4, 4), 0, "mean", None, [])).SerializeToString(), options,
                         providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node
           if n.op_type not in ("Shape", "Gather", "Range")]
    assert ops.count("Unsqueeze") == 1 and "Where" not in ops and ops.count("Max") == 2  # the guard's and the count's
    assert len(ops) == 14, ops


@pytest.mark.parametrize("shape", [(4, 5), (1, 3), (3, 4, 2)])
@pytest.mark.parametrize("symbolic", [0, 1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [None, -100, 1])
def test_bits_of_the_onehot_form(shape: tuple, symbolic: int, reduction: str, ignore_index: int | None) -> None:
    """Byte-equal to the one-hot form at static shapes: bad labels (-2, -1, C, C + 1), ignored ones, every label
    ignored, dY 0.37, inf, a [1] dY; log_prob with NaN, -inf and signed zeros."""
    rng = np.random.default_rng([len(shape), symbolic, len(reduction), abs(ignore_index or 7)])
    label_shape = [shape[0], *shape[2:]]
    for dy_shape in ([], [1]):
        guarded = _model(shape, symbolic, reduction, ignore_index, dy_shape)
        onehot = _model(shape, None, reduction, ignore_index, dy_shape)
        for case in range(4):
            lp = np.log(rng.dirichlet(np.ones(shape[1]), size=label_shape)).astype(np.float32)
            lp = np.moveaxis(lp, -1, 1).copy()
            if case == 3:
                lp.reshape(-1)[::5] = [np.nan, -np.inf, 0.0, -0.0][rng.integers(0, 4)]
            y = rng.integers(-2, shape[1] + 2, size=label_shape).astype(np.int64)
            if ignore_index is not None:
                y[rng.random(label_shape) < 0.3] = ignore_index
            if case == 2:
                y[:] = -1 if ignore_index is None else ignore_index
            value = np.array([1.0, 0.37, np.inf, -2.5][case], np.float32)
            dy = np.full(label_shape, value) if reduction == "none" else value.reshape(dy_shape)
            feeds = {"dy": dy, "lp": lp, "y": y}
            assert _run(guarded, feeds).tobytes() == _run(onehot, feeds).tobytes()
