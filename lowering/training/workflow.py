"""The rest of onnxruntime-training's on-device workflow on plain onnxruntime: evaluation and the inference model.

An artifact directory holds ``eval_model.onnx`` besides the training and optimizer models: the forward
model in inference mode followed by the loss block, every parameter (trainable and frozen) a graph input.

- :func:`evaluate` runs it (lowered where it holds custom ops) on given parameter values over batches of
  data and returns the mean loss, and the accuracy for a classification loss (SoftmaxCrossEntropyLoss:
  the argmax of its scores against its labels, ``ignore_index`` left out; BCEWithLogitsLoss, a loss-block
  Sigmoid of a forward output: each logit's sign against its 0/1 target).
- :func:`export_inference` writes what onnxruntime-training's ``Module.export_model_for_inferencing``
  gives: the forward part of the eval model with the parameter values (running statistics included) as
  initializers, the labels input, the loss block and every training-only output gone; standard ONNX.

``generate_artifacts`` turns a training-mode BatchNormalization's ``training_mode`` off in the eval model but
keeps its three outputs; onnxruntime refuses an inference-mode BatchNormalization with more than one output
("Y" only in inference mode). :func:`repair_eval_model` drops the outputs nothing reads (the running mean and
variance, which no node of the eval model uses), which leaves the computed values unchanged.

The forward model's outputs are found by name: ``generate_artifacts``' loss block (onnxblock) names every node
it adds ``onnx::<Op>::<n>``; the forward outputs are the values made by other nodes that the loss block reads
(e.g. ``output`` for a torch export). ``outputs=`` names them instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from lowering.modelio import load_model, write_atomic
from lowering.passes import lower_model, lower_runnable
from lowering.training.checkpoint import CheckpointError, read_checkpoint
from lowering.training.labels import check_labels, label_inputs
from lowering.training.trainer import CHECKPOINT, TrainingDataError
from opdef.errors import LoweringError, ModelError, OplowerError, RuntimeFailure
from runtime.session import find_custom_nodes, np_dtype, ort_message

EVAL_MODEL = "eval_model.onnx"
LOSS_BLOCK_PREFIX = "onnx::"  # onnxblock's node names


def repair_eval_model(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """A copy in which every inference-mode BatchNormalization keeps only the outputs something reads
    (graph outputs or other nodes); returns it and the names of the nodes changed."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    read = {n for node in model.graph.node for n in node.input} | {o.name for o in model.graph.output}
    changed = []
    for node in model.graph.node:
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx") or len(node.output) < 2:
            continue
        training = next((a.i for a in node.attribute if a.name == "training_mode"), 0)
        if training or any(o in read for o in node.output[1:]):
            continue
        del node.output[1:]
        changed.append(node.name or node.output[0])
    return model, changed


@dataclass(frozen=True)
class EvalModel:
    """The lowered eval model and its interface."""

    model: onnx.ModelProto
    loss: str  # the first graph output
    params: tuple[str, ...]  # inputs the parameter values feed
    data: tuple[str, ...]  # every other input
    scores: str | None  # a classification loss's scores and labels (accuracy), if there is one
    labels: str | None
    ignore_index: int | None
    binary: bool = False  # BCEWithLogitsLoss: one 0/1 target per logit


