"""The architectures people train on device (issue 19): tiny generate_artifacts models recorded with
onnxruntime-training 1.19.2 (tools/ort_training/make_artifacts.py: bert, bert_torch, gpt, vit, mobilenet,
mlp_act), run on plain onnxruntime.

What the whole-graph acceptance needs beyond this file is in tests/test_training_updates_recorded.py, which
takes every artifact directory: one train step against the training API's (loss within 1e-5 relative, each
gradient within 1e-4 of max(its largest entry, 1e-3 of the model's largest gradient), parameters after the
optimizer within 1e-5), the 20-step curve (1e-4), the optimizer step, and strict lowering of both models to
standard ONNX that passes onnx.checker's full check. Here: that the recordings exercise what the issue lists
(and are comparable at all: every Dropout ratio 0), `oplower lower --strict` and `oplower train` on each.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from lowering.cli import main

ROOT = Path(__file__).resolve().parent / "fixtures" / "ort_training" / "artifacts"
NAMES = ("bert", "bert_torch", "gpt", "vit", "mobilenet", "mlp_act")
# the com.microsoft ops issue 19 names that generate_artifacts writes for these models (FastGeluGrad and
# BiasFastGeluGrad_dX do not appear: torch's tanh GELU stays Tanh & co., its gradient TanhGrad)
ISSUE_OPS = {"DropoutGrad", "SoftmaxGrad_13", "GatherGrad", "LayerNormalizationGrad", "FusedMatMul", "BiasGelu",
             "BiasGeluGrad_dX", "ConcatTraining", "SplitTraining", "SliceGrad", "TanhGrad", "LeakyReluGrad",
             "QuickGelu", "QuickGeluGrad"}


def _meta(name: str) -> dict:
    return json.loads((ROOT / name / "meta.json").read_text())


def _training_model(name: str) -> onnx.ModelProto:
    return onnx.load(ROOT / name / "training_model.onnx")


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    values.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node
                   if n.op_type == "Constant" and n.attribute[0].name == "value"})
    return values


def test_the_artifacts_exercise_every_op_the_issue_lists():
    seen: dict[str, set[str]] = {}
    for name in NAMES:
        for op in _meta(name)["non_standard_ops"]["training_model.onnx"]:
            seen.setdefault(op["op_type"], set()).add(name)
    assert ISSUE_OPS <= set(seen), ISSUE_OPS - set(seen)
    assert seen["QuickGelu"] == {"mlp_act"} and seen["ConcatTraining"] == {"vit"} and seen["SliceGrad"] == {"gpt"}


@pytest.mark.parametrize("name", NAMES)
def test_every_dropout_was_recorded_with_ratio_zero(name):
    """Whole graphs are comparable only without random masks: make_artifacts.py sets every Dropout and
    DropoutGrad ratio to 0 after generation (a mask still exists, so DropoutGrad stays in the graph)."""
    model = _training_model(name)
    values = _constants(model)
    ratios = {"Dropout": 1, "DropoutGrad": 2}
    nodes = [n for n in model.graph.node if n.op_type in ratios]
    assert bool(nodes) == (name != "mlp_act")
    for node in nodes:
        assert float(values[node.input[ratios[node.op_type]]]) == 0.0, node.name
    assert len([n for n in nodes if n.op_type == "Dropout"]) == len([n for n in nodes if n.op_type == "DropoutGrad"])


@pytest.mark.parametrize("name", ["bert", "bert_torch", "gpt", "vit"])
def test_layer_normalization_exposes_its_statistics(name):
    """The forward patch generate_artifacts needs: LayerNormalization with Mean and InvStdDev, which
    LayerNormalizationGrad reads."""
    model = _training_model(name)
    norms = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    grads = [n for n in model.graph.node if n.op_type == "LayerNormalizationGrad"]
    assert norms and len(norms) == len(grads)
    assert all(len(n.output) == 3 and all(n.output) for n in norms)


def test_gpt_reads_the_last_position_with_a_negative_scalar_index():
    """`x[:, -1]`: a GatherGrad along axis 1 with a scalar index -1 (and the embedding's along axis 0)."""
    model = _training_model("gpt")
    values = _constants(model)
    axes = {}
    for node in model.graph.node:
        if node.op_type == "GatherGrad":
            index = values.get(node.input[1])
            axes[node.attribute[0].i] = None if index is None else index.tolist()
    assert axes == {0: None, 1: -1}


@pytest.mark.parametrize("name", NAMES)
def test_oplower_lower_strict_writes_a_standard_training_model(name, tmp_path, capsys):
    out = tmp_path / "lowered.onnx"
    assert main(["lower", str(ROOT / name / "training_model.onnx"), "-o", str(out), "--strict"]) == 0
    assert capsys.readouterr().err == ""
    lowered = onnx.load(out)
    onnx.checker.check_model(lowered, full_check=True)
    assert {n.domain for n in lowered.graph.node} <= {"", "ai.onnx"}


@pytest.mark.parametrize("name", NAMES)
def test_oplower_train_trains_like_onnxruntime_training(name, tmp_path, capsys):
    """`oplower train` on the committed artifact, from its recorded initial parameters, on its one batch: the
    printed losses are the training API's first three."""
    meta = _meta(name)
    directory = ROOT / name
    data = dict(np.load(directory / "data.npz"))
    batch = tmp_path / "batch.npz"
    np.savez(batch, input=data["input"], **{meta["labels_input"]: data["labels"]})
    steps = 3
    assert main(["train", str(directory), "--steps", str(steps), "--data", str(batch), "--params",
                 str(directory / "initial_params.npz"), "--lr", repr(meta["learning_rate"])]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    losses = [float(line.split()[-1]) for line in lines]
    curve = json.loads((directory / "api_curve.json").read_text())["loss"][:steps]
    np.testing.assert_allclose(losses, curve, rtol=1e-5)  # printed to 6 significant digits
