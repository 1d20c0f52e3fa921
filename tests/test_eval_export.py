"""lowering.training.workflow: evaluation and the inference model against onnxruntime-training 1.19.2.

Fixtures: tests/fixtures/ort_training/workflow/<name>/ (tools/ort_training/record_workflow.py): the training
API's eval step (eval.npz ``loss``, one per batch of eval_data.npz) and the outputs of the model its
``export_model_for_inferencing`` wrote (eval.npz ``output``), both on the parameters after 6 steps
(ortt_k6.npz). Acceptance (3): eval equals onnxruntime-training's eval (1e-5 relative); (4) the exported model's
outputs equal export_model_for_inferencing's model's (1e-6 relative) in onnxruntime, OpenVINO and tract.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from test_portable import _run as run_in

from lowering.cli import main
from lowering.training.workflow import (
    EVAL_MODEL,
    evaluate,
    export_inference,
    forward_outputs,
    parameter_values,
    repair_eval_model,
)
from opdef.errors import ModelError

FIXTURES = Path(__file__).parent / "fixtures" / "ort_training"
ARTIFACTS = FIXTURES / "artifacts"
WORKFLOW = FIXTURES / "workflow"
NAMES = ("cnn1d", "mlp_bce")


def _k6_values(name: str) -> dict[str, np.ndarray]:
    recorded = np.load(WORKFLOW / name / "ortt_k6.npz")
    return {k[len("param."):]: recorded[k] for k in recorded.files if k.startswith("param.")}


def _eval_data(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(WORKFLOW / name / "eval_data.npz"))


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    return float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), 1e-30)


@pytest.mark.parametrize("name", NAMES)
def test_generate_artifacts_eval_model_is_refused_until_repaired(name):
    raw = onnx.load(ARTIFACTS / name / EVAL_MODEL)
    with pytest.raises(Exception, match="BatchNormalization"):
        ort.InferenceSession(raw.SerializeToString(), providers=["CPUExecutionProvider"])
    repaired, changed = repair_eval_model(raw)
    assert changed == ["/1/BatchNormalization"]
    bn = next(n for n in repaired.graph.node if n.op_type == "BatchNormalization")
    assert list(bn.output) == ["/1/BatchNormalization_output_0"]
    onnx.checker.check_model(repaired, full_check=True)
    ort.InferenceSession(repaired.SerializeToString(), providers=["CPUExecutionProvider"])
    assert repair_eval_model(repaired)[1] == []  # nothing left to do


@pytest.mark.parametrize("name", NAMES)
def test_eval_equals_onnxruntime_training_eval(name):
    recorded = np.load(WORKFLOW / name / "eval.npz")
    data, values = _eval_data(name), _k6_values(name)
    result = evaluate(ARTIFACTS / name, data, values)
    assert result.batches == 2
    assert abs(result.loss - float(np.mean(recorded["loss"]))) <= 1e-5 * abs(float(np.mean(recorded["loss"])))
    for b in range(2):
        one = evaluate(ARTIFACTS / name, {k: v[b] for k, v in data.items()}, values)
        assert one.batches == 1 and abs(one.loss - recorded["loss"][b]) <= 1e-5 * abs(recorded["loss"][b])
    # accuracy from the logits of onnxruntime-training's exported model
    if name == "cnn1d":  # SoftmaxCrossEntropyLoss: argmax against the class
        expected = float(np.mean(np.argmax(recorded["output"], axis=-1) == data["labels"]))
    else:  # BCEWithLogitsLoss: each logit's sign against its 0/1 target
        expected = float(np.mean((recorded["output"] > 0) == (data["target"] > 0.5)))
    assert result.accuracy == pytest.approx(expected)
    # labels that agree with the logits: accuracy 1; with the first sample's flipped: a known fraction
    label = "labels" if name == "cnn1d" else "target"
    logits = recorded["output"]
    agree = np.argmax(logits, -1) if name == "cnn1d" else (logits > 0).astype(data[label].dtype)
    assert evaluate(ARTIFACTS / name, {**data, label: agree.astype(data[label].dtype)}, values).accuracy == 1.0
    flipped = agree.copy()
    flipped.flat[0] = (flipped.flat[0] + 1) % 3 if name == "cnn1d" else 1 - flipped.flat[0]
    total = flipped.size
    assert evaluate(ARTIFACTS / name, {**data, label: flipped.astype(data[label].dtype)}, values).accuracy == \
        pytest.approx((total - 1) / total)


def test_parameter_values_come_from_the_directory_checkpoint():
    values = parameter_values(ARTIFACTS / "cnn1d")
    initial = np.load(ARTIFACTS / "cnn1d" / "initial_params.npz")
    assert sorted(values) == sorted(initial.files)
    for k in initial.files:
        np.testing.assert_array_equal(values[k], initial[k])


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino", "tract"])
@pytest.mark.parametrize("name", NAMES)
def test_export_equals_export_model_for_inferencing(name, runtime, tmp_path):
    recorded = np.load(WORKFLOW / name / "eval.npz")
    interface = json.loads((WORKFLOW / name / "export.json").read_text())
    path = tmp_path / "inference.onnx"
    model = export_inference(ARTIFACTS / name, _k6_values(name), path)
    assert onnx.load(path) == model
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == interface["inputs"]
    assert [o.name for o in model.graph.output] == interface["outputs"]
    assert sorted(t.name for t in model.graph.initializer) == interface["initializers"]
    assert [n.op_type for n in model.graph.node] == interface["nodes"]
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    data = _eval_data(name)
    for b in range(2):
        got = run_in(runtime, model, {"input": data["input"][b]}, tmp_path)["output"]
        assert _rel(got, recorded["output"][b]) <= 1e-6, (runtime, b)


def test_forward_outputs_are_what_the_loss_block_reads():
    for name in NAMES:
        assert forward_outputs(onnx.load(ARTIFACTS / name / EVAL_MODEL)) == ["output"]
    model = export_inference(ARTIFACTS / "cnn1d", _k6_values("cnn1d"), outputs=["/2/Relu_output_0", "output"])
    assert [o.name for o in model.graph.output] == ["/2/Relu_output_0", "output"]
    with pytest.raises(ModelError, match=r"eval_model.onnx: no value 'nothing' to export"):
        export_inference(ARTIFACTS / "cnn1d", _k6_values("cnn1d"), outputs=["nothing"])


def test_cli_eval_prints_loss_and_accuracy(tmp_path, capsys):
    params = tmp_path / "p.npz"
    np.savez(params, **_k6_values("cnn1d"))
    data = tmp_path / "data.npz"
    np.savez(data, **_eval_data("cnn1d"))
    assert main(["eval", str(ARTIFACTS / "cnn1d"), "--data", str(data), "--params", str(params)]) == 0
    line = capsys.readouterr().out.strip()
    recorded = np.load(WORKFLOW / "cnn1d" / "eval.npz")
    words = line.split()
    assert words[:2] == ["eval", "loss"] and words[3] == "accuracy" and line.endswith("(2 batches)")
    assert abs(float(words[2]) - float(np.mean(recorded["loss"]))) <= 1e-5


def test_cli_train_export_goes_on_from_a_checkpoint_and_exports(tmp_path, capsys):
    name = "cnn1d"
    data = tmp_path / "data.npz"
    art = np.load(ARTIFACTS / name / "data.npz")
    np.savez(data, input=art["input"], labels=art["labels"])
    out = tmp_path / "model.onnx"
    code = main(["train", str(ARTIFACTS / name), "--steps", "3", "--data", str(data), "--checkpoint",
                 str(WORKFLOW / name / "ortt_k3.ckpt"), "--export", str(out)])
    assert code == 0 and f"wrote {out}" in capsys.readouterr().out
    recorded = np.load(WORKFLOW / name / "eval.npz")  # export of the parameters after step 6
    got = run_in("onnxruntime", onnx.load(out), {"input": _eval_data(name)["input"][0]}, tmp_path)["output"]
    assert _rel(got, recorded["output"][0]) <= 1e-5


def test_cli_bad_export_and_eval_arguments(tmp_path, capsys):
    data = tmp_path / "data.npz"
    art = np.load(ARTIFACTS / "cnn1d" / "data.npz")
    np.savez(data, input=art["input"], labels=art["labels"])
    out = tmp_path / "model.onnx"
    code = main(["train", str(ARTIFACTS / "cnn1d"), "--steps", "1", "--data", str(data), "--export", str(out),
                 "--export-output", "nothing"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "no value 'nothing' to export" in err[0] and not out.exists()
    code = main(["eval", str(ARTIFACTS / "cnn1d"), "--data", str(data), "--params", str(data)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "'input' is no data input of eval_model.onnx" in err[0]
    np.savez(data, input=art["input"])
    code = main(["eval", str(ARTIFACTS / "cnn1d"), "--data", str(data)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "no array for the data input 'labels'" in err[0]
    labels = art["labels"].copy()
    labels[1] = 3  # cnn1d has 3 classes
    np.savez(data, input=art["input"], labels=labels)
    code = main(["eval", str(ARTIFACTS / "cnn1d"), "--data", str(data)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert "label input 'labels' holds 3 at [0, 1] (batch 0)" in err[0] and "class id in [0, 3)" in err[0]


def test_the_workflow_block_in_docs_training_runs_as_written(tmp_path):
    """docs/training.md's copy-paste workflow (train from the directory's checkpoint, save a checkpoint, go on
    from it, export, eval, run the export) runs as it stands and prints onnxruntime-training's losses."""
    import os
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    text = (root / "docs" / "training.md").read_text()
    section = text[text.index("## 4. Checkpoints"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, command in (("oplower", f'"{sys.executable}" -m lowering'), ("python", f'"{sys.executable}"')):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        (bin_dir / name).chmod(0o755)
    (tmp_path / "tests").symlink_to(root / "tests")
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(["bash", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    for loss in ("step 4 loss 0.681481", "step 5 loss 0.678806", "step 6 loss 0.676146",
                 "eval loss 0.66424 accuracy 0.5 (1 batch)"):
        assert loss in done.stdout, done.stdout
    assert (tmp_path / "y.npz").exists() and (tmp_path / "k6.ckpt").exists()
