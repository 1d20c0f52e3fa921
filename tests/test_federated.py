"""Federated training on Flower (issue 30): ``oplower federate`` in Flower's Simulation Engine, the same apps
deployed with a real SuperLink and SuperNodes, against the definition computed independently.

The definition (docs/federated.md): each round every sampled client starts from the global state with fresh
optimizer state and trains E passes over its B batches, exactly ``oplower train DIR --params GLOBAL.npz --data
P.npz --steps E*B --lr LR``; the new global state is the example-weighted mean of every state tensor the
clients return. The artifacts are held out: made here by ``oplower artifacts`` from the committed cnn forward
model (convolutions, batch norm with running statistics, AdamW), not the committed onnxruntime-training ones.

Bounded: every process is started with a timeout in its own session and its whole process group is stopped at
the end, also on failure; ports are free ones on 127.0.0.1; the clients run one onnxruntime thread each, as the
reference does, so each client's result is bit-identical to its ``oplower train``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import onnx
import pytest

from lowering.cli import main
from lowering.training.checkpoint import read_checkpoint
from lowering.training.federated import FederatedError
from lowering.training.federated.local import (
    check_partition,
    global_start,
    read_partition,
    training_models,
    write_global,
)
from lowering.training.federated.partition import split

ROOT = Path(__file__).resolve().parent.parent
# Flower 1.42 (the extra) installs on Python 3.11 and newer only; on 3.10 the extra's marker leaves it out and
# `oplower federate` says so (test_oplower_works_without_flower_and_federate_names_the_extra runs everywhere)
needs_flower = pytest.mark.skipif(sys.version_info < (3, 11), reason="Flower 1.42 needs Python >= 3.11")
FORWARD = ROOT / "tests" / "fixtures" / "ort_training" / "artifacts" / "cnn" / "forward_model.onnx"
DOCS = ROOT / "docs" / "federated.md"
LR, EPOCHS = 0.01, 2
GOOD = {"p1": 3, "p2": 1}  # batches of 4 samples: unequal partitions (12 and 4 examples)
SIMULATION_TIMEOUT, DEPLOYMENT_TIMEOUT = 240, 300
# importing Flower imports typer, which uses click APIs that click deprecates
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:typer")

QUIET = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "RAY_USAGE_STATS_ENABLED": "0"}


def samples(rng: np.random.Generator, batches: int) -> dict[str, np.ndarray]:
    """Learnable data for the cnn: class c's images are a fixed pattern of class c plus noise."""
    patterns = np.random.default_rng(7).normal(size=(4, 3, 8, 8)).astype(np.float32)
    labels = rng.integers(0, 4, size=(batches, 4))
    images = patterns[labels] + rng.normal(size=(batches, 4, 3, 8, 8)).astype(np.float32)
    return {"input": images.astype(np.float32), "labels": labels.astype(np.int64)}


