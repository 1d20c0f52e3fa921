"""oplower's artifact generator on the held-out sweep's models, against onnxruntime-training's own step on each.

    /work/ortt-venv/bin/python tools/ort_training/heldout_sweep.py          # records /tmp/heldout/<name>/
    PYTHONPATH=. /work/venv/bin/python tools/heldout_check.py [--root /tmp/heldout] [--no-ort] [NAME ...]

Per recorded model (tools/ort_training/heldout_sweep.py wrote ``forward_model.onnx``, ``data.npz``,
``initial_params.npz``, ``reference.npz`` and ``meta.json``):

1. ``build_artifacts`` on the forward model (unpatched, Dropout ratios 0) with meta.json's trainable and frozen
   parameters, loss and optimizer; the four files written to ``<name>/oplower/`` (``oplower check``'s verification
   of the training model included);
2. plain onnxruntime: the training model lowered with its accumulators removed (the gradients exposed as outputs)
   for the loss and gradients, then one step + optimizer step with :class:`lowering.training.trainer.Trainer`
   from ``initial_params.npz`` at meta.json's learning rate for the parameters (frozen ones too);
3. onnxruntime-training's own runtime: ``heldout_sweep.py --run-ours`` in its venv loads ``<name>/oplower/`` in
   CheckpointState / Module / Optimizer and takes the same step (skipped with ``--no-ort``).

Both against ``reference.npz`` (onnxruntime-training's step, or torch float64 where onnxruntime-training fails:
meta.json's ``truth``): loss 1e-5 relative, gradients 1e-4 of the largest entry (a gradient that is zero to
rounding is judged against 1e-2 of the model's largest), parameters 1e-4 of the largest. Prints a table; exit 1
when any model fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import onnx

from lowering.passes import lower_model
from lowering.training.artifacts import LossType, OptimType, build_artifacts, write_artifacts
from lowering.training.trainer import Trainer, lower_artifacts, starting_point
from runtime.session import run_model

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "tools" / "ort_training" / "heldout_sweep.py"
ORTT_PYTHON = Path("/work/ortt-venv/bin/python")
ACCUMULATOR = ("com.microsoft", "InPlaceAccumulatorV2")
LOSS_RTOL, ARRAY_TOL = 1e-5, 1e-4


def gradients_exposed(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, str]]:
    """The training model without its accumulators: {parameter: its gradient, now a graph output}."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    kept, exposed = [], {}
    for node in graph.node:
        if (node.domain, node.op_type) == ACCUMULATOR:
            exposed[node.input[0].removesuffix("_grad.accumulation.buffer")] = node.input[1]
        else:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    outputs = [o for o in graph.output if not o.name.endswith(".accumulation.out")]
    del graph.output[:]
    graph.output.extend(outputs)
    graph.output.extend(onnx.helper.make_empty_tensor_value_info(g) for g in exposed.values())
    buffers = {f"{p}_grad.accumulation.buffer" for p in exposed} | {"lazy_reset_grad"}
    inputs = [i for i in graph.input if i.name not in buffers]
    del graph.input[:]
    graph.input.extend(inputs)
    return model, exposed


def rel(got, want, floor: float = 0.0) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if want.size == 0:
        return 0.0
    return float(np.abs(got - want).max()) / max(float(np.abs(want).max()), floor, 1e-30)


def compare(ref: dict, loss: float, grads: dict, params: dict, trainable: list[str]) -> dict:
    """The same measure as heldout_sweep.compare (onnxruntime-training's side)."""
    floor = 1e-2 * max(float(np.abs(ref[f"grad.{p}"]).max()) for p in trainable)
    g = max(((rel(grads[p], ref[f"grad.{p}"], floor), p) for p in trainable), default=(0.0, ""))
    prm = max(((rel(params[p], ref[f"param.{p}"]), p) for p in params if f"param.{p}" in ref), default=(0.0, ""))
    want = float(ref["loss"])
    return {"loss": abs(loss - want) / max(abs(want), 1e-30), "grad": g[0], "grad_param": g[1], "param": prm[0],
            "param_name": prm[1]}


def passes(result: dict) -> bool:
    return "error" not in result and result["loss"] <= LOSS_RTOL and result["grad"] <= ARRAY_TOL and \
        result["param"] <= ARRAY_TOL


