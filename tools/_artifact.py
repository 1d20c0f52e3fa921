"""What the train-step measurement tools share: a generate_artifacts directory (a committed artifact or one of
``tools/ort_training/native_step.py make``) lowered, its starting parameters and its batch, and a Trainer on
them with the settings every comparison uses (spinning off)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lowering.training.trainer import StartingPoint, Trainer, TrainingModels, initial_parameters, lower_artifacts


@dataclass(frozen=True)
class Artifact:
    models: TrainingModels
    start: StartingPoint  # initial_params.npz
    batch: dict[str, np.ndarray]  # data.npz's input and labels, by the train-step model's input names
    learning_rate: float  # meta.json's

    def trainer(self, threads: int | None, models: TrainingModels | None = None, cls: type[Trainer] = Trainer,
                memory_pattern: bool | None = None) -> Trainer:
        return cls(models or self.models, self.start, learning_rate=self.learning_rate, threads=threads,
                   spinning=False, memory_pattern=memory_pattern)

    def median_step_ms(self, trainer: Trainer, steps: int, clock=time.perf_counter) -> float:
        """The median milliseconds of ``steps`` steps of ``trainer`` on the batch (``clock``: the wall clock, or
        e.g. ``time.process_time``: the CPU time of every thread of the process, which other processes on the
        cores disturb less)."""
        times = []
        for _ in range(steps):
            begin = clock()
            trainer.step(self.batch)
            times.append(clock() - begin)
        return float(np.median(times) * 1e3)


def labels(meta: dict, data: dict[str, np.ndarray]) -> np.ndarray:
    """data.npz's labels: under "labels", or (the #29 held-out sweep's) under the labels input's own name."""
    return data["labels"] if "labels" in data else data[meta["labels_input"]]


def load(directory: Path) -> Artifact:
    meta = json.loads((directory / "meta.json").read_text())
    models = lower_artifacts(directory)
    start = initial_parameters(directory, models, dict(np.load(directory / "initial_params.npz")))
    data = dict(np.load(directory / "data.npz"))
    batch = {models.step.interface.data[0]: data["input"], meta["labels_input"]: labels(meta, data)}
    return Artifact(models, start, batch, meta["learning_rate"])
