"""``oplower train-step DIR -o STEP.onnx``: the tensor-only train-step model of an artifact directory."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from lowering.cli.arguments import positive_int
from lowering.cli.run import load_npz
from lowering.modelio import write_atomic
from lowering.rules import TARGETS
from lowering.training.train_step import FIRST_MOMENT, SECOND_MOMENT, train_step
from lowering.training.trainer import batches, lower_artifacts, starting_point
from lowering.training.web_bundle import write_bundle
from opdef.errors import OplowerError

HELP = ("write the train-step model of an onnxruntime-training artifact directory: one standard ONNX model "
        "doing a whole step (forward, backward, optimizer update) with tensor inputs and outputs only")


class TrainStepArgumentError(OplowerError):
    """Options that do not go together."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifacts", metavar="ARTIFACT_DIR",
                   help="directory with training_model.onnx and optimizer_model.onnx")
    p.add_argument("-o", "--output", metavar="STEP.onnx", help="where to write the train-step model")
    p.add_argument("--target", choices=TARGETS, default="onnxruntime",
                   help="lowering target (portable: runs in OpenVINO and tract too; default onnxruntime)")
    p.add_argument("--flat-state", action="store_true",
                   help="the parameters and moments of each element type as one flat input and output "
                        "(flat.params.<type>, ...; what oplower train runs: fewer kernels) instead of one per "
                        "parameter")
    p.add_argument("--bundle", metavar="WEB_DIR",
                   help="also write what the browser page trains: the model, bundle.json and tensors.bin "
                        "(needs --data)")
    p.add_argument("--data", metavar="IN.npz", help="with --bundle: one array per data input (as oplower train)")
    p.add_argument("--params", metavar="P.npz",
                   help="with --bundle: initial parameters by name (default: as oplower train)")
    p.add_argument("--steps", type=positive_int, default=20, metavar="N", help="with --bundle: steps (default 20)")
    p.add_argument("--lr", type=float, default=1e-3, metavar="LR", help="with --bundle: learning rate (default 1e-3)")


def run(args: argparse.Namespace) -> int:
    if not args.output and not args.bundle:
        raise TrainStepArgumentError("nothing to write: give -o STEP.onnx, --bundle WEB_DIR or both")
    if args.bundle and not args.data:
        raise TrainStepArgumentError("--bundle needs --data IN.npz (the batches the page trains on)")
    if not args.bundle and (args.data or args.params):
        raise TrainStepArgumentError("--data and --params only go with --bundle")
    if not math.isfinite(args.lr) or args.lr <= 0:
        raise TrainStepArgumentError(f"--lr {args.lr}: the learning rate must be finite and > 0")
    directory = Path(args.artifacts)
    # the browser page feeds one tensor per parameter: the bundle keeps that form
    models = lower_artifacts(directory, target=args.target, flat_state=False)
    step = models.step
    interface = step.interface
    if args.bundle:
        data_path = Path(args.data)
        data = load_npz(data_path)
        given = load_npz(Path(args.params)) if args.params else None
        start = starting_point(directory, models, params=given, params_source=args.params or "")
        feed = batches(data, models, start.frozen, str(data_path))
        count = max(np.asarray(data[n]).shape[0] if np.asarray(data[n]).ndim > _rank(models, n) else 1
                    for n in interface.data)
        stacked = {n: np.stack([feed(k)[n] for k in range(count)]) for n in interface.data}
        write_bundle(Path(args.bundle), step, stacked, start.params, start.frozen, steps=args.steps,
                     learning_rate=args.lr, moments=start.moments, steps_taken=start.step)
        print(f"wrote {args.bundle} (train_step.onnx, bundle.json, tensors.bin: {args.steps} steps)")
    if args.output:
        if args.flat_state:
            step = train_step(directory, target=args.target, flat_state=True)
            interface = step.interface
        write_atomic(Path(args.output), step.model.SerializeToString())
        moments = f", {FIRST_MOMENT[1:]}/{SECOND_MOMENT[1:]} per parameter" if interface.moments else ""
        flat = {p for f in interface.flat for p in f.params}
        where = ", ".join(f.names[0] for f in interface.flat)
        held = f" ({len(flat)} of them in {where}{', with moments' * bool(moments)})" if flat else ""
        moments = "" if flat and len(flat) == len(interface.params) else moments
        print(f"wrote {args.output}: inputs {', '.join(interface.data)}, learning_rate, step, "
              f"{len(interface.params)} parameters{held}{moments}, {len(interface.frozen)} frozen values; "
              f"outputs {interface.loss} and the .updated state")
    return 0


def _rank(models, name: str) -> int:
    return next(len(i.type.tensor_type.shape.dim) for i in models.training.graph.input if i.name == name)
