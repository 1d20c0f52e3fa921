"""Peak memory of a train step: oplower's lowered step on plain onnxruntime against onnxruntime-training's own.

    PYTHONPATH=. python tools/step_memory.py DIR --ort-training-python /work/ortt-venv/bin/python [--steps 5]

DIR as for ``tools/ab_train_step.py``. Each side runs in a fresh process (the lowered side is this script
again with ``--lowered-only``; the native side ``tools/ort_training/native_step.py memory``): it sets up
(lowering, sessions, state), collects garbage, reads its resident memory (VmRSS), resets the peak (VmHWM,
``5 > /proc/self/clear_refs``, Linux only), runs the steps and reads the peak. Reported per side: the RSS before
the first step, the peak during the steps and their difference (what the steps themselves add: activations,
gradients, workspaces); then the ratios lowered / native. The lowered side's RSS before the steps includes the
lowering pass's Python heap, which a process that loads a saved train-step model would not carry, so the
step's own growth is the figure to compare.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def memory_now() -> dict:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}


def lowered(directory: Path, steps: int, threads: int) -> dict:
    import _artifact

    artifact = _artifact.load(directory)
    trainer, batch = artifact.trainer(threads), artifact.batch
    del artifact
    gc.collect()
    before = memory_now()["VmRSS"]
    Path("/proc/self/clear_refs").write_text("5")
    for _ in range(steps):
        trainer.step(batch)
    return {"side": "lowered", "rss_before_mb": before, "peak_mb": memory_now()["VmHWM"], "steps": steps,
            "threads": threads}


def run_side(command: list[str]) -> dict:
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"step_memory: {' '.join(command[:3])}: failed: {tail}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--ort-training-python", help="python of tools/ort_training/make_env.sh's venv")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lowered-only", action="store_true", help="print this process's lowered side only")
    args = parser.parse_args()
    if not (args.directory / "training_model.onnx").exists():
        print(f"step_memory: {args.directory}: no training_model.onnx", file=sys.stderr)
        return 1
    if args.lowered_only:
        print(json.dumps(lowered(args.directory, args.steps, args.threads)))
        return 0
    if not args.ort_training_python:
        print("step_memory: --ort-training-python is required (the native side runs in its venv)", file=sys.stderr)
        return 1
    common = [str(args.directory), "--steps", str(args.steps), "--threads", str(args.threads)]
    ours = run_side([sys.executable, __file__, *common, "--lowered-only"])
    native = run_side([args.ort_training_python, str(HERE / "ort_training" / "native_step.py"), "memory", *common])
    for side in (ours, native):
        side["step_growth_mb"] = side["peak_mb"] - side["rss_before_mb"]
        print(f"{side['side']:>20}: RSS before the steps {side['rss_before_mb']:.1f} MB, peak during "
              f"{args.steps} steps {side['peak_mb']:.1f} MB, growth {side['step_growth_mb']:.1f} MB")
    growth = ours["step_growth_mb"] / native["step_growth_mb"] if native["step_growth_mb"] > 0 else float("nan")
    print(f"{args.directory.name}: peak {ours['peak_mb'] / native['peak_mb']:.2f}x, step growth {growth:.2f}x "
          "(lowered / onnxruntime-training)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
