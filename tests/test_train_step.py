"""The train-step model (lowering.training.train_step, ``oplower train-step``): one standard ONNX model per training
step with tensor inputs and outputs only, equal to onnxruntime-training's recorded steps on every committed
artifact, in both targets; the portable one in OpenVINO and tract too."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from test_portable_training import _run

from lowering.cli import main
from lowering.rules import PORTABLE_OPS
from lowering.training.portable_std import RANDOM_OPS
from lowering.training.train_step import train_step, train_step_model

ARTIFACTS = Path(__file__).resolve().parent / "fixtures" / "ort_training" / "artifacts"
NAMES = sorted(p.name for p in ARTIFACTS.iterdir() if p.is_dir())
TARGETS = ("onnxruntime", "portable")
_BUILT: dict = {}


def _built(name: str, target: str):
    if (name, target) not in _BUILT:
        _BUILT[name, target] = train_step(ARTIFACTS / name, target=target)
    return _BUILT[name, target]


def _start(name: str, step):
    """(meta, the first step's feeds) from the artifact's recorded data and initial parameters."""
    directory = ARTIFACTS / name
    meta = json.loads((directory / "meta.json").read_text())
    initial = dict(np.load(directory / "initial_params.npz"))
    data = dict(np.load(directory / "data.npz"))
    interface = step.interface
    feeds = {interface.data[0]: data["input"], meta["labels_input"]: data["labels"],
             "learning_rate": np.array([meta["learning_rate"]], np.float32), "step": np.array([1], np.int64)}
    feeds |= {p: initial[p] for p in interface.params} | {n: initial[n] for n in interface.frozen}
    if interface.moments:
        feeds |= {p + m: np.zeros_like(initial[p]) for p in interface.params
                  for m in (".first_order_moment", ".second_order_moment")}
    return meta, feeds


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", NAMES)
def test_interface_is_tensor_only_and_fixed(name, target):
    step = _built(name, target)
    model, interface = step.model, step.interface
    onnx.checker.check_model(model, full_check=True)
    for value in (*model.graph.input, *model.graph.output):
        assert value.type.HasField("tensor_type"), f"{value.name} is not a tensor"
    meta = json.loads((ARTIFACTS / name / "meta.json").read_text())
    params = meta["trainable_params"]
    assert interface.params == tuple(params)
    moments = [p + m for p in params for m in (".first_order_moment", ".second_order_moment")] \
        if meta["optimizer"] == "AdamW" else []
    assert [i.name for i in model.graph.input] == [
        "input", meta["labels_input"], "learning_rate", "step", *params,
        *[p + m for p in params for m in (".first_order_moment", ".second_order_moment")][:len(moments)],
        *meta["frozen_params"]]
    running = [p for p in meta["frozen_params"] if "running_" in p]  # batch norm's, updated in place
    assert [o.name for o in model.graph.output] == [
        onnx.load(ARTIFACTS / name / "training_model.onnx").graph.output[0].name,
        *[f"{p}.updated" for p in params], *[f"{m}.updated" for m in moments], *[f"{p}.updated" for p in running]]
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    if target == "portable":
        nodes = onnx.load(ARTIFACTS / name / "training_model.onnx").graph.node
        original = {n.op_type for n in nodes if n.domain in ("", "ai.onnx")}
        ops = {n.op_type for n in model.graph.node}
        # spelled out (lowering/training/portable_std.py): the loss always; a training-mode Dropout with a random draw
        # (those of these artifacts have a constant training_mode input; one without it is the identity, kept)
        assert ops - PORTABLE_OPS <= (original | RANDOM_OPS) - {"SoftmaxCrossEntropyLoss"}
        assert not [n for n in model.graph.node if n.op_type == "Dropout" and len(n.input) > 2]
        assert bool(ops & RANDOM_OPS) == any(n.op_type == "Dropout" and len(n.input) > 2 for n in nodes)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", NAMES)
def test_one_step_and_twenty_step_curve_equal_onnxruntime_training(name, target):
    step = _built(name, target)
    meta, feeds = _start(name, step)
    interface = step.interface
    session = ort.InferenceSession(step.model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    recorded = np.load(ARTIFACTS / name / "api_step1.npz")
    after = np.load(ARTIFACTS / name / "api_optimizer_step1.npz")
    curve = json.loads((ARTIFACTS / name / "api_curve.json").read_text())["loss"]
    losses = []
    for k in range(1, len(curve) + 1):
        feeds["step"] = np.array([k], np.int64)
        out = dict(zip(names, session.run(None, feeds), strict=True))
        losses.append(float(out[interface.loss]))
        if k == 1:
            assert losses[0] == pytest.approx(float(recorded["loss"]), rel=1e-5)
            for p in (*interface.params, *interface.updated_frozen):
                want = after[f"param.{p}"]
                err = float(np.max(np.abs(out[f"{p}.updated"] - want))) / max(float(np.max(np.abs(want))), 1e-30)
                assert err <= 1e-5, f"{p} after one step: {err:.3g} of its largest entry"
        feeds |= {n: out[f"{n}.updated"] for n in interface.state_inputs}
    np.testing.assert_allclose(losses, curve, rtol=1e-4)


@pytest.mark.parametrize("runtime", ["openvino", "tract"])
@pytest.mark.parametrize("name", NAMES)
def test_portable_step_runs_in_openvino_and_tract(name, runtime, tmp_path):
    step = _built(name, "portable")
    _, feeds = _start(name, step)
    got = _run(runtime, step.model, feeds, tmp_path)
    after = np.load(ARTIFACTS / name / "api_optimizer_step1.npz")
    recorded = np.load(ARTIFACTS / name / "api_step1.npz")
    assert float(np.asarray(got[step.interface.loss])) == pytest.approx(float(recorded["loss"]), rel=1e-5)
    for p in step.interface.params:
        want = after[f"param.{p}"]
        assert float(np.max(np.abs(got[f"{p}.updated"] - want))) <= 1e-5 * max(float(np.max(np.abs(want))), 1e-30), p


def test_library_call_equals_the_cli(tmp_path):
    out = tmp_path / "step.onnx"
    assert main(["train-step", str(ARTIFACTS / "mlp"), "-o", str(out)]) == 0
    assert onnx.load(out) == train_step_model(ARTIFACTS / "mlp")


@pytest.mark.parametrize("argv, message", [
    (["train-step", "NOPE", "-o", "{out}"], "NOPE: not an artifact directory"),
    (["train-step", str(ARTIFACTS / "mlp")], "nothing to write"),
    (["train-step", str(ARTIFACTS / "mlp"), "--bundle", "{out}"], "--bundle needs --data"),
    (["train-step", str(ARTIFACTS / "mlp"), "-o", "{out}", "--data", "x.npz"], "--data and --params only go with"),
    (["train-step", str(ARTIFACTS / "mlp"), "-o", "{out}", "--lr", "nan"], "the learning rate must be finite"),
])
def test_bad_use_is_one_line_and_writes_nothing(argv, message, tmp_path, capsys):
    out = tmp_path / "out.onnx"
    assert main([a.format(out=out) for a in argv]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_a_training_model_without_accumulators_is_refused(tmp_path, capsys):
    for name in ("training_model.onnx", "optimizer_model.onnx"):
        (tmp_path / name).write_bytes((ARTIFACTS / "mlp" / name).read_bytes())
    model = onnx.load(tmp_path / "training_model.onnx")
    kept = [n for n in model.graph.node if n.op_type != "InPlaceAccumulatorV2"]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    kept_out = [o for o in model.graph.output if not o.name.endswith("accumulation.out")]
    del model.graph.output[:]
    model.graph.output.extend(kept_out)
    onnx.save(model, tmp_path / "training_model.onnx")
    assert main(["train-step", str(tmp_path), "-o", str(tmp_path / "out.onnx")]) == 1
    err = capsys.readouterr().err
    assert "InPlaceAccumulatorV2" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out.onnx").exists()


def test_bound_trainer_state_reads_and_writes_like_the_two_model_trainer():
    """Trainer keeps the train-step model's state in onnxruntime's buffers: what it reads out equals the
    two-model Trainer's state after each step, and state assigned to it is what the next step starts from."""
    import dataclasses

    from lowering.training.trainer import Trainer, initial_parameters, lower_artifacts

    directory = ARTIFACTS / "cnn"
    meta = json.loads((directory / "meta.json").read_text())
    models = lower_artifacts(directory)
    start = initial_parameters(directory, models, dict(np.load(directory / "initial_params.npz")))
    bound = Trainer(models, start, learning_rate=meta["learning_rate"])
    plain = Trainer(dataclasses.replace(models, step=None), start, learning_rate=meta["learning_rate"])
    data = dict(np.load(directory / "data.npz"))
    batch = {"input": data["input"], "labels": data["labels"]}
    for _ in range(3):
        assert bound.step(batch) == pytest.approx(plain.step(batch), rel=1e-6)
    for got, want in ((bound.params, plain.params), (bound.frozen, plain.frozen)):
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)
    for got, want in ((bound.first_moments, plain.first_moments), (bound.second_moments, plain.second_moments)):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-9)
    # replace the bound trainer's whole state by another one: both go on alike
    fresh = {p: v * 0.5 for p, v in plain.params.items()}
    bound.params, plain.params = fresh, dict(fresh)
    bound.first_moments, bound.second_moments = plain.first_moments, plain.second_moments
    bound.frozen = plain.frozen
    assert bound.step(batch) == pytest.approx(plain.step(batch), rel=1e-6)
    first = bound.params
    first[next(iter(first))][...] = 1e9  # a copy: changing it changes nothing in the trainer
    assert float(np.max(np.abs(bound.params[next(iter(first))]))) < 1e6


