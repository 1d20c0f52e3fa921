"""The whole workflow on artifacts oplower made itself, against what onnxruntime-training recorded on its own.

For the architectures with recorded workflow fixtures (cnn1d: BatchNorm, pools, SGD; mlp_bce: BatchNorm,
BCEWithLogitsLoss, AdamW), from ``forward_model.onnx`` (torch's export):

- ``oplower train`` 3 steps, ``--save-checkpoint``, then 3 more from that checkpoint equals onnxruntime-training's
  6 steps (ortt_k6.npz: losses 1e-5 relative, parameters and running statistics 1e-4 of the largest);
- our eval model (valid as written: no repair needed) on the parameters after 6 steps gives the training API's
  eval losses (eval.npz, 1e-5), ``oplower eval`` prints them;
- ``--export`` gives the outputs of the model onnxruntime-training's ``export_model_for_inferencing`` wrote;
- the train-step model and its ``--bundle`` are written from our artifacts;
- our checkpoint is onnxruntime-training's format: ``oplower train`` starts from it when no ``--params`` is given.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from lowering.cli import main
from lowering.training.workflow import evaluate, export_inference

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "ort_training"
ARTIFACTS = FIXTURES / "artifacts"
WORKFLOW = FIXTURES / "workflow"
NAMES = ("cnn1d", "mlp_bce")


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    return float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), 1e-30)


def _make(name: str, tmp_path: Path) -> tuple[Path, dict, Path]:
    meta = json.loads((ARTIFACTS / name / "meta.json").read_text())
    out = tmp_path / "art"
    assert main(["artifacts", str(ARTIFACTS / name / "forward_model.onnx"), "-o", str(out), "--loss", meta["loss"],
                 "--optimizer", meta["optimizer"], "--requires-grad", *meta["trainable_params"]]
                + (["--frozen", *meta["frozen_params"]] if meta["frozen_params"] else [])) == 0
    raw = dict(np.load(ARTIFACTS / name / "data.npz"))
    data = tmp_path / "data.npz"
    np.savez(data, **{"input": raw["input"], meta["labels_input"]: raw["labels"]})
    return out, meta, data


@pytest.mark.parametrize("name", NAMES)
def test_six_steps_through_a_checkpoint_eval_and_export(name, tmp_path, capsys):
    out, meta, data = _make(name, tmp_path)
    lr = str(meta["learning_rate"])
    ckpt, params = tmp_path / "k3.ckpt", tmp_path / "k6.npz"
    # no --params: the checkpoint oplower wrote holds the initial parameters (onnxruntime-training's format)
    assert main(["train", str(out), "--steps", "3", "--data", str(data), "--lr", lr,
                 "--save-checkpoint", str(ckpt)]) == 0
    assert main(["train", str(out), "--steps", "3", "--data", str(data), "--checkpoint", str(ckpt),
                 "--save", str(params)]) == 0
    printed = capsys.readouterr().out
    losses = [float(line.split()[-1]) for line in printed.splitlines() if line.startswith("step ")]
    recorded = np.load(WORKFLOW / name / "ortt_k6.npz")
    np.testing.assert_allclose(losses, recorded["loss"], rtol=1e-5)
    values = dict(np.load(params))
    for key in recorded.files:
        if key.startswith("param."):
            assert _rel(values[key[len("param."):]], recorded[key]) <= 1e-4, key

    # eval: our eval model loads as written (onnxruntime-training's needs repairing) and gives its eval losses
    onnx.checker.check_model(onnx.load(out / "eval_model.onnx"), full_check=True)
    ort.InferenceSession(str(out / "eval_model.onnx"), providers=["CPUExecutionProvider"])
    eval_data = dict(np.load(WORKFLOW / name / "eval_data.npz"))
    want = np.load(WORKFLOW / name / "eval.npz")
    for b in range(2):
        one = evaluate(out, {k: v[b] for k, v in eval_data.items()}, values)
        assert abs(one.loss - want["loss"][b]) <= 1e-5 * abs(want["loss"][b]), b
    assert main(["eval", str(out), "--data", str(WORKFLOW / name / "eval_data.npz"), "--params", str(params)]) == 0
    assert capsys.readouterr().out.startswith("eval loss")

    # export: the inference model's outputs equal export_model_for_inferencing's model's
    exported = export_inference(out, values)
    session = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    for k in range(want["output"].shape[0]):
        got = session.run(None, {"input": eval_data["input"][k]})[0]
        assert _rel(got, want["output"][k]) <= 1e-5


def test_train_step_model_and_bundle_from_oplower_artifacts(tmp_path, capsys):
    out, meta, data = _make("mlp_bce", tmp_path)
    assert main(["train-step", str(out), "-o", str(tmp_path / "step.onnx"), "--bundle", str(tmp_path / "web"),
                 "--data", str(data), "--steps", "4"]) == 0
    step = onnx.load(tmp_path / "step.onnx")
    names = {i.name for i in step.graph.input}
    assert {"input", "target", "learning_rate", "step"} <= names
    assert sorted(p.name for p in (tmp_path / "web").iterdir()) == ["bundle.json", "tensors.bin", "train_step.onnx"]
