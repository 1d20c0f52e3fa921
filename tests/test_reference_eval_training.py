"""The float64 model evaluator (runtime.reference_eval, the oracle of `lower --verify` and `run --check`) on
onnxruntime-training's graphs: the pool gradients, InPlaceAccumulatorV2 and both optimizers, checked against
onnxruntime-training's recorded results; its MaxPool Indices against onnxruntime's; whole training graphs
through `lower --verify`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from test_training_updates_recorded import optimizer_step

from lowering.cli import main
from opdef.errors import VerificationError
from runtime.reference_eval import evaluate

ROOT = Path(__file__).resolve().parent / "fixtures" / "ort_training"


def _close(got, want, tol: float, what: str) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    scale = max(float(np.max(np.abs(want))), 1e-30)
    assert float(np.max(np.abs(got - want))) / scale <= tol, what


@pytest.mark.parametrize("name", ["cnn", "mlp", "mlp_bce", "cnn1d"])  # AdamW, SGD, AdamW, SGD
def test_optimizer_models_evaluate_like_onnxruntime_training(name):
    """The original optimizer model (custom op, tensor sequences) in the evaluator, fed the recorded first
    step's inputs: the updated sequences equal onnxruntime-training's within 1e-5, exact and rounded."""
    directory = ROOT / "artifacts" / name
    meta = json.loads((directory / "meta.json").read_text())
    model = onnx.load(directory / "optimizer_model.onnx")
    feeds, recorded = optimizer_step(directory, meta, {i.name for i in model.graph.input})
    params = feeds["params"]
    for exact in (True, False):
        got = evaluate(model, feeds, exact=exact)
        assert [len(got["params.updated"])] == [len(params)]
        for i, p in enumerate(meta["trainable_params"]):
            _close(got["params.updated"][i], recorded[f"params.updated.{i}"], 1e-5, f"{name} {p}")
            if not exact:
                assert got["params.updated"][i].dtype == params[i].dtype
        flag = next(o.name for o in model.graph.output)  # the update flag, true, shaped like step or lr
        assert got[flag].dtype == bool and got[flag].all()


def test_whole_training_graph_passes_lower_verify(tmp_path, capsys):
    """cnn1d's training graph (Conv, BatchNormInternal, MaxPool with ceil_mode, AveragePool, their gradients,
    SoftmaxCrossEntropyLossGrad, eight accumulators) through `lower --verify`: every output, the
    '<buffer>.updated' ones included, within tolerance of the float64 evaluation."""
    out = tmp_path / "lowered.onnx"
    code = main(["lower", str(ROOT / "artifacts" / "cnn1d" / "training_model.onnx"), "-o", str(out), "--verify"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert out.exists()
    assert printed.count("PASS") == len(onnx.load(out).graph.output) and "FAIL" not in printed
    assert "accumulation.buffer.updated" in printed


def _pool_model(pads, strides, ceil_mode):
    node = helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[3, 3], pads=pads, strides=strides,
                            ceil_mode=ceil_mode)
    graph = helper.make_graph([node], "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 7, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("i", TensorProto.INT64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("pads,strides,ceil_mode", [([1, 1, 1, 1], [1, 1], 0), ([1, 0, 1, 0], [2, 2], 1),
                                                    ([0, 0, 0, 0], [2, 2], 0)])
@pytest.mark.parametrize("relu", [False, True], ids=["random", "ties"])
def test_maxpool_indices_are_onnxruntimes(pads, strides, ceil_mode, relu):
    """onnx.reference's own MaxPool gives wrong Indices where the pool has pads; the evaluator's gives
    onnxruntime's (first maximum, flat position in the whole input), ties after a ReLU included."""
    model = _pool_model(pads, strides, ceil_mode)
    x = np.random.default_rng(0).standard_normal((2, 3, 7, 6)).astype(np.float32)
    if relu:
        x = np.maximum(x, 0)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = evaluate(model, {"x": x})
    np.testing.assert_array_equal(got["y"], want[0])
    np.testing.assert_array_equal(got["i"], want[1])


def test_pool_gradient_without_a_declared_dx_shape_is_named():
    """MaxPoolGrad takes dX's shape from the graph's declared type (as onnxruntime's kernel does); without
    one the evaluator names the node and the missing shape."""
    node = helper.make_node("MaxPoolGrad", ["dy", "idx"], ["dx"], name="pool_grad", kernel_shape=[2, 2],
                            strides=[2, 2])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("dy", TensorProto.FLOAT, [1, 1, 2, 2]),
                                            helper.make_tensor_value_info("idx", TensorProto.INT64, [1, 1, 2, 2])],
                              [helper.make_tensor_value_info("dx", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(VerificationError, match="pool_grad.*declares no static shape for dX"):
        evaluate(model, {"dy": np.ones((1, 1, 2, 2), np.float32), "idx": np.arange(4).reshape(1, 1, 2, 2)})
