"""A/B of one train step: oplower's lowered step on plain onnxruntime against onnxruntime-training's own.

    PYTHONPATH=. python tools/ab_train_step.py DIR --ort-training-python /work/ortt-venv/bin/python [--pairs 9]

DIR is a generate_artifacts directory with data.npz, initial_params.npz and meta.json (a committed artifact
under tests/fixtures/ort_training/artifacts/, or one ``tools/ort_training/native_step.py make`` writes). The
two sides cannot share a process (both provide the ``onnxruntime`` module): each pair runs the native side in
a subprocess (``native_step.py time``) and the lowered side here (``lowering.training.Trainer``, the bound
train-step model), in alternating order, both with 2 intra-op threads and spinning off; each side reports the
median of its steps after warm-up, from the same training state (the lowered side restores the state of its
first 10 steps before each pair's timed steps, as the native side starts each pair's process afresh). Prints each
pair's ratio (lowered / native), their median, and the ratio of each side's fastest pair (the least noise-bound
figure on a shared machine, where another tenant only slows a side down). ``--torch`` adds torch's eager step of
the same network, weights and batch as a third side (``native_step.py torch``, in the same venv, which has torch;
only for the networks ``native_step.py make`` writes; OpenMP's default spinning workers, so run it on a quiet
machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _artifact

HERE = Path(__file__).resolve().parent
WARMUP_STEPS = 10  # native_step.py's WARMUP
WARMUP_SECONDS = 0.5


def lowered_side(directory: Path, threads: int | None, clock: str = "wall"):
    artifact = _artifact.load(directory)
    trainer, batch = artifact.trainer(threads), artifact.batch
    first_loss = trainer.step(batch)
    for _ in range(WARMUP_STEPS - 1):
        trainer.step(batch)
    # the state after the native side's warm-up steps: each pair times the steps from there, as the native side's
    # fresh process does (not the thousands of steps later that training on across pairs would reach)
    state = (trainer.params, trainer.frozen, trainer.first_moments, trainer.second_moments, trainer.step_count)
    timer = time.perf_counter if clock == "wall" else time.process_time

    def timed(steps: int) -> float:
        # warm-up before each timing, as the native side has its process's start and WARMUP steps: after the
        # other side has run, a tiny model's steps ran up to 2x slower for a while (mlp_act: a median of
        # 0.10 against 0.05 ms over 200 steps), which the median of a few hundred 50-us steps does not outvote
        begin, count = time.perf_counter(), 0
        while count < WARMUP_STEPS or time.perf_counter() - begin < WARMUP_SECONDS:
            trainer.step(batch)
            count += 1
        trainer.params, trainer.frozen, trainer.first_moments, trainer.second_moments, trainer.step_count = state
        return artifact.median_step_ms(trainer, steps, timer)

    return timed, first_loss


def native_side(python: str, directory: Path, steps: int, threads: int, clock: str = "wall") -> float:
    out = subprocess.run([python, str(HERE / "ort_training" / "native_step.py"), "time", str(directory),
                          "--steps", str(steps), "--threads", str(threads), "--clock", clock], capture_output=True,
                         text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["median_ms"])


def torch_side(python: str, directory: Path, steps: int, threads: int) -> dict:
    out = subprocess.run([python, str(HERE / "ort_training" / "native_step.py"), "torch", str(directory),
                          "--steps", str(steps), "--threads", str(threads)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--ort-training-python", required=True, help="python of tools/ort_training/make_env.sh's venv")
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side and pair")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lowered-threads", default=None, metavar="N|auto",
                        help="the lowered side's threads (default: --threads); auto: Trainer's own choice (one "
                             "thread and the memory pattern for a small step, lowering.training.step_size)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time both sides by the wall clock (default) or by each process's CPU time (all its "
                             "threads; on cores that other processes load it varies less; not with --torch)")
    parser.add_argument("--torch", action="store_true",
                        help="also time torch's eager step in the same venv (networks of native_step.py make only)")
    args = parser.parse_args()
    lowered_threads = args.threads if args.lowered_threads is None else \
        None if args.lowered_threads == "auto" else int(args.lowered_threads)
    timed, first_loss = lowered_side(args.directory, lowered_threads, args.clock)
    ratios, torch_ratios, sides = [], [], []
    for pair in range(args.pairs):
        if pair % 2:
            lowered = timed(args.steps)
            native = native_side(args.ort_training_python, args.directory, args.steps, args.threads, args.clock)
        else:
            native = native_side(args.ort_training_python, args.directory, args.steps, args.threads, args.clock)
            lowered = timed(args.steps)
        ratios.append(lowered / native)
        sides.append((lowered, native))
        line = f"pair {pair + 1}: lowered {lowered:.3f} ms, native {native:.3f} ms, ratio {ratios[-1]:.3f}"
        if args.torch:
            eager = torch_side(args.ort_training_python, args.directory, args.steps, args.threads)
            if pair == 0:
                print(f"first loss: lowered {first_loss:.7f}, torch {eager['first_loss']:.7f}")
            torch_ratios.append(lowered / eager["median_ms"])
            line += f"; torch {eager['median_ms']:.3f} ms, lowered / torch {torch_ratios[-1]:.3f}"
        print(line, flush=True)
    # another tenant of the VM only ever slows a side down: the ratio of each side's fastest pair is the figure
    # that noise moves least (this VM's pairs moved 0.55-1.14 in one run), the median of the pairs' ratios the one
    # that counts a slow phase of either side
    fastest = min(lowered for lowered, _ in sides) / min(native for _, native in sides)
    print(f"{args.directory.name}: median ratio {statistics.median(ratios):.3f} over {len(ratios)} pairs "
          f"(lowered / onnxruntime-training, {args.threads} threads, the lowered side "
          f"{'auto' if lowered_threads is None else lowered_threads}, no spinning, {args.clock} clock); "
          f"fastest / fastest {fastest:.3f}"
          + (f"; lowered / torch eager {statistics.median(torch_ratios):.3f}" if torch_ratios else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
