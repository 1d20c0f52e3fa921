"""oplower's generate_artifacts against onnxruntime-training's: generation time, the lowered step of their artifacts.

    PYTHONPATH=. python tools/ab_artifacts.py DIR --ort-training-python /work/ortt-venv/bin/python \\
        [--rounds 5] [--step-rounds 9] [--steps 10] [--threads 2] [--clock cpu] [--native [--native-rounds N]]
        [--json OUT]

DIR is a directory ``tools/ort_training/native_step.py make NAME --out DIR`` wrote: onnxruntime-training's four
files, torch's export ``forward_model.onnx`` (unpatched), ``meta.json``, ``data.npz``, ``initial_params.npz``.

Generation, ``--rounds`` rounds in alternating order, every run in a fresh process with the imports not timed:
onnxruntime-training's ``generate_artifacts`` (``native_step.py generate DIR --once``: its forward model after
``patch_forward``) and oplower's (this script's ``--generate-once``: ``build_artifacts`` + ``write_artifacts``,
which is ``lowering.training.artifacts.generate_artifacts``; once with the training model's verification
against the project's schemas, as generate_artifacts does, once without, ``--no-verify``) on the same forward
model, parameters, CrossEntropyLoss and AdamW. Each run times its first call (what a script pays) and a second
call in the same process; printed: the medians and the per-round ratios oplower / onnxruntime-training. A fourth
process per round splits oplower's first call: the schema registry loaded (from its disk cache,
``opdef/registry_cache.py``; one untimed oplower process before the rounds fills the cache), onnx's own schema
registry initialised (its first query; onnxruntime-training's first call pays it too), a first call without the
check, a call with it, a call without (the check's first-call cost: the last two's difference).

``--whole-process N``: N rounds of what a user's shell sees, wall clock, imports included, alternating: a Python
script calling onnxruntime-training's ``generate_artifacts`` on the export; ``oplower artifacts`` (the CLI) with
the registry cache warm and cold (``XDG_CACHE_HOME`` a fresh directory: the specs parsed); a Python script calling
oplower's ``generate_artifacts``. ``--generation-only`` skips the step comparison.

Step: oplower's artifacts of the forward model with every Dropout ratio 0 (``tools/make_oplower_artifacts.py``'s
``zero_dropout``; ``make`` zeroes onnxruntime-training's after generation, the same graphs either way) are
written beside DIR's (``--work``, default a temporary directory) with DIR's data, parameters and meta.json;
both directories are lowered (``lowering.training.lower_artifacts``) and trained in this process with
``lowering.training.Trainer`` (bound train-step model, ``--threads`` intra-op threads, spinning off), in rounds of
``--steps`` steps that alternate which side goes first, after warm-up (``tools/ab_lowered.py``'s procedure).
Prints the first losses (they must agree), each round's B/A (oplower-made over onnxruntime-training-made median
step ms) and their median. ``--native`` adds onnxruntime-training's own step (``native_step.py time``) on both
directories, a fresh process per side and round, alternating. ``--clock cpu`` times the steps (both kinds) by
the process's CPU time instead of the wall clock (all threads; spinning is off, so it is the work done): on cores
that other processes load it varies far less.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def generate_once(directory: Path, verify: bool) -> dict:
    """One fresh-process run of oplower's generator (``--generate-once``): the first and a second call."""
    start = time.perf_counter()
    import onnx

    from lowering.training.artifacts import LossType, OptimType, build_artifacts, write_artifacts

    imported = time.perf_counter() - start
    meta = json.loads((directory / "meta.json").read_text())
    forward = onnx.load(directory / "forward_model.onnx")
    times = []
    for _ in range(2):
        with tempfile.TemporaryDirectory() as work:
            start = time.perf_counter()
            artifacts = build_artifacts(forward, meta["trainable_params"], meta["frozen_params"],
                                        LossType.CrossEntropyLoss, OptimType.AdamW, verify=verify)
            write_artifacts(artifacts, Path(work))
            times.append((time.perf_counter() - start) * 1e3)
            sizes = {f.name: f.stat().st_size for f in Path(work).iterdir()}
    return {"side": "oplower" + ("" if verify else " (no verification)"), "ms": times[0], "second_ms": times[1],
            "import_ms": imported * 1e3, "files": sizes}


