"""oplower-made artifacts in onnxruntime-training 1.19.2's own runtime (issue 29 item 3b), as recorded.

``tools/ort_training/run_oplower_artifacts.py`` loaded the artifacts ``tools/make_oplower_artifacts.py`` writes for
each committed architecture (its forward_model.onnx, Dropout ratios 0, the recorded meta.json's arguments) into
onnxruntime-training's ``CheckpointState`` / ``Module`` / ``Optimizer``, took the recorded procedure's first step,
optimizer step and 20-step curve, and ran the eval model; ``tests/fixtures/ort_training/oplower_made.json`` holds
the outcome. These tests need neither torch nor onnxruntime-training: they check that every architecture passed
within the tolerances, and that the training model it ran is the one the current generator writes (same sha256),
so a generator change that alters a training model fails here until it is re-recorded (the two commands are in
tests/fixtures/ort_training/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _artifacts import make_oplower_artifacts_driver

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "tests" / "fixtures" / "ort_training" / "oplower_made.json"
LOSS_RTOL, ARRAY_TOL = 1e-5, 1e-4
RERECORD = ("re-record: PYTHONPATH=. python tools/make_oplower_artifacts.py --out DIR && /work/ortt-venv/bin/python "
            "tools/ort_training/run_oplower_artifacts.py DIR --record tests/fixtures/ort_training/oplower_made.json")


DRIVER = make_oplower_artifacts_driver()
NAMES = DRIVER.architectures()
RECORDED = json.loads(RECORD.read_text())


def _entry(name: str) -> dict:
    entry = RECORDED["architectures"].get(name)
    if entry is None:
        reason = RECORDED["failing"].get(name, "not in the recording")
        pytest.fail(f"{name}: not recorded as passing in onnxruntime-training's runtime: {reason}; {RERECORD}")
    return entry


def test_the_recording_covers_every_architecture_and_its_tolerances():
    assert len(NAMES) >= 14
    assert sorted(RECORDED["architectures"]) == NAMES, RECORDED["failing"]
    assert RECORDED["failing"] == {}
    assert RECORDED["onnxruntime_training"] == "1.19.2"
    assert RECORDED["tolerances"] == {"loss_rel": LOSS_RTOL, "grad_param_of_largest": ARRAY_TOL}


@pytest.mark.parametrize("name", NAMES)
def test_first_step_curve_and_eval_match_onnxruntime_trainings_own_artifacts(name):
    e = _entry(name)
    assert e["passed"] is True
    assert e["checkpoint_vs_initial_params"] == 0.0  # our checkpoint holds initial_params.npz exactly
    assert e["loss1_rel"] <= LOSS_RTOL
    assert e["grad_rel_max"] <= ARRAY_TOL, e["grad_worst_param"]
    assert all(v <= ARRAY_TOL for v in e["zero_truth_grads"].values())
    assert e["param_rel_max"] <= ARRAY_TOL, e["param_worst"]
    assert e["curve_rel_max"] <= LOSS_RTOL
    assert e["eval_loaded"] is True, e.get("eval_error")
    assert e["eval_loss_rel_to_own"] <= LOSS_RTOL


def test_batch_norm_nets_eval_model_loads_where_onnxruntime_trainings_own_does_not():
    """The recorded cases where its own eval model fails to load (BatchNormalization with training_mode off and
    three outputs) and ours loads and gives its (output-trimmed) eval model's loss."""
    refused = {name for name, e in RECORDED["architectures"].items() if not e["own_eval_model"]["loaded"]}
    assert {"cnn", "cnn1d", "mlp", "mobilenet"} <= refused
    for name in refused:
        assert "BatchNormalization" in RECORDED["architectures"][name]["own_eval_model"]["error"]
        assert RECORDED["architectures"][name]["eval_loaded"] is True


@pytest.mark.parametrize("name", NAMES)
def test_recorded_training_model_is_the_one_the_generator_writes_now(name):
    recorded = _entry(name)["training_model_sha256"]
    now = DRIVER.training_sha256(DRIVER.build(name))
    assert now == recorded, f"{name}: the generator's training model changed since the recording; {RERECORD}"


def test_zero_dropout_reads_a_zero_ratio_everywhere():
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = DRIVER.forward_model("mobilenet")
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    dropouts = [n for n in model.graph.node if n.op_type == "Dropout"]
    assert dropouts
    for node in dropouts:
        assert float(inits[node.input[1]]) == 0.0
    original = onnx.load(DRIVER.ARTIFACTS / "mobilenet" / "forward_model.onnx")
    assert len(model.graph.node) < len(original.graph.node)  # the ratio Constants nothing reads any more are gone
    assert np.all([len(n.output) == len(o.output) for n, o in zip(dropouts, [n for n in original.graph.node
                                                                             if n.op_type == "Dropout"], strict=True)])
