"""``oplower bench``'s machinery on a tiny workload (no timing assertions)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lowering import bench
from lowering.bench import runtimes as bench_runtimes
from lowering.bench import training as bench_training
from lowering.cli import main
from lowering.training.trainer import initial_parameters, lower_artifacts
from opdef.errors import ModelError


def test_bench_tiny_writes_well_formed_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--shapes", "tiny", "--no-torch", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"machine", "copy_gbps", "cases", "summary", "pass"} <= set(result)
    assert result["copy_gbps"] > 0
    assert {(c["layout"], c["dtype"]) for c in result["cases"]} == {
        (layout, dtype) for layout in ("NCX", "NXC") for dtype in ("f32", "bf16", "f16")}
    for case in result["cases"]:
        assert case["ms"] > 0 and case["gbps"] > 0 and case["vs_bound"] > 0
        assert case["torch_ms"] is None and case["vs_torch"] is None
    assert [(r["layout"], r["channels"], r["size"]) for r in result["in_graph"]] == [("NCX", 4, 5), ("NXC", 4, 5)]
    assert all(r["ms"] > 0 and r["torch_ms"] is None for r in result["in_graph"])
    assert [row["nodes"] for row in result["pass"]] == [1, 10]
    assert all(row["ms_per_node"] > 0 and row["distinct_ms_per_node"] > 0 and row["lowered_nodes"] > row["nodes"]
               for row in result["pass"])
    printed = capsys.readouterr()
    assert "| layout | dtype |" in printed.out and "onnxruntime" in printed.out
    assert "In a training graph (f32)" in printed.out
    assert "copy bandwidth" in printed.err  # progress goes to stderr


def test_onednn_model_lowers_to_standard_ops():
    from onnx import TensorProto

    lowered = bench.lowered_model((2, 3, 4, 4), "NXC", TensorProto.BFLOAT16)
    assert {n.domain for n in lowered.graph.node} <= {""}
    assert [o.name for o in lowered.graph.output] == ["diff_src_0", "diff_gamma_0", "diff_beta_0"]


def test_read_by_a_node_makes_diff_src_internal():
    """The in-graph benchmark model: diff_src is read by a ReduceSum, so the NCX lowering adds its depthwise
    Conv (group = C) to a*dy in place; as a graph output it adds it to dy and scales by a last; both run."""
    from onnx import TensorProto

    from lowering import lower_model
    from runtime.session import run_model

    shape = (2, 3, 14, 14)
    plain = bench.lowered_model(shape, "NCX", TensorProto.FLOAT)
    read = lower_model(bench.read_by_a_node(bench.onednn_model(shape, "NCX", TensorProto.FLOAT)))

    def depthwise(model):
        return [n for n in model.graph.node if n.op_type == "Conv" and n.attribute[0].i == 3]

    def adds_dy(model):
        conv = depthwise(model)[0].output[0]
        return any(n.op_type == "Add" and conv in n.input and "diff_dst" in n.input for n in model.graph.node)

    assert len(depthwise(plain)) == len(depthwise(read)) == 1
    assert adds_dy(plain) and not adds_dy(read)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    vec = np.ones(3, np.float32)
    feeds = {"src": x, "diff_dst": x[::-1].copy(), "mean": x.mean(axis=(0, 2, 3)), "variance": vec, "gamma": vec}
    np.testing.assert_allclose(run_model(read, feeds)["dx_sum"], run_model(plain, feeds)["diff_src_0"].sum(),
                               rtol=1e-4, atol=1e-4)


def test_bench_runtimes_table_for_both_targets(tmp_path, capsys):
    """--runtimes: a row per runtime; tract refuses the onnxruntime target (computed BatchNormalization
    parameters) and runs the portable one; the others run both."""
    for target in ("onnxruntime", "portable"):
        out = tmp_path / f"{target}.json"
        assert main(["bench", "--shapes", "tiny", "--no-torch", "--runtimes", "--target", target,
                     "--json", str(out)]) == 0
        result = json.loads(out.read_text())
        assert result["target"] == target
        rows = {(r["runtime"], r["layout"]): r for r in result["runtimes"]}
        assert set(rows) == {(rt, layout) for rt in bench_runtimes.RUNTIMES for layout in ("NCX", "NXC")}
        for (runtime, _), row in rows.items():
            if runtime == "tract" and target == "onnxruntime":
                assert row["ms"] is None and "Params are not const" in row["status"]
            else:
                assert row["status"] == "ok" and row["ms"] > 0
        assert "| runtime | target |" in capsys.readouterr().out


def _fake_peer_model(torch, shape, layout, epsilon=1e-5):
    """Stands in for the exported decomposition: the peer's inputs and outputs, standard ops."""
    from onnx import TensorProto, helper

    from lowering.bench import peer

    channels = shape[1] if layout == "NCX" else shape[-1]
    vi = helper.make_tensor_value_info
    tensor = {"diff_dst", "src", "diff_src"}
    nodes = [helper.make_node("Add", ["diff_dst", "src"], ["diff_src"]),
             helper.make_node("Mul", ["gamma", "inv_std"], ["diff_gamma"]),
             helper.make_node("Identity", ["mean"], ["diff_beta"])]
    io = {n: vi(n, TensorProto.FLOAT, list(shape) if n in tensor else [channels])
          for n in peer.PEER_INPUTS + peer.PEER_OUTPUTS}
    graph = helper.make_graph(nodes, "fake_peer", [io[n] for n in peer.PEER_INPUTS],
                              [io[n] for n in peer.PEER_OUTPUTS])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def test_bench_peer_column_with_a_fake_torch(tmp_path, monkeypatch, capsys):
    """With torch importable (faked here: torch is no test dependency) the f32 cases get the peer's time and
    peer/oplower, built by the bench itself for each shape and layout (NHWC for NXC); --no-torch drops both."""
    import types

    from lowering.bench import peer

    built = []

    def fake_peer(torch, shape, layout, epsilon=1e-5):
        built.append((tuple(shape), layout))
        return _fake_peer_model(torch, shape, layout, epsilon)

    fake_torch = types.SimpleNamespace(__version__="0.fake", set_num_threads=lambda n: None)
    monkeypatch.setattr(bench, "_torch", lambda: fake_torch)
    monkeypatch.setattr(bench, "_warm_torch", lambda torch: None)
    monkeypatch.setattr(bench, "_torch_runner", lambda *args, **kwargs: (lambda: None))
    monkeypatch.setattr(peer, "peer_model", fake_peer)
    out = tmp_path / "bench.json"
    assert main(["bench", "--shapes", "tiny", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert sorted(built) == [((2, 4, 5, 5), "NCX"), ((2, 5, 5, 4), "NXC")]
    for case in result["cases"]:
        if case["dtype"] == "f32":
            assert case["peer_ms"] > 0
            assert case["peer_speedup"] == case["peer_ms"] / case["ms"]
        else:
            assert case["peer_ms"] is None and case["peer_speedup"] is None
    for layout in ("NCX", "NXC"):
        assert result["summary"][f"{layout}/f32"]["geomean_peer_speedup"] > 0
        assert "geomean_peer_speedup" not in result["summary"][f"{layout}/bf16"]
    printed = capsys.readouterr().out
    assert "| peer ms | peer/oplower |" in printed and "exported to ONNX" in printed

    built.clear()
    assert main(["bench", "--shapes", "tiny", "--no-torch", "--json", str(out)]) == 0
    assert not built
    assert all(c["peer_ms"] is None for c in json.loads(out.read_text())["cases"])


def test_peer_model_matches_the_reference():
    """The real peer (only where torch happens to be installed; it is never a test dependency): its outputs
    agree with the float64 reference in both layouts, so the bench times a correct computation."""
    import pytest

    torch = pytest.importorskip("torch")
    from lowering.bench import peer
    from runtime.reference import batch_norm_backward as reference
    from runtime.session import run_model

    rng = np.random.default_rng(1)
    for layout, shape in (("NCX", (2, 3, 4, 5)), ("NXC", (2, 4, 5, 3))):
        axes = (0, 2, 3) if layout == "NCX" else (0, 1, 2)
        x = (rng.standard_normal(shape) * 2 + 0.5).astype(np.float32)
        dy = rng.standard_normal(shape).astype(np.float32)
        mean = x.astype(np.float64).mean(axis=axes).astype(np.float32)
        var = x.astype(np.float64).var(axis=axes).astype(np.float32)
        gamma = rng.uniform(0.5, 1.5, shape[1] if layout == "NCX" else shape[-1]).astype(np.float32)
        inv_std = (1 / np.sqrt(var.astype(np.float64) + 1e-5)).astype(np.float32)
        got = run_model(peer.peer_model(torch, shape, layout),
                        dict(zip(peer.PEER_INPUTS, (dy, x, gamma, mean, inv_std), strict=True)))
        want = reference(x, dy, mean, var, gamma, epsilon=1e-5, reduce_axes=axes, statistics="batch",
                         stat_input="variance", outputs=("diff_src", "diff_gamma", "diff_beta"))
        for role in ("diff_src", "diff_gamma", "diff_beta"):
            np.testing.assert_allclose(got[role], want[role], rtol=1e-4, atol=1e-5 * np.abs(want[role]).max())


# -- oplower bench --training (lowering/bench/training.py) --

CNN = bench_training.CNN_ARTIFACTS
TRAINING_OPS = {"AveragePoolGrad", "MaxPoolGrad", "BatchNormInternal", "BatchNormalizationGrad", "ConvGrad",
                "InPlaceAccumulatorV2", "ReluGrad", "Scale", "SoftmaxCrossEntropyLossGrad"}


def _recorded_losses() -> list[float]:
    """onnxruntime-training's own 20-step curve on the committed CNN (tests/fixtures/ort_training)."""
    return json.loads((CNN / "raw_curve.json").read_text())["loss"]


def _check_training_result(result: dict, printed: str) -> None:
    assert result["artifact"] == "cnn" and result["torch"] is None and result["reps"] == 3
    assert "dW: the windows of X" in result["conv_grad_formulation"]
    (row,) = result["steps"]
    assert row["threads"] == 1 and row["batch"] == 4 and row["input"] == [4, 3, 8, 8] and not row["redeclared"]
    assert row["ms"] > 0 and row["torch_ms"] is None and row["vs_torch"] is None and row["loss_torch"] is None
    assert row["losses_agree"] is None
    # the bench's first step is onnxruntime-training's first step
    assert abs(row["loss_ort"] - _recorded_losses()[0]) <= 1e-5 * _recorded_losses()[0]
    profile = row["profile"]
    origins = {r["origin"] for r in profile["rows"]}
    assert origins == TRAINING_OPS | {bench_training.FORWARD}
    assert abs(sum(r["share"] for r in profile["rows"]) - 1) < 1e-9
    conv = next(r for r in profile["rows"] if r["origin"] == "ConvGrad")
    assert {"Conv", "ConvTranspose"} <= set(conv["ops"])  # dW and dX
    assert profile["training_ms"] > 0 and profile["optimizer_ms"] > 0
    assert 0 < profile["conv_grad_share_of_step"] < conv["share"]
    assert "| threads | batch | input | ms | training + optimizer ms | torch ms |" in printed
    assert "| ConvGrad |" in printed and "ConvGrad formulation: dX: ConvTranspose" in printed
    assert row["step_ms"] > 0 and row["ort_training_ms"] is None and row["vs_ort_training"] is None
    assert "onnxruntime-training column: not measured (no --ort-training-json FILE" in printed
    # issue 19's artifacts beside the CNN: each one lowered, timed, its first step onnxruntime-training's
    others = result["architectures"]
    assert [r["artifact"] for r in others] == list(bench_training.ARCHITECTURES)
    for r in others:
        assert r["error"] is None, r
        assert r["threads"] == 1 and r["batch"] == (3 if r["artifact"] == "lstm" else 4) and r["ms"] > 0
        assert r["lowered_nodes"] > 0 and r["step_ms"] > 0
        assert r["loss_rel_diff"] <= 1e-5, r
        assert r["kernels_total"] == round(sum(v[1] for v in r["kernels"].values())) > 0
        assert r["ort_training_kernels"] is None
    assert "| artifact | threads | batch | lowered nodes | ms |" in printed and "| gpt | 1 | 4 |" in printed
    # kernels per step of the train-step model, each charged to the training-graph op it came from
    kernels = row["kernels"]
    assert set(kernels) >= (TRAINING_OPS - {"InPlaceAccumulatorV2"}) | {bench_training.UPDATE}
    assert "InPlaceAccumulatorV2" not in kernels  # the train-step model adds the gradients where they are made
    assert all(count == round(count) for _, count in kernels.values())
    assert row["kernels_total"] == round(sum(v[1] for v in kernels.values()))
    assert row["update_kernels"] == round(kernels[bench_training.UPDATE][1]) > 0 and row["ort_training_kernels"] is None
    assert "| training-graph op | kernels | kernel ms | onnxruntime-training kernels | its kernel ms |" in printed
    assert f"| **all** | {row['kernels_total']} |" in printed and "Kernels per step, lstm (batch 3" in printed


def test_an_artifact_that_does_not_lower_is_a_row_not_a_failed_bench(tmp_path):
    (tmp_path / "training_model.onnx").write_bytes(b"not a model")
    row = bench_training.time_architecture(tmp_path, 3, 1)
    assert row["ms"] is None and "training_model.onnx" in row["error"]
    result = {"machine": {"cpu": "x", "cores": 1, "onnxruntime": "1"}, "torch": None, "reps": 3, "artifact": "cnn",
              "conv_grad_formulation": "", "steps": [], "architectures": [row]}
    assert f"| {tmp_path.name} | 1 | – | – | – | not lowered: " in bench_training.markdown(result)


def test_bench_training_without_torch_writes_json_and_markdown(tmp_path, capsys):
    out = tmp_path / "training.json"
    assert main(["bench", "--training", "--shapes", "tiny", "--no-torch", "--json", str(out)]) == 0
    printed = capsys.readouterr()
    _check_training_result(json.loads(out.read_text()), printed.out)
    assert "[training] cnn train step, batch 4" in printed.err


def test_bench_training_reads_the_onnxruntime_training_json(tmp_path, capsys):
    native = tmp_path / "native.json"
    kernels = {"ConvGrad": [0.1, 5.0], "Conv": [0.03, 3.0], "FusedConv": [0.02, 2.0],
               "InPlaceAccumulatorV2": [0.04, 14]}
    native.write_text(json.dumps({"tool": bench_training.NATIVE_TOOL, "artifact": "cnn", "onnxruntime_training": "x",
                                  "steps": [{"batch": 4, "threads": 1, "median_ms": 0.5, "kernels": kernels,
                                             "optimizer_kernels": 1},
                                            {"batch": 64, "threads": 1, "median_ms": 7.0}],
                                  "architectures": [{"artifact": "gpt", "threads": 1, "median_ms": 0.25,
                                                     "kernels": {"GatherGrad": [0.01, 2.0]}, "optimizer_kernels": 1}]}))
    out = tmp_path / "training.json"
    assert main(["bench", "--training", "--shapes", "tiny", "--no-torch", "--ort-training-json", str(native),
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    (row,) = result["steps"]
    assert row["step_ms"] > 0 and row["ort_training_ms"] == 0.5
    assert row["vs_ort_training"] == pytest.approx(row["step_ms"] / 0.5)
    assert row["ort_training_kernels"] == 25  # 24 training kernels + the optimizer's
    assert f"| {row['step_ms']:.2f} | 0.50 | {row['vs_ort_training']:.2f} | {row['kernels_total']} | 25 |" in printed
    assert "onnxruntime-training column: its Module + Optimizer step, from" in printed
    assert f"| ConvGrad | {round(row['kernels']['ConvGrad'][1])} | " in printed and "| 5 | 0.100 |" in printed
    assert "| FusedConv (native only) | – | – | 2 | 0.020 |" in printed  # its fusion of Conv + Relu
    assert "| InPlaceAccumulatorV2 (native only) | – | – | 14 | 0.040 |" in printed
    gpt = next(r for r in result["architectures"] if r["artifact"] == "gpt")
    assert gpt["ort_training_ms"] == 0.25 and gpt["ort_training_kernels"] == 3
    assert gpt["vs_ort_training"] == pytest.approx(gpt["step_ms"] / 0.25)
    bert = next(r for r in result["architectures"] if r["artifact"] == "bert")
    assert bert["ort_training_ms"] is None and bert["ort_training_kernels"] is None


@pytest.mark.parametrize("content,problem", [
    ("{", "not JSON"),
    ('{"tool": "x", "steps": []}', "not a JSON written by tools/ort_training/native_step.py bench"),
    ('{"tool": "tools/ort_training/native_step.py bench", "artifact": "resnet", "steps": []}',
     "times the 'resnet' artifact, the bench runs 'cnn'"),
    ('{"tool": "tools/ort_training/native_step.py bench", "artifact": "cnn", "steps": [{"batch": 4}]}',
     "a step without batch, threads and median_ms"),
])
def test_bench_training_refuses_a_bad_onnxruntime_training_json(tmp_path, capsys, content, problem):
    native = tmp_path / "native.json"
    native.write_text(content)
    assert main(["bench", "--training", "--shapes", "tiny", "--no-torch", "--ort-training-json", str(native)]) == 1
    err = capsys.readouterr().err.strip()
    assert problem in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert main(["bench", "--training", "--no-torch", "--ort-training-json", str(tmp_path / "none.json")]) == 1
    assert "cannot read it" in capsys.readouterr().err
    assert main(["bench", "--ort-training-json", str(native)]) == 1
    assert "only with --training" in capsys.readouterr().err


def test_bench_training_when_torch_is_absent(tmp_path, capsys, monkeypatch):
    """No --no-torch, but torch not importable: the same table without torch's columns."""
    monkeypatch.setattr(bench, "_torch", lambda: None)
    out = tmp_path / "training.json"
    assert main(["bench", "--training", "--shapes", "tiny", "--json", str(out)]) == 0
    _check_training_result(json.loads(out.read_text()), capsys.readouterr().out)


def test_ort_train_step_follows_the_recorded_curve():
    """Bound buffers, parameters updated in place, moments and step carried: three steps of the bench's runner
    give onnxruntime-training's recorded losses."""
    models = lower_artifacts(CNN)
    start = initial_parameters(CNN, models, dict(np.load(CNN / "initial_params.npz")))
    step = bench_training.OrtTrainStep(models, start, dict(np.load(CNN / "data.npz")),
                                       bench_training.learning_rate(CNN))
    losses = [step() for _ in range(3)]
    np.testing.assert_allclose(losses, _recorded_losses()[:3], rtol=1e-5)


def test_redeclared_batch_trains_like_the_committed_one(tmp_path):
    """The training model re-declared for 8 samples, fed the committed batch twice: batch norm's statistics
    and the mean loss are those of the 4 samples, so the loss is onnxruntime-training's recorded one."""
    source = bench_training.artifacts_at_batch(CNN, 8, tmp_path)
    assert source != CNN and bench_training.artifacts_at_batch(CNN, 4, tmp_path) == CNN
    models = lower_artifacts(source)
    dims = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in models.training.graph.input}
    assert dims["input"] == [8, 3, 8, 8] and dims["labels"] == [8] and dims["13.weight"] == [4, 8]
    start = initial_parameters(CNN, models, dict(np.load(CNN / "initial_params.npz")))
    data = {k: np.concatenate([v, v]) for k, v in np.load(CNN / "data.npz").items()}
    step = bench_training.OrtTrainStep(models, start, data, bench_training.learning_rate(CNN))
    np.testing.assert_allclose(step(), _recorded_losses()[0], rtol=1e-5)


def test_torch_train_step_matches_the_recorded_first_loss():
    """The bench's torch side (when torch is importable) is the artifact's network with its initial weights."""
    torch = pytest.importorskip("torch")
    step = bench_training.torch_train_step(torch, dict(np.load(CNN / "initial_params.npz")),
                                           dict(np.load(CNN / "data.npz")), bench_training.learning_rate(CNN),
                                           bench_training.adamw_hyperparameters(CNN))
    np.testing.assert_allclose(float(step()), _recorded_losses()[0], rtol=1e-5)


def test_bench_training_needs_the_artifacts(tmp_path):
    with pytest.raises(ModelError, match="no training_model.onnx"):
        bench_training.run_training_bench(directory=tmp_path, use_torch=False)


def test_adamw_hyperparameters_fill_omitted_attributes_from_the_spec(tmp_path):
    """The committed optimizer model's own values; a node without attributes gets AdamWOptimizer.rst's
    defaults (weight_decay 0.01, epsilon 1e-8, alpha 0.9, beta 0.999, adam_mode 0)."""
    import onnx

    own = bench_training.adamw_hyperparameters(CNN)
    assert own["adam_mode"] == 1 and own["weight_decay"] == 0.0 and own["eps"] == pytest.approx(1e-6)
    model = onnx.load(CNN / "optimizer_model.onnx")
    for node in model.graph.node:
        if node.op_type == "AdamWOptimizer":
            del node.attribute[:]
    onnx.save(model, tmp_path / "optimizer_model.onnx")
    bare = bench_training.adamw_hyperparameters(tmp_path)
    assert bare == {"betas": (pytest.approx(0.9), pytest.approx(0.999)), "eps": pytest.approx(1e-8),
                    "weight_decay": pytest.approx(0.01), "adam_mode": 0}