def load_eval_model(directory: Path | str, parameter_names: Iterable[str], *,
                    target: str = "onnxruntime") -> EvalModel:
    """Load ``eval_model.onnx`` of ``directory``, repair and lower it; ``parameter_names`` are the inputs the
    parameter values feed (every other input is data)."""
    path = Path(directory) / EVAL_MODEL
    model, _ = repair_eval_model(load_model(path))
    model = lower_runnable(model, str(path), target=target)
    if not model.graph.output:
        raise ModelError(f"{path}: no outputs (expected the loss first)")
    initialized = {t.name for t in model.graph.initializer}
    names = set(parameter_names)
    inputs = [i.name for i in model.graph.input if i.name not in initialized]
    sce = next((n for n in model.graph.node if n.op_type == "SoftmaxCrossEntropyLoss"), None)
    scores = labels = ignore = None
    binary = False
    if sce is not None:
        scores, labels = sce.input[0], sce.input[1]
        ignore = next((a.i for a in sce.attribute if a.name == "ignore_index"), None)
    else:  # BCEWithLogitsLoss: the loss block's Sigmoid of a forward output, the one data input it also reads
        forward = forward_outputs(model)
        block = [n for n in model.graph.node if n.name.startswith(LOSS_BLOCK_PREFIX)]
        sigmoid = next((n for n in block if n.op_type == "Sigmoid" and n.input[0] in forward), None)
        targets = {i for n in block for i in n.input if i in inputs and i not in names}
        if sigmoid is not None and len(targets) == 1:
            scores, labels, binary = sigmoid.input[0], targets.pop(), True
    if scores is not None and scores not in {o.name for o in model.graph.output}:
        model.graph.output.append(helper.make_empty_tensor_value_info(scores))
    return EvalModel(model, model.graph.output[0].name, tuple(n for n in inputs if n in names),
                     tuple(n for n in inputs if n not in names), scores, labels, ignore, binary)


def parameter_values(directory: Path | str, *, params: Mapping[str, np.ndarray] | None = None,
                     checkpoint: Path | str | None = None) -> dict[str, np.ndarray]:
    """Trainable and frozen values by name: ``params`` if given, else the checkpoint file, else
    ``<directory>/checkpoint``."""
    if params is not None:
        return {k: np.asarray(v) for k, v in params.items()}
    path = Path(checkpoint) if checkpoint is not None else Path(directory) / CHECKPOINT
    if checkpoint is None and not path.is_file():
        raise CheckpointError(f"{path}: no such file (pass --checkpoint FILE or --params P.npz)")
    ckpt = read_checkpoint(path)
    return {**ckpt.params, **ckpt.frozen}


@dataclass(frozen=True)
class Evaluation:
    loss: float  # mean over the batches of the eval model's loss
    accuracy: float | None  # classification losses only
    batches: int


