"""Kernels per lowered train step, charged to the training-graph op each came from (onnxruntime's profiler).

    PYTHONPATH=. python tools/kernel_count.py DIR [DIR ...] [--detail]

DIR: a generate_artifacts directory (a committed artifact under tests/fixtures/ort_training/artifacts/ or one of
``tools/ort_training/native_step.py make``). Counts do not depend on the machine's load, so they are how a change
of a lowered form is judged before it is timed; ``--detail`` splits each op's count by the lowered op types.
``oplower bench --training`` reports the same counts beside its times (lowering.bench.training.profile_train_step).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import _artifact
import numpy as np

from lowering.bench.training import learning_rate, profile_train_step
from lowering.modelio import load_model
from lowering.training.trainer import TRAINING_MODEL, initial_parameters, lower_artifacts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directories", nargs="+", type=Path)
    parser.add_argument("--detail", action="store_true", help="each op's kernels by lowered op type")
    args = parser.parse_args()
    for directory in args.directories:
        models = lower_artifacts(directory)
        meta = json.loads((directory / "meta.json").read_text())
        start = initial_parameters(directory, models, dict(np.load(directory / "initial_params.npz")))
        data = dict(np.load(directory / "data.npz"))
        feeds = {models.training.graph.input[0].name: data["input"], meta["labels_input"]: _artifact.labels(meta, data)}
        detail: dict[str, dict[str, list[float]]] = {}
        groups = profile_train_step(models, start, feeds, learning_rate(directory),
                                    load_model(directory / TRAINING_MODEL), 1, 5, detail)
        print(f"{directory.name}: {sum(v[1] for v in groups.values()):.0f} kernels per step")
        for op, (_, count) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
            split = ""
            if args.detail:
                split = "  " + ", ".join(f"{k} {c:.0f}" for k, (_, c) in
                                         sorted(detail[op].items(), key=lambda kv: -kv[1][1]))
            print(f"  {op:44s} {count:5.0f}{split}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
