"""The training side: artifacts made from a forward model, trained on plain onnxruntime.

Modules (imports run one way: this package uses the pass, ``lowering.passes`` and ``lowering.rules``, never
the other way round; ``lowering.cli`` and ``lowering.bench`` sit above it):

- ``artifacts`` -- ``generate_artifacts``: a forward model to the four files onnxruntime-training writes;
  ``autodiff`` (the gradient graph), ``gradients/`` (one gradient rule per forward op, per op family),
  ``losses`` and ``optimizers`` (the loss and optimizer blocks);
- ``trainer`` -- lower an artifact directory once and train it (``Trainer``, ``train``);
- ``train_step`` -- the tensor-only train-step model; ``web_bundle`` -- the browser page's files;
- ``checkpoint`` -- onnxruntime-training's FlatBuffers checkpoints, read and written;
- ``workflow`` -- the eval model and the inference export; ``labels`` -- class labels checked before feeding;
  ``portable_std`` -- standard ops some runtimes lack, spelled out for the portable train-step model.

``lowering.training.Trainer``, ``lowering.training.train`` and the other names of the trainer module stay
importable from here (this package replaced the module ``lowering/training.py``); they load on first use, so
importing ``lowering.training.checkpoint`` alone does not load onnxruntime.
"""

from __future__ import annotations

import importlib

_TRAINER_NAMES = ("BUFFER_SUFFIX", "CHECKPOINT", "LAZY_RESET", "MOMENTS", "OPTIMIZER_MODEL", "OPTIMIZER_SEQUENCES",
                  "StartingPoint", "TRAINING_MODEL", "Trainer", "TrainingDataError", "TrainingModels", "batches",
                  "checkpoint_start", "initial_parameters", "lower_artifacts", "moment_count", "starting_point",
                  "train")
_ARTIFACT_NAMES = ("LossType", "OptimType", "generate_artifacts")

__all__ = [*_TRAINER_NAMES, *_ARTIFACT_NAMES]


def __getattr__(name: str):
    if name in _TRAINER_NAMES:
        return getattr(importlib.import_module("lowering.training.trainer"), name)
    if name in _ARTIFACT_NAMES:
        return getattr(importlib.import_module("lowering.training.artifacts"), name)
    raise AttributeError(f"module 'lowering.training' has no attribute {name!r}")
