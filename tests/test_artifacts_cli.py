"""``oplower artifacts`` and ``lowering.training.generate_artifacts`` on hand-built forward models: the
interface (onnxruntime-training's signature and enums), the files, a numpy float64 check of the gradients,
training with ``oplower train``, and every kind of bad input (one line, exit 1, nothing written)."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from _artifacts import gradients_exposed
from onnx import TensorProto, helper, numpy_helper

from lowering.cli import main
from lowering.passes import lower_model
from lowering.training import LossType, OptimType, generate_artifacts
from lowering.training.checkpoint import read_checkpoint
from runtime.session import run_model

RNG = np.random.default_rng(7)
W1 = RNG.standard_normal((5, 6)).astype(np.float32) * 0.5
B1 = RNG.standard_normal(5).astype(np.float32) * 0.1
W2 = RNG.standard_normal((3, 5)).astype(np.float32) * 0.5
B2 = RNG.standard_normal(3).astype(np.float32) * 0.1
X = RNG.standard_normal((4, 6)).astype(np.float32)
LABELS = np.array([0, 2, 1, 2], np.int64)


def mlp(*, extra_nodes=(), extra_inits=(), output_type=TensorProto.FLOAT, extra_inputs=()) -> onnx.ModelProto:
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["scores"], name="fc2", transB=1), *extra_nodes]
    inits = [numpy_helper.from_array(v, n) for n, v in (("w1", W1), ("b1", B1), ("w2", W2), ("b2", B2))]
    out = nodes[-1].output[0]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6]),
                                             *extra_inputs],
                              [helper.make_tensor_value_info(out, output_type, None)], inits + list(extra_inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture
def forward(tmp_path) -> Path:
    path = tmp_path / "forward.onnx"
    onnx.save(mlp(), path)
    return path


def test_signature_and_enums_are_onnxruntime_trainings():
    params = list(inspect.signature(generate_artifacts).parameters)
    assert params[:6] == ["model", "requires_grad", "frozen_params", "loss", "optimizer", "artifact_directory"]
    for name in ("prefix", "additional_output_names", "loss_input_names"):
        assert name in params
    assert {m.name: m.value for m in LossType} == {"MSELoss": 1, "CrossEntropyLoss": 2, "BCEWithLogitsLoss": 3,
                                                   "L1Loss": 4}
    assert {m.name: m.value for m in OptimType} == {"AdamW": 1, "SGD": 2}


def _numpy_gradients() -> tuple[float, dict[str, np.ndarray]]:
    """Cross-entropy of the MLP in float64, by hand."""
    x, w1, b1, w2, b2 = (a.astype(np.float64) for a in (X, W1, B1, W2, B2))
    h = x @ w1.T + b1
    r = np.maximum(h, 0)
    s = r @ w2.T + b2
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    loss = -np.mean(np.log(p[np.arange(4), LABELS]))
    ds = p.copy()
    ds[np.arange(4), LABELS] -= 1
    ds /= 4
    dr = ds @ w2
    dh = dr * (h > 0)
    return loss, {"w1": dh.T @ x, "b1": dh.sum(0), "w2": ds.T @ r, "b2": ds.sum(0)}


def test_library_writes_four_files_with_numpy_exact_gradients(forward, tmp_path):
    out = tmp_path / "art"
    generate_artifacts(str(forward), requires_grad=["w1", "b1", "w2", "b2"], loss=LossType.CrossEntropyLoss,
                       optimizer=OptimType.AdamW, artifact_directory=out, prefix="p_")
    assert sorted(p.name for p in out.iterdir()) == ["p_checkpoint", "p_eval_model.onnx", "p_optimizer_model.onnx",
                                                     "p_training_model.onnx"]
    training = onnx.load(out / "p_training_model.onnx")
    assert [i.name for i in training.graph.input] == [
        "x", "labels", "w1", "b1", "w2", "b2", "w1_grad.accumulation.buffer", "b1_grad.accumulation.buffer",
        "w2_grad.accumulation.buffer", "b2_grad.accumulation.buffer", "lazy_reset_grad"]
    assert [o.name for o in training.graph.output][1:] == [f"{p}_grad.accumulation.out" for p in
                                                          ("w1", "b1", "w2", "b2")]
    # gradients: the accumulators cut off (their second input is the gradient), compared with numpy
    training, accumulate = gradients_exposed(training)
    got = run_model(lower_model(training), {"x": X, "labels": LABELS, "w1": W1, "b1": B1, "w2": W2, "b2": B2})
    loss, want = _numpy_gradients()
    assert abs(float(got[training.graph.output[0].name]) - loss) <= 1e-6 * abs(loss)
    for p, g in accumulate.items():
        assert np.max(np.abs(got[g] - want[p])) <= 1e-6 * np.max(np.abs(want[p])), p
    ckpt = read_checkpoint(out / "p_checkpoint")
    assert sorted(ckpt.params) == ["b1", "b2", "w1", "w2"] and not ckpt.frozen
    np.testing.assert_array_equal(ckpt.params["w2"], W2)


def test_cli_makes_artifacts_that_oplower_train_trains(forward, tmp_path, capsys):
    out = tmp_path / "art"
    assert main(["artifacts", str(forward), "-o", str(out), "--loss", "CrossEntropyLoss", "--optimizer", "SGD"]) == 0
    printed = capsys.readouterr().out
    assert "4 trainable parameters" in printed and "inputs x, labels" in printed
    data = tmp_path / "data.npz"
    np.savez(data, x=np.stack([X] * 2), labels=np.stack([LABELS] * 2))
    assert main(["train", str(out), "--steps", "30", "--data", str(data), "--lr", "0.1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    first, last = float(lines[0].split()[-1]), float(lines[-1].split()[-1])
    assert last < 0.5 * first, (first, last)


def _fails(argv: list[str], capsys, fragment: str, out: Path | None = None) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert fragment in err, err
    if out is not None:
        assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("extra, fragment", [
    (["--requires-grad", "w1", "nope"], "'nope' is not an initializer of the forward model"),
    (["--requires-grad", "w1", "--frozen", "w1"], "'w1' is both in requires_grad and in frozen_params"),
    (["--requires-grad", "shape"], "'shape' is a int64 initializer; only floating-point parameters"),
])
def test_bad_parameter_names(extra, fragment, tmp_path, capsys):
    path = tmp_path / "f.onnx"
    onnx.save(mlp(extra_inits=[numpy_helper.from_array(np.array([4, 3], np.int64), "shape")]), path)
    before = path.read_bytes()
    out = tmp_path / "art"
    _fails(["artifacts", str(path), "-o", str(out), "--loss", "CrossEntropyLoss", *extra], capsys, fragment, out)
    assert path.read_bytes() == before


def test_no_float_output_for_the_loss(tmp_path, capsys):
    path = tmp_path / "f.onnx"
    onnx.save(mlp(extra_nodes=[helper.make_node("ArgMax", ["scores"], ["cls"], axis=1)],
                  output_type=TensorProto.INT64), path)
    _fails(["artifacts", str(path), "-o", str(tmp_path / "a"), "--loss", "none"], capsys, "not a floating-point value",
           tmp_path / "a")


def test_labels_of_the_wrong_rank(tmp_path, capsys):
    path = tmp_path / "f.onnx"
    onnx.save(mlp(extra_inputs=[helper.make_tensor_value_info("labels", TensorProto.INT64, [4, 3])]), path)
    _fails(["artifacts", str(path), "-o", str(tmp_path / "a"), "--loss", "CrossEntropyLoss"], capsys,
           "label input 'labels' has rank 2", tmp_path / "a")


def test_op_without_gradient_rule_names_op_node_and_parameter(tmp_path, capsys):
    model = mlp()
    model.graph.node[1].op_type = "Frobnicate"
    model.graph.node[1].domain = "example.custom"
    model.opset_import.append(helper.make_opsetid("example.custom", 1))
    path = tmp_path / "f.onnx"
    onnx.save(model, path)
    _fails(["artifacts", str(path), "-o", str(tmp_path / "a"), "--loss", "CrossEntropyLoss"], capsys,
           "node 'relu': no gradient rule for example.custom::Frobnicate, which is on the path from parameter 'w1'",
           tmp_path / "a")


def test_parameter_that_does_not_reach_the_loss(tmp_path, capsys):
    path = tmp_path / "f.onnx"
    onnx.save(mlp(extra_inits=[numpy_helper.from_array(np.ones(3, np.float32), "unused")]), path)
    _fails(["artifacts", str(path), "-o", str(tmp_path / "a"), "--loss", "CrossEntropyLoss", "--requires-grad",
            "w1", "unused"], capsys, "parameter 'unused' does not reach the loss", tmp_path / "a")


def test_unreadable_model_and_output_that_is_a_file(tmp_path, capsys, forward):
    _fails(["artifacts", str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "a"), "--loss", "MSELoss"], capsys,
           "no such file")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _fails(["artifacts", str(forward), "-o", str(blocker), "--loss", "MSELoss"], capsys,
           "cannot create the artifact directory")
    assert blocker.read_text() == "x"


def test_usage_errors_exit_2(forward):
    run = subprocess.run([sys.executable, "-m", "lowering", "artifacts", str(forward), "-o", "x"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "--loss" in run.stderr and "Traceback" not in run.stderr


def test_parameters_sharing_a_gradient_and_a_parameter_used_twice(tmp_path):
    """Add(p, q) hands both the same gradient value; p also feeds a second node (its contributions summed):
    each parameter still gets its own <p>_grad, numerically right."""
    p = RNG.standard_normal((4, 3)).astype(np.float32)
    q = RNG.standard_normal((4, 3)).astype(np.float32)
    nodes = [helper.make_node("Add", ["p", "q"], ["s"]), helper.make_node("Mul", ["s", "p"], ["t"]),
             helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(p, "p"), numpy_helper.from_array(q, "q")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    generate_artifacts(model, requires_grad=["p", "q"], loss=None, optimizer=OptimType.SGD, artifact_directory=tmp_path)
    training = onnx.load(tmp_path / "training_model.onnx")
    training, grads = gradients_exposed(training)
    assert grads == {"p": "p_grad", "q": "q_grad"}
    got = run_model(lower_model(training), {"p": p, "q": q})
    np.testing.assert_allclose(got["p_grad"], 2 * p + q, rtol=1e-6)  # d/dp sum((p + q) p)
    np.testing.assert_allclose(got["q_grad"], p, rtol=1e-6)


def test_forward_model_with_external_data_and_the_large_model_path(tmp_path, monkeypatch, capsys):
    """A forward model whose weights live in an external data file is read from its path; with the 2 GB
    protobuf limit lowered to a few bytes, the large-model code paths run (shape inference on a copy without
    the weights, the training and eval models written with external data) and the artifacts still train."""
    import lowering.training.artifacts as artifacts_module

    path = tmp_path / "forward.onnx"
    onnx.save(mlp(), path, save_as_external_data=True, all_tensors_to_one_file=True, location="forward.onnx.data",
              size_threshold=0)
    assert (tmp_path / "forward.onnx.data").stat().st_size > 0
    monkeypatch.setattr(artifacts_module, "PROTOBUF_LIMIT", 64)
    out = tmp_path / "art"
    assert main(["artifacts", str(path), "-o", str(out), "--loss", "CrossEntropyLoss", "--optimizer", "SGD"]) == 0
    assert (out / "training_model.onnx.data").exists()  # the eval model holds no initializer here
    capsys.readouterr()
    data = tmp_path / "data.npz"
    np.savez(data, x=X, labels=LABELS)
    assert main(["train", str(out), "--steps", "3", "--data", str(data), "--lr", "0.1"]) == 0
    losses = [float(line.split()[-1]) for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert abs(losses[0] - _numpy_gradients()[0]) <= 1e-5 * losses[0] and losses[-1] < losses[0]


def test_several_forward_outputs(tmp_path):
    """With a loss block, only the first output is the scores (onnxruntime-training would take a second output as
    its labels); with no loss block, the other outputs stay outputs after the loss, as onnxruntime-training keeps
    them; additional outputs follow."""
    model = mlp()
    model.graph.output.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))
    generate_artifacts(model, loss=LossType.CrossEntropyLoss, optimizer=OptimType.SGD,
                       artifact_directory=tmp_path / "a", additional_output_names=["h"])
    training = onnx.load(tmp_path / "a" / "training_model.onnx")
    assert [i.name for i in training.graph.input][:2] == ["x", "labels"]
    assert [o.name for o in training.graph.output][1:2] == ["h"]
    loss_model = mlp(extra_nodes=[helper.make_node("ReduceMean", ["scores"], ["loss"], keepdims=0)])
    loss_model.graph.output.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))
    generate_artifacts(loss_model, loss=None, optimizer=OptimType.SGD, artifact_directory=tmp_path / "b")
    for file in ("training_model.onnx", "eval_model.onnx"):
        outputs = [o.name for o in onnx.load(tmp_path / "b" / file).graph.output]
        assert outputs[:2] == ["loss", "r"], file


@pytest.mark.parametrize("batch", [4, "N"])
def test_a_custom_loss_that_is_a_tensor_is_seeded_with_ones(batch, tmp_path):
    """--loss none on a per-sample loss [batch] (static or symbolic): the gradient is that of its sum."""
    model = mlp(extra_nodes=[helper.make_node("ReduceSum", ["scores"], ["per_sample"], axes=[1], keepdims=0)])
    model.opset_import[0].version = 12  # ReduceSum's axes an attribute
    model.graph.input[0].type.tensor_type.shape.dim[0].Clear()
    if isinstance(batch, str):
        model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = batch
    else:
        model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = batch
    generate_artifacts(model, requires_grad=["b2"], loss=None, optimizer=OptimType.SGD, artifact_directory=tmp_path)
    training, _ = gradients_exposed(onnx.load(tmp_path / "training_model.onnx"))
    got = run_model(lower_model(training), {"x": X, "b2": B2})
    np.testing.assert_allclose(got["b2_grad"], np.full(3, 4.0, np.float32))  # d sum_n sum_c (.. + b2_c) / d b2_c


def test_a_frozen_parameter_before_the_first_trainable_one_trains(tmp_path):
    """A frozen initializer listed before every trainable one (a class-weight buffer registered first): the train
    step takes it from the checkpoint as frozen state, not as data (found by the held-out sweep)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Mul", ["m", "cw"], ["y"]),
             helper.make_node("ReduceMean", ["y"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "cw"),
                               numpy_helper.from_array(np.ones((3, 2), np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    generate_artifacts(model, requires_grad=["w"], frozen_params=["cw"], optimizer=OptimType.SGD,
                       artifact_directory=tmp_path)
    from lowering.training.trainer import train

    losses, params = train(tmp_path, {"x": np.ones((2, 3), np.float32)}, 2, learning_rate=0.5)
    assert losses[0] == pytest.approx(4.5)  # mean of [3, 6]
    # d loss / d w[i, j] = mean over the 2x2 outputs of x[n, i] * cw[j] = cw[j] / 2
    np.testing.assert_allclose(params["w"], np.ones((3, 2)) - 2 * 0.5 * np.array([0.5, 1.0]), rtol=1e-6)
