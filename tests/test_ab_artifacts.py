"""tools/ab_artifacts.py's oplower side (its onnxruntime-training side needs that venv): the fresh-process generation
runs print what the comparison reads, and the step A/B trains oplower-made artifacts beside onnxruntime-training's
with the same first loss. On the committed cnn artifact, which has what ``native_step.py make`` writes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
CNN = ROOT / "tests" / "fixtures" / "ort_training" / "artifacts" / "cnn"


def _run(*args: str) -> dict:
    out = subprocess.run([sys.executable, str(TOOLS / "ab_artifacts.py"), str(CNN), *args], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_generation_runs_report_first_and_second_calls():
    run = _run("--generate-once")
    assert run["side"] == "oplower"
    assert run["ms"] > 0 and run["second_ms"] > 0 and run["import_ms"] > 0
    assert set(run["files"]) == {"training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint"}
    parts = _run("--generate-once", "--breakdown")
    assert {"load_schemas_ms", "onnx_schemas_init_ms", "verification_ms", "call_without_verification_ms"} <= set(
        parts)


def test_step_ab_trains_both_sides_from_the_same_start(tmp_path, capsys):
    sys.path.insert(0, str(TOOLS))
    try:
        spec = importlib.util.spec_from_file_location("ab_artifacts", TOOLS / "ab_artifacts.py")
        ab = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ab)
        ab.make_oplower_side(CNN, tmp_path / "cnn_oplower")
        assert {"meta.json", "data.npz", "initial_params.npz", "training_model.onnx", "checkpoint"} <= {
            p.name for p in (tmp_path / "cnn_oplower").iterdir()}
        result = ab.step_ab(CNN, tmp_path / "cnn_oplower", rounds=1, steps=2, threads=1)
    finally:
        sys.path.remove(str(TOOLS))
    assert abs(result["first_loss"]["A"] - result["first_loss"]["B"]) <= 1e-6 * abs(result["first_loss"]["A"])
    assert abs(result["loss_10"]["A"] - result["loss_10"]["B"]) <= 1e-5 * abs(result["loss_10"]["A"])
    assert result["ratio"] > 0 and result["nodes"]["A"] > 0 and result["nodes"]["B"] > 0
    assert "B/A" in capsys.readouterr().out
