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


def test_step_profile_charges_every_lowered_kernel_to_a_training_graph_op():
    """tools/step_profile.py's lowered side (the native side needs onnxruntime-training's venv): every kernel of
    the bound train step is charged to an op of the artifact's training graph or to the optimizer update, and
    the gradient ops of the cnn artifact are there with their kernels."""
    import importlib.util

    import onnx

    sys.path.insert(0, str(TOOLS))
    try:
        spec = importlib.util.spec_from_file_location("step_profile", TOOLS / "step_profile.py")
        step_profile = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(step_profile)
    finally:
        sys.path.remove(str(TOOLS))
    cnn = TOOLS.parent / "tests" / "fixtures" / "ort_training" / "artifacts" / "cnn"
    detail: dict = {}
    groups = step_profile.lowered_profile(cnn, 2, 1, detail)
    raw_ops = {n.op_type for n in onnx.load(cnn / "training_model.onnx").graph.node}
    for key, (ms, kernels) in groups.items():
        op = key.removesuffix(" (forward, standard)")
        assert key == step_profile.UPDATE or op in raw_ops or key.endswith("(forward, standard)"), key
        assert ms > 0 and kernels >= 1
        assert abs(sum(v[1] for v in detail[key].values()) - kernels) < 1e-9
    for op in ("ConvGrad", "BatchNormalizationGrad", "MaxPoolGrad", step_profile.UPDATE):
        assert groups[op][1] >= 1, op
    native = {"training": {"ConvGrad": [0.1, 5.0], "Conv": [0.05, 3.0]}, "optimizer_wall_ms": 0.03}
    rendered = step_profile.table(groups, native)
    assert "| ConvGrad |" in rendered and "| **all** |" in rendered


def _is_git_checkout() -> bool:
    try:
        return subprocess.run(["git", "-C", str(TOOLS.parent), "rev-parse", "HEAD"], capture_output=True,
                              timeout=30).returncode == 0
    except OSError:  # no git at all
        return False


@pytest.mark.skipif(not _is_git_checkout(), reason="ab_lowered.py exports a git revision: the project is not a git "
                                                   "checkout here (a source archive) or git is missing")
def test_ab_lowered_compares_a_revision_with_the_checkout():
    """tools/ab_lowered.py: the base revision's own `train-step` writes side A's model (git archive of HEAD
    here, so both sides lower alike), both train from the same start: equal first losses, one B/A per round."""
    root = TOOLS.parent
    mlp = root / "tests" / "fixtures" / "ort_training" / "artifacts" / "mlp_bce"
    done = subprocess.run([sys.executable, str(TOOLS / "ab_lowered.py"), str(mlp), "--base", "HEAD", "--rounds", "2",
                           "--steps", "2"], capture_output=True, text=True, timeout=300, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr
    import re

    first = done.stdout.splitlines()[0]
    a, b = re.match(r"first losses: A (\S+), B (\S+);", first).groups()
    assert a == b, first
    assert sum(line.startswith("round ") for line in done.stdout.splitlines()) == 2
    assert "median B/A" in done.stdout.splitlines()[-1]
