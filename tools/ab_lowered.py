"""B/A of the lowered train step between two versions of oplower: this checkout (B) against a git revision (A).

    PYTHONPATH=. python tools/ab_lowered.py DIR --base REV [--rounds 15] [--steps 10]

DIR as for ``tools/ab_train_step.py``. The base revision's tree is exported (``git archive``) to a temporary
directory, where its own ``python -m lowering train-step DIR [--flat-state]`` writes its train-step model (the
flat state form, what ``Trainer`` runs, where the revision has it, else one input per parameter); both train-step
models then run in this process with this checkout's ``lowering.training.Trainer`` (bound, 2 intra-op threads,
spinning off), in rounds of ``--steps`` steps that alternate which side goes first, after warm-up. Prints each
round's B/A (median step time of B over A) and their median: below 1, this checkout is faster. Both models start
from the same parameters and train the same batch, so their losses are printed for a sanity check. ``--clock
cpu`` times the process's CPU time instead of the wall clock: on cores other processes load, it varies less.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _artifact
import onnx

from lowering.training.train_step import train_step

ROOT = Path(__file__).resolve().parents[1]


def base_step_model(revision: str, directory: Path, work: Path) -> onnx.ModelProto:
    tree = work / "base"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    out = work / "base_step.onnx"
    command = [sys.executable, "-m", "lowering", "train-step", str(directory.resolve()), "-o", str(out)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # the flat state form (what Trainer runs) where the base revision has it, else its one per parameter
    flat = subprocess.run([*command, "--flat-state"], cwd=tree, env=env, capture_output=True)
    if flat.returncode != 0:
        subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True)
    return onnx.load(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--base", required=True, help="git revision of side A (e.g. main, HEAD~1)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side and round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time steps by the wall clock (default) or by the process's CPU time (all threads; "
                             "on cores that other processes load, the CPU time varies less)")
    args = parser.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    artifact = _artifact.load(args.directory)
    models, batch = artifact.models, artifact.batch
    with tempfile.TemporaryDirectory() as work:
        base = base_step_model(args.base, args.directory, Path(work))
    # the base model's own interface: this checkout's, in the form (flat state or per parameter) it has
    flat = any(i.name.startswith("flat.params.") for i in base.graph.input)
    interface = train_step(args.directory, flat_state=flat).interface
    if not any(i.name.startswith("flat.frozen.") for i in base.graph.input):  # a revision before that part
        interface = dataclasses.replace(interface, flat_frozen=())
    base_models = dataclasses.replace(models, step=dataclasses.replace(models.step, model=base, interface=interface))
    sides = {name: artifact.trainer(args.threads, m) for name, m in (("A", base_models), ("B", models))}
    losses = {name: [trainer.step(batch) for _ in range(10)] for name, trainer in sides.items()}
    print(f"first losses: A {losses['A'][0]:.7f}, B {losses['B'][0]:.7f}; "
          f"after 10 steps A {losses['A'][-1]:.7f}, B {losses['B'][-1]:.7f}")

    ratios = []
    for r in range(args.rounds):
        order = ("A", "B") if r % 2 == 0 else ("B", "A")
        ms = {name: artifact.median_step_ms(sides[name], args.steps, clock) for name in order}
        ratios.append(ms["B"] / ms["A"])
        print(f"round {r + 1}: A {ms['A']:.3f} ms, B {ms['B']:.3f} ms, B/A {ratios[-1]:.3f}", flush=True)
    print(f"{args.directory.name}: median B/A {statistics.median(ratios):.3f} over {len(ratios)} rounds "
          f"(B this checkout, A {args.base}; {args.clock} clock)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
