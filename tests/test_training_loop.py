"""lowering.training.trainer and ``oplower train``: an artifact directory trained on plain onnxruntime.

The committed hand-built artifact directory tests/fixtures/tiny_mlp (tests/fixtures/make_tiny_mlp.py: an MLP
with an MSE loss whose backward is standard ops, InPlaceAccumulatorV2 nodes and an AdamWOptimizer model) is
trained for a few steps and compared with an independent float64 NumPy implementation of the same MLP and
the float64 optimizer references. Real onnxruntime-training artifacts (recorded fixtures) are tested in
test_ort_training_artifacts.py once they exist.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from lowering.cli import main
from lowering.training.trainer import TrainingDataError, initial_parameters, lower_artifacts, train
from opdef.errors import LoweringError
from runtime import reference_updates as ref

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import make_tiny_mlp as tiny  # noqa: E402

TINY = FIXTURES / "tiny_mlp"
F32 = np.float32


def _forward_backward(params, x, t):
    """The MLP's loss and parameter gradients in float64 (by hand, independent of the ONNX graph)."""
    w1, b1, w2, b2 = (params[k].astype(np.float64) for k in tiny.PARAMS)
    x, t = x.astype(np.float64), t.astype(np.float64)
    h = x @ w1.T + b1
    a = np.maximum(h, 0)
    y = a @ w2.T + b2
    d = y - t
    loss = float(np.mean(d * d))
    dy = 2 * d / d.size
    da = dy @ w2
    dh = da * (h > 0)
    grads = {"fc1.weight": dh.T @ x, "fc1.bias": dh.sum(0), "fc2.weight": dy.T @ a, "fc2.bias": dy.sum(0)}
    return loss, grads


def _reference_run(params, data, steps, lr, optimizer="adamw"):
    params = {k: v.astype(np.float64) for k, v in params.items()}
    m1 = [np.zeros_like(v) for v in params.values()]
    m2 = [np.zeros_like(v) for v in params.values()]
    losses = []
    for k in range(steps):
        b = k % data["input"].shape[0]
        loss, grads = _forward_backward(params, data["input"][b], data["target"][b])
        losses.append(loss)
        g = [grads[p] for p in params]
        if optimizer == "adamw":
            _, w, m1, m2 = ref.adamw_optimizer(float(F32(lr)), k + 1, list(params.values()), g, m1, m2,
                                               alpha=float(F32(0.9)), beta=float(F32(0.999)),
                                               epsilon=float(F32(1e-8)), weight_decay=float(F32(0.01)),
                                               adam_mode=0, correct_bias=1)
        else:
            _, w = ref.sgd_optimizer(float(F32(lr)), list(params.values()), g)
        params = dict(zip(params, w, strict=True))
    return losses, params


def _start():
    return {i.name: numpy_helper.to_array(i) for i in onnx.load(TINY / "model.onnx").graph.initializer}


def test_committed_fixture_is_what_its_generator_writes(tmp_path):
    tiny.write(tmp_path)
    for name in ("training_model.onnx", "optimizer_model.onnx", "model.onnx"):
        assert onnx.load(tmp_path / name) == onnx.load(TINY / name), name
    for key, value in np.load(TINY / "data.npz").items():
        np.testing.assert_array_equal(value, np.load(tmp_path / "data.npz")[key])


def test_lowered_artifacts_are_standard_onnx_with_updated_outputs():
    models = lower_artifacts(TINY)
    for model in (models.training, models.optimizer):
        onnx.checker.check_model(model, full_check=True)
        assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    outputs = [o.name for o in models.training.graph.output]
    assert outputs[0] == "loss" and all(f"{p}_grad.accumulation.buffer.updated" in outputs for p in tiny.PARAMS)
    assert [o.name for o in models.optimizer.graph.output] == [
        "update_completed", "params.updated", "first_order_moments.updated", "second_order_moments.updated"]
    assert models.params == tuple(tiny.PARAMS) and models.other_inputs == ("input", "target")


@pytest.mark.parametrize("steps", [1, 6])
def test_training_matches_the_float64_reference(steps):
    data = dict(np.load(TINY / "data.npz"))
    losses, params = train(TINY, data, steps, learning_rate=0.01)
    want_losses, want_params = _reference_run(_start(), data, steps, 0.01)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for p in tiny.PARAMS:
        np.testing.assert_allclose(params[p], want_params[p], rtol=1e-4, atol=1e-5, err_msg=p)
    if steps > 1:
        assert losses[-1] < losses[0]  # it learns


def test_sgd_optimizer_model_trains_too(tmp_path):
    shutil.copytree(TINY, tmp_path / "art")
    seq = helper.make_sequence_type_proto(helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, None))
    node = helper.make_node("SGDOptimizerV2", ["learning_rate", "params", "gradients"], ["update_completed"],
                            domain="com.microsoft")
    graph = helper.make_graph([node], "sgd", [helper.make_tensor_value_info("learning_rate", 1, [1]),
                                              helper.make_value_info("params", seq),
                                              helper.make_value_info("gradients", seq)],
                              [helper.make_tensor_value_info("update_completed", onnx.TensorProto.BOOL, [1])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                      helper.make_opsetid("com.microsoft", 1)], ir_version=9),
              tmp_path / "art" / "optimizer_model.onnx")
    data = dict(np.load(TINY / "data.npz"))
    losses, params = train(tmp_path / "art", data, 4, learning_rate=0.05)
    want_losses, want_params = _reference_run(_start(), data, 4, 0.05, optimizer="sgd")
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for p in tiny.PARAMS:
        np.testing.assert_allclose(params[p], want_params[p], rtol=1e-5, atol=1e-6, err_msg=p)


