"""Train on plain onnxruntime from an onnxruntime-training artifact directory.

``generate_artifacts`` writes ``training_model.onnx`` (data inputs, labels, the trainable parameters as
inputs, one ``<p>_grad.accumulation.buffer`` input per parameter and ``lazy_reset_grad``; outputs the loss
and the accumulators' flags) and ``optimizer_model.onnx`` (``learning_rate``, ``step`` and the tensor
sequences ``params``, ``gradients``, ``first_order_moments``, ``second_order_moments``). :class:`Trainer`
lowers both once; their in-place updates come back as ``<input>.updated`` outputs (DESIGN.md section 9),
which it carries to the next step: the accumulation buffers into the optimizer's ``gradients``, the
optimizer's ``params.updated`` and moments into the next step. One optimizer step per training step, so
``lazy_reset_grad`` is always true (each step's gradient replaces the buffer). The first optimizer step
passes ``step = [1]``, as onnxruntime-training does.

Data (``--data IN.npz``): one array per data input of the training model (every input that is not a
parameter, an accumulation buffer or ``lazy_reset_grad``), named after it, with a leading batch-index
axis; step ``k`` (from 0) feeds index ``k mod B`` of each array. Initial parameters: an ``.npz`` keyed by
parameter name, else the initializers of the other ``.onnx`` models in the directory (the forward model
the artifacts were generated from), else the training model's own initializers. Inputs without an
accumulation buffer that the parameter source holds (batch norm's running statistics: generate_artifacts'
frozen parameters) start from that value; where a training op updates one in place (BatchNormInternal's
running statistics, returned as ``<input>.updated``) the update is carried to the next step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from lowering.modelio import load_model
from lowering.passes import lower_runnable
from lowering.static_shapes import fold_static_shapes
from lowering.training.checkpoint import Checkpoint, CheckpointError, read_checkpoint, write_checkpoint
from lowering.training.labels import LabelInput, check_labels, label_inputs
from lowering.training.step_size import step_is_small, with_input_shapes
from lowering.training.train_step import (
    FIRST_MOMENT,
    SECOND_MOMENT,
    BoundStep,
    TrainStep,
    bound_model,
    merge_staged_sums,
    train_step,
)
from opdef.errors import ModelError, OplowerError, RuntimeFailure
from runtime.session import np_dtype, ort_message

TRAINING_MODEL, OPTIMIZER_MODEL = "training_model.onnx", "optimizer_model.onnx"
BUFFER_SUFFIX = "_grad.accumulation.buffer"
LAZY_RESET = "lazy_reset_grad"
OPTIMIZER_SEQUENCES = ("params", "gradients", "first_order_moments", "second_order_moments")
MOMENTS = OPTIMIZER_SEQUENCES[2:]
CHECKPOINT = "checkpoint"


class TrainingDataError(OplowerError):
    """Training data or initial parameters that do not fit the artifacts."""


@dataclass(frozen=True)
class TrainingModels:
    """The two lowered models and the training model's interface."""

    training: onnx.ModelProto
    optimizer: onnx.ModelProto
    loss: str  # the training model's first output
    params: tuple[str, ...]  # trainable parameters, in the training model's input order
    # every other input: data, labels, and frozen parameters (e.g. batch norm's running statistics), which
    # take their value from the parameter source and keep it
    other_inputs: tuple[str, ...]
    # the same step as one tensor-only model (lowering.training.train_step), which Trainer runs when it is there
    step: TrainStep | None = None
    # the class-label inputs and their class counts (lowering.training.labels): labels are checked before they are fed
    labels: tuple[LabelInput, ...] = ()


def moment_count(models: TrainingModels) -> int:
    """How many moment sequences the optimizer model takes (SGDOptimizerV2 1, AdamWOptimizer 2)."""
    names = {i.name for i in models.optimizer.graph.input}
    return sum(1 for m in MOMENTS if m in names)


