"""lowering.training.checkpoint and training from/to checkpoints against onnxruntime-training 1.19.2.

Fixtures: tests/fixtures/ort_training/workflow/<name>/ (tools/ort_training/record_workflow.py). Acceptance:
(1) onnxruntime-training's checkpoint after k=3 steps, read by oplower and trained m=3 more steps, and
oplower's own 3 steps + checkpoint + 3 steps, both equal onnxruntime-training's 6 steps (loss 1e-5 relative
per step, parameters 1e-5 of the largest entry); (2) the checkpoint oplower writes is the one
onnxruntime-training loaded in the recording (same values), and its next step there equals oplower's.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import onnx
import pytest

from lowering.cli import main
from lowering.training import checkpoint as ckmod
from lowering.training.checkpoint import CheckpointError, decode_checkpoint, encode_checkpoint, read_checkpoint
from lowering.training.trainer import Trainer, batches, checkpoint_start, lower_artifacts, starting_point, train

FIXTURES = Path(__file__).parent / "fixtures" / "ort_training"
ARTIFACTS = FIXTURES / "artifacts"
WORKFLOW = FIXTURES / "workflow"
NAMES = ("cnn1d", "mlp_bce")
K = M = 3


def _meta(name: str) -> dict:
    return json.loads((ARTIFACTS / name / "meta.json").read_text())


def _data(name: str) -> dict[str, np.ndarray]:
    data = np.load(ARTIFACTS / name / "data.npz")
    return {"input": data["input"], _meta(name)["labels_input"]: data["labels"]}


def _close(got, want, tol=1e-5, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    err = float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), 1e-30)
    assert err <= tol, f"{what}: relative error {err:.3g}"


def _losses_close(got, want):
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= 1e-5 * abs(w), f"step {k + 1}: {g} != {w}"


def _params_close(params, frozen, recorded, prefix="param."):
    for key in recorded.files:
        if key.startswith(prefix):
            name = key[len(prefix):]
            _close(params[name] if name in params else frozen[name], recorded[key], what=name)


# -- reading and writing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_reads_what_onnxruntime_training_saved(name):
    meta = _meta(name)
    ckpt = read_checkpoint(WORKFLOW / name / "ortt_k3.ckpt")
    assert sorted(ckpt.params) == sorted(meta["trainable_params"])
    assert sorted(ckpt.frozen) == sorted(meta["frozen_params"])
    assert ckpt.step == K and ckpt.learning_rate == pytest.approx(meta["learning_rate"])
    moments = 2 if meta["optimizer"] == "AdamW" else 1  # SGD's first_order_moments input is kept, all zero
    assert {len(m) for m in ckpt.moments.values()} == {moments} and set(ckpt.moments) == set(ckpt.params)
    for p, value in ckpt.params.items():
        assert value.dtype == np.float32 and all(m.shape == value.shape for m in ckpt.moments[p])
    initial = read_checkpoint(ARTIFACTS / name / "checkpoint")  # generate_artifacts': no optimizer state
    assert initial.step == 0 and not initial.has_optimizer_state
    recorded = np.load(ARTIFACTS / name / "initial_params.npz")
    for p in recorded.files:
        np.testing.assert_array_equal({**initial.params, **initial.frozen}[p], recorded[p])


@pytest.mark.parametrize("name", NAMES)
def test_write_then_read_gives_back_every_value(name):
    ckpt = read_checkpoint(WORKFLOW / name / "ortt_k3.ckpt")
    ckpt.properties = {"epoch": 7, "best": 0.25, "note": "x"}
    again = decode_checkpoint(encode_checkpoint(ckpt))
    assert again.step == ckpt.step and again.learning_rate == pytest.approx(ckpt.learning_rate)
    assert again.properties == ckpt.properties
    for group in ("params", "frozen"):
        a, b = getattr(again, group), getattr(ckpt, group)
        assert list(a) == sorted(b)
        for p in b:
            np.testing.assert_array_equal(a[p], b[p])
    for p, moments in ckpt.moments.items():
        for x, y in zip(again.moments[p], moments, strict=True):
            np.testing.assert_array_equal(x, y)


def _small() -> bytes:
    return (WORKFLOW / "mlp_bce" / "ortt_k3.ckpt").read_bytes()


def test_every_truncation_is_one_line_naming_the_file():
    data = _small()
    for n in range(len(data)):
        with pytest.raises(CheckpointError) as info:
            decode_checkpoint(data[:n], "ck.bin")
        message = str(info.value)
        assert message.startswith("ck.bin: ") and "\n" not in message, n
    decode_checkpoint(data, "ck.bin")  # the whole file reads


@pytest.mark.parametrize("name", NAMES)
def test_random_damage_is_read_or_refused_never_anything_else(name):
    rng = random.Random(22)
    for source in (WORKFLOW / name / "ortt_k3.ckpt", WORKFLOW / name / "oplower_k3.ckpt"):
        data = source.read_bytes()
        refused = 0
        for _ in range(300):
            damaged = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                damaged[rng.randrange(len(damaged))] = rng.randrange(256)
            try:
                decode_checkpoint(bytes(damaged), "ck.bin")
            except CheckpointError as exc:
                refused += 1
                assert str(exc).startswith("ck.bin: ") and "\n" not in str(exc)
        assert refused > 100  # most damage is caught; a changed float in a tensor cannot be


def test_other_version_and_foreign_files(tmp_path, monkeypatch):
    ckpt = read_checkpoint(ARTIFACTS / "mlp_bce" / "checkpoint")
    monkeypatch.setattr(ckmod, "VERSION", 3)
    newer = encode_checkpoint(ckpt)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"^v3: checkpoint version 3; oplower reads version 2"):
        decode_checkpoint(newer, "v3")
    with pytest.raises(CheckpointError, match=r"training_model.onnx: not an onnxruntime-training checkpoint"):
        read_checkpoint(ARTIFACTS / "mlp_bce" / "training_model.onnx")
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"empty: not an onnxruntime-training checkpoint \(empty"):
        read_checkpoint(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="nothere: no such file"):
        read_checkpoint(tmp_path / "nothere")
    with pytest.raises(CheckpointError, match="is a directory"):
        read_checkpoint(tmp_path)


def test_a_checkpoint_that_does_not_fit_the_artifacts_names_the_first_mismatch(tmp_path):
    models = lower_artifacts(ARTIFACTS / "cnn1d")
    with pytest.raises(CheckpointError, match=r"checkpoint: the trainable parameter '4.weight' of the training "
                                              r"model is not in it"):
        checkpoint_start(ARTIFACTS / "mlp_bce" / "checkpoint", models)
    ckpt = read_checkpoint(WORKFLOW / "cnn1d" / "ortt_k3.ckpt")
    cases = [
        (lambda c: c.moments.clear() or c.params.update({"0.weight": c.params["0.weight"][:5]}),
         r"parameter '0.weight' is float32\[5, 3, 3\]; the training model declares float32\[6, 3, 3\]"),
        (lambda c: c.moments.clear() or c.params.update({"0.bias": c.params["0.bias"].astype(np.float64)}),
         "'0.bias' is float64"),
        (lambda c: c.moments.clear() or c.params.update({"extra": np.zeros(2, np.float32)}),
         "'extra' is no trainable parameter"),
        (lambda c: c.frozen.update({"extra": np.zeros(2, np.float32)}), "frozen parameter 'extra' is no input"),
        (lambda c: c.moments.clear() or c.frozen.update({"0.bias": c.params.pop("0.bias")}),
         "'0.bias' of the training model is frozen"),
        (lambda c: c.moments.update({p: m * 2 for p, m in c.moments.items()}),
         r"2 optimizer moment\(s\) per parameter; the optimizer model takes 1 \(first_order_moments\)"),
    ]
    for change, fragment in cases:
        bad = read_checkpoint(WORKFLOW / "cnn1d" / "ortt_k3.ckpt")
        change(bad)
        path = tmp_path / "bad.ckpt"
        ckmod.write_checkpoint(path, bad)
        with pytest.raises(CheckpointError, match=fragment) as info:
            checkpoint_start(path, models)
        assert str(info.value).startswith(f"{path}: ")
    assert checkpoint_start(WORKFLOW / "cnn1d" / "ortt_k3.ckpt", models).step == ckpt.step


# -- acceptance against onnxruntime-training ----------------------------------------------------------------


def _models(name: str, path: str):
    """The lowered artifacts, run as one train-step model (Trainer's default) or as the two models."""
    models = lower_artifacts(ARTIFACTS / name)
    assert models.step is not None
    return models if path == "train-step" else dataclasses.replace(models, step=None)


@pytest.mark.parametrize("path", ["train-step", "two-models"])
@pytest.mark.parametrize("name", NAMES)
def test_onnxruntime_training_checkpoint_then_m_steps_equals_its_k_plus_m(name, path):
    recorded = np.load(WORKFLOW / name / "ortt_k6.npz")
    models = _models(name, path)
    start = checkpoint_start(WORKFLOW / name / "ortt_k3.ckpt", models)
    trainer = Trainer(models, start)
    feed = batches(_data(name), models, start.frozen)
    losses = [trainer.step(feed(k)) for k in range(K, K + M)]
    assert trainer.step_count == K + M
    _losses_close(losses, recorded["loss"][K:])
    _params_close(trainer.params, trainer.frozen, recorded)


@pytest.mark.parametrize("name", NAMES)
def test_oplower_k_steps_checkpoint_m_steps_equals_onnxruntime_training(name, tmp_path):
    recorded = np.load(WORKFLOW / name / "ortt_k6.npz")
    saved = tmp_path / "k3.ckpt"
    first, _ = train(ARTIFACTS / name, _data(name), K, save_checkpoint=saved)  # from DIR/checkpoint
    steps = []
    second, params = train(ARTIFACTS / name, _data(name), M, checkpoint=saved, on_step=lambda k, _: steps.append(k))
    assert steps == [4, 5, 6]
    _losses_close(first + second, recorded["loss"])
    ckpt = read_checkpoint(saved)
    assert ckpt.step == K
    models = lower_artifacts(ARTIFACTS / name)
    trainer = Trainer(models, checkpoint_start(saved, models))
    feed = batches(_data(name), models, ckpt.frozen)
    for k in range(K, K + M):
        trainer.step(feed(k))
    _params_close(trainer.params, trainer.frozen, recorded)


@pytest.mark.parametrize("path", ["train-step", "two-models"])
@pytest.mark.parametrize("name", NAMES)
def test_onnxruntime_training_loads_oplower_checkpoint_and_its_next_step_matches(name, path, tmp_path):
    # the recording ran `oplower train --steps 3 --save-checkpoint` and loaded the file in onnxruntime-training
    recorded_file = read_checkpoint(WORKFLOW / name / "oplower_k3.ckpt")
    after = np.load(WORKFLOW / name / "ortt_from_oplower.npz")
    for key in after.files:
        if key.startswith("loaded."):  # what onnxruntime-training read is what the file holds
            p = key[len("loaded."):]
            np.testing.assert_array_equal(after[key], {**recorded_file.params, **recorded_file.frozen}[p])
    # today's oplower writes the same state
    saved = tmp_path / "k3.ckpt"
    train(ARTIFACTS / name, _data(name), K, save_checkpoint=saved)
    now = read_checkpoint(saved)
    assert now.step == recorded_file.step == K
    # moments relative to the largest moment of their kind over all parameters: a Linear bias before a
    # training-mode BatchNorm (mlp_bce's 0.bias) has a gradient that is zero but for rounding, so its own
    # moments are rounding noise (~1e-10) that any change of summation order in the forms moves wholesale
    kinds = max((len(m) for m in recorded_file.moments.values()), default=0)  # 2 for AdamW, 0 for SGD
    scales = [max(float(np.max(np.abs(m[i]))) for m in recorded_file.moments.values()) for i in range(kinds)]
    for p in recorded_file.params:
        _close(now.params[p], recorded_file.params[p], 1e-6, p)
        for i, (x, y) in enumerate(zip(now.moments[p], recorded_file.moments[p], strict=True)):
            if np.any(y):
                err = float(np.max(np.abs(np.asarray(x, np.float64) - y))) / scales[i]
                assert err <= 1e-6, f"{p}: moment {i}: error {err:.3g} of the largest such moment"
            else:
                np.testing.assert_array_equal(x, y)
    # and its next step equals onnxruntime-training's step from that file
    models = _models(name, path)
    trainer = Trainer(models, checkpoint_start(WORKFLOW / name / "oplower_k3.ckpt", models))
    loss = trainer.step(batches(_data(name), models, recorded_file.frozen)(K))
    _losses_close([loss], [float(after["loss"])])
    _params_close(trainer.params, trainer.frozen, after)


def test_params_override_the_directory_checkpoint():
    name = "cnn1d"
    models = lower_artifacts(ARTIFACTS / name)
    assert starting_point(ARTIFACTS / name, models).params.keys() == set(models.params)
    curve = json.loads((ARTIFACTS / name / "api_curve.json").read_text())["loss"]
    losses, _ = train(ARTIFACTS / name, _data(name), 2)  # DIR/checkpoint = onnxruntime-training's start
    _losses_close(losses, curve[:2])
    given = {k: v * 1.5 for k, v in np.load(ARTIFACTS / name / "initial_params.npz").items()}
    other, _ = train(ARTIFACTS / name, _data(name), 1, params=given)
    assert abs(other[0] - curve[0]) > 1e-3


# -- the command line ---------------------------------------------------------------------------------------


def _npz(tmp_path, name) -> str:
    path = tmp_path / "data.npz"
    np.savez(path, **_data(name))
    return str(path)


def test_cli_save_checkpoint_then_go_on(tmp_path, capsys):
    name = "mlp_bce"
    data, ck = _npz(tmp_path, name), tmp_path / "k3.ckpt"
    assert main(["train", str(ARTIFACTS / name), "--steps", "3", "--data", data, "--save-checkpoint", str(ck)]) == 0
    assert main(["train", str(ARTIFACTS / name), "--steps", "3", "--data", data, "--checkpoint", str(ck)]) == 0
    out = capsys.readouterr().out
    recorded = np.load(WORKFLOW / name / "ortt_k6.npz")["loss"]
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [int(line.split()[1]) for line in lines] == [1, 2, 3, 4, 5, 6]
    _losses_close([float(line.split()[3]) for line in lines], recorded)  # printed to 6 digits
    assert "for 3 steps after step 3" in out


@pytest.mark.parametrize("case", ["truncated", "foreign", "mismatch", "missing"])
@pytest.mark.parametrize("command", ["train", "eval"])
def test_cli_bad_checkpoint_exit_1_one_line_nothing_written(case, command, tmp_path, capsys):
    bad = tmp_path / "bad.ckpt"
    good = (WORKFLOW / "cnn1d" / "ortt_k3.ckpt").read_bytes()
    if case == "truncated":
        bad.write_bytes(good[: len(good) // 2])
    elif case == "foreign":
        bad.write_bytes(onnx.load(ARTIFACTS / "cnn1d" / "eval_model.onnx").SerializeToString())
    elif case == "mismatch":
        bad.write_bytes((WORKFLOW / "mlp_bce" / "ortt_k3.ckpt").read_bytes())
    data = _npz(tmp_path, "cnn1d")
    outs = [tmp_path / "out.npz", tmp_path / "out.ckpt", tmp_path / "out.onnx"]
    if command == "train":
        argv = ["train", str(ARTIFACTS / "cnn1d"), "--steps", "1", "--data", data, "--checkpoint", str(bad),
                "--save", str(outs[0]), "--save-checkpoint", str(outs[1]), "--export", str(outs[2])]
    else:
        argv = ["eval", str(ARTIFACTS / "cnn1d"), "--data", data, "--checkpoint", str(bad)]
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith(f"oplower {command}: error: {bad}"), err
    if case == "missing":
        assert "no such file" in err[0]
    elif case == "mismatch" and command == "train":
        assert "trainable parameter '4.weight'" in err[0]
    elif case == "mismatch":
        assert "parameter '3.bias' is no input of eval_model.onnx" in err[0]
    assert not any(p.exists() for p in outs)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"data.npz", *(["bad.ckpt"] if bad.exists() else [])})


# -- progress in a terminal and out of one ------------------------------------------------------------------


def _run_cli(argv: list[str], tty: bool) -> tuple[str, str]:
    """``python -m lowering ARGV`` with stdout and stderr on one pseudo-terminal (tty: returns what it shows,
    "") or on two pipes (returns stdout, stderr)."""
    import os
    import pty
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent))
    command = [sys.executable, "-m", "lowering", *argv]
    if not tty:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout, done.stderr
    leader, follower = pty.openpty()
    process = subprocess.Popen(command, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert process.wait(timeout=300) == 0
    return b"".join(chunks).decode(), ""


def _screen(raw: str) -> list[str]:
    """The lines a terminal shows: within a line, text before a carriage return + erase-line is gone."""
    lines = []
    for line in raw.replace("\r\n", "\n").split("\n"):
        lines.append(line.split("\r\x1b[K")[-1].split("\r")[-1])
    return lines


@pytest.mark.parametrize("command", ["train", "eval"])
def test_progress_bar_in_a_terminal_and_clean_stdout_out_of_one(command, tmp_path):
    data = _npz(tmp_path, "cnn1d")
    argv = ["train", str(ARTIFACTS / "cnn1d"), "--steps", "3", "--data", data] if command == "train" else \
        ["eval", str(ARTIFACTS / "cnn1d"), "--data", data]
    out, err = _run_cli(argv, tty=False)
    assert err == "" and "\r" not in out and "[" not in out
    if command == "train":
        assert [line.split()[:2] for line in out.splitlines()[1:]] == [["step", "1"], ["step", "2"], ["step", "3"]]
    raw, _ = _run_cli(argv, tty=True)
    assert "[##########" in raw  # the bar was drawn
    shown = [line for line in _screen(raw) if line.strip()]
    assert shown == [line for line in out.splitlines() if line.strip()]  # and erased: the same lines as a pipe gets


def test_reading_a_checkpoint_does_not_import_torch(tmp_path):
    """onnxruntime.tools' __init__ imports torch whenever torch is installed (1 s, ~170 MB); the checkpoint
    classes are loaded around it. A `torch` on the path that refuses to be imported proves it: the training
    module imports and a recorded checkpoint reads in a fresh process."""
    import os
    import subprocess
    import sys

    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    root = Path(__file__).resolve().parent.parent
    ckpt = root / "tests" / "fixtures" / "ort_training" / "artifacts" / "cnn" / "checkpoint"
    code = ("import sys, lowering.training.trainer, lowering.training.checkpoint as c; "
            f"s = c.read_checkpoint({str(ckpt)!r}); print(len(s.params), 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])})
    assert done.returncode == 0, done.stderr
    count, imported = done.stdout.split()
    assert int(count) > 0 and imported == "False"
