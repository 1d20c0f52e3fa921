"""oplower's own artifacts (``generate_artifacts`` / ``oplower artifacts``) against onnxruntime-training's.

For each committed architecture, the forward model exactly as torch exported it (``forward_model.onnx``,
unpatched: LayerNormalization with Y only, Dropout without a mask, training-mode BatchNormalization with its
running-statistics outputs) becomes artifacts with the arguments onnxruntime-training 1.19.2 was given
(meta.json). Every Dropout ratio is set to 0 first, as the fixtures' own graphs were after generation, so that
no random mask enters the comparison. Then:

- the graph inputs and outputs are onnxruntime-training's (names, order, types; the loss value's name differs
  only in onnxblock's process-wide counter);
- one step on plain onnxruntime (the training model lowered) gives onnxruntime-training's loss (1e-5
  relative) and gradients (1e-4 of the largest entry), the optimizer step its parameters (1e-4 of the largest);
- 20 steps follow its loss curve (1e-5 relative);
- the gradients are at least as accurate as onnxruntime-training's against torch autograd in float64
  (``torch_f64_step1.npz``), up to a rounding-level slack;
- every custom node of the training model verifies against the project's specs, and the eval model runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from _artifacts import gradients_exposed
from onnx import numpy_helper

from lowering.passes import lower_model
from lowering.training import trainer
from lowering.training.artifacts import LossType, OptimType, build_artifacts, write_artifacts
from opdef.model_verify import verify_model
from runtime.session import run_model

ARTIFACTS = Path(__file__).resolve().parent / "fixtures" / "ort_training" / "artifacts"
NAMES = ("cnn", "cnn1d", "mlp", "mlp_bce", "mlp_l1", "mlp_act", "mobilenet", "bert", "bert_torch", "gpt", "vit",
         "lstm", "gru", "lstm2")
ACCUMULATOR = ("com.microsoft", "InPlaceAccumulatorV2")


def zero_dropout(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every Dropout's ratio set to 0 (a new initializer), the nodes kept."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for node in model.graph.node:
        if node.op_type == "Dropout":
            name = f"{node.output[0]}.zero_ratio"
            model.graph.initializer.append(numpy_helper.from_array(np.array(0.0, np.float32), name))
            while len(node.input) < 2:
                node.input.append("")
            node.input[1] = name
    return model


def _meta(name: str) -> dict:
    return json.loads((ARTIFACTS / name / "meta.json").read_text())


_CACHE: dict[str, object] = {}


def made(name: str, tmp_root: Path):
    """(artifact directory, Artifacts) of ``name``, generated once per test session."""
    if name not in _CACHE:
        meta = _meta(name)
        forward = zero_dropout(onnx.load(str(ARTIFACTS / name / "forward_model.onnx")))
        art = build_artifacts(forward, meta["trainable_params"], meta["frozen_params"], LossType[meta["loss"]],
                              OptimType[meta["optimizer"]])
        directory = tmp_root / name
        write_artifacts(art, directory)
        _CACHE[name] = (directory, art)
    return _CACHE[name]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("artifacts")


def _feeds(name: str) -> dict[str, np.ndarray]:
    meta = _meta(name)
    data = dict(np.load(ARTIFACTS / name / "data.npz"))
    return {"input": data["input"], meta["labels_input"]: data["labels"]}


def _signature(graph_values) -> list[tuple]:
    out = []
    for vi in graph_values:
        t = vi.type
        if t.HasField("sequence_type"):
            out.append((vi.name, "seq", t.sequence_type.elem_type.tensor_type.elem_type))
        else:
            dims = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.tensor_type.shape.dim)
            out.append((vi.name, t.tensor_type.elem_type, dims))
    return out


def _counterless(name: str) -> str:
    return name.rsplit("::", 1)[0] if name.startswith("onnx::") else name


@pytest.mark.parametrize("name", NAMES)
def test_inputs_and_outputs_are_onnxruntime_trainings(name, root):
    _, art = made(name, root)
    folder = ARTIFACTS / name
    for ours, file in ((art.training, "training_model.onnx"), (art.eval, "eval_model.onnx"),
                       (art.optimizer, "optimizer_model.onnx")):
        theirs = onnx.load(str(folder / file))
        assert _signature(ours.graph.input) == _signature(theirs.graph.input), file
        ours_out = [(_counterless(n), *rest) for n, *rest in _signature(ours.graph.output)]
        theirs_out = [(_counterless(n), *rest) for n, *rest in _signature(theirs.graph.output)]
        if file == "eval_model.onnx":  # onnxruntime-training declares no type for its eval loss in some models
            ours_out, theirs_out = [o[0] for o in ours_out], [o[0] for o in theirs_out]
        assert ours_out == theirs_out, file
    assert list(art.checkpoint.params) == _meta(name)["trainable_params"]
    assert list(art.checkpoint.frozen) == _meta(name)["frozen_params"]




_STEP1: dict[str, tuple] = {}


def step1(name: str, root: Path) -> tuple[float, dict[str, np.ndarray]]:
    if name not in _STEP1:
        _, art = made(name, root)
        model, exposed = gradients_exposed(art.training)
        lowered = lower_model(model)
        left = {(n.domain, n.op_type) for n in lowered.graph.node if n.domain not in ("", "ai.onnx")}
        assert not left, f"not lowered: {left}"
        feeds = _feeds(name) | dict(np.load(ARTIFACTS / name / "initial_params.npz"))
        feeds = {k: v for k, v in feeds.items() if k in {i.name for i in lowered.graph.input}}
        got = run_model(lowered, feeds)
        _STEP1[name] = (float(got[art.loss]), {p: got[g] for p, g in exposed.items()})
    return _STEP1[name]


def _rel(got: np.ndarray, want: np.ndarray, floor: float = 0.0) -> float:
    return float(np.max(np.abs(got.astype(np.float64) - want))) / max(float(np.max(np.abs(want))), floor, 1e-30)


@pytest.mark.parametrize("name", NAMES)
def test_one_step_equals_onnxruntime_trainings(name, root):
    loss, grads = step1(name, root)
    recorded = np.load(ARTIFACTS / name / "api_step1.npz")
    want = float(recorded["loss"])
    assert abs(loss - want) <= 1e-5 * abs(want), (loss, want)
    # a gradient that is zero up to rounding (a bias right before a BatchNorm) is judged against 1e-2 of the
    # model's largest gradient entry, not against its own noise
    floor = 1e-2 * max(float(np.max(np.abs(recorded[f"grad.{p}"]))) for p in grads)
    for p, g in grads.items():
        err = _rel(g, recorded[f"grad.{p}"], floor)
        assert err <= 1e-4, f"{p}: {err:.3g} of the largest entry"


@pytest.mark.parametrize("name", NAMES)
def test_gradients_as_accurate_as_onnxruntime_trainings(name, root):
    _, grads = step1(name, root)
    truth = np.load(ARTIFACTS / name / "torch_f64_step1.npz")
    theirs = np.load(ARTIFACTS / name / "api_step1.npz")
    scale = max(float(np.max(np.abs(truth[f"grad.{p}"]))) for p in grads)
    for p, g in grads.items():
        want = truth[f"grad.{p}"]
        ours = float(np.max(np.abs(g - want)))
        native = float(np.max(np.abs(theirs[f"grad.{p}"] - want)))
        # slack: a few f32 roundings of the model's largest gradient entry
        assert ours <= native + 4 * 2.0 ** -24 * scale, f"{p}: ours {ours:.3g}, onnxruntime-training {native:.3g}"


@pytest.mark.parametrize("name", NAMES)
def test_optimizer_step_and_curve_equal_onnxruntime_trainings(name, root):
    directory, _ = made(name, root)
    curve = json.loads((ARTIFACTS / name / "api_curve.json").read_text())
    init = dict(np.load(ARTIFACTS / name / "initial_params.npz"))
    losses, params = trainer.train(directory, _feeds(name), 1, params=init, learning_rate=curve["learning_rate"])
    recorded = np.load(ARTIFACTS / name / "api_optimizer_step1.npz")
    for p, value in params.items():
        assert _rel(value, recorded[f"param.{p}"]) <= 1e-4, p
    losses, _ = trainer.train(directory, _feeds(name), curve["steps"], params=init,
                              learning_rate=curve["learning_rate"])
    for k, (got, want) in enumerate(zip(losses, curve["loss"], strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {k + 1}: {got} vs {want}"


@pytest.mark.parametrize("name", NAMES)
def test_custom_nodes_verify_and_eval_model_runs(name, root):
    directory, art = made(name, root)
    verify_model(art.training)
    onnx.checker.check_model(art.eval, full_check=True)
    feeds = _feeds(name) | dict(np.load(ARTIFACTS / name / "initial_params.npz"))
    feeds = {k: v for k, v in feeds.items() if k in {i.name for i in art.eval.graph.input}}
    got = run_model(lower_model(art.eval), feeds)
    assert np.isfinite(float(got[art.eval.graph.output[0].name]))
    assert not any(n.op_type == "BatchNormalization" and len([o for o in n.output if o]) > 1
                   for n in art.eval.graph.node)