@pytest.mark.parametrize("target", TARGETS)
def test_flat_optimizer_update_gives_the_same_bits_as_one_update_per_parameter(target, monkeypatch):
    """The update runs over one Concat of the flattened parameters (and gradients, moments) and is split
    back: the same arithmetic per element, so the same bits as the per-parameter chains, in far fewer
    kernels."""
    import lowering.training.train_step as ts

    flat = train_step(ARTIFACTS / "cnn", target=target)
    monkeypatch.setattr(ts, "_flat_groups", lambda params, inputs: [[p] for p in params])
    each = train_step(ARTIFACTS / "cnn", target=target)
    ops = [n.op_type for n in flat.model.graph.node if n.op_type != "Constant"]
    fewer = sum(n.op_type != "Constant" for n in each.model.graph.node) - len(ops)
    params = len(flat.interface.params)
    assert ops.count("Concat") >= 4 and fewer > (5 * params if target == "onnxruntime" else 0)
    update = [n.op_type for n in flat.model.graph.node if n.name.startswith("train_step/")]  # the update's own
    assert update.count("Split") == (0 if target == "portable" else 3)  # parameters, first and second moments
    _, feeds = _start("cnn", flat)
    runs = []
    for step in (flat, each):
        session = ort.InferenceSession(step.model.SerializeToString(), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        runs.append(dict(zip(names, session.run(None, feeds), strict=True)))
    assert runs[0].keys() == runs[1].keys()
    for name in runs[1]:
        np.testing.assert_array_equal(runs[0][name], runs[1][name], err_msg=name)


def _flat_feeds(step, feeds):
    """Per-parameter feeds in the flat state form: each flat input the concatenation of its parameters' values."""
    views = step.interface.views()
    out = {n: v for n, v in feeds.items() if n not in views}
    for f in (*step.interface.flat, *step.interface.flat_frozen):
        for name in f.names:
            out[name] = np.concatenate([np.asarray(feeds[n]).reshape(-1) for n, (flat, *_) in views.items()
                                        if flat == name])
    return out


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", ["cnn", "bert", "mlp", "lstm", "mobilenet"])
def test_flat_state_gives_the_per_parameter_steps_bits(name, target):
    """The flat state form (what Trainer runs): one input and output per element type for the parameters and
    each moment; two steps from the same state give the per-parameter form's bits, in fewer kernels."""
    each, flat = _built(name, target), train_step(ARTIFACTS / name, target=target, flat_state=True)
    interface = flat.interface
    assert interface.params == each.interface.params and interface.flat
    onnx.checker.check_model(flat.model, full_check=True)
    in_flat = [p for f in interface.flat for p in f.params]
    assert len(in_flat) == len(set(in_flat)) and set(in_flat) <= set(interface.params)
    inputs = {i.name: i for i in flat.model.graph.input}
    for f in interface.flat:
        assert f.names[0] == "flat.params.float32" and len(f.names) == (3 if interface.moments else 1)
        for n in f.names:
            assert [d.dim_value for d in inputs[n].type.tensor_type.shape.dim] == [f.size]
            assert f"{n}.updated" in {o.name for o in flat.model.graph.output}
    assert not set(in_flat) & set(inputs)  # no per-parameter input for what the flat state holds
    running = [n for n in interface.updated_frozen if "running_" in n]  # batch norm's, in one flat input
    assert [n for f in interface.flat_frozen for n in f.params] == (running if len(running) > 1 else [])
    for f in interface.flat_frozen:
        assert f.names == ("flat.frozen.float32",)
        assert f"{f.names[0]}.updated" in {o.name for o in flat.model.graph.output}
        assert not set(f.params) & set(inputs)
    assert set(interface.state_inputs) == {o.name.removesuffix(".updated") for o in flat.model.graph.output[1:]}
    assert sum(n.op_type != "Constant" for n in flat.model.graph.node) < \
        sum(n.op_type != "Constant" for n in each.model.graph.node)
    _, feeds = _start(name, each)
    runs = {}
    for key, step, fed in (("each", each, feeds), ("flat", flat, _flat_feeds(flat, feeds))):
        session = ort.InferenceSession(step.model.SerializeToString(), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        for k in (1, 2):
            out = dict(zip(names, session.run(None, {**fed, "step": np.array([k], np.int64)}), strict=True))
            fed = {**fed, **{n: out[f"{n}.updated"] for n in step.interface.state_inputs}}
        runs[key] = (out, fed)
    (out_each, state_each), (out_flat, state_flat) = runs["each"], runs["flat"]
    np.testing.assert_array_equal(out_each[interface.loss], out_flat[interface.loss])
    views = interface.views()
    for n in each.interface.state_inputs:
        if n in views:
            flat_name, start, end, shape = views[n]
            got = state_flat[flat_name][start:end].reshape(shape)
        else:
            got = state_flat[n]
        np.testing.assert_array_equal(got, state_each[n], err_msg=n)


def test_cli_writes_the_flat_state_form(tmp_path, capsys):
    out = tmp_path / "step.onnx"
    assert main(["train-step", str(ARTIFACTS / "cnn"), "-o", str(out), "--flat-state"]) == 0
    printed = capsys.readouterr().out
    assert "14 parameters (14 of them in flat.params.float32, with moments)" in printed
    assert onnx.load(out) == train_step_model(ARTIFACTS / "cnn", flat_state=True)


@pytest.mark.parametrize("name", ["cnn", "mobilenet"])
def test_batch_norm_inverse_deviations_are_computed_by_the_kernels(name):
    """The flat state form gives batch norm's gradient BatchNormalizations the batch variance and epsilon, so that
    each computes 1 / sqrt(var + eps) (times the scale) itself: no Add, Sqrt, Reciprocal per layer, nor the Mul of
    the scale (the bits: test_flat_state_gives_the_per_parameter_steps_bits)."""
    flat = train_step(ARTIFACTS / name, flat_state=True).model
    each = _built(name, "onnxruntime").model
    layers = sum(n.op_type == "Reciprocal" for n in each.graph.node)
    assert layers >= 2
    assert not any(n.op_type == "Reciprocal" for n in flat.graph.node)
    producer = {o: n for n in flat.graph.node for o in n.output}
    reads_variance = [n for n in flat.graph.node if n.op_type == "BatchNormalization" and n.input[4] in producer
                      and producer[n.input[4]].op_type == "BatchNormalization" and n.input[4] ==
                      producer[n.input[4]].output[2]]
    assert len(reads_variance) == 2 * layers  # x * inv_std and the final scale * inv_std, each layer
    assert all(next(a.f for a in n.attribute if a.name == "epsilon") > 0 for n in reads_variance)
    assert sum(n.op_type == "Mul" for n in flat.graph.node) <= sum(n.op_type == "Mul" for n in each.graph.node) \
        - layers