def rel(got, want) -> float:
    """The largest difference relative to the largest entry of ``want``."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    return float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), 1e-30)


def worst(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want)
    return max(rel(got[k], want[k]) for k in want)


def start(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    """A process in a session of its own (so that its whole group can be stopped), output to ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, wait: float = 15.0) -> None:
    """Stop ``proc``'s process group: ``sig``, then SIGKILL after ``wait`` seconds."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left (the ClientApp / ServerApp children)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=wait)


def run_bounded(cmd: list[str], timeout: float, env: dict, cwd: Path | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
                            start_new_session=True, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd[:4]} ... did not finish within {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        stop(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def free_ports(n: int) -> list[int]:
    sockets = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def environment() -> dict:
    env = {**os.environ, **QUIET}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # flower-superexec & co.
    return env


# -- the held-out artifacts, the partitions, one simulation ---------------------------------------------------


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("federated")
    art = work / "art"
    assert main(["artifacts", str(FORWARD), "-o", str(art), "--loss", "CrossEntropyLoss", "--optimizer", "AdamW"]) == 0
    rng = np.random.default_rng(0)
    parts = {}
    for name, batches in GOOD.items():
        parts[name] = work / f"{name}.npz"
        np.savez(parts[name], **samples(rng, batches))
    good = samples(rng, 1)
    bad = {
        "bad_labels": {**good, "labels": np.where(np.arange(4) == 2, 7, good["labels"])},
        "bad_shape": {**good, "input": np.zeros((1, 4, 3, 9, 9), np.float32)},
        "bad_dtype": {**good, "labels": good["labels"].astype(np.float32)},
        "no_labels": {"input": good["input"]},
    }
    for name, arrays in bad.items():
        parts[name] = work / f"{name}.npz"
        np.savez(parts[name], **arrays)
    start_state = global_start(art)
    np.savez(work / "start.npz", **start_state)
    return {"work": work, "art": art, "parts": parts, "start": start_state}


@pytest.fixture(scope="module")
def simulation(setup) -> dict:
    """``oplower federate`` over the two good partitions and four bad ones, 2 rounds, every output."""
    work = setup["work"]
    rounds = work / "sim_rounds"
    rounds.mkdir()
    cmd = [sys.executable, "-m", "lowering", "federate", str(setup["art"]),
           *[a for name in ("p1", "bad_labels", "p2", "bad_shape", "bad_dtype", "no_labels")
             for a in ("--partition", str(setup["parts"][name]))],
           "--rounds", "2", "--local-epochs", str(EPOCHS), "--lr", str(LR), "--cpus", "2",
           "--save-rounds", str(rounds), "--save", str(work / "sim.npz"), "--save-checkpoint", str(work / "sim.ckpt"),
           "--export", str(work / "sim.onnx")]
    began = time.monotonic()
    run = run_bounded(cmd, SIMULATION_TIMEOUT, environment(), cwd=work)
    assert run.returncode == 0, run.stdout + run.stderr
    return {"run": run, "rounds": rounds, "seconds": time.monotonic() - began}


def reference_round(setup, start: Path, names=tuple(GOOD)) -> dict[str, np.ndarray]:
    """The definition: each client's own ``oplower train`` from ``start``, then the example-weighted mean in
    float64 (numpy), cast back to each tensor's dtype."""
    total, acc = 0, {}
    for name in names:
        out = setup["work"] / f"ref_{name}_{start.stem}.npz"
        steps = EPOCHS * GOOD[name]
        assert main(["train", str(setup["art"]), "--params", str(start), "--data", str(setup["parts"][name]),
                     "--steps", str(steps), "--lr", str(LR), "--threads", "1", "--save", str(out)]) == 0
        trained, examples = dict(np.load(out)), GOOD[name] * 4
        total += examples
        for k, v in trained.items():
            acc[k] = acc.get(k, 0) + examples * v.astype(np.float64)
    return {k: (v / total).astype(setup["start"][k].dtype) for k, v in acc.items()}


@needs_flower
def test_the_round_lines_name_every_failed_client(simulation):
    lines = simulation["run"].stdout.splitlines()
    assert lines[0].startswith("federating 6 clients on ") and "2 local epochs, lr 0.01" in lines[0]
    rounds = [line for line in lines if line.startswith("round ")]
    assert len(rounds) == 2
    for r, line in enumerate(rounds, 1):
        assert re.fullmatch(rf"round {r}/2: 2 of 6 clients trained, 4 failed, train loss [\d.]+, eval loss [\d.]+ "
                            r"accuracy [\d.]+ \(2 clients\)", line), line
    failed = [line for line in lines if line.startswith("  client failed: ")]
    assert len(failed) == 8  # four bad partitions, two rounds: one line each, the project's one-line errors
    expected = {
        "bad_labels": "label input 'labels' holds 7 at [0, 2] (batch 0); each label must be a class id in [0, 4)",
        "bad_shape": "'input' has shape [1, 4, 3, 9, 9]; the training model takes [4, 3, 8, 8] per batch",
        "bad_dtype": "'labels' is float32; the training model takes int64",
        "no_labels": "no array for the data input 'labels'",
    }
    for name, text in expected.items():
        hits = [line for line in failed if f"{name}.npz: " in line]
        assert len(hits) == 2 and all(text in line for line in hits), (name, hits)
    assert "Traceback" not in simulation["run"].stderr and "Traceback" not in simulation["run"].stdout
    assert [line for line in lines if line.startswith("wrote ")] == [
        f"wrote {simulation['rounds'].parent / n}" for n in ("sim.npz", "sim.ckpt", "sim.onnx")]


