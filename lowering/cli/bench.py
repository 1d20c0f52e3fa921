"""``oplower bench``: the performance table (DESIGN.md section 7)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lowering.rules import TARGETS
from opdef.errors import OplowerError

HELP = ("time the lowered batch-norm backward on the ResNet-50 layers (vs. memory bound, torch and the peer) "
        "and the pass")


class OutputPathError(OplowerError):
    """The --json file cannot be written where asked."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer shapes and runs (about 20 seconds)")
    p.add_argument("--json", metavar="FILE", type=Path, help="also write every number to FILE as JSON")
    p.add_argument("--no-torch", action="store_true",
                   help="do not compare with torch (its fused kernel and the peer built with it) even if importable")
    p.add_argument("--target", choices=TARGETS, default="onnxruntime",
                   help="which lowering to time in onnxruntime (default: onnxruntime, the tuned one)")
    p.add_argument("--runtimes", action="store_true",
                   help="also time the 64x56x56 layer (f32) in OpenVINO, tract and onnx.reference where installed")
    p.add_argument("--training", action="store_true",
                   help="instead: time a train step of the committed CNN artifact (lowered, plain onnxruntime) "
                        "against torch's eager step, with ConvGrad's share from onnxruntime's profiler "
                        "(--target and --runtimes do not apply)")
    p.add_argument("--ort-training-json", metavar="FILE", type=Path,
                   help="with --training: onnxruntime-training's own step times (written by "
                        "tools/ort_training/native_step.py bench in its venv) for the onnxruntime-training column")
    # test-only: a tiny workload that exercises the machinery in seconds
    p.add_argument("--shapes", choices=("resnet50", "quick", "tiny"), help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from lowering import bench
    from lowering.modelio import write_atomic

    kwargs = {}
    if args.shapes == "tiny":
        kwargs = {"shapes": bench.TINY, "batch": 2, "reps": 3, "pass_nodes": (1, 10)}
    elif args.shapes:
        kwargs = {"shapes": bench.RESNET50 if args.shapes == "resnet50" else bench.QUICK}
    if args.json is not None and not (args.json.parent if str(args.json.parent) else Path(".")).is_dir():
        raise OutputPathError(f"{args.json}: directory {args.json.parent} does not exist (checked before timing)")
    if args.ort_training_json is not None and not args.training:
        raise OutputPathError("--ort-training-json: only with --training (the onnxruntime-training column of the "
                              "train-step bench)")
    if args.training:
        return _run_training(args)
    result = bench.run_bench(quick=args.quick, use_torch=not args.no_torch, target=args.target, runtimes=args.runtimes,
                             **kwargs)
    print(bench.markdown(result))
    if args.json:
        write_atomic(args.json, (json.dumps(result, indent=2) + "\n").encode())
    return 0


def _run_training(args: argparse.Namespace) -> int:
    from lowering.bench import training
    from lowering.modelio import write_atomic

    kwargs = {}
    if args.shapes == "tiny":
        kwargs = {"batches": (4,), "reps": 3, "profile_steps": 2, "threads": (1,)}
    elif args.quick:
        kwargs = {"batches": (4, 64), "reps": 7}
    result = training.run_training_bench(use_torch=not args.no_torch, native=args.ort_training_json, **kwargs)
    print(training.markdown(result))
    if args.json:
        write_atomic(args.json, (json.dumps(result, indent=2) + "\n").encode())
    return 0
