"""Recorded onnxruntime-training 1.19.2 outputs (tests/fixtures/ort_training, recorded on branch issue12a):
the per-op cases of InPlaceAccumulatorV2, AdamWOptimizer and SGDOptimizerV2, the optimizer step of each
generate_artifacts artifact, and whole-artifact training where every op of the training model has a
lowering. The lowered graphs run on plain onnxruntime; the fixtures are the ground truth.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _recorded import recorded_cases
from onnx import helper

import lowering
from lowering.training.trainer import Trainer, initial_parameters, lower_artifacts

ROOT = Path(__file__).resolve().parent / "fixtures" / "ort_training"
OURS = ("InPlaceAccumulatorV2", "AdamWOptimizer", "SGDOptimizerV2")
CASES = recorded_cases(*OURS)
ARTIFACTS = sorted(p.name for p in (ROOT / "artifacts").iterdir() if p.is_dir())


def _close(got, want, tol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    scale = max(float(np.max(np.abs(want))) if want.size else 0.0, 1e-30)
    err = float(np.max(np.abs(got - want))) / scale if want.size else 0.0
    assert err <= tol, f"{what}: error {err:.3g} of the largest entry > {tol}"


def _value(arrays, key):
    """A recorded tensor, or a recorded sequence (``key.0``, ``key.1`` ...) as a list."""
    if key in arrays:
        return arrays[key]
    items = []
    while f"{key}.{len(items)}" in arrays:
        items.append(arrays[f"{key}.{len(items)}"])
    assert items, f"nothing recorded under {key!r}"
    return items


def _recorded_after_the_update(arrays) -> bool:
    """onnxruntime-training updates these inputs in place: a recorder that saves the input arrays after the
    run saves the updated values (and, for sequences, memory onnxruntime reused: NaN). Such a case cannot
    test anything: the input it claims is not the input that was run."""
    floats = [v for v in arrays.values() if v.dtype.kind == "f"]
    if any(np.isnan(v).any() for v in floats):
        return True
    if "in.update_signal" in arrays and not arrays["in.update_signal"].all():
        return False  # no update: inputs equal to outputs are what should be recorded
    pairs = [("in.accumulation_buffer", "out.accumulation_buffer_out"), ("in.weights.0", "out.updated_weights.0")]
    return any(a in arrays and b in arrays and np.array_equal(arrays[a], arrays[b])
               and not np.array_equal(arrays.get("in.value", arrays.get("in.gradients.0")), arrays[b])
               for a, b in pairs)


def _type_outputs(model, arrays):
    """The recorder's one-node models leave their graph outputs untyped, which onnx.checker refuses before
    any lowering; type them from the recorded values (a sequence as a sequence of its elements' type)."""
    for output in model.graph.output:
        if output.type.WhichOneof("value") is not None:
            continue
        value = _value(arrays, f"out.{output.name}")
        element = value[0] if isinstance(value, list) else value
        tensor = helper.make_tensor_type_proto(helper.np_dtype_to_tensor_dtype(element.dtype), list(element.shape))
        if isinstance(value, list):
            tensor = helper.make_sequence_type_proto(helper.make_tensor_type_proto(tensor.tensor_type.elem_type, None))
        output.type.CopyFrom(tensor)


def test_the_fixtures_cover_the_three_ops():
    assert {c["op_type"] for c in CASES} == set(OURS) and len(CASES) >= 10


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['op_type']}-{c['variant']}")
def test_per_op_fixture(case):
    model = onnx.load(ROOT / case["model"])
    arrays = dict(np.load(ROOT / case["arrays"]))
    # a recorder that lets the in-place kernels write into its input arrays records the updated values (or
    # NaN) as inputs: such a case could test nothing (tools/ort_training/make_fixtures.py feeds copies)
    assert not _recorded_after_the_update(arrays), "the recording aliases inputs with in-place outputs"
    _type_outputs(model, arrays)
    lowered = lowering.lower_model(model)
    onnx.checker.check_model(lowered, full_check=True)
    assert all(n.domain in ("", "ai.onnx") for n in lowered.graph.node)
    session = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: _value(arrays, f"in.{i.name}") for i in session.get_inputs()}
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    node = model.graph.node[0]
    for name in node.output:
        if not name:
            continue
        want = _value(arrays, f"out.{name}")
        if isinstance(want, list):
            assert len(got[name]) == len(want)
            for i, (g, w) in enumerate(zip(got[name], want, strict=True)):
                _close(g, w, 1e-5, f"{name}[{i}]")
        elif want.dtype == bool:
            assert got[name].tolist() == want.tolist(), name
        else:
            _close(got[name], want, 1e-6, name)
    # the in-place contract: each updated input is also a graph output '<input>.updated', equal to the
    # op's own output for it
    exposed = [o.name for o in lowered.graph.output if o.name.endswith(".updated")]
    assert exposed, "no '.updated' output"
    for name in exposed:
        source = name.removesuffix(".updated")
        assert source in node.input
        own = {"accumulation_buffer": "accumulation_buffer_out", "weights": "updated_weights",
               "momentums_1": "updated_momentums_1", "momentums_2": "updated_momentums_2"}[source]
        if own in node.output:
            a, b = got[name], got[own]
            assert [np.asarray(x).tolist() for x in (a if isinstance(a, list) else [a])] == \
                [np.asarray(x).tolist() for x in (b if isinstance(b, list) else [b])]