def test_initial_parameters_from_an_npz_replace_the_forward_model():
    models = lower_artifacts(TINY)
    given = {k: np.full_like(v, 0.1) for k, v in _start().items()}
    start = initial_parameters(TINY, models, given, "p.npz")
    assert all(np.all(v == F32(0.1)) for v in start.params.values()) and start.frozen == {}
    data = dict(np.load(TINY / "data.npz"))
    losses, _ = train(TINY, data, 1, params=given)
    assert losses[0] == pytest.approx(_forward_backward(given, data["input"][0], data["target"][0])[0], rel=1e-6)


def test_bad_parameters_and_data_are_one_line_errors():
    models = lower_artifacts(TINY)
    with pytest.raises(TrainingDataError, match="p.npz: parameter 'fc1.bias' has shape \\[3\\]"):
        initial_parameters(TINY, models, {**_start(), "fc1.bias": np.zeros(3, F32)}, "p.npz")
    with pytest.raises(TrainingDataError, match="'fc9.weight' is no parameter of the training model"):
        initial_parameters(TINY, models, {"fc9.weight": np.zeros(3, F32)}, "p.npz")
    with pytest.raises(TrainingDataError, match="no array for the data input 'target'"):
        train(TINY, {"input": np.zeros((2, 8, 4), F32)}, 1)
    with pytest.raises(TrainingDataError, match="'input' has shape \\[4\\]; expected the input's rank 2 "
                       "\\(one batch\\) or a leading batch-index axis over it"):
        train(TINY, {"input": np.zeros((4,), F32), "target": np.zeros((1, 8, 2), F32)}, 1)
    with pytest.raises(TrainingDataError, match="'input' has shape \\[1, 1, 8, 4\\]"):
        train(TINY, {"input": np.zeros((1, 1, 8, 4), F32), "target": np.zeros((1, 8, 2), F32)}, 1)


def test_one_batch_of_the_inputs_own_rank_is_fed_at_every_step():
    data = dict(np.load(TINY / "data.npz"))
    batch = {k: v[0] for k, v in data.items()}
    one, _ = train(TINY, batch, 3)
    many, _ = train(TINY, {k: np.stack([v, v, v]) for k, v in batch.items()}, 3)
    assert one == many
    cycled, _ = train(TINY, data, 3)
    assert data["input"].shape[0] > 1 and cycled != one  # the batch-index form does cycle


def test_an_op_without_lowering_is_named(tmp_path):
    shutil.copytree(TINY, tmp_path / "art")
    model = onnx.load(tmp_path / "art" / "training_model.onnx")
    model.graph.node.append(helper.make_node("ConvGradX", ["h"], ["unused"], domain="com.microsoft", name="cg"))
    onnx.save(model, tmp_path / "art" / "training_model.onnx")
    with pytest.raises(LoweringError, match="plain onnxruntime cannot run com.microsoft::ConvGradX "):
        lower_artifacts(tmp_path / "art")


# -- the CLI -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["onnxruntime", "portable"])
def test_cli_trains_and_saves(tmp_path, capsys, target):
    out = tmp_path / "trained.npz"
    code = main(["train", str(TINY), "--steps", "3", "--data", str(TINY / "data.npz"), "--lr", "0.01",
                 "--save", str(out), "--target", target])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = dict(np.load(TINY / "data.npz"))
    want_losses, want_params = _reference_run(_start(), data, 3, 0.01)
    lines = [line for line in captured.out.splitlines() if line.startswith("step ")]
    assert [line.split()[:2] for line in lines] == [["step", "1"], ["step", "2"], ["step", "3"]]
    np.testing.assert_allclose([float(line.split()[3]) for line in lines], want_losses, rtol=1e-5)
    assert captured.err == ""  # the progress bar only on a terminal (test_checkpoint.py tests it under a pty)
    saved = np.load(out)
    for p in tiny.PARAMS:
        np.testing.assert_allclose(saved[p], want_params[p], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("change, fragment", [
    (lambda d: d.pop("target"), "no array for the data input 'target'"),
    (lambda d: d.update(extra=np.zeros(3, F32)), "'extra' is no data input of the training model"),
])
def test_cli_bad_data_exit_1_nothing_written(tmp_path, capsys, change, fragment):
    data = dict(np.load(TINY / "data.npz"))
    change(data)
    np.savez(tmp_path / "bad.npz", **data)
    out = tmp_path / "trained.npz"
    code = main(["train", str(TINY), "--steps", "2", "--data", str(tmp_path / "bad.npz"), "--save", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and fragment in err[0] and err[0].startswith("oplower train: error: ")
    assert not out.exists()


def test_cli_bad_arguments(tmp_path, capsys):
    data = str(TINY / "data.npz")
    assert main(["train", str(tmp_path), "--steps", "1", "--data", data]) == 1
    assert "training_model.onnx: no such file" in capsys.readouterr().err
    assert main(["train", str(TINY), "--steps", "1", "--data", data, "--lr", "-1"]) == 1
    assert "--lr -1.0: the learning rate must be finite and > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["train", str(TINY), "--steps", "0", "--data", data])
    assert info.value.code == 2
