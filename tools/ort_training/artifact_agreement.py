"""How closely plain onnxruntime, on the lowered models, follows onnxruntime-training's recorded training of
each committed artifact: first-step loss, gradients, parameters after the optimizer, the 20-step curve.

Run in the project's environment (not the onnxruntime-training one):

    PYTHONPATH=. python tools/ort_training/artifact_agreement.py [--target portable] [NAME ...]

Errors are relative: the loss's to the recorded loss; each gradient's to max(its largest entry, 1e-3 of the
model's largest gradient) (the tests' measure); each parameter's to its largest entry; the curve's per step.
The two-model Trainer is used (its accumulation buffers are the gradients).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "fixtures" / "ort_training" / "artifacts"


def agreement(directory: Path, target: str) -> dict:
    from lowering.training.trainer import Trainer, initial_parameters, lower_artifacts

    meta = json.loads((directory / "meta.json").read_text())
    models = dataclasses.replace(lower_artifacts(directory, target=target), step=None)
    start = initial_parameters(directory, models, dict(np.load(directory / "initial_params.npz")), "initial")
    trainer = Trainer(models, start, learning_rate=meta["learning_rate"])
    data = dict(np.load(directory / "data.npz"))
    batch = {models.training.graph.input[0].name: data["input"], meta["labels_input"]: data["labels"]}
    recorded = dict(np.load(directory / "api_step1.npz"))
    after = dict(np.load(directory / "api_optimizer_step1.npz"))
    curve = json.loads((directory / "api_curve.json").read_text())["loss"]
    params = meta["trainable_params"]
    losses = [trainer.step(batch)]
    largest = max(float(np.abs(recorded[f"grad.{p}"]).max()) for p in params)
    gradient = max(float(np.abs(trainer.buffers[p] - recorded[f"grad.{p}"]).max())
                   / max(float(np.abs(recorded[f"grad.{p}"]).max()), 1e-3 * largest) for p in params)
    parameter = max(float(np.abs(trainer.params[p] - after[f"param.{p}"]).max())
                    / max(float(np.abs(after[f"param.{p}"]).max()), 1e-30) for p in params)
    losses += [trainer.step(batch) for _ in range(len(curve) - 1)]
    return {"artifact": directory.name, "nodes": len(models.training.graph.node),
            "loss": abs(losses[0] - curve[0]) / abs(curve[0]), "gradient": gradient, "parameter": parameter,
            "curve": float(np.max(np.abs(np.array(losses) - curve) / np.abs(curve)))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="artifact directories (default: every one)")
    parser.add_argument("--target", choices=("onnxruntime", "portable"), default="onnxruntime")
    args = parser.parse_args(argv)
    names = args.names or sorted(p.name for p in ARTIFACTS.iterdir() if p.is_dir())
    print(f"| artifact ({args.target}) | lowered training nodes | loss | gradients | parameters | 20-step curve |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        r = agreement(ARTIFACTS / name, args.target)
        print(f"| {r['artifact']} | {r['nodes']} | {r['loss']:.1e} | {r['gradient']:.1e} | {r['parameter']:.1e} "
              f"| {r['curve']:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
