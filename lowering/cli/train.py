"""``oplower train``: train from an onnxruntime-training artifact directory on plain onnxruntime."""

from __future__ import annotations

import argparse
import io
import math
from pathlib import Path

import numpy as np

from lowering.cli.arguments import positive_int
from lowering.cli.progress import Progress
from lowering.cli.run import load_npz
from lowering.modelio import write_atomic
from lowering.rules import TARGETS
from lowering.training.checkpoint import write_checkpoint
from lowering.training.trainer import Trainer, batches, lower_artifacts, starting_point
from lowering.training.workflow import check_outputs, export_inference
from opdef.errors import OplowerError

HELP = ("train on plain onnxruntime from an onnxruntime-training artifact directory (training_model.onnx, "
        "optimizer_model.onnx): lowered once, then N steps")


class TrainingArgumentError(OplowerError):
    """An option value that cannot be trained with."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifacts", metavar="ARTIFACT_DIR",
                   help="directory with training_model.onnx and optimizer_model.onnx")
    p.add_argument("--steps", type=positive_int, required=True, metavar="N", help="training steps to run")
    p.add_argument("--data", required=True, metavar="IN.npz",
                   help="one array per data input of the training model, named after it, with a leading "
                        "batch-index axis; step k feeds index k mod B")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--params", metavar="P.npz",
                       help="initial parameters by name (default: ARTIFACT_DIR/checkpoint, else the initializers of "
                            "the forward model in ARTIFACT_DIR)")
    start.add_argument("--checkpoint", metavar="FILE",
                       help="start from this onnxruntime-training checkpoint: parameters, and the optimizer's moments "
                            "and step when it holds them (steps go on from k+1)")
    p.add_argument("--lr", type=float, default=None, metavar="LR",
                   help="learning rate (default: the checkpoint's, else 1e-3)")
    p.add_argument("--save", metavar="OUT.npz", help="write the trained parameters here")
    p.add_argument("--save-checkpoint", metavar="OUT",
                   help="write an onnxruntime-training checkpoint (parameters, optimizer state, step) here")
    p.add_argument("--export", metavar="OUT.onnx",
                   help="write the inference model (eval_model.onnx's forward part, trained parameters as "
                        "initializers) here")
    p.add_argument("--export-output", action="append", metavar="NAME",
                   help="an output of the exported model (repeatable; default: the values the loss block reads)")
    p.add_argument("--threads", type=positive_int, metavar="N", help="onnxruntime intra-op threads")
    p.add_argument("--target", choices=TARGETS, default="onnxruntime",
                   help="lowering target of both models (see oplower lower --help; default onnxruntime)")


def run(args: argparse.Namespace) -> int:
    if args.lr is not None and (not math.isfinite(args.lr) or args.lr <= 0):
        raise TrainingArgumentError(f"--lr {args.lr}: the learning rate must be finite and > 0")
    if args.export_output and not args.export:
        raise TrainingArgumentError("--export-output: only with --export OUT.onnx")
    directory = Path(args.artifacts)
    data_path = Path(args.data)
    data = load_npz(data_path)
    models = lower_artifacts(directory, target=args.target)
    export_outputs = check_outputs(directory, args.export_output) if args.export else None
    given = load_npz(Path(args.params)) if args.params else None
    start = starting_point(directory, models, params=given, params_source=args.params or "",
                           checkpoint=args.checkpoint)
    feed = batches(data, models, start.frozen, str(data_path))
    trainer = Trainer(models, start, learning_rate=args.lr or start.learning_rate or 1e-3, threads=args.threads)
    data_inputs = [n for n in models.other_inputs if n not in start.frozen]
    after = f" after step {start.step}" if start.step else ""
    print(f"training {len(models.params)} parameters of {directory} for {args.steps} steps{after} on plain "
          f"onnxruntime (data inputs: {', '.join(data_inputs)})")
    progress = Progress(args.steps)
    try:
        for k in range(start.step, start.step + args.steps):  # step k + 1 feeds batch k, numbered on from a checkpoint
            loss = trainer.step(feed(k))
            progress.update(k + 1 - start.step, f"loss {loss:.4g}")
            progress.write(f"step {k + 1} loss {loss:.6g}")
    finally:
        progress.close()
    if args.save:
        buffer = io.BytesIO()
        np.savez(buffer, **trainer.params, **trainer.frozen)  # running statistics too: --params reads both
        write_atomic(Path(args.save), buffer.getvalue())
        print(f"wrote {args.save}")
    if args.save_checkpoint:
        write_checkpoint(args.save_checkpoint, trainer.checkpoint())
        print(f"wrote {args.save_checkpoint}")
    if args.export:
        export_inference(directory, {**trainer.params, **trainer.frozen}, args.export, outputs=export_outputs)
        print(f"wrote {args.export}")
    return 0

