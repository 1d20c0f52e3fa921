"""The lowered train step under onnxruntime's settings: 1 or 2 intra-op threads, memory pattern off or on.

    PYTHONPATH=. python tools/step_settings.py DIR [DIR ...] [--steps 100] [--rounds 5]

DIR: a generate_artifacts directory as tools/ab_train_step.py takes (a committed artifact or one of
``tools/ort_training/native_step.py make``). The four Trainers of a directory live in this one process and are
timed in alternating rounds (spinning off); prints each variant's median ms and its ratio to 2 threads without
the pattern, and the step's multiply-accumulates (lowering.training.step_size), what Trainer's own choice reads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import _artifact

from lowering.training.step_size import multiply_accumulates

VARIANTS = ((2, False), (2, True), (1, False), (1, True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directories", nargs="+", type=Path)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for directory in args.directories:
        artifact = _artifact.load(directory)
        trainers = {}
        for threads, pattern in VARIANTS:
            trainer = artifact.trainer(threads, memory_pattern=pattern)
            for _ in range(5):
                trainer.step(artifact.batch)
            trainers[threads, pattern] = trainer
        times: dict[tuple[int, bool], list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for variant, trainer in trainers.items():
                times[variant].append(artifact.median_step_ms(trainer, args.steps))
        medians = {v: statistics.median(t) for v, t in times.items()}
        base = medians[2, False]
        cells = [f"{t} thread{'s' if t > 1 else ''}{' + pattern' if p else ''} {m:.3f} ({m / base:.2f})"
                 for (t, p), m in medians.items()]
        macs = multiply_accumulates(artifact.models.step.model) if artifact.models.step is not None else None
        print(f"{directory.name}: " + ", ".join(cells) + f"; multiply-accumulates {macs}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
