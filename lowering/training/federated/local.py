"""What one federated client does, and the server's start and outputs, without Flower.

A client trains the artifact directory on its own partition from the global state (every state tensor:
the trainable parameters, then the frozen values such as batch norm's running statistics) with **fresh
optimizer state** -- moments zero, the optimizer step counting from 1 -- for ``epochs`` passes over its
partition's B batches in order (E·B steps, step k feeding batch k mod B), exactly what

    oplower train DIR --params GLOBAL.npz --data PARTITION.npz --steps E·B --lr LR

does, and reports every state tensor after the last step (what ``--save`` writes), its number of examples
(samples in the partition: B times the batch size) and its mean loss over the steps. Evaluation runs the eval
model on the partition with the global state (loss, accuracy for a classification loss).

A partition is an .npz file in ``oplower train --data``'s format (one array per data input, named after it,
with a leading batch-index axis, or one batch of the input's own rank). A client refuses, with one line, a
partition missing a data input or holding another array, an array whose dtype does not cast to the input's
element type without changing its kind (floats for integer class labels), whose shape does not fit the input's
declared dims, whose arrays hold different numbers of batches, or whose class labels lie outside [0, C).

The lowered models are cached per process (a Simulation Engine actor or a SuperNode's ClientApp process
trains many rounds); each round builds a fresh :class:`~lowering.training.trainer.Trainer` (fresh optimizer
state).
"""

from __future__ import annotations

import io
import time
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lowering.modelio import write_atomic
from lowering.training.checkpoint import Checkpoint, write_checkpoint
from lowering.training.trainer import (
    Trainer,
    TrainingDataError,
    TrainingModels,
    batches,
    lower_artifacts,
    starting_point,
)
from lowering.training.workflow import check_outputs, evaluate, export_inference
from runtime.session import np_dtype

GLOBAL_SOURCE = "the global model"

_MODELS: dict[tuple[str, str], TrainingModels] = {}


class PartitionError(TrainingDataError):
    """A partition file that cannot be read or does not fit the artifacts."""


@dataclass(frozen=True)
class LocalTraining:
    """One client's round: the state after training, the examples it trained on, its mean loss."""

    state: dict[str, np.ndarray]
    examples: int
    loss: float
    steps: int
    seconds: float


@dataclass(frozen=True)
class LocalEvaluation:
    loss: float
    accuracy: float | None
    examples: int
    seconds: float


def training_models(directory: Path | str, target: str = "onnxruntime") -> TrainingModels:
    """``lower_artifacts(directory, target=target)``, lowered once per process."""
    key = (str(Path(directory).resolve()), target)
    if key not in _MODELS:
        _MODELS[key] = lower_artifacts(directory, target=target)
    return _MODELS[key]


def state_order(models: TrainingModels, names: Iterable[str]) -> list[str]:
    """``names`` in the artifacts' order: the trainable parameters as the training model takes them, then the
    frozen values in its input order (anything else last, as given)."""
    names = list(names)
    order = [*models.params, *models.other_inputs]
    known = [n for n in order if n in names]
    return known + [n for n in names if n not in known]


def read_partition(path: Path | str) -> dict[str, np.ndarray]:
    """Every array of an .npz file (no pickles); a file that is not one is a one-line PartitionError."""
    path = Path(path)
    if not path.is_file():
        raise PartitionError(f"{path}: no such file" if not path.exists() else f"{path}: not a file")
    try:
        with np.load(path, allow_pickle=False) as data:
            if not isinstance(data, np.lib.npyio.NpzFile):
                raise PartitionError(f"{path}: a single array, expected an .npz file (np.savez) keyed by input name")
            arrays = {name: data[name] for name in data.files}
    except PartitionError:
        raise
    except AttributeError:  # np.load of a plain .npy gives an ndarray, which has no context manager
        raise PartitionError(f"{path}: a single array, expected an .npz file (np.savez) keyed by input name") from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise PartitionError(f"{path}: not a readable .npz file ({reason})") from None
    return arrays


def check_partition(arrays: Mapping[str, np.ndarray], models: TrainingModels, frozen: Iterable[str],
                    source: str) -> tuple[int, int]:
    """Check a partition against the training model's data inputs (see the module docstring); returns (B,
    examples): its batch count and its number of samples."""
    frozen = set(frozen)
    data_inputs = [n for n in models.other_inputs if n not in frozen]
    missing = [n for n in data_inputs if n not in arrays]
    if missing:
        raise PartitionError(f"{source}: no array for the data input {missing[0]!r} (a partition holds one array "
                             f"per data input: {', '.join(data_inputs)})")
    extra = [k for k in arrays if k not in data_inputs]
    if extra:
        raise PartitionError(f"{source}: {extra[0]!r} is no data input of the training model (they are: "
                             f"{', '.join(data_inputs)})")
    types = {i.name: i.type.tensor_type for i in models.training.graph.input}
    counts, examples = {}, None
    for name in data_inputs:
        value = np.asarray(arrays[name])
        declared = np_dtype(types[name].elem_type)
        if not np.can_cast(value.dtype, declared, casting="same_kind"):
            raise PartitionError(f"{source}: {name!r} is {value.dtype}; the training model takes {declared} (an "
                                 f"array of another kind is refused rather than converted)")
        dims = [d.dim_value if d.HasField("dim_value") else None for d in types[name].shape.dim]
        batched = value.ndim == len(dims) + 1
        per_batch = list(value.shape[1:] if batched else value.shape)
        if value.ndim not in (len(dims), len(dims) + 1) or any(
                d is not None and d != s for d, s in zip(dims, per_batch, strict=False)):
            shown = ", ".join("?" if d is None else str(d) for d in dims)
            raise PartitionError(f"{source}: {name!r} has shape {list(value.shape)}; the training model takes "
                                 f"[{shown}] per batch (with a leading batch-index axis: [B, {shown}])")
        counts[name] = value.shape[0] if batched else 1
        if examples is None:
            examples = counts[name] * (per_batch[0] if per_batch else 1)
    if len(set(counts.values())) > 1:
        raise PartitionError(f"{source}: the arrays hold different numbers of batches ("
                             + ", ".join(f"{k} {v}" for k, v in counts.items()) + ")")
    batch_count = next(iter(counts.values()), 1)
    if batch_count == 0 or not examples:
        raise PartitionError(f"{source}: holds no samples")
    return batch_count, examples