def lower_artifacts(directory: Path | str, *, target: str = "onnxruntime", flat_state: bool = True) -> TrainingModels:
    """Load and lower ``training_model.onnx`` and ``optimizer_model.onnx`` for ``target`` (see
    lowering.rules.TARGETS); refuse what would not run. The train-step model (``step``) holds the parameters and
    moments of each element type as one flat state unless ``flat_state`` is false (one input and output per
    parameter: :mod:`lowering.training.train_step`)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelError(f"{directory}: not an artifact directory (expected {TRAINING_MODEL} and {OPTIMIZER_MODEL})")
    lowered = {}
    labels: tuple[LabelInput, ...] = ()
    for name in (TRAINING_MODEL, OPTIMIZER_MODEL):
        path = directory / name
        model = load_model(path)  # its errors name the file already
        if name == TRAINING_MODEL:
            labels = label_inputs(model)
        lowered[name] = lower_runnable(model, str(path), target=target)
    training, optimizer = lowered[TRAINING_MODEL], lowered[OPTIMIZER_MODEL]
    inputs = [i.name for i in training.graph.input]
    initialized = {t.name for t in training.graph.initializer}
    params = tuple(n[:-len(BUFFER_SUFFIX)] for n in inputs if n.endswith(BUFFER_SUFFIX))
    missing = [p for p in params if p not in inputs]
    if missing:
        raise ModelError(f"{directory / TRAINING_MODEL}: accumulation buffer for {missing[0]!r}, which is no input")
    for p in params:
        if f"{p}{BUFFER_SUFFIX}.updated" not in {o.name for o in training.graph.output}:
            raise ModelError(f"{directory / TRAINING_MODEL}: no InPlaceAccumulatorV2 updates {p}{BUFFER_SUFFIX}")
    taken = {*params, *(p + BUFFER_SUFFIX for p in params), LAZY_RESET}
    data = tuple(n for n in inputs if n not in taken and n not in initialized)
    opt_inputs = {i.name for i in optimizer.graph.input}
    absent = [n for n in ("learning_rate", *OPTIMIZER_SEQUENCES[:2]) if n not in opt_inputs]
    if absent:
        raise ModelError(f"{directory / OPTIMIZER_MODEL}: no input {absent[0]!r} (expected an optimizer model "
                         "from generate_artifacts)")
    if not training.graph.output:
        raise ModelError(f"{directory / TRAINING_MODEL}: no outputs (expected the loss first)")
    step = train_step(directory, target=target, flat_state=flat_state)
    return TrainingModels(training, optimizer, training.graph.output[0].name, params, data, step, labels)


@dataclass(frozen=True)
class StartingPoint:
    """Where training starts: the trainable parameters and the frozen ones (constant inputs); from a
    checkpoint with optimizer state also the moments (``moments[i]`` = the optimizer model's i-th moment
    sequence, one array per trainable parameter in ``params`` order), the optimizer steps taken and the
    learning rate the checkpoint records."""

    params: dict[str, np.ndarray]
    frozen: dict[str, np.ndarray]
    moments: tuple[list[np.ndarray], ...] = ()
    step: int = 0
    learning_rate: float | None = None


def initial_parameters(directory: Path | str, models: TrainingModels,
                       given: Mapping[str, np.ndarray] | None = None, source: str = "") -> StartingPoint:
    """Each parameter's starting value (see the module docstring for where it comes from): every trainable
    one, and the frozen ones the source also holds (inputs of the training model that are no data)."""
    directory = Path(directory)
    inputs = {i.name: i.type.tensor_type for i in models.training.graph.input}
    wanted = (*models.params, *models.other_inputs)
    found: dict[str, np.ndarray] = {}
    if given is not None:
        extra = [k for k in given if k not in wanted]
        if extra:
            raise TrainingDataError(f"{source}: {extra[0]!r} is no parameter of the training model (its trainable "
                                    f"parameters: {', '.join(models.params)})")
        found.update(given)
    else:
        others = sorted(p for p in directory.glob("*.onnx")
                        if p.name not in (TRAINING_MODEL, OPTIMIZER_MODEL, "eval_model.onnx"))
        for model in (*(load_model(p) for p in others), models.training):
            for init in model.graph.initializer:
                if init.name in wanted:
                    found.setdefault(init.name, numpy_helper.to_array(init))
    missing = [p for p in models.params if p not in found]
    if missing:
        where = source or f"{directory} (no forward model with these initializers; pass --params P.npz)"
        raise TrainingDataError(f"{where}: no initial value for parameter {missing[0]!r}"
                                + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    out = {}
    for p, value in found.items():
        value = np.asarray(value)
        declared = [d.dim_value if d.HasField("dim_value") else None for d in inputs[p].shape.dim]
        if len(declared) != value.ndim or any(d is not None and d != s for d, s in zip(declared, value.shape,
                                                                                      strict=False)):
            raise TrainingDataError(f"{source or directory}: parameter {p!r} has shape {list(value.shape)}; the "
                                    f"training model declares {declared}")
        out[p] = value.astype(np_dtype(inputs[p].elem_type))
    return StartingPoint({p: out[p] for p in models.params},
                         {p: out[p] for p in models.other_inputs if p in out})


class Trainer:
    """N steps of training on plain onnxruntime, parameters, buffers and moments carried between steps.

    With the train-step model (``models.step``, what :func:`lower_artifacts` builds) one bound session run
    per step (:class:`lowering.training.train_step.BoundStep`): the state stays in onnxruntime's buffers, and
    ``params``, ``frozen`` and the moments are read out (as copies) only when asked for; assign them to
    change the state. Without it, the training and optimizer models run in turn with NumPy feeds (their
    ``buffers`` then hold each step's gradients).

    ``threads`` (intra-op) and ``memory_pattern`` left None: a small step (:mod:`lowering.training.step_size`)
    gets one thread and onnxruntime's memory pattern, a larger one onnxruntime's default threads and no pattern.
    ``small_step`` is None while unknown: a symbolic dim (the batch) is decided by the first step's batch.
    """

    def __init__(self, models: TrainingModels, start: StartingPoint, *, learning_rate: float = 1e-3,
                 threads: int | None = None, spinning: bool = True, memory_pattern: bool | None = None) -> None:
        self.models = models
        params = {p: np.asarray(start.params[p]) for p in models.params}
        self.buffers = {p: np.zeros_like(v) for p, v in params.items()}
        # the moments a checkpoint held (first, then second), zeros for the rest
        given = [list(m) for m in start.moments]
        given += [[np.zeros_like(v) for v in params.values()] for _ in range(len(MOMENTS) - len(given))]
        self.learning_rate = np.array([learning_rate], np.float32)
        self.step_count = start.step  # optimizer steps taken: the next one passes step_count + 1
        # a small step (lowering.training.step_size): one intra-op thread, unless the caller chose, and the memory
        # pattern; 0.53-0.86x of the 2-thread step on the committed tiny artifacts. A symbolic dim (the batch)
        # leaves it unknown until a step shows the batch's shapes (_follow_batch_shapes)
        step_model = models.step.model if models.step is not None else models.training
        self.small_step: bool | None = step_is_small(step_model)
        self._follow_shapes = self.small_step is None and models.step is not None  # each batch's shapes decide
        self._chosen = (threads, memory_pattern)  # the caller's, which a step's shapes do not override
        if threads is None and self.small_step:
            threads = 1
        self.threads = threads  # None: onnxruntime's default (one per physical core)
        self._spinning = spinning
        options = self._options(threads, spinning, bool(self.small_step) if memory_pattern is None else memory_pattern)
        # One bound session run per step when the train-step model is there (measured on the cnn artifact,
        # 2 threads: 0.63 ms against 0.74 ms for unbound runs of the same model and ~0.9-1.0 ms for the two
        # models; mlp_bce 0.071 / 0.124 / 0.22 ms); the two-model step otherwise.
        self._bound: BoundStep | None = None
        moments = {p + m: np.asarray(given[i][j]) for j, p in enumerate(params)
                   for i, m in enumerate((FIRST_MOMENT, SECOND_MOMENT))}
        if models.step is not None:
            interface = models.step.interface
            # the bound form (train_step.bound_model): parameters bound as views of the flat state, AdamW's step
            # scalars computed here, batch norm's scratch inputs, and with one thread its staged sums merged
            self._merged = threads == 1
            self._bound_model = bound_model(models.step, single_thread=self._merged)
            session = self._session(self._bound_model.model, options, "train-step model")
            state = {**params, **moments, **{n: start.frozen[n] for n in interface.updated_frozen}}
            constants = {n: v for n, v in start.frozen.items() if n not in interface.updated_frozen}
            self._bound = BoundStep(session, interface, state, constants, self.learning_rate, self._bound_model)
            # a symbolic dim: the sessions by the batches' shapes (_follow_batch_shapes)
            self._generic, self._signature = session, None
            self._shaped: dict[tuple, tuple[ort.InferenceSession, bool]] = {}
            # shapes past the first few share one (_follow_batch_shapes)
            self._varying: tuple[ort.InferenceSession, bool] | None = None
            self._sgd_moments = moments  # SGD has none; kept so the moments read the same either way
            return
        self._params, self._frozen = params, dict(start.frozen)
        self._first = [moments[p + FIRST_MOMENT] for p in params]
        self._second = [moments[p + SECOND_MOMENT] for p in params]
        self._training = self._session(models.training, options, TRAINING_MODEL)
        self._optimizer = self._session(models.optimizer, options, OPTIMIZER_MODEL)
        self._opt_inputs = {i.name for i in self._optimizer.get_inputs()}
        self._names = [o.name for o in self._training.get_outputs()]
        self._opt_names = [o.name for o in self._optimizer.get_outputs()]

    # -- the state: read from / written to onnxruntime's buffers with the train-step model ------------------

    @property
    def params(self) -> dict[str, np.ndarray]:
        return self._bound.read(self.models.params) if self._bound else self._params

    @params.setter
    def params(self, values: Mapping[str, np.ndarray]) -> None:
        if self._bound:
            self._bound.write(values)
        else:
            self._params = dict(values)

    @property
    def frozen(self) -> dict[str, np.ndarray]:
        """Frozen values (batch norm's running statistics, updated by the step where a training op does)."""
        if self._bound:
            interface = self.models.step.interface
            return self._bound.read(n for n in interface.frozen if n in self._bound_names())
        return self._frozen

    @frozen.setter
    def frozen(self, values: Mapping[str, np.ndarray]) -> None:
        if self._bound:
            self._bound.write(values)
        else:
            self._frozen = dict(values)

    @property
    def first_moments(self) -> list[np.ndarray]:
        return self._moments(FIRST_MOMENT) if self._bound else self._first

    @first_moments.setter
    def first_moments(self, values) -> None:
        self._set_moments(FIRST_MOMENT, values)

    @property
    def second_moments(self) -> list[np.ndarray]:
        return self._moments(SECOND_MOMENT) if self._bound else self._second

    @second_moments.setter
    def second_moments(self, values) -> None:
        self._set_moments(SECOND_MOMENT, values)

    def _bound_names(self) -> set[str]:
        interface = self._bound.interface
        return {*interface.state_inputs, *interface.views(), *self._bound._constants}

    def _moments(self, suffix: str) -> list[np.ndarray]:
        names = [p + suffix for p in self.models.params]
        if self.models.step.interface.moments:
            return list(self._bound.read(names).values())
        return [self._sgd_moments[n] for n in names]

    def _set_moments(self, suffix: str, values) -> None:
        values = list(values)
        if not self._bound:
            if suffix == FIRST_MOMENT:
                self._first = values
            else:
                self._second = values
            return
        named = {p + suffix: v for p, v in zip(self.models.params, values, strict=True)}
        if self.models.step.interface.moments:
            self._bound.write(named)
        else:
            self._sgd_moments.update(named)

    @staticmethod
    def _options(threads: int | None, spinning: bool, memory_pattern: bool) -> ort.SessionOptions:
        options = ort.SessionOptions()
        options.log_severity_level = 3  # onnxruntime's warnings (unused initializers ...) are not the user's
        if threads:
            options.intra_op_num_threads = threads
        if not spinning:  # idle workers that spin take the cores from other work between steps
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # onnxruntime's memory pattern (one block planned from the first run) left the ResNet-CIFAR step at
        # 1.6x onnxruntime-training's peak growth (102 against 64 MB at batch 32); without it 62 MB, and no
        # measurable change in step time (tools/step_memory.py, paired runs of tools/ab_train_step.py). A small
        # step keeps it: a few kB, and one allocation fewer per kernel (cnn 0.40 -> 0.37 ms, bert 0.22 -> 0.19)
        options.enable_mem_pattern = memory_pattern
        return options

    def _follow_batch_shapes(self, batch: Mapping[str, np.ndarray]) -> None:
        """A step with a symbolic dim (the batch), decided by the shapes of the batch at hand: a small step runs a
        session of its own for those shapes, with one thread and the memory pattern (unless the caller chose
        either), whose model has the shapes fixed and its shape arithmetic folded
        (:func:`lowering.static_shapes.fold_static_shapes`: held-out vit_dyn 599 -> 385 kernels, every Shape chain
        and its GatherGrads' index checks on constant indices); a large one the session built first. The first
        SHAPED_SESSIONS shapes keep their sessions (a last, smaller batch of an epoch and back cost no rebuild);
        shapes past those (a sequence length that varies batch by batch) share one session of the model as it is,
        with the first shape's choice of threads, so no step waits for a new session (hundreds of ms) again; the
        state stays where it is throughout (:meth:`BoundStep.replace_session`)."""
        data = [n for n in self.models.step.interface.data if n in batch]
        signature = tuple(np.shape(batch[n]) for n in data)  # the interface's order: no sorting, no dict a step
        if signature == self._signature:
            return
        self._signature = signature
        known = self._shaped.get(signature)
        if known is None and len(self._shaped) >= self.SHAPED_SESSIONS:
            if self._varying is None:
                small = next(iter(self._shaped.values()))[1]
                model = with_input_shapes(self._bound_model.model, {})  # a copy
                self._varying = (self._small_session(model) if small else self._generic, small)
            known = self._varying
        if known is None:
            # fixed and folded once: the count reads the folded model (the bound model's Conv/MatMul/Gemm are the
            # step model's), and a small step's session runs it
            model = with_input_shapes(self._bound_model.model, dict(zip(data, signature, strict=True)))
            fold_static_shapes(model)
            small = step_is_small(model) is True
            known = self._shaped[signature] = (self._small_session(model) if small else self._generic, small)
        session, self.small_step = known
        self.threads = self._chosen[0] or (1 if self.small_step else None)
        if session is not self._bound.session:
            self._bound.replace_session(session)

    SHAPED_SESSIONS = 4  # batch shapes with a session of their own (see _follow_batch_shapes)

    def _small_session(self, model: onnx.ModelProto) -> ort.InferenceSession:
        """A small step's session of ``model`` (a copy of the bound model, which this may change): one thread and
        the memory pattern unless the caller chose, batch norm's staged sums merged for one thread."""
        threads, pattern = self._chosen
        if (threads or 1) == 1 and not self._merged:  # one thread here, not in the model built first
            merge_staged_sums(model.graph)
        options = self._options(threads or 1, self._spinning, True if pattern is None else pattern)
        return self._session(model, options, "train-step model")

    @staticmethod
    def _session(model: onnx.ModelProto, options: ort.SessionOptions, what: str) -> ort.InferenceSession:
        try:
            return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 -- onnxruntime raises several unrelated types
            raise RuntimeFailure(f"{what} (lowered): onnxruntime refuses it: {ort_message(exc)}") from None

    def step(self, batch: Mapping[str, np.ndarray]) -> float:
        """One training step and one optimizer step; returns the loss. Class labels outside [0, C) (not
        ignore_index) raise LabelValueError before anything runs."""
        if self.models.labels:
            check_labels(batch, self.models.labels, f"step {self.step_count + 1}")
        if self._bound is not None:
            if self._follow_shapes:
                self._follow_batch_shapes(batch)
            self.step_count += 1
            self._bound.set_learning_rate(float(self.learning_rate.reshape(-1)[0]))
            try:
                return self._bound.run(batch, self.step_count)
            except Exception as exc:  # noqa: BLE001
                raise RuntimeFailure(f"train-step model: step {self.step_count}: {ort_message(exc)}") from None
        feeds = dict(batch)
        feeds.update(self._frozen)
        feeds.update(self._params)
        feeds.update({p + BUFFER_SUFFIX: b for p, b in self.buffers.items()})
        feeds[LAZY_RESET] = np.array([True])
        try:
            results = dict(zip(self._names, self._training.run(None, feeds), strict=True))
        except Exception as exc:  # noqa: BLE001
            raise RuntimeFailure(f"{TRAINING_MODEL}: step {self.step_count + 1}: {ort_message(exc)}") from None
        self.buffers = {p: results[f"{p}{BUFFER_SUFFIX}.updated"] for p in self._params}
        # frozen inputs a training op updates in place (batch norm's running statistics) carry on, as
        # onnxruntime-training's training API updates them
        self._frozen.update({p: results[f"{p}.updated"] for p in self._frozen if f"{p}.updated" in results})
        self.step_count += 1
        opt_feeds = {"learning_rate": self.learning_rate, "step": np.array([self.step_count], np.int64),
                     "params": list(self._params.values()), "gradients": list(self.buffers.values()),
                     "first_order_moments": self._first, "second_order_moments": self._second}
        opt_feeds = {k: v for k, v in opt_feeds.items() if k in self._opt_inputs}
        try:
            updated = dict(zip(self._opt_names, self._optimizer.run(None, opt_feeds), strict=True))
        except Exception as exc:  # noqa: BLE001
            raise RuntimeFailure(f"{OPTIMIZER_MODEL}: step {self.step_count}: {ort_message(exc)}") from None
        self._params = {p: np.asarray(v) for p, v in zip(self._params, updated["params.updated"], strict=True)}
        if "first_order_moments.updated" in updated:
            self._first = [np.asarray(v) for v in updated["first_order_moments.updated"]]
            self._second = [np.asarray(v) for v in updated["second_order_moments.updated"]]
        return float(np.asarray(results[self.models.loss]).reshape(-1)[0])

    def checkpoint(self) -> Checkpoint:
        """The state to go on from: parameters, frozen values (running statistics as updated), the moments
        the optimizer model takes (``momentum0`` = first_order_moments, ``momentum1`` = second) and the step."""
        moments = (self.first_moments, self.second_moments)[:moment_count(self.models)]
        return Checkpoint(params=dict(self.params), frozen=dict(self.frozen),
                          moments={p: [m[i] for m in moments] for i, p in enumerate(self.params)},
                          step=self.step_count, learning_rate=float(self.learning_rate[0]))


def checkpoint_start(path: Path | str, models: TrainingModels, checkpoint: Checkpoint | None = None) -> StartingPoint:
    """The starting point a checkpoint file holds, checked against the artifacts: the same trainable
    parameters, frozen ones the training model takes, every shape and element type as declared, as many
    moments per parameter as the optimizer model takes. The first mismatch raises CheckpointError."""
    ckpt = checkpoint if checkpoint is not None else read_checkpoint(path)
    inputs = {i.name: i.type.tensor_type for i in models.training.graph.input}
    training = "the training model"
    missing = [p for p in models.params if p not in ckpt.params]
    if missing:
        where = "is frozen there" if missing[0] in ckpt.frozen else "is not in it"
        raise CheckpointError(f"{path}: the trainable parameter {missing[0]!r} of {training} {where} (the "
                              f"checkpoint's trainable parameters: {', '.join(sorted(ckpt.params)) or 'none'})")
    extra = [p for p in ckpt.params if p not in models.params]
    if extra:
        raise CheckpointError(f"{path}: trainable parameter {extra[0]!r} is no trainable parameter of {training} "
                              f"({', '.join(models.params)})")
    stray = [p for p in ckpt.frozen if p not in models.other_inputs]
    if stray:
        raise CheckpointError(f"{path}: frozen parameter {stray[0]!r} is no input of {training}")
    for group in (ckpt.params, ckpt.frozen):
        for name, value in group.items():
            declared = [d.dim_value if d.HasField("dim_value") else None for d in inputs[name].shape.dim]
            dtype = np_dtype(inputs[name].elem_type)
            if value.dtype != dtype or len(declared) != value.ndim or any(
                    d is not None and d != s for d, s in zip(declared, value.shape, strict=False)):
                raise CheckpointError(f"{path}: parameter {name!r} is {value.dtype}{list(value.shape)}; {training} "
                                      f"declares {np.dtype(dtype)}{declared}")
    moments: tuple[list[np.ndarray], ...] = ()
    if ckpt.has_optimizer_state:
        wanted = moment_count(models)
        held = len(next(iter(ckpt.moments.values())))
        if held != wanted:
            raise CheckpointError(f"{path}: {held} optimizer moment(s) per parameter; the optimizer model takes "
                                  f"{wanted} ({', '.join(MOMENTS[:wanted]) or 'none'})")
        moments = tuple([ckpt.moments[p][i] for p in models.params] for i in range(wanted))
    return StartingPoint({p: ckpt.params[p] for p in models.params}, dict(ckpt.frozen), moments,
                         ckpt.step if ckpt.has_optimizer_state else 0, ckpt.learning_rate)


def starting_point(directory: Path | str, models: TrainingModels, *,
                   params: Mapping[str, np.ndarray] | None = None, params_source: str = "",
                   checkpoint: Path | str | None = None) -> StartingPoint:
    """Where training starts: ``params`` (by name) if given, else the checkpoint file ``checkpoint``, else
    ``<directory>/checkpoint`` when there is one, else the initializers of the forward model in the
    directory (:func:`initial_parameters`)."""
    if params is not None:
        return initial_parameters(directory, models, params, params_source)
    if checkpoint is None and (Path(directory) / CHECKPOINT).is_file():
        checkpoint = Path(directory) / CHECKPOINT
    if checkpoint is not None:
        return checkpoint_start(checkpoint, models)
    return initial_parameters(directory, models)


def batches(data: Mapping[str, np.ndarray], models: TrainingModels, frozen: Mapping[str, np.ndarray] = {},  # noqa: B006
            source: str = "") -> Callable[[int], dict]:
    """Step ``k`` -> the feeds of the training model's data inputs: index ``k mod B`` of an array with a
    leading batch-index axis (B batches, cycled), or the array itself, every step, when it has the input's
    own rank (one batch). The data inputs are the inputs that are no parameter, buffer, ``lazy_reset_grad``
    or ``frozen`` value."""
    data_inputs = [n for n in models.other_inputs if n not in frozen]
    extra = [k for k in data if k not in data_inputs]
    if extra:
        raise TrainingDataError(f"{source}: {extra[0]!r} is no data input of the training model (they are: "
                                f"{', '.join(data_inputs)})")
    missing = [k for k in data_inputs if k not in data]
    if missing:
        raise TrainingDataError(f"{source}: no array for the data input {missing[0]!r} (one array per data input, "
                                "with a leading batch-index axis)")
    types = {i.name: i.type.tensor_type for i in models.training.graph.input}
    arrays = {}
    for name in data_inputs:
        value = np.asarray(data[name])
        rank = len(types[name].shape.dim)
        if value.ndim == rank:
            value = value[None]  # one batch, fed at every step
        if value.ndim != rank + 1 or value.shape[0] == 0:
            raise TrainingDataError(f"{source}: {name!r} has shape {list(value.shape)}; expected the input's rank "
                                    f"{rank} (one batch) or a leading batch-index axis over it")
        arrays[name] = value.astype(np_dtype(types[name].elem_type), copy=False)
    check_labels(arrays, models.labels, source, batch_axis=True)
    return lambda k: {name: value[k % value.shape[0]] for name, value in arrays.items()}


def train(directory: Path | str, data: Mapping[str, np.ndarray], steps: int, *,
          params: Mapping[str, np.ndarray] | None = None, learning_rate: float | None = None,
          checkpoint: Path | str | None = None, save_checkpoint: Path | str | None = None,
          on_step: Callable[[int, float], None] | None = None) -> tuple[list[float], dict[str, np.ndarray]]:
    """Lower the artifacts once, train ``steps`` steps from :func:`starting_point`; returns the loss per
    step and the final parameters. ``learning_rate`` defaults to the checkpoint's, else 1e-3; step ``k``
    (numbered on from the checkpoint's: the first step after k steps is step k + 1, from 0 here) feeds batch
    ``k``; ``save_checkpoint`` writes the state after the last step."""
    models = lower_artifacts(directory)
    start = starting_point(directory, models, params=params, checkpoint=checkpoint)
    trainer = Trainer(models, start, learning_rate=learning_rate or start.learning_rate or 1e-3)
    feed = batches(data, models, start.frozen)
    losses = []
    for k in range(start.step, start.step + steps):
        losses.append(trainer.step(feed(k)))
        if on_step is not None:
            on_step(k + 1, losses[-1])
    if save_checkpoint is not None:
        write_checkpoint(save_checkpoint, trainer.checkpoint())
    return losses, trainer.params