def evaluate(directory: Path | str, data: Mapping[str, np.ndarray], values: Mapping[str, np.ndarray], *,
             source: str = "", values_source: str = "", threads: int | None = None,
             on_batch: Callable[[int, int, float], None] | None = None) -> Evaluation:
    """Run the eval model on ``values`` (parameters by name) over the batches of ``data`` (one array per
    data input, with a leading batch-index axis, or one batch of the input's own rank); ``on_batch(done,
    total, loss)`` after each batch."""
    directory = Path(directory)
    ev = load_eval_model(directory, values)
    declared = {i.name: i.type.tensor_type for i in ev.model.graph.input}
    feeds = _checked_values(ev, declared, values, values_source or str(directory))
    arrays = _batched(ev, declared, data, source)
    # a class id outside the scores' classes: one line naming input, value and position, before onnxruntime
    # fails inside a Gather (or, where the loss skips it, reports a wrong loss and accuracy)
    check_labels(arrays, label_inputs(ev.model), source or str(directory), batch_axis=True)
    count = next(iter(arrays.values())).shape[0] if arrays else 1
    options = ort.SessionOptions()
    options.log_severity_level = 3  # onnxruntime's warnings (unused initializers ...) are not the user's
    if threads:
        options.intra_op_num_threads = threads
    try:
        session = ort.InferenceSession(ev.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 -- onnxruntime raises several unrelated types
        raise RuntimeFailure(f"{directory / EVAL_MODEL} (lowered): onnxruntime refuses it: {ort_message(exc)}") \
            from None
    wanted = [ev.loss] + ([ev.scores] if ev.scores else [])
    losses, right, total = [], 0, 0
    for k in range(count):
        batch = {**feeds, **{n: a[k] for n, a in arrays.items()}}
        try:
            out = session.run(wanted, batch)
        except Exception as exc:  # noqa: BLE001
            raise RuntimeFailure(f"{directory / EVAL_MODEL} (lowered): batch {k}{' of ' + source if source else ''}: "
                                 f"{ort_message(exc)}") from None
        losses.append(float(np.asarray(out[0]).reshape(-1)[0]))
        if on_batch is not None:
            on_batch(k + 1, count, losses[-1])
        if ev.binary:
            right += int(np.sum((np.asarray(out[1]) > 0) == (np.asarray(batch[ev.labels]) > 0.5)))
            total += int(np.asarray(out[1]).size)
        elif ev.scores:
            predicted = np.argmax(out[1], axis=1)
            labels = np.asarray(batch[ev.labels]).astype(np.int64)
            keep = labels != ev.ignore_index if ev.ignore_index is not None else np.ones_like(labels, bool)
            right += int(np.sum((predicted == labels) & keep))
            total += int(np.sum(keep))
    accuracy = (right / total if total else float("nan")) if ev.scores else None
    return Evaluation(float(np.mean(losses)), accuracy, count)


def _checked_values(ev: EvalModel, declared, values: Mapping[str, np.ndarray], source: str) -> dict:
    stray = [k for k in values if k not in declared]
    if stray:
        raise CheckpointError(f"{source}: parameter {stray[0]!r} is no input of {EVAL_MODEL} (its inputs: "
                              f"{', '.join(declared)})")
    feeds = {}
    for name in ev.params:
        value = np.asarray(values[name])
        shape = [d.dim_value if d.HasField("dim_value") else None for d in declared[name].shape.dim]
        if value.ndim != len(shape) or any(d is not None and d != s for d, s in zip(shape, value.shape,
                                                                                   strict=False)):
            raise TrainingDataError(f"{source}: parameter {name!r} has shape {list(value.shape)}; {EVAL_MODEL} "
                                    f"declares {shape}")
        feeds[name] = value.astype(np_dtype(declared[name].elem_type), copy=False)
    return feeds


def _batched(ev: EvalModel, declared, data: Mapping[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    extra = [k for k in data if k not in ev.data]
    if extra:
        raise TrainingDataError(f"{source}: {extra[0]!r} is no data input of {EVAL_MODEL} (they are: "
                                f"{', '.join(ev.data)})")
    missing = [k for k in ev.data if k not in data]
    if missing:
        raise TrainingDataError(f"{source}: no array for the data input {missing[0]!r} of {EVAL_MODEL}"
                                + (" (or a parameter missing from the parameter values)" if "." in missing[0] else ""))
    arrays = {}
    for name in ev.data:
        value = np.asarray(data[name])
        rank = len(declared[name].shape.dim)
        if value.ndim == rank:
            value = value[None]
        if value.ndim != rank + 1 or value.shape[0] == 0:
            raise TrainingDataError(f"{source}: {name!r} has shape {list(value.shape)}; expected the input's rank "
                                    f"{rank} (one batch) or a leading batch-index axis over it")
        arrays[name] = value.astype(np_dtype(declared[name].elem_type), copy=False)
    counts = {a.shape[0] for a in arrays.values()}
    if len(counts) > 1:
        raise TrainingDataError(f"{source}: the data arrays hold different numbers of batches ({sorted(counts)})")
    return arrays


def forward_outputs(model: onnx.ModelProto) -> list[str]:
    """The forward model's outputs in an eval model from generate_artifacts: values made by nodes outside the
    loss block (whose nodes onnxblock names ``onnx::<Op>::<n>``) that the loss block reads, in node order."""
    made_outside = {o for n in model.graph.node if not n.name.startswith(LOSS_BLOCK_PREFIX) for o in n.output}
    out: list[str] = []
    for node in model.graph.node:
        if node.name.startswith(LOSS_BLOCK_PREFIX):
            out.extend(i for i in node.input if i in made_outside and i not in out)
    return out


def check_outputs(directory: Path | str, outputs: Iterable[str] | None) -> list[str]:
    """The outputs an export of ``directory`` would have (``outputs`` or :func:`forward_outputs`), checked
    against the eval model before any work is done."""
    source = Path(directory) / EVAL_MODEL
    model = load_model(source)
    made = {o for n in model.graph.node for o in n.output if o} | {i.name for i in model.graph.input}
    outputs = list(outputs) if outputs is not None else forward_outputs(model)
    if not outputs:
        raise ModelError(f"{source}: cannot tell the forward model's outputs (no loss block nodes named "
                         f"'{LOSS_BLOCK_PREFIX}...'); name them")
    unknown = [o for o in outputs if o not in made]
    if unknown:
        raise ModelError(f"{source}: no value {unknown[0]!r} to export as an output")
    return outputs


def export_inference(directory: Path | str, values: Mapping[str, np.ndarray], path: Path | str | None = None, *,
                     outputs: Iterable[str] | None = None, values_source: str = "") -> onnx.ModelProto:
    """The inference model: the eval model's forward part computing ``outputs`` (default
    :func:`forward_outputs`), every parameter input it reads replaced by an initializer holding its value,
    nothing else left; written to ``path`` (atomically) when given."""
    directory = Path(directory)
    source = directory / EVAL_MODEL
    outputs = check_outputs(directory, outputs)
    model, _ = repair_eval_model(load_model(source))
    graph = model.graph
    # keep the nodes the outputs need, walking back from them
    producer = {o: n for n in graph.node for o in n.output if o}
    needed, stack, keep = set(), list(outputs), set()
    while stack:
        name = stack.pop()
        if name in needed:
            continue
        needed.add(name)
        node = producer.get(name)
        if node is not None and id(node) not in keep:
            keep.add(id(node))
            stack.extend(i for i in node.input if i)
            stack.extend(i for a in node.attribute if a.type == onnx.AttributeProto.GRAPH for i in _outer(a.g))
    nodes = [n for n in graph.node if id(n) in keep]
    initialized = {t.name for t in graph.initializer}
    param_inputs = [i for i in graph.input if i.name in needed and i.name in values and i.name not in initialized]
    inputs = [i for i in graph.input if i.name in needed and i.name not in values and i.name not in initialized]
    declared = {i.name: i.type.tensor_type for i in graph.input}
    initializers = [t for t in graph.initializer if t.name in needed]
    for vi in param_inputs:
        value = np.asarray(values[vi.name])
        shape = [d.dim_value if d.HasField("dim_value") else None for d in declared[vi.name].shape.dim]
        if value.ndim != len(shape) or any(d is not None and d != s for d, s in zip(shape, value.shape,
                                                                                   strict=False)):
            raise TrainingDataError(f"{values_source or directory}: parameter {vi.name!r} has shape "
                                    f"{list(value.shape)}; {EVAL_MODEL} declares {shape}")
        initializers.append(numpy_helper.from_array(value.astype(np_dtype(declared[vi.name].elem_type)), vi.name))
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v for v in (*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input)}
    out_infos = [types[o] if o in types else helper.make_empty_tensor_value_info(o) for o in outputs]
    new_graph = helper.make_graph(nodes, graph.name or "inference", inputs, out_infos, initializers)
    result = helper.make_model(new_graph, opset_imports=list(model.opset_import), ir_version=model.ir_version,
                               producer_name="oplower")
    if find_custom_nodes(result):
        try:
            result = lower_model(result)
        except OplowerError as exc:
            raise LoweringError(f"{source}: {exc}") from None
    try:
        onnx.checker.check_model(result, full_check=True)
    except onnx.checker.ValidationError as exc:
        raise ModelError(f"{source}: the exported model is not valid ONNX: {' '.join(str(exc).split())}") from None
    if path is not None:
        write_atomic(Path(path), result.SerializeToString())
    return result


def _outer(graph: onnx.GraphProto) -> list[str]:
    """Names a subgraph reads from its enclosing scope."""
    local = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {
        o for n in graph.node for o in n.output}
    read = [i for n in graph.node for i in n.input if i] + [
        i for n in graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH for i in _outer(a.g)]
    return [r for r in read if r not in local]