def breakdown_once(directory: Path) -> dict:
    """Where oplower's first call goes, in a fresh process (``--generate-once --breakdown``): the schema registry
    loaded (``opdef.registry.load_schemas``: the disk cache's hit, or the spec documents parsed), onnx's own schema
    registry initialised (its first query, which the first shape inference would pay), a first call without the
    check, a call with it, a call without: ``verification_ms`` is the check's cost in a process's first call
    (its rule modules imported, its caches filled), ``call_without_verification_ms`` a warm call's rest."""
    start = time.perf_counter()
    import onnx

    from lowering.training.artifacts import LossType, OptimType, build_artifacts, write_artifacts
    from opdef.registry import load_schemas

    imported = time.perf_counter() - start
    meta = json.loads((directory / "meta.json").read_text())
    forward = onnx.load(directory / "forward_model.onnx")
    out = {"side": "oplower breakdown", "import_ms": imported * 1e3}
    start = time.perf_counter()
    load_schemas()
    out["load_schemas_ms"] = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    onnx.defs.has("Relu")
    out["onnx_schemas_init_ms"] = (time.perf_counter() - start) * 1e3
    for key, verify in (("first_call_without_verification_ms", False), ("call_with_verification_ms", True),
                        ("call_without_verification_ms", False)):
        with tempfile.TemporaryDirectory() as work:
            start = time.perf_counter()
            write_artifacts(build_artifacts(forward, meta["trainable_params"], meta["frozen_params"],
                                            LossType.CrossEntropyLoss, OptimType.AdamW, verify=verify), Path(work))
            out[key] = (time.perf_counter() - start) * 1e3
    out["verification_ms"] = out["call_with_verification_ms"] - out["call_without_verification_ms"]
    return out


ORT_SCRIPT = """
import json, sys
import onnx
from onnxruntime.training import artifacts
meta = json.load(open(sys.argv[2]))
artifacts.generate_artifacts(onnx.load(sys.argv[1]), requires_grad=meta["trainable_params"],
                             frozen_params=meta["frozen_params"], loss=artifacts.LossType.CrossEntropyLoss,
                             optimizer=artifacts.OptimType.AdamW, artifact_directory=sys.argv[3])
"""
OPLOWER_SCRIPT = ORT_SCRIPT.replace("from onnxruntime.training import artifacts",
                                    "from lowering.training import artifacts")