def check_plain(directory: Path, meta: dict) -> tuple[dict, dict]:
    """(errors on plain onnxruntime, facts about the generated training model)."""
    forward = onnx.load(str(directory / "forward_model.onnx"))
    trainable, frozen = meta["trainable_params"], meta["frozen_params"]
    art = build_artifacts(forward, trainable, frozen, LossType[meta["loss"]] if meta["loss"] else None,
                          OptimType[meta["optimizer"]], source=str(directory / "forward_model.onnx"))
    out = directory / "oplower"
    write_artifacts(art, out)
    custom = sorted({n.op_type for n in art.training.graph.node if n.domain not in ("", "ai.onnx")})
    facts = {"custom_ops": custom}
    data = dict(np.load(directory / "data.npz"))
    init = dict(np.load(directory / "initial_params.npz"))
    ref = dict(np.load(directory / "reference.npz"))

    model, exposed = gradients_exposed(art.training)
    lowered = lower_model(model)
    left = sorted({n.op_type for n in lowered.graph.node if n.domain not in ("", "ai.onnx")})
    if left:
        return {"error": f"not lowered: {left}"}, facts
    names = {i.name for i in lowered.graph.input}
    feeds = {k: v for k, v in (data | init).items() if k in names}
    got = run_model(lowered, feeds)
    loss = float(got[art.loss])
    grads = {p: got[g] for p, g in exposed.items()}

    models = lower_artifacts(out)
    wanted = set(models.params) | set(models.other_inputs)
    start = starting_point(out, models, params={k: v for k, v in init.items() if k in wanted})
    trainer = Trainer(models, start, learning_rate=meta["learning_rate"])
    batch = {k: data[k] for k in meta["inputs"]}
    step_loss = trainer.step(batch)
    params = trainer.params | trainer.frozen
    result = compare(ref, loss, grads, params, trainable)
    result["step_loss_vs_graph_loss"] = abs(step_loss - loss) / max(abs(loss), 1e-30)
    if "torch_f64.npz" in {p.name for p in directory.iterdir()} and meta["truth"] == "onnxruntime-training":
        truth = dict(np.load(directory / "torch_f64.npz"))
        scale = max(float(np.abs(truth[f"grad.{p}"]).max()) for p in trainable)
        facts["ours_vs_f64"] = max(float(np.abs(grads[p] - truth[f"grad.{p}"]).max()) for p in trainable) / scale
        facts["ort_vs_f64"] = max(float(np.abs(ref[f"grad.{p}"] - truth[f"grad.{p}"]).max()) for p in trainable) / scale
    return result, facts


def check_ort(directory: Path) -> dict:
    proc = subprocess.run([str(ORTT_PYTHON), str(SWEEP), "--run-ours", str(directory)], capture_output=True,
                          text=True, timeout=600, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1][:300]}"}
    return json.loads(lines[-1])


def fmt(result: dict | None) -> str:
    if result is None:
        return "-"
    if "error" in result:
        return "ERROR"
    mark = "ok" if passes(result) else "FAIL"
    return f"{mark} {result['loss']:.0e}/{result['grad']:.0e}/{result['param']:.0e}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*")
    parser.add_argument("--root", type=Path, default=Path("/tmp/heldout"))
    parser.add_argument("--no-ort", action="store_true", help="skip onnxruntime-training's runtime")
    parser.add_argument("--json", type=Path, help="write every result here")
    args = parser.parse_args()
    names = args.names or sorted(d.name for d in args.root.iterdir() if (d / "meta.json").is_file())
    rows, failed, details = [], [], {}
    for name in names:
        directory = args.root / name
        meta = json.loads((directory / "meta.json").read_text())
        if meta.get("truth") is None:
            rows.append((name, meta, None, None, {}, "no reference recorded"))
            continue
        try:
            plain, facts = check_plain(directory, meta)
        except Exception as exc:  # noqa: BLE001 -- reported per model
            first = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
            plain, facts = {"error": f"{type(exc).__name__}: {first}"[:500]}, {}
            details[name] = traceback.format_exc()
        ours_ort = None if args.no_ort or "error" in plain and "not lowered" not in plain["error"] and \
            not (directory / "oplower" / "training_model.onnx").exists() else check_ort(directory)
        note = plain.get("error", "") or (ours_ort or {}).get("error", "")
        rows.append((name, meta, plain, ours_ort, facts, note))
        ok = passes(plain) and (args.no_ort or (ours_ort is not None and passes(ours_ort)))
        if not ok:
            failed.append(name)
        print(f"{name:18s} plain {fmt(plain):28s} ort-training {fmt(ours_ort):28s} {note[:150]}", flush=True)

    print("\nmodel              truth  ORT-training generator          oplower plain ORT (loss/grad/param)"
          "   oplower in ORT-training runtime")
    for name, meta, plain, ours_ort, _facts, note in rows:
        truth = {"onnxruntime-training": "ORT", "torch-f64": "f64"}.get(meta.get("truth"), "none")
        ort_fail = (meta.get("ort_failure") or "ok")[:60]
        print(f"{name:18s} {truth:5s}  {ort_fail:31s} {fmt(plain):36s} {fmt(ours_ort)}")
        if note:
            print(f"{'':18s}   -> {note[:300]}")
    if args.json:
        args.json.write_text(json.dumps({n: {"plain": p, "ort_runtime": o, "facts": f, "ops": m.get("ops"),
                                             "truth": m.get("truth"), "ort_failure": m.get("ort_failure")}
                                         for n, m, p, o, f, _ in rows}, indent=1) + "\n")
    for name, text in details.items():
        print(f"\n--- {name}\n{text[-2000:]}", file=sys.stderr)
    print(f"\n{len(rows) - len(failed)}/{len(rows)} pass" + (f"; failing: {' '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
