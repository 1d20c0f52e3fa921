"""Op-by-op profile of one train step: oplower's lowered step on plain onnxruntime against onnxruntime-training's.

    PYTHONPATH=. python tools/step_profile.py DIR --ort-training-python /work/ortt-venv/bin/python [--steps 20]

DIR as for ``tools/ab_train_step.py``. Both sides run onnxruntime's profiler (2 intra-op threads, spinning off):
the lowered side the bound train-step model (what ``lowering.training.Trainer`` runs), each lowered kernel
charged to the training-graph op it came from (lowered node names start with that node's name; the update's
nodes are charged to the optimizer), the native side (``native_step.py profile``, its own venv and process) its
training session's kernels by op type; the native optimizer is timed by the clock (its session is not
profiled). Prints one row per training-graph op type: kernels per step and kernel milliseconds per step on each
side, and their ratio. Profiling adds a fixed cost per kernel, which weighs on the side with more kernels: read
the kernel counts with the times, and the unprofiled step times of ``tools/ab_train_step.py`` for the totals.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import _artifact
import onnx

from lowering.bench.training import UPDATE, kernel_rows, profile_train_step

HERE = Path(__file__).resolve().parent


def lowered_profile(directory: Path, steps: int, threads: int,
                    detail: dict[str, dict[str, list[float]]] | None = None) -> dict[str, list[float]]:
    """{training-graph op type: [kernel ms per step, kernels per step]} of the lowered train step; ``detail``,
    when given, receives the same split by lowered op type under each training-graph op type
    (:func:`lowering.bench.training.profile_train_step`)."""
    artifact = _artifact.load(directory)
    raw = onnx.load(directory / "training_model.onnx", load_external_data=False)
    return profile_train_step(artifact.models, artifact.start, artifact.batch, artifact.learning_rate, raw, threads,
                              steps, detail)


def native_profile(python: str, directory: Path, steps: int, threads: int) -> dict:
    out = subprocess.run([python, str(HERE / "ort_training" / "native_step.py"), "profile", str(directory),
                          "--steps", str(steps), "--threads", str(threads)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(lowered: dict[str, list[float]], native: dict) -> str:
    """Markdown rows: training-graph op, lowered kernels and ms, native kernels and ms, ratio."""
    lines = ["| training-graph op | lowered kernels | lowered ms | native kernels | native ms | lowered / native |",
             "|---|---:|---:|---:|---:|---:|"]

    def cells(count, ms):
        return ("–", "–") if count is None else (f"{count:.0f}", f"{ms:.3f}")

    for r in kernel_rows(lowered, native["training"]):
        ratio = f"{r['ms'] / r['native_ms']:.2f}" if r["ms"] and r["native_ms"] else "–"
        lines.append(f"| {r['op']} | {' | '.join(cells(r['kernels'], r['ms']))} | "
                     f"{' | '.join(cells(r['native_kernels'], r['native_ms']))} | {ratio} |")
    update = lowered.get(UPDATE, [0.0, 0.0])
    lines.append(f"| {UPDATE} | {update[1]:.0f} | {update[0]:.3f} | (own session) | "
                 f"{native['optimizer_wall_ms']:.3f} wall | – |")
    low_total = sum(v[0] for v in lowered.values())
    low_count = sum(v[1] for v in lowered.values())
    nat_total = sum(v[0] for v in native["training"].values()) + native["optimizer_wall_ms"]
    nat_count = sum(v[1] for v in native["training"].values())
    lines.append(f"| **all** | {low_count:.0f} | {low_total:.3f} | {nat_count:.0f} + optimizer | {nat_total:.3f} | "
                 f"{low_total / nat_total:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--ort-training-python", required=True, help="python of onnxruntime-training's venv")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write both profiles as JSON")
    parser.add_argument("--detail", action="store_true", help="also split each lowered op by the ops it became")
    args = parser.parse_args()
    native = native_profile(args.ort_training_python, args.directory, args.steps, args.threads)
    detail: dict[str, dict[str, list[float]]] = {}
    lowered = lowered_profile(args.directory, args.steps, args.threads, detail)
    print(f"{args.directory.name}: kernel ms per step by training-graph op, {args.threads} threads, "
          f"{args.steps} profiled steps each side")
    print(table(lowered, native))
    if args.detail:
        for key, ops in sorted(detail.items(), key=lambda kv: -lowered[kv[0]][0])[:8]:
            parts = sorted(ops.items(), key=lambda kv: -kv[1][0])
            print(f"- {key}: " + ", ".join(f"{op} {v[0]:.2f} ms ({v[1]:.0f})" for op, v in parts[:8]))
    if args.json:
        args.json.write_text(json.dumps({"lowered": lowered, "native": native}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
