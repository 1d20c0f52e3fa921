"""``oplower eval``: run an artifact directory's eval_model.onnx on plain onnxruntime and print the mean loss."""

from __future__ import annotations

import argparse
from pathlib import Path

from lowering.cli.arguments import positive_int
from lowering.cli.progress import Progress
from lowering.cli.run import load_npz
from lowering.training.workflow import EVAL_MODEL, evaluate, parameter_values

HELP = ("evaluate trained parameters with an onnxruntime-training artifact directory's eval_model.onnx on plain "
        "onnxruntime: the mean loss over the batches (and the accuracy for a classification loss)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifacts", metavar="ARTIFACT_DIR", help=f"directory with {EVAL_MODEL}")
    p.add_argument("--data", required=True, metavar="IN.npz",
                   help="one array per data input of the eval model (data and labels), with a leading batch-index "
                        "axis (or one batch)")
    values = p.add_mutually_exclusive_group()
    values.add_argument("--checkpoint", metavar="FILE",
                        help="the parameters of this checkpoint (default: ARTIFACT_DIR/checkpoint)")
    values.add_argument("--params", metavar="P.npz", help="the parameters by name (oplower train --save)")
    p.add_argument("--threads", type=positive_int, metavar="N", help="onnxruntime intra-op threads")


def run(args: argparse.Namespace) -> int:
    directory = Path(args.artifacts)
    data_path = Path(args.data)
    data = load_npz(data_path)
    given = load_npz(Path(args.params)) if args.params else None
    values = parameter_values(directory, params=given, checkpoint=args.checkpoint)
    source = args.params or args.checkpoint or str(directory / "checkpoint")
    progress = Progress(1)
    try:
        result = evaluate(directory, data, values, source=str(data_path), values_source=source, threads=args.threads,
                          on_batch=lambda done, total, loss: _update(progress, done, total, loss))
    finally:
        progress.close()
    accuracy = f" accuracy {result.accuracy:.6g}" if result.accuracy is not None else ""
    print(f"eval loss {result.loss:.6g}{accuracy} ({result.batches} batch{'es' if result.batches > 1 else ''})")
    return 0


def _update(progress: Progress, done: int, total: int, loss: float) -> None:
    progress.total = total
    progress.update(done, f"loss {loss:.4g}")