@needs_flower
def test_rounds_are_fedavg_of_each_clients_oplower_train(setup, simulation):
    """Round 1: the clients' own ``oplower train`` from the artifacts' checkpoint, example-weighted (1e-6 of
    each tensor's largest entry); round 2: the same from the global model after round 1."""
    work, rounds = setup["work"], simulation["rounds"]
    got1 = dict(np.load(rounds / "round-1.npz"))
    want1 = reference_round(setup, work / "start.npz")
    assert worst(got1, want1) <= 1e-6
    got2 = dict(np.load(rounds / "round-2.npz"))
    want2 = reference_round(setup, rounds / "round-1.npz")
    assert worst(got2, want2) <= 1e-6
    # the whole chain computed independently: round 2 from the reference's own round 1; Flower averages in
    # float32, numpy here in float64, and AdamW's first steps turn that last-bit difference into at most a few
    # 1e-6 of a tensor's largest entry (a near-zero gradient element's update is ~lr whatever its size)
    np.savez(work / "want1.npz", **want1)
    assert worst(got2, reference_round(setup, work / "want1.npz")) <= 2e-5
    # every state tensor is averaged: the batch norms' running statistics moved from the start
    assert rel(got1["1.running_mean"], setup["start"]["1.running_mean"]) > 1e-3
    assert list(got1) == list(setup["start"])  # the artifacts' order: trainable parameters, then frozen values


@needs_flower
def test_the_global_model_is_written_as_oplower_train_writes_it(setup, simulation):
    work = setup["work"]
    final = dict(np.load(work / "sim.npz"))
    assert worst(final, dict(np.load(simulation["rounds"] / "round-2.npz"))) == 0
    ckpt = read_checkpoint(work / "sim.ckpt")
    assert not ckpt.has_optimizer_state
    assert worst({**ckpt.params, **ckpt.frozen}, final) == 0
    onnx.checker.check_model(onnx.load(work / "sim.onnx"), full_check=True)
    # training goes on from the checkpoint with fresh optimizer state, as a round starts
    assert main(["train", str(setup["art"]), "--checkpoint", str(work / "sim.ckpt"), "--steps", "1",
                 "--data", str(setup["parts"]["p2"])]) == 0


# -- deployed: a SuperLink and two SuperNodes, `flwr run` -------------------------------------------------------


def flower_app(docs: Path) -> str:
    """The app's pyproject.toml as docs/federated.md shows it (the first ```toml block)."""
    match = re.search(r"```toml\n(.*?)```", docs.read_text(encoding="utf-8"), re.S)
    assert match, f"{docs}: no ```toml block (the Flower app's pyproject.toml)"
    return match.group(1)


def wait_for(what: str, check, timeout: float, procs=()) -> None:
    end = time.monotonic() + timeout
    while not check():
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > end:
            pytest.fail(f"{what}: {'a process exited' if dead else f'not within {timeout} s'}")
        time.sleep(0.2)


