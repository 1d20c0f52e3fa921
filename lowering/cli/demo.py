"""``oplower demo``: lower an embedded example of every dialect, run it, compare with float64."""

from __future__ import annotations

import argparse

from lowering.rules import TARGETS

HELP = ("lower an embedded example (batch-norm backward nodes of every dialect), run it in onnxruntime "
        "and compare with the float64 reference")


def add_arguments(p: argparse.ArgumentParser) -> None:
    # no files needed; only the lowering's target can be chosen
    p.add_argument("--target", choices=TARGETS, default="onnxruntime",
                   help="'onnxruntime' (default): tuned for onnxruntime's CPU provider; 'portable': only ops "
                        "every ONNX runtime runs with computed inputs (no Conv/BatchNormalization on computed "
                        "weights or statistics)")


def run(args: argparse.Namespace) -> int:
    from lowering.demo import run_demo

    return run_demo(target=args.target)
