"""The measurement scripts under tools/ that need torch (docs/numerics.md, docs/performance.md) at least parse their
arguments and import against the current package without it, so they do not rot between measurements."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


@pytest.mark.parametrize("script", ["peer_ab.py", "accuracy_vs_torch.py"])
def test_tool_help_runs_without_torch(script):
    done = subprocess.run([sys.executable, str(TOOLS / script), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=TOOLS.parent)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and "torch" in done.stdout


def test_step_memory_lowered_side_reports_its_peak():
    """tools/step_memory.py's lowered side (the native side needs onnxruntime-training's venv): a fresh
    process, RSS before the steps and the peak during them."""
    import json
    import os

    root = TOOLS.parent
    cnn = root / "tests" / "fixtures" / "ort_training" / "artifacts" / "cnn"
    done = subprocess.run([sys.executable, str(TOOLS / "step_memory.py"), str(cnn), "--steps", "2", "--lowered-only"],
                          capture_output=True, text=True, timeout=300, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["side"] == "lowered" and result["steps"] == 2 and result["peak_mb"] >= result["rss_before_mb"] > 0
    refused = subprocess.run([sys.executable, str(TOOLS / "step_memory.py"), str(cnn)], capture_output=True, text=True,
                             timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert refused.returncode == 1 and "--ort-training-python is required" in refused.stderr


def test_native_step_redeclares_the_batch_like_the_bench(tmp_path):
    """tools/ort_training/native_step.py's at_batch (onnx and NumPy only; its timing needs onnxruntime-training)
    re-declares the same dims as the bench's with_batch, so both columns time the same graph."""
    import importlib.util

    import numpy as np
    import onnx

    from lowering.bench import training as bench_training

    spec = importlib.util.spec_from_file_location("native_step", TOOLS / "ort_training" / "native_step.py")
    native_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native_step)
    cnn = native_step.CNN
    assert native_step.at_batch(cnn, 4, tmp_path)[0] == cnn
    source, data = native_step.at_batch(cnn, 16, tmp_path)
    assert data["input"].shape == (16, 3, 8, 8) and data["labels"].shape == (16,)
    ours = bench_training.with_batch(onnx.load(cnn / "training_model.onnx"), 16,
                                     set(np.load(cnn / "initial_params.npz").files))
    theirs = onnx.load(source / "training_model.onnx")

    def dims(model):
        return {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
                for v in (*model.graph.input, *model.graph.value_info)}

    assert dims(theirs) == dims(ours) and dims(ours)["input"] == [16, 3, 8, 8]
    assert (source / "checkpoint").exists() and (source / "optimizer_model.onnx").exists()


def test_artifact_agreement_prints_one_row_per_artifact():
    """tools/ort_training/artifact_agreement.py (the numbers of the issue-19 report): the rows are the tests'
    own measures, within the tests' tolerances on an artifact every op of which has a rule."""
    env = {**os.environ, "PYTHONPATH": str(TOOLS.parent)}
    done = subprocess.run([sys.executable, str(TOOLS / "ort_training" / "artifact_agreement.py"), "mlp", "cnn1d"],
                          capture_output=True, text=True, timeout=300, cwd=TOOLS.parent, env=env)
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()[2:]]
    assert [r[0].strip() for r in rows] == ["mlp", "cnn1d"]
    for row in rows:
        loss, gradient, parameter, curve = (float(v) for v in row[2:])
        assert loss <= 1e-5 and gradient <= 1e-4 and parameter <= 1e-5 and curve <= 1e-4, row