def whole_process(directory: Path, ort_python: str, rounds: int) -> dict:
    """Wall-clock seconds of whole processes, imports included (``--whole-process``): a script calling
    onnxruntime-training's generate_artifacts, ``oplower artifacts`` with the registry cache warm and cold, a
    script calling oplower's generate_artifacts; alternating order, each round's outputs in fresh directories."""
    meta = json.loads((directory / "meta.json").read_text())
    forward, meta_path = str(directory / "forward_model.onnx"), str(directory / "meta.json")
    oplower = str(Path(sys.executable).parent / "oplower")
    cli = [oplower, "artifacts", forward, "--loss", "CrossEntropyLoss", "--optimizer", "AdamW",
           "--requires-grad", *meta["trainable_params"], *(["--frozen", *meta["frozen_params"]]
                                                           if meta["frozen_params"] else [])]
    times: dict[str, list[float]] = {"ort_script": [], "oplower_cli_warm": [], "oplower_cli_cold": [],
                                     "oplower_script_warm": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        warm = tmp / "warm-cache"
        base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        oplower_env = {**base, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(warm)}
        subprocess.run([*cli, "-o", str(tmp / "fill")], check=True, capture_output=True, env=oplower_env)

        def command(side: str, out: Path) -> tuple[list[str], dict]:
            if side == "ort_script":
                return [ort_python, "-c", ORT_SCRIPT, forward, meta_path, str(out)], base
            if side == "oplower_script_warm":
                return [sys.executable, "-c", OPLOWER_SCRIPT, forward, meta_path, str(out)], oplower_env
            env = oplower_env if side == "oplower_cli_warm" else {**oplower_env, "XDG_CACHE_HOME": str(out) + ".cache"}
            return [*cli, "-o", str(out)], env

        for r in range(rounds):
            sides = list(times) if r % 2 == 0 else list(reversed(times))
            for side in sides:
                out = tmp / f"{side}-{r}"
                out.mkdir()  # onnxruntime-training's generate_artifacts writes into an existing directory
                cmd, env = command(side, out)
                start = time.perf_counter()
                done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
                elapsed = time.perf_counter() - start
                if done.returncode:
                    raise SystemExit(f"{side} failed:\n{done.stderr[-2000:]}")
                times[side].append(elapsed)
            print(f"whole-process round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
                  flush=True)
    summary = {k: statistics.median(v) for k, v in times.items()}
    summary["ratios"] = {k: statistics.median(a / b for a, b in zip(times[k], times["ort_script"], strict=True))
                         for k in times if k != "ort_script"}
    summary["rounds"] = rounds
    return summary


def run_json(command: list[str]) -> dict:
    env = dict(os.environ)
    if command[0] == sys.executable:  # oplower's side: this checkout; onnxruntime-training's venv gets none of it
        env["PYTHONPATH"] = str(ROOT)
    else:
        env.pop("PYTHONPATH", None)
    out = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if out.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def generation(directory: Path, ort_python: str, rounds: int) -> dict:
    sides = {
        "ort": [ort_python, str(HERE / "ort_training" / "native_step.py"), "generate", str(directory), "--once"],
        "oplower": [sys.executable, __file__, str(directory), "--generate-once"],
        "oplower_no_verify": [sys.executable, __file__, str(directory), "--generate-once", "--no-verify"],
    }
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    parts = []
    run_json(sides["oplower_no_verify"])  # untimed: fills the schema registry's disk cache if it is cold
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            runs[name].append(run_json(sides[name]))
        parts.append(run_json([sys.executable, __file__, str(directory), "--generate-once", "--breakdown"]))
        line = ", ".join(f"{k} {runs[k][-1]['ms']:.1f} ms (second {runs[k][-1]['second_ms']:.1f})" for k in sides)
        ratio = runs["oplower"][-1]["ms"] / runs["ort"][-1]["ms"]
        print(f"generation round {r + 1}: {line}; oplower / ort {ratio:.1f}", flush=True)
    summary = {}
    for k, v in runs.items():
        summary[k] = {key: statistics.median(x[key] for x in v) for key in ("ms", "second_ms", "import_ms")}
    for k in ("oplower", "oplower_no_verify"):
        summary[k]["ratio_first"] = statistics.median(a["ms"] / b["ms"] for a, b in zip(runs[k], runs["ort"],
                                                                                         strict=True))
        summary[k]["ratio_second"] = statistics.median(a["second_ms"] / b["second_ms"]
                                                       for a, b in zip(runs[k], runs["ort"], strict=True))
    summary["files"] = {k: v[-1]["files"] for k, v in runs.items()}
    summary["oplower_breakdown"] = {key: statistics.median(p[key] for p in parts) for key in parts[0]
                                    if key.endswith("_ms")}
    return summary


def make_oplower_side(directory: Path, out: Path) -> None:
    """oplower's artifacts of DIR's forward model with Dropout ratios 0, plus DIR's data, parameters and meta."""
    import importlib.util

    import onnx

    from lowering.training.artifacts import LossType, OptimType, build_artifacts, write_artifacts

    spec = importlib.util.spec_from_file_location("make_oplower_artifacts", HERE / "make_oplower_artifacts.py")
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    meta = json.loads((directory / "meta.json").read_text())
    forward = driver.zero_dropout(onnx.load(directory / "forward_model.onnx"))
    artifacts = build_artifacts(forward, meta["trainable_params"], meta["frozen_params"], LossType.CrossEntropyLoss,
                                OptimType.AdamW)
    shutil.rmtree(out, ignore_errors=True)
    write_artifacts(artifacts, out)
    for name in ("meta.json", "data.npz", "initial_params.npz"):
        shutil.copy(directory / name, out / name)


def step_ab(ort_made: Path, oplower_made: Path, rounds: int, steps: int, threads: int, clock: str = "wall") -> dict:
    sys.path.insert(0, str(HERE))
    import _artifact

    artifacts = {"A": _artifact.load(ort_made), "B": _artifact.load(oplower_made)}
    trainers = {k: a.trainer(threads) for k, a in artifacts.items()}
    losses = {k: [trainers[k].step(artifacts[k].batch) for _ in range(10)] for k in trainers}
    kernels = {k: len(a.models.step.model.graph.node) for k, a in artifacts.items()}
    print(f"first losses: onnxruntime-training-made {losses['A'][0]:.7f}, oplower-made {losses['B'][0]:.7f}; after 10 "
          f"steps {losses['A'][-1]:.7f}, {losses['B'][-1]:.7f}; lowered train-step nodes {kernels['A']} / "
          f"{kernels['B']}", flush=True)
    ratios, ms = [], {"A": [], "B": []}
    for r in range(rounds):
        order = ("A", "B") if r % 2 == 0 else ("B", "A")
        timer = time.perf_counter if clock == "wall" else time.process_time
        now = {k: artifacts[k].median_step_ms(trainers[k], steps, timer) for k in order}
        for k in now:
            ms[k].append(now[k])
        ratios.append(now["B"] / now["A"])
        print(f"step round {r + 1}: onnxruntime-training-made {now['A']:.2f} ms, oplower-made {now['B']:.2f} ms, "
              f"B/A {ratios[-1]:.3f}", flush=True)
    return {"first_loss": {k: v[0] for k, v in losses.items()}, "loss_10": {k: v[-1] for k, v in losses.items()},
            "nodes": kernels, "ms": {k: statistics.median(v) for k, v in ms.items()},
            "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)], "rounds": rounds,
            "clock": clock}


def native_ab(ort_python: str, ort_made: Path, oplower_made: Path, rounds: int, steps: int, threads: int,
              clock: str = "wall") -> dict:
    """onnxruntime-training's own step (``native_step.py time``, a fresh process per side and round, alternating)
    on its artifacts (A) and on oplower's (B)."""
    ratios, ms = [], {"A": [], "B": []}
    dirs = {"A": ort_made, "B": oplower_made}
    for r in range(rounds):
        now = {}
        for k in (("A", "B") if r % 2 == 0 else ("B", "A")):
            now[k] = run_json([ort_python, str(HERE / "ort_training" / "native_step.py"), "time", str(dirs[k]),
                               "--steps", str(steps), "--threads", str(threads),
                               *(["--clock", "cpu"] if clock == "cpu" else [])])["median_ms"]
            ms[k].append(now[k])
        ratios.append(now["B"] / now["A"])
        print(f"native round {r + 1}: its own artifacts {now['A']:.2f} ms, oplower-made {now['B']:.2f} ms, "
              f"B/A {ratios[-1]:.3f}", flush=True)
    return {"ms": {k: statistics.median(v) for k, v in ms.items()}, "ratio": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)], "rounds": rounds, "clock": clock}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--ort-training-python", help="python of tools/ort_training/make_env.sh's venv")
    parser.add_argument("--rounds", type=int, default=5, help="generation rounds (3 fresh processes each)")
    parser.add_argument("--step-rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side and round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--native", action="store_true",
                        help="also time onnxruntime-training's own step on both sides' artifacts")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time steps by the wall clock or by the process's CPU time (all threads; varies less "
                             "on cores other processes load); generation is timed by the wall clock")
    parser.add_argument("--native-rounds", type=int, help="rounds of --native (default: --step-rounds)")
    parser.add_argument("--work", type=Path, help="where oplower's artifacts go (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    parser.add_argument("--generation-only", action="store_true", help="skip the step comparison")
    parser.add_argument("--whole-process", type=int, default=0, metavar="N",
                        help="also time N rounds of whole processes (imports included): a script calling "
                             "onnxruntime-training's generate_artifacts against `oplower artifacts`, cache warm and "
                             "cold, and a script calling oplower's")
    parser.add_argument("--generate-once", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-verify", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--breakdown", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.generate_once:
        print(json.dumps(breakdown_once(args.directory) if args.breakdown else
                         generate_once(args.directory, not args.no_verify)))
        return 0
    if not args.ort_training_python:
        parser.error("--ort-training-python is required")
    summary = {"network": json.loads((args.directory / "meta.json").read_text()).get("name", args.directory.name)}
    summary["generation"] = gen = generation(args.directory, args.ort_training_python, args.rounds)
    print(f"generation medians over {args.rounds} fresh processes each (imports not timed): onnxruntime-training "
          f"{gen['ort']['ms']:.1f} ms (second call {gen['ort']['second_ms']:.1f}); oplower {gen['oplower']['ms']:.1f} "
          f"(second {gen['oplower']['second_ms']:.1f}), ratio {gen['oplower']['ratio_first']:.1f} "
          f"(second {gen['oplower']['ratio_second']:.1f}); without verification "
          f"{gen['oplower_no_verify']['ms']:.1f} (second {gen['oplower_no_verify']['second_ms']:.1f}), ratio "
          f"{gen['oplower_no_verify']['ratio_first']:.1f} (second {gen['oplower_no_verify']['ratio_second']:.1f}); "
          f"imports: onnxruntime-training {gen['ort']['import_ms']:.0f} ms, oplower {gen['oplower']['import_ms']:.0f}",
          flush=True)
    parts = gen["oplower_breakdown"]
    print("oplower's first call, medians: " + ", ".join(f"{k[:-3]} {v:.1f} ms" for k, v in parts.items()
                                                         if k != "import_ms"), flush=True)
    if args.whole_process:
        summary["whole_process"] = whole = whole_process(args.directory, args.ort_training_python,
                                                         args.whole_process)
        print(f"whole processes, medians over {args.whole_process} rounds: " + ", ".join(
            f"{k} {whole[k]:.2f} s" for k in ("ort_script", "oplower_cli_warm", "oplower_cli_cold",
                                              "oplower_script_warm")) + "; ratios to onnxruntime-training's: " +
            ", ".join(f"{k} {v:.2f}" for k, v in whole["ratios"].items()), flush=True)
    if args.generation_only:
        if args.json:
            args.json.write_text(json.dumps(summary, indent=1) + "\n")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        oplower_made = work / f"{args.directory.name}_oplower"
        make_oplower_side(args.directory, oplower_made)
        summary["step"] = step = step_ab(args.directory, oplower_made, args.step_rounds, args.steps, args.threads,
                                         args.clock)
        if args.native:
            summary["native_step"] = native_ab(args.ort_training_python, args.directory, oplower_made,
                                               args.native_rounds or args.step_rounds, args.steps, args.threads,
                                               args.clock)
    print(f"{summary['network']}: lowered step, oplower-made / onnxruntime-training-made: median "
          f"{step['ratio']:.3f} over {args.step_rounds} rounds ({step['ms']['B']:.2f} / {step['ms']['A']:.2f} ms "
          f"{args.clock} clock, {args.threads} threads, no spinning)")
    if args.native:
        native = summary["native_step"]
        print(f"{summary['network']}: onnxruntime-training's own step, oplower-made / its own artifacts: median "
              f"{native['ratio']:.3f} over {native['rounds']} rounds ({native['ms']['B']:.2f} / "
              f"{native['ms']['A']:.2f} ms)")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
