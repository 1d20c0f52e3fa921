"""``oplower demo``: lower an embedded example of every dialect, run it, compare with float64."""

from __future__ import annotations

import argparse

HELP = ("lower an embedded example (batch-norm backward nodes of every dialect), run it in onnxruntime "
        "and compare with the float64 reference")


def add_arguments(p: argparse.ArgumentParser) -> None:
    del p  # no arguments: the demo needs no files


def run(args: argparse.Namespace) -> int:
    from lowering.demo import run_demo

    return run_demo()