@needs_flower
def test_deployed_superlink_and_supernodes(setup, simulation):
    """Two rounds on a real SuperLink + two SuperNodes equal the simulation of the same partitions; in round 3
    one SuperNode is stopped while it trains: the run finishes with the other client and the round's line says
    a client failed."""
    work = setup["work"]
    dep = work / "deployment"
    (dep / "app").mkdir(parents=True)
    (dep / "home").mkdir()
    (dep / "rounds").mkdir()
    (dep / "app" / "pyproject.toml").write_text(flower_app(DOCS), encoding="utf-8")
    link_port, port1, port2 = free_ports(3)
    (dep / "home" / "config.toml").write_text(
        '[superlink]\ndefault = "local-deployment"\n\n[superlink.local-deployment]\n'
        f'address = "127.0.0.1:{link_port}"\ninsecure = true\n', encoding="utf-8")
    env = {**environment(), "FLWR_HOME": str(dep / "home")}
    bin_dir = Path(sys.executable).parent
    procs: list[subprocess.Popen] = []
    try:
        link_log = dep / "superlink.log"
        procs.append(start([str(bin_dir / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port",
                            str(link_port), "--disable-runtime-dependency-installation"], link_log, env))
        wait_for("the SuperLink", lambda: "Uvicorn running" in link_log.read_text(errors="replace"), 60, procs)
        node_logs = []
        for name, port in (("p1", port1), ("p2", port2)):
            node_logs.append(dep / f"supernode_{name}.log")
            procs.append(start([str(bin_dir / "flower-supernode"), "--insecure", "--superlink",
                                f"127.0.0.1:{link_port}", "--port", str(port),
                                "--node-config", f'partition="{setup["parts"][name]}" threads=1'], node_logs[-1],
                                env))
        wait_for("two SuperNodes", lambda: link_log.read_text(errors="replace").count("Activated node_id") >= 2,
                 60, procs)
        config = (f"artifacts='{setup['art']}' rounds=3 local-epochs={EPOCHS} lr={LR} fraction-evaluate=0.0 "
                  f"min-nodes=2 round-timeout=120.0 save-rounds='{dep / 'rounds'}' save='{dep / 'final.npz'}'")
        run_log = dep / "flwr_run.log"
        run = start([str(bin_dir / "flwr"), "run", str(dep / "app"), "local-deployment", "--stream",
                     "--run-config", config], run_log, env)
        procs.append(run)
        node2, stopped = procs[2], False
        end = time.monotonic() + DEPLOYMENT_TIMEOUT
        while run.poll() is None:
            assert time.monotonic() < end, f"flwr run did not finish within {DEPLOYMENT_TIMEOUT} s"
            # the third train message reached SuperNode 2: stop it (gracefully, as Ctrl-C) while it trains
            if not stopped and node_logs[1].read_text(errors="replace").count("Receiving: train message") >= 3:
                os.killpg(node2.pid, signal.SIGTERM)
                stopped = True
            time.sleep(0.1)
        log = run_log.read_text(errors="replace")
        assert run.returncode == 0 and stopped, log[-4000:]
    finally:
        for proc in reversed(procs):
            stop(proc)
    rounds = [line.split("INFO", 1)[-1].split(":", 1)[-1].strip() for line in log.splitlines()
              if re.search(r"\bround \d/3: ", line)]
    assert rounds[0].startswith("round 1/3: 2 of 2 clients trained, train loss ") and "failed" not in rounds[0], rounds
    assert rounds[1].startswith("round 2/3: 2 of 2 clients trained, train loss "), rounds
    assert rounds[2].startswith("round 3/3: 1 of 2 clients trained, 1 failed, train loss "), rounds
    assert re.search(r"client failed: node \d+: Error: Node Unavailable", log), log[-4000:]
    # the same global model as the simulation of the same partitions (whose bad clients failed every round)
    for r in (1, 2):
        deployed = dict(np.load(dep / "rounds" / f"round-{r}.npz"))
        difference = worst(deployed, dict(np.load(simulation["rounds"] / f"round-{r}.npz")))
        print(f"round {r}: deployed vs simulated {difference:.3g} of the largest entry")
        assert difference <= 1e-6
    # round 3 is client p1's own oplower train from round 2's global model
    final = dict(np.load(dep / "final.npz"))
    assert worst(final, reference_round(setup, dep / "rounds" / "round-2.npz", names=("p1",))) <= 1e-6


# -- bad input, without Flower, the split helper -------------------------------------------------------------


def test_bad_arguments_are_one_line_errors(setup, tmp_path, capsys):
    art, p1 = str(setup["art"]), str(setup["parts"]["p1"])
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {
        ("federate", art, "--rounds", "2"): "no partitions: give each client's data with --partition P.npz",
        ("federate", art, "--partition", p1, "--rounds", "0"): "--rounds 0: the round count must be 1 or more",
        ("federate", art, "--partition", p1, "--rounds", "-3"): "--rounds -3: the round count must be 1 or more",
        ("federate", str(tmp_path / "nope"), "--partition", p1, "--rounds", "1"): "not an artifact directory",
        ("federate", str(empty), "--partition", p1, "--rounds", "1"): "training_model.onnx",
        ("federate", art, "--partition", str(tmp_path / "p9.npz"), "--rounds", "1"): "p9.npz: no such file",
        ("federate", art, "--partition", p1, "--rounds", "1", "--fraction-train", "0"): "--fraction-train 0",
        ("federate", art, "--partition", p1, "--rounds", "1", "--lr", "nan"): "--lr nan",
        ("federate", art, "--partition", p1, "--rounds", "1", "--save", str(tmp_path / "no" / "x.npz")):
            "does not exist",
        ("federate", art, "--split", p1, "--rounds", "1"): "--split: also give --clients N",
    }
    for argv, text in cases.items():
        assert main(list(argv)) == 1, argv
        err = capsys.readouterr().err
        # on Python 3.10 (no Flower 1.42 there) an argument that passes the checks before Flower's meets its absence
        found = text in err or (sys.version_info < (3, 11) and "needs Python 3.11 or newer" in err)
        assert err.count("\n") == 1 and err.startswith("oplower federate: error: ") and found, (argv, err)
        assert "Traceback" not in err


def test_oplower_works_without_flower_and_federate_names_the_extra(setup, tmp_path):
    """Flower blocked from importing: oplower imports, trains; federate is one line naming the extra, exit 1."""
    script = (
        "import sys\n"
        "sys.modules['flwr'] = None\nsys.modules['ray'] = None\n"  # an import of either now fails
        "import lowering, lowering.training, lowering.training.federated, lowering.training.federated.local\n"
        "from lowering.cli import main\n"
        f"assert main(['train', {str(setup['art'])!r}, '--steps', '1', '--data', {str(setup['parts']['p2'])!r}]) == 0\n"
        f"sys.exit(main(['federate', {str(setup['art'])!r}, '--partition', {str(setup['parts']['p1'])!r}, "
        "'--rounds', '1']))\n")
    run = run_bounded([sys.executable, "-c", script], 120, environment(), cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stdout.startswith("training 14 parameters")
    if sys.version_info < (3, 11):
        assert run.stderr.startswith("oplower federate: error: federated training needs Flower 1.42, which needs "
                                     "Python 3.11 or newer") and run.stderr.count("\n") == 1
    else:
        assert run.stderr == ("oplower federate: error: federated training needs Flower, which is not installed: "
                              "pip install 'oplower[federated]'\n")


def test_split_iid_and_by_label(setup):
    models = training_models(setup["art"])
    frozen = [n for n in setup["start"] if n not in models.params]
    data = samples(np.random.default_rng(3), 20)  # 80 samples, 20 batches of 4
    iid = split(data, models, 3, frozen=frozen, seed=1)
    assert [p["input"].shape[:2] for p in iid] == [(7, 4), (7, 4), (6, 4)]
    assert all(check_partition(p, models, frozen, "p") == (len(p["input"]), 4 * len(p["input"])) for p in iid)
    seen = np.sort(np.concatenate([p["labels"].reshape(-1) for p in iid]))
    assert np.array_equal(seen, np.sort(data["labels"].reshape(-1)))  # every sample once
    again = split(data, models, 3, frozen=frozen, seed=1)
    assert all(np.array_equal(a["input"], b["input"]) for a, b in zip(iid, again, strict=True))
    skewed = split(data, models, 4, frozen=frozen, alpha=0.1, seed=0)
    assert all(p["input"].shape[1:] == (4, 3, 8, 8) and len(p["input"]) >= 1 for p in skewed)
    # with alpha 0.1 a client holds mostly one class; IID holds them all
    top = [np.bincount(p["labels"].reshape(-1), minlength=4).max() / p["labels"].size for p in skewed]
    assert np.mean(top) > 0.6 > max(np.bincount(p["labels"].reshape(-1), minlength=4).max() / p["labels"].size
                                    for p in iid)
    with pytest.raises(Exception, match="too few for 30 clients"):
        split(data, models, 30, frozen=frozen)
    with pytest.raises(Exception, match="Dirichlet alpha -1"):
        split(data, models, 2, frozen=frozen, alpha=-1)


def test_partition_checks_are_one_line(setup, tmp_path):
    models = training_models(setup["art"])
    frozen = [n for n in setup["start"] if n not in models.params]
    (tmp_path / "x.npy").write_bytes(b"\x93NUMPY junk")
    (tmp_path / "t.txt").write_text("not numpy")
    for path, text in ((tmp_path / "t.txt", "not a readable .npz file"), (tmp_path / "none.npz", "no such file")):
        with pytest.raises(Exception, match=re.escape(text)):
            read_partition(path)
    good = samples(np.random.default_rng(0), 2)
    with pytest.raises(Exception, match="different numbers of batches"):
        check_partition({**good, "labels": good["labels"][:1]}, models, frozen, "p")
    with pytest.raises(Exception, match="'extra' is no data input"):
        check_partition({**good, "extra": good["labels"]}, models, frozen, "p")
    assert check_partition({k: v[0] for k, v in good.items()}, models, frozen, "p") == (1, 4)  # one batch


# -- the server's paths with Flower's FedAvg and the real ClientApp, on a Grid that runs it in this process -------


class InProcessGrid:
    """A Grid (what FedAvg uses of it) whose nodes run the deployed ClientApp in this process, one after the
    other; ``silent`` nodes never answer."""

    def __init__(self, app, nodes: dict[int, dict], artifacts: Path, silent=()) -> None:
        self.app, self.nodes, self.silent, self.replies, self.sampled = app, nodes, set(silent), {}, []
        self.run_config = {"artifacts": str(artifacts)}  # the deployed run config's; a node config may override it

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, messages):
        from flwr.app import Context, RecordDict

        ids = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            ids.append(m.metadata.message_id)
            node = m.metadata.dst_node_id
            self.sampled.append((m.metadata.message_type, node))
            if node not in self.silent:
                context = Context(run_id=1, node_id=node, node_config=self.nodes[node], state=RecordDict(),
                                  run_config=self.run_config)
                self.replies[m.metadata.message_id] = self.app(m, context)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]


