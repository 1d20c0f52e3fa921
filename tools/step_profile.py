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
import tempfile
from pathlib import Path

import _artifact
import onnx

from lowering.bench.training import origins
from lowering.training.trainer import Trainer

HERE = Path(__file__).resolve().parent
UPDATE = "optimizer (update)"
FORWARD = "{} (forward, standard)"


def lowered_profile(directory: Path, steps: int, threads: int,
                    detail: dict[str, dict[str, list[float]]] | None = None) -> dict[str, list[float]]:
    """{training-graph op type: [kernel ms per step, kernels per step]} of the lowered train step; ``detail``,
    when given, receives the same split by lowered op type under each training-graph op type."""
    import onnxruntime as ort

    artifact = _artifact.load(directory)
    raw = onnx.load(directory / "training_model.onnx", load_external_data=False)
    charged = origins(raw, artifact.models.step.model)
    standard = {n.name: n.op_type for n in raw.graph.node if n.name and n.name not in charged}
    names = sorted(charged, key=len, reverse=True)
    with tempfile.TemporaryDirectory() as work:
        class Profiled(Trainer):  # the Trainer's own session settings, with onnxruntime's profiler on
            @staticmethod
            def _session(model, options, what):
                options.enable_profiling = True
                options.profile_file_prefix = str(Path(work) / "lowered")
                return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

        trainer = artifact.trainer(threads, cls=Profiled)
        for _ in range(10 + steps):
            trainer.step(artifact.batch)
        events = json.loads(Path(trainer._bound.session.end_profiling()).read_text())
    runs = [e for e in events if e.get("name") == "model_run"]
    first = runs[10]["ts"]
    groups: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time") or e["ts"] < first:
            continue
        node = e["name"][: -len("_kernel_time")]
        if node.startswith("train_step/"):
            key = UPDATE
        elif node in standard:
            key = FORWARD.format(standard[node])
        else:
            key = next((charged[o] for o in names if node.startswith(o + "/")), FORWARD.format(e["args"]["op_name"]))
        entries = [groups.setdefault(key, [0.0, 0.0])]
        if detail is not None:
            entries.append(detail.setdefault(key, {}).setdefault(e["args"]["op_name"], [0.0, 0.0]))
        for entry in entries:
            entry[0] += e["dur"] / 1e3 / steps
            entry[1] += 1 / steps
    return groups


def native_profile(python: str, directory: Path, steps: int, threads: int) -> dict:
    out = subprocess.run([python, str(HERE / "ort_training" / "native_step.py"), "profile", str(directory),
                          "--steps", str(steps), "--threads", str(threads)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(lowered: dict[str, list[float]], native: dict) -> str:
    """Markdown rows: training-graph op, lowered kernels and ms, native kernels and ms, ratio."""
    ops = dict(native["training"])
    rows, lowered_keys = [], dict(lowered)
    for key in list(lowered_keys):
        name = key[: -len(" (forward, standard)")] if key.endswith("(forward, standard)") else key
        if key == UPDATE:
            continue
        if name in ops:
            rows.append((key, lowered_keys.pop(key), ops.pop(name)))
    for key, value in lowered_keys.items():
        if key != UPDATE:
            rows.append((key, value, None))
    for name, value in ops.items():
        # standard ops only the native graph has (after its own fusions), or its training ops with no lowered
        # counterpart in this graph (the gradient accumulators the train-step model does not need)
        rows.append((FORWARD.format(name) if onnx.defs.has(name) else f"{name} (native only)", None, value))
    update = lowered.get(UPDATE, [0.0, 0.0])
    rows.sort(key=lambda r: -max(r[1][0] if r[1] else 0.0, r[2][0] if r[2] else 0.0))
    lines = ["| training-graph op | lowered kernels | lowered ms | native kernels | native ms | lowered / native |",
             "|---|---:|---:|---:|---:|---:|"]

    def cells(value):
        return ("–", "–") if value is None else (f"{value[1]:.0f}", f"{value[0]:.3f}")

    for key, low, nat in rows:
        ratio = f"{low[0] / nat[0]:.2f}" if low and nat and nat[0] > 0 else "–"
        lines.append(f"| {key} | {' | '.join(cells(low))} | {' | '.join(cells(nat))} | {ratio} |")
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