def optimizer_step(directory: Path, meta: dict, inputs: set[str]) -> tuple[dict, dict]:
    """The recorded first optimizer step of an artifact: (feeds for those of ``inputs`` the optimizer model
    has: initial parameters, the recorded first-step gradients, zero moments, the recorded learning rate
    and step; the recorded raw optimizer outputs)."""
    initial = dict(np.load(directory / "initial_params.npz"))
    train_out = dict(np.load(directory / "raw_train_step1.npz"))
    recorded = dict(np.load(directory / "raw_optimizer_step1.npz"))
    params = [initial[p] for p in meta["trainable_params"]]
    zeros = [np.zeros_like(p) for p in params]
    feeds = {"learning_rate": recorded["in.learning_rate"], "step": recorded["in.step"], "params": params,
             "gradients": [train_out[f"{p}_grad.accumulation.buffer.updated"] for p in meta["trainable_params"]],
             "first_order_moments": zeros, "second_order_moments": zeros}
    return {k: v for k, v in feeds.items() if k in inputs}, recorded


@pytest.mark.parametrize("name", ARTIFACTS)
def test_artifact_optimizer_step(name):
    """One optimizer step of the artifact's own optimizer model, from the recorded first-step gradients."""
    directory = ROOT / "artifacts" / name
    meta = json.loads((directory / "meta.json").read_text())
    model = lowering.lower_model(onnx.load(directory / "optimizer_model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds, recorded = optimizer_step(directory, meta, {i.name for i in session.get_inputs()})
    assert recorded["in.step"].tolist() == [1]
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    for seq in ("params", "first_order_moments", "second_order_moments"):
        if f"{seq}.updated.0" not in recorded:
            continue
        want = _value(recorded, f"{seq}.updated")
        for p, g, w in zip(meta["trainable_params"], got[f"{seq}.updated"], want, strict=True):
            _close(g, w, 1e-5, f"{name} {seq}.updated[{p}]")


def _artifact_data(directory, meta, models):
    data = dict(np.load(directory / "data.npz"))
    first = models.training.graph.input[0].name
    return {first: data["input"][None], meta["labels_input"]: data["labels"][None]}


def _trainer(name, *, two_models: bool = False):
    """The Trainer of an artifact: the train-step model (one run per step, as ``oplower train``) or, with
    ``two_models``, the lowered training and optimizer models, whose accumulation buffers show the gradients."""
    directory = ROOT / "artifacts" / name
    models = lower_artifacts(directory)
    if two_models:
        models = dataclasses.replace(models, step=None)
    meta = json.loads((directory / "meta.json").read_text())
    start = initial_parameters(directory, models, dict(np.load(directory / "initial_params.npz")), "initial")
    trainer = Trainer(models, start, learning_rate=meta["learning_rate"])
    return directory, meta, models, trainer


def _close_gradients(got: dict, recorded: dict, params: list[str], tol: float = 1e-4) -> None:
    """Each gradient within ``tol`` of its largest entry. A gradient that is zero in exact arithmetic (the
    bias of a layer right before batch norm) holds only rounding noise (~1e-8) on both sides: it is measured
    against 1e-3 of the model's largest gradient instead of its own largest entry."""
    largest = max(float(np.abs(recorded[f"grad.{p}"]).max()) for p in params)
    for p in params:
        want = recorded[f"grad.{p}"]
        assert got[p].shape == want.shape, p
        err = float(np.abs(got[p] - want).max()) / max(float(np.abs(want).max()), 1e-3 * largest)
        assert err <= tol, f"gradient of {p}: error {err:.3g}"


@pytest.mark.parametrize("two_models", [False, True], ids=["train_step_model", "two_models"])
@pytest.mark.parametrize("name", ARTIFACTS)
def test_artifact_one_train_step(name, two_models):
    directory, meta, models, trainer = _trainer(name, two_models=two_models)
    data = _artifact_data(directory, meta, models)
    recorded = dict(np.load(directory / "api_step1.npz"))
    loss = trainer.step({k: v[0] for k, v in data.items()})
    assert loss == pytest.approx(float(recorded["loss"]), rel=1e-5)
    if two_models:
        _close_gradients(trainer.buffers, recorded, meta["trainable_params"])
    after = dict(np.load(directory / "api_optimizer_step1.npz"))
    for p in meta["trainable_params"]:
        _close(trainer.params[p], after[f"param.{p}"], 1e-5, f"{p} after one step")
    for p in meta["frozen_params"]:  # batch norm's running statistics, updated in place by the training API
        _close(trainer.frozen[p], after[f"param.{p}"], 1e-5, f"{p} after one step")


@pytest.mark.parametrize("name", ARTIFACTS)
def test_artifact_twenty_step_loss_curve(name):
    directory, meta, models, trainer = _trainer(name)
    data = _artifact_data(directory, meta, models)
    curve = json.loads((directory / "api_curve.json").read_text())
    losses = [trainer.step({k: v[0] for k, v in data.items()}) for _ in range(curve["steps"])]
    np.testing.assert_allclose(losses, curve["loss"], rtol=1e-4)


def test_readme_cnn_example_trains_like_onnxruntime_training(capsys):
    """The copy-paste example of the README and docs/training.md: `oplower train` on the committed CNN artifact,
    its data.npz holding one batch (arrays of the inputs' own rank, fed at every step), the losses printed per
    step."""
    from lowering.cli import main

    directory = ROOT / "artifacts" / "cnn"
    steps = 4
    assert main(["train", str(directory), "--steps", str(steps), "--data", str(directory / "data.npz"),
                 "--params", str(directory / "initial_params.npz")]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    losses = [float(line.split()[-1]) for line in lines]
    curve = json.loads((directory / "api_curve.json").read_text())["loss"][:steps]
    np.testing.assert_allclose(losses, curve, rtol=1e-5)  # printed to 6 significant digits


@pytest.mark.parametrize("name", ARTIFACTS)
def test_every_artifact_lowers_to_standard_onnx(name):
    """Acceptance of issues 12 and 19: both models lower in strict mode (no op left without a rule) to standard
    ONNX only that passes onnx.checker's full check."""
    for file in ("training_model.onnx", "optimizer_model.onnx"):
        model = lowering.lower_model(onnx.load(ROOT / "artifacts" / name / file), strict=True)
        onnx.checker.check_model(model, full_check=True)
        assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
        assert not [n.op_type for n in model.graph.node if n.op_type in ("MaxPoolGrad", "AveragePoolGrad")]


@pytest.mark.parametrize("name", ["cnn", "mlp", "mobilenet"])
def test_running_statistics_are_updated_like_onnxruntime_training(name):
    """BatchNormInternal updates its running statistics in place (they feed no node): the lowered training
    model returns them as '<input>.updated' and the trainer carries them, equal to what onnxruntime-training
    recorded after one step (raw_train_step1.npz's '<running input>.updated')."""
    directory, meta, models, trainer = _trainer(name)
    recorded = dict(np.load(directory / "raw_train_step1.npz"))
    running = [k.removesuffix(".updated") for k in recorded if ".running_" in k and k.endswith(".updated")]
    assert running and sorted(running) == sorted(meta["frozen_params"])
    outputs = {o.name for o in models.training.graph.output}
    assert all(f"{r}.updated" in outputs for r in running)
    trainer.step({k: v[0] for k, v in _artifact_data(directory, meta, models).items()})
    for r in running:
        _close(trainer.frozen[r], recorded[f"{r}.updated"], 1e-5, f"{r} after one step")


# issue 19's architectures too: their families' lowerings emit one form for both targets
@pytest.mark.parametrize("name", ["cnn1d", "mlp_bce", "bert", "bert_torch", "gpt", "vit", "mobilenet", "mlp_act"])
def test_portable_artifacts_train_like_onnxruntime_training(name):
    """--target portable for whole artifacts: the training and optimizer models hold only PORTABLE_OPS (Loop
    bodies included) and one step gives onnxruntime-training's loss, gradients and parameters."""
    from lowering.rules import PORTABLE_OPS
    from opdef.graphs import model_nodes

    directory = ROOT / "artifacts" / name
    models = lower_artifacts(directory, target="portable")
    for model, lowered_from in ((models.training, "training_model.onnx"), (models.optimizer, "optimizer_model.onnx")):
        onnx.checker.check_model(model, full_check=True)
        original = {n.name for n in onnx.load(directory / lowered_from).graph.node}
        emitted = {n.op_type for n in model_nodes(model) if n.name not in original}  # the lowerings' own nodes
        assert emitted <= PORTABLE_OPS, emitted - PORTABLE_OPS
    meta = json.loads((directory / "meta.json").read_text())
    start = initial_parameters(directory, models, dict(np.load(directory / "initial_params.npz")), "initial")
    # the two models (their buffers show the gradients); the train-step model is tests/test_train_step.py's
    trainer = Trainer(dataclasses.replace(models, step=None), start, learning_rate=meta["learning_rate"])
    recorded = dict(np.load(directory / "api_step1.npz"))
    loss = trainer.step({k: v[0] for k, v in _artifact_data(directory, meta, models).items()})
    assert loss == pytest.approx(float(recorded["loss"]), rel=1e-5)
    _close_gradients(trainer.buffers, recorded, meta["trainable_params"])
    after = dict(np.load(directory / "api_optimizer_step1.npz"))
    for p in meta["trainable_params"]:
        _close(trainer.params[p], after[f"param.{p}"], 1e-5, f"{p} after one step")


@pytest.mark.parametrize("name", ["cnn1d", "mlp_bce"])
def test_lowered_optimizer_in_other_runtimes(name, tmp_path):
    """The lowered optimizer model (one form for both targets) in the other runtimes of docs/targets.md's
    table: onnx.reference runs it and gives onnxruntime's sequences; OpenVINO and tract take no model whose
    inputs are tensor sequences (asserted refusals, so a runtime that learns them shows up here)."""
    from onnx.reference import ReferenceEvaluator

    model = lower_artifacts(ROOT / "artifacts" / name, target="portable").optimizer
    rng = np.random.default_rng(0)
    shapes = {k: v.shape for k, v in np.load(ROOT / "artifacts" / name / "initial_params.npz").items()}
    trainable = json.loads((ROOT / "artifacts" / name / "meta.json").read_text())["trainable_params"]
    feeds = {"learning_rate": np.array([0.01], np.float32), "step": np.array([1], np.int64)}
    sequences = [i.name for i in model.graph.input if i.type.HasField("sequence_type")]
    for s in sequences:
        feeds[s] = [rng.standard_normal(shapes[p]).astype(np.float32) for p in trainable]
    names = [o.name for o in model.graph.output]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(names, feeds)
    got = ReferenceEvaluator(model).run(names, feeds)
    for n, w, g in zip(names, want, got, strict=True):
        if isinstance(w, list):
            assert len(g) == len(w) == len(trainable), n
            for a, b in zip(w, g, strict=True):
                np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7, err_msg=n)
        else:
            np.testing.assert_array_equal(g, w)
    path = tmp_path / "optimizer.onnx"
    onnx.save(model, path)
    import openvino as ov
    import tract

    with pytest.raises(Exception, match="SequenceInsert|[Ss]equence"):
        ov.Core().compile_model(str(path), "CPU")
    with pytest.raises(Exception, match="has no type value"):
        tract.onnx().load(str(path)).into_model().into_runnable()
