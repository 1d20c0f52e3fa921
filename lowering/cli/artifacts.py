"""``oplower artifacts FORWARD.onnx -o DIR``: onnxruntime-training's four artifact files, made by oplower."""

from __future__ import annotations

import argparse
from pathlib import Path

from lowering.modelio import load_model
from lowering.training.artifacts import LossType, OptimType, build_artifacts, write_artifacts

HELP = ("make training artifacts from a forward model: training_model.onnx (with the gradient graph), "
        "eval_model.onnx, optimizer_model.onnx and checkpoint, as onnxruntime-training's generate_artifacts "
        "writes them (no onnxruntime-training needed)")

LOSSES = [t.name for t in LossType] + ["none"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="FORWARD.onnx", help="the forward model (e.g. a torch export in training mode)")
    p.add_argument("-o", "--output", metavar="DIR", required=True, help="the artifact directory to write")
    p.add_argument("--loss", choices=LOSSES, required=True,
                   help="the loss block on the model's first output (none: that output is the loss already)")
    p.add_argument("--optimizer", choices=[t.name for t in OptimType], default="AdamW",
                   help="the optimizer model (default AdamW, onnxruntime-training's defaults)")
    p.add_argument("--requires-grad", nargs="+", action="extend", metavar="NAME",
                   help="the parameters to train (default: every float initializer that reaches the loss and is "
                        "not --frozen)")
    p.add_argument("--frozen", nargs="+", action="extend", metavar="NAME", default=[],
                   help="parameters kept as inputs but not trained (default with no --requires-grad: batch-norm "
                        "running statistics)")
    p.add_argument("--additional-output", action="append", metavar="NAME", default=[],
                   help="a value to output beside the loss (onnxruntime-training's additional_output_names)")
    p.add_argument("--loss-input", action="append", metavar="NAME", default=[],
                   help="the values the loss block reads (default: the model's outputs; loss_input_names)")
    p.add_argument("--prefix", default="", help="prefix of the file names")
    p.add_argument("--inference-batch-norm", action="append", metavar="NODE", default=[],
                   help="keep this BatchNormalization node in inference mode (running statistics, frozen) for "
                        "fine-tuning; 'all' for every one (default: every BatchNormalization trains with batch "
                        "statistics, as onnxruntime-training makes it)")


def run(args: argparse.Namespace) -> int:
    path = Path(args.model)
    model = load_model(path)
    keep = args.inference_batch_norm
    if "all" in keep:
        keep = [n.name for n in model.graph.node if n.op_type == "BatchNormalization"]
    artifacts = build_artifacts(model, args.requires_grad, args.frozen, None if args.loss == "none"
                                else LossType[args.loss], OptimType[args.optimizer], args.additional_output or None,
                                args.loss_input or None, keep_inference_batch_norm=keep, source=str(path))
    out = Path(args.output)
    written = write_artifacts(artifacts, out, args.prefix)
    graph = artifacts.training.graph
    data = [i.name for i in graph.input if i.name not in set(artifacts.trainable) | set(artifacts.frozen)
            and not i.name.endswith("_grad.accumulation.buffer") and i.name != "lazy_reset_grad"]
    print(f"{path} -> {out}: {', '.join(p.name for p in written)}")
    print(f"  {len(artifacts.trainable)} trainable parameters, {len(artifacts.frozen)} frozen; inputs "
          f"{', '.join(data)}; loss {artifacts.loss!r}; training model {len(graph.node)} nodes")
    return 0