def train_local(directory: Path | str, state: Mapping[str, np.ndarray], partition: Path | str, *, epochs: int,
                learning_rate: float, threads: int | None = None, target: str = "onnxruntime") -> LocalTraining:
    """Train ``epochs`` passes over the partition's batches from ``state`` with fresh optimizer state (see the
    module docstring); errors are the project's one-line OplowerErrors."""
    began = time.perf_counter()
    models = training_models(directory, target)
    start = starting_point(directory, models, params=dict(state), params_source=GLOBAL_SOURCE)
    arrays = read_partition(partition)
    count, examples = check_partition(arrays, models, start.frozen, str(partition))
    feed = batches(arrays, models, start.frozen, str(partition))
    trainer = Trainer(models, start, learning_rate=learning_rate, threads=threads)
    losses = [trainer.step(feed(k)) for k in range(epochs * count)]
    after = {**trainer.params, **trainer.frozen}
    ordered = {n: np.ascontiguousarray(after[n]) for n in state_order(models, after)}
    return LocalTraining(ordered, examples, float(np.mean(losses)), len(losses), time.perf_counter() - began)


def evaluate_local(directory: Path | str, state: Mapping[str, np.ndarray], partition: Path | str, *,
                   threads: int | None = None, target: str = "onnxruntime") -> LocalEvaluation:
    """The eval model on the partition with ``state``: mean loss over its batches, accuracy for a
    classification loss, and the partition's number of samples."""
    began = time.perf_counter()
    models = training_models(directory, target)
    arrays = read_partition(partition)
    frozen = [n for n in models.other_inputs if n in state]
    _, examples = check_partition(arrays, models, frozen, str(partition))
    result = evaluate(directory, arrays, state, source=str(partition), values_source=GLOBAL_SOURCE, threads=threads)
    return LocalEvaluation(result.loss, result.accuracy, examples, time.perf_counter() - began)


# -- the server's side: where the global model starts, what is written at the end ------------------------------


def global_start(directory: Path | str, *, params: Mapping[str, np.ndarray] | None = None, params_source: str = "",
                 checkpoint: Path | str | None = None, target: str = "onnxruntime") -> dict[str, np.ndarray]:
    """The global model before round 1, as ``oplower train`` starts: ``params`` (by name), else the checkpoint
    file, else ``DIR/checkpoint``, else the forward model's initializers; every state tensor in the artifacts'
    order (trainable parameters, then frozen values)."""
    models = training_models(directory, target)
    start = starting_point(directory, models, params=params, params_source=params_source, checkpoint=checkpoint)
    state = {**start.params, **start.frozen}
    return {n: np.ascontiguousarray(state[n]) for n in state_order(models, state)}


def check_outputs_writable(paths: Iterable[Path | str | None]) -> None:
    """Refuse, before any round runs, an output whose directory does not exist or that names a directory."""
    for path in paths:
        if not path:
            continue
        path = Path(path)
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise PartitionError(f"{path}: directory {parent} does not exist")
        if path.is_dir():
            raise PartitionError(f"{path}: is a directory, expected a file name to write")


def write_global(directory: Path | str, state: Mapping[str, np.ndarray], *, save: Path | str | None = None,
                 save_checkpoint: Path | str | None = None, export: Path | str | None = None,
                 export_outputs: list[str] | None = None, target: str = "onnxruntime") -> list[str]:
    """Write the global model as ``oplower train`` writes its result: ``save`` (.npz by name, what ``--params``
    reads), ``save_checkpoint`` (an onnxruntime-training checkpoint without optimizer state: training goes on
    from it with fresh moments, as each round starts), ``export`` (the inference model). Returns the paths
    written."""
    written = []
    if save:
        write_atomic(Path(save), npz_bytes(state))
        written.append(str(save))
    if save_checkpoint:
        models = training_models(directory, target)
        params = {n: np.asarray(state[n]) for n in models.params}
        frozen = {n: np.asarray(v) for n, v in state.items() if n not in params}
        write_checkpoint(save_checkpoint, Checkpoint(params=params, frozen=frozen))
        written.append(str(save_checkpoint))
    if export:
        export_inference(directory, dict(state), export, outputs=export_outputs)
        written.append(str(export))
    return written


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def export_outputs_of(directory: Path | str) -> list[str]:
    """The outputs an export will have, checked before any round runs."""
    return check_outputs(directory, None)