@pytest.fixture
def in_process(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    from lowering.training.federated import app

    for name in ("_run_id", "_task_id", "_node_id"):  # what a Flower runtime sets for the process's messages
        monkeypatch.setattr(TaskIdentity, name, 1)
    return app


@needs_flower
def test_the_server_starts_from_params_or_a_checkpoint(setup, in_process, tmp_path):
    app, art = in_process, str(setup["art"])
    nodes = {10 + k: {"partition": str(setup["parts"][name]), "threads": 1} for k, name in enumerate(GOOD)}
    rng = np.random.default_rng(5)
    moved = {k: (v + 0.01 * rng.normal(size=v.shape)).astype(v.dtype) for k, v in setup["start"].items()}
    np.savez(tmp_path / "moved.npz", **moved)
    write_global(art, moved, save_checkpoint=tmp_path / "moved.ckpt")
    results = {}
    for how in ("params", "checkpoint"):
        path = str(tmp_path / ("moved.npz" if how == "params" else "moved.ckpt"))
        settings = app.ServerSettings(art, 1, EPOCHS, LR, **{how: path}, save=str(tmp_path / f"{how}.npz"))
        results[how] = app.serve(InProcessGrid(app.clientapp, nodes, art), settings).state
        assert worst(dict(np.load(tmp_path / f"{how}.npz")), results[how]) == 0
    assert worst(results["params"], reference_round(setup, tmp_path / "moved.npz")) <= 1e-6
    assert worst(results["checkpoint"], results["params"]) == 0


@needs_flower
def test_fraction_timeouts_and_a_run_nobody_trains(setup, in_process, tmp_path):
    app, art = in_process, str(setup["art"])
    nodes = {n: {"partition": str(setup["parts"]["p2"]), "threads": 1} for n in (5, 6, 7, 8)}
    # FedAvg samples half the nodes each round; seeded, the same nodes sample the same way
    picks = []
    for _ in range(2):
        grid = InProcessGrid(app.clientapp, nodes, art)
        summaries = app.serve(grid, app.ServerSettings(art, 2, fraction_train=0.5, fraction_evaluate=0.0)).rounds
        assert [(s.sampled, s.trained, s.eval_sampled) for s in summaries] == [(2, 2, 0), (2, 2, 0)]
        assert summaries[0].lines()[0].endswith("no evaluation")
        picks.append(grid.sampled)
    assert picks[0] == picks[1]
    # a node that never answers counts as failed once the round's timeout passes
    grid, progress = InProcessGrid(app.clientapp, nodes, art, silent={8}), []
    (summary,) = app.serve(grid, app.ServerSettings(art, 1, round_timeout=0.5),
                           on_progress=lambda *a: progress.append(a)).rounds
    # what oplower federate's progress bar draws: each phase from 0 replies to the last one that came
    assert progress[0] == ("train", 0, 4) and ("train", 3, 4) in progress and progress[-1] == ("evaluate", 3, 4)
    assert (summary.trained, summary.failures) == (3, ["no reply within the round timeout"])
    assert summary.eval_failures == ["no reply within the round timeout"]
    # no client trains in any round: one line, nothing written
    bad = {n: {"partition": str(setup["parts"]["bad_dtype"])} for n in (1, 2)}
    out = tmp_path / "never.npz"
    with pytest.raises(FederatedError, match=r"no client trained in any of the 2 round\(s\); nothing written \(the "
                                             r"first failure: .*bad_dtype.npz: 'labels' is float32"):
        app.serve(InProcessGrid(app.clientapp, bad, art), app.ServerSettings(art, 2, save=str(out)))
    assert not out.exists()


@needs_flower
def test_deployed_configs(setup, in_process):
    app = in_process
    settings = app.server_settings_from_config({"artifacts": "a", "rounds": 4, "lr": 0.5, "seed": -1})
    assert (settings.rounds, settings.learning_rate, settings.seed, settings.min_nodes) == (4, 0.5, None, 2)
    with pytest.raises(FederatedError, match="run config: unknown key 'round'"):
        app.server_settings_from_config({"round": 3})
    # a SuperNode started without a partition answers every message with that one line
    grid = InProcessGrid(app.clientapp, {1: {}, 2: {"partition": str(setup["parts"]["p2"])}}, setup["art"])
    (summary,) = app.serve(grid, app.ServerSettings(str(setup["art"]), 1), initial=setup["start"]).rounds
    assert summary.failures == ["this SuperNode has no partition: start it with --node-config 'partition=\"P.npz\"'"]
