"""``oplower train``: train from an onnxruntime-training artifact directory on plain onnxruntime."""

from __future__ import annotations

import argparse
import io
import math
import sys
from pathlib import Path

import numpy as np

from lowering.cli.arguments import positive_int
from lowering.cli.run import load_npz
from lowering.modelio import write_atomic
from lowering.rules import TARGETS
from lowering.training import Trainer, batches, initial_parameters, lower_artifacts
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
    p.add_argument("--params", metavar="P.npz",
                   help="initial parameters by name (default: the initializers of the forward model in ARTIFACT_DIR)")
    p.add_argument("--lr", type=float, default=1e-3, metavar="LR", help="learning rate (default 1e-3)")
    p.add_argument("--save", metavar="OUT.npz", help="write the trained parameters here")
    p.add_argument("--threads", type=positive_int, metavar="N", help="onnxruntime intra-op threads")
    p.add_argument("--target", choices=TARGETS, default="onnxruntime",
                   help="lowering target of both models (see oplower lower --help; default onnxruntime)")


def run(args: argparse.Namespace) -> int:
    if not math.isfinite(args.lr) or args.lr <= 0:
        raise TrainingArgumentError(f"--lr {args.lr}: the learning rate must be finite and > 0")
    directory = Path(args.artifacts)
    data_path = Path(args.data)
    data = load_npz(data_path)
    models = lower_artifacts(directory, target=args.target)
    given = load_npz(Path(args.params)) if args.params else None
    start = initial_parameters(directory, models, given, args.params or "")
    feed = batches(data, models, start.frozen, str(data_path))
    trainer = Trainer(models, start, learning_rate=args.lr, threads=args.threads)
    data_inputs = [n for n in models.other_inputs if n not in start.frozen]
    print(f"training {len(models.params)} parameters of {directory} for {args.steps} steps on plain onnxruntime "
          f"(data inputs: {', '.join(data_inputs)})")
    for k in range(args.steps):
        loss = trainer.step(feed(k))
        _progress(k + 1, args.steps, loss)
        print(f"step {k + 1} loss {loss:.6g}", flush=True)
    print(file=sys.stderr)
    if args.save:
        buffer = io.BytesIO()
        np.savez(buffer, **trainer.params, **trainer.frozen)  # running statistics too: --params reads both
        write_atomic(Path(args.save), buffer.getvalue())
        print(f"wrote {args.save}")
    return 0


def _progress(done: int, total: int, loss: float, width: int = 30) -> None:
    filled = width * done // total
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} loss {loss:.4g}", end="", file=sys.stderr,
          flush=True)
