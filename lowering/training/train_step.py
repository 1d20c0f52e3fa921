"""The train-step model: one standard ONNX model that does a whole training step, tensors in and out.

onnxruntime-training's artifacts split a step into two models, and the optimizer model takes tensor
sequences, which onnxruntime's JavaScript, mobile and C APIs (and OpenVINO, tract) cannot feed. The
train-step model joins them: the training model's forward and backward pass, its gradients taken straight
from what each ``InPlaceAccumulatorV2`` would have added (one optimizer step per train step, so the
accumulation buffers and ``lazy_reset_grad`` drop out), and the optimizer's update with the same arithmetic
as the lowered optimizer model (:mod:`lowering.rules.training_updates`), run over one flat buffer per element
type (the same bits as one update per parameter, with fewer kernels).

Interface (fixed; ``TrainStepInterface`` lists it for a given artifact):
- inputs: the training model's data inputs by name; ``learning_rate`` [1] f32; ``step`` [1] int64 (the
  optimizer step, 1 for the first); every trainable parameter ``<p>``; for AdamW its moments
  ``<p>.first_order_moment`` and ``<p>.second_order_moment``; every frozen value by its name (batch norm's
  running statistics);
- outputs: the loss (the training model's loss name) first, then ``<p>.updated`` for every parameter, for
  AdamW ``<p>.first_order_moment.updated`` and ``<p>.second_order_moment.updated``, then
  ``<frozen>.updated`` for every frozen value a training op updates in place.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from lowering.builder import NodeBuilder
from lowering.graphs import constant_values
from lowering.modelio import load_model
from lowering.passes import lower_runnable
from lowering.rules.training_updates import AdamW, StepScalars, sgd_update
from lowering.static_shapes import static_shapes
from lowering.training.checkpoint import CheckpointError, read_checkpoint
from lowering.training.portable_std import spell_out_for_portable
from opdef.errors import LoweringError, ModelError, OplowerError
from opdef.verify import infer_node, value_types_of_graph

TRAINING_MODEL, OPTIMIZER_MODEL = "training_model.onnx", "optimizer_model.onnx"
BUFFER_SUFFIX = "_grad.accumulation.buffer"
LAZY_RESET = "lazy_reset_grad"
ACCUMULATOR = ("com.microsoft", "InPlaceAccumulatorV2")
OPTIMIZERS = ("AdamWOptimizer", "SGDOptimizerV2")
FIRST_MOMENT, SECOND_MOMENT = ".first_order_moment", ".second_order_moment"


@dataclass(frozen=True)
class FlatState:
    """One element type's parameters held in one flat 1-D input (the flat state form): ``names[0]`` holds the
    parameters one after another in ``params`` order (each flattened), ``names[1:]`` (AdamW) the first and
    second moments alike; each name's ``<name>.updated`` output holds the same after the step."""

    params: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    elem_type: int
    names: tuple[str, ...]

    @property
    def size(self) -> int:
        return sum(self.sizes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

    def views(self) -> dict[str, tuple[str, int, int, tuple[int, ...]]]:
        """{per-member state name: (flat input, start, end, shape)}: ``<p>`` and, for AdamW's parameters,
        ``<p>.first_order_moment`` / ``<p>.second_order_moment``."""
        suffixes = ("", FIRST_MOMENT, SECOND_MOMENT)[:len(self.names)]
        out = {}
        start = 0
        for p, shape, size in zip(self.params, self.shapes, self.sizes, strict=True):
            for name, suffix in zip(self.names, suffixes, strict=True):
                out[p + suffix] = (name, start, start + size, shape)
            start += size
        return out


@dataclass(frozen=True)
class TrainStepInterface:
    """The train-step model's inputs and outputs by kind (names as in the module docstring)."""

    data: tuple[str, ...]
    params: tuple[str, ...]
    moments: bool  # AdamW: <p>.first_order_moment / <p>.second_order_moment in and .updated out
    frozen: tuple[str, ...]  # every other input: frozen values (batch norm's running statistics)
    updated_frozen: tuple[str, ...]  # the frozen values a training op updates: <name>.updated outputs
    loss: str
    optimizer: str  # the optimizer op: AdamWOptimizer or SGDOptimizerV2
    flat: tuple[FlatState, ...] = ()  # the flat state form: the parameters (and moments) held per element type
    # the flat state form: the updated frozen values (batch norm's running statistics) held per element type
    flat_frozen: tuple[FlatState, ...] = ()

    @property
    def state_inputs(self) -> tuple[str, ...]:
        """The inputs a step updates, each the input of the output ``<name>.updated``."""
        flat = {p for f in (*self.flat, *self.flat_frozen) for p in f.params}
        own = [p for p in self.params if p not in flat]
        moments = tuple(p + m for p in own for m in (FIRST_MOMENT, SECOND_MOMENT)) if self.moments else ()
        return (*(n for f in (*self.flat, *self.flat_frozen) for n in f.names), *own, *moments,
                *(n for n in self.updated_frozen if n not in flat))

    def views(self) -> dict[str, tuple[str, int, int, tuple[int, ...]]]:
        """{state name (``<p>``, its moments, an updated frozen value): (flat input, start, end, shape)} of what the
        flat state holds (empty in the per-parameter form)."""
        return {k: v for f in (*self.flat, *self.flat_frozen) for k, v in f.views().items()}


@dataclass(frozen=True)
class TrainStep:
    model: onnx.ModelProto
    interface: TrainStepInterface
    # AdamW's settings and the values its per-step scalars are computed into ([1] f32 each; None: SGD, or scalars
    # of another shape): what :func:`bound_model` turns into inputs the caller computes
    adamw: AdamW | None = None
    scalars: StepScalars | None = None


def train_step(directory: Path | str, *, target: str = "onnxruntime", flat_state: bool = False) -> TrainStep:
    """Build the train-step model of a generate_artifacts directory, lowered for ``target``; ``flat_state``:
    the parameters (and moments) of each element type as one flat input and output (see the module docstring)
    instead of one per parameter."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelError(f"{directory}: not an artifact directory (expected {TRAINING_MODEL} and {OPTIMIZER_MODEL})")
    training_path, optimizer_path = directory / TRAINING_MODEL, directory / OPTIMIZER_MODEL
    training, optimizer = load_model(training_path), load_model(optimizer_path)
    cut, gradients = _without_accumulators(training, training_path)
    lowered = lower_runnable(cut, str(training_path), target=target)
    if target == "portable":
        lowered = spell_out_for_portable(lowered)
    node = _optimizer_node(optimizer, optimizer_path)
    try:
        inference = infer_node(node, value_types_of_graph(optimizer.graph))
        settings = AdamW.of(inference) if node.op_type == "AdamWOptimizer" else None
    except OplowerError as exc:
        raise LoweringError(f"{optimizer_path}: {exc}") from None
    interface = _interface(training, lowered, gradients, node.op_type, _checkpoint_frozen(directory))
    interface, scalars = _append_updates(lowered, interface, gradients, settings, portable=target == "portable",
                                         flat_state=flat_state)
    return TrainStep(lowered, interface, settings, scalars)


def train_step_model(directory: Path | str, *, target: str = "onnxruntime", flat_state: bool = False
                     ) -> onnx.ModelProto:
    """The train-step model of a generate_artifacts directory (see the module docstring)."""
    return train_step(directory, target=target, flat_state=flat_state).model


def _without_accumulators(training: onnx.ModelProto, path: Path) -> tuple[onnx.ModelProto, dict[str, str]]:
    """A copy of the training model without its accumulators, their buffers and ``lazy_reset_grad``; each
    parameter's gradient (the value its accumulator adds) is a graph output, so the lowering keeps it.
    Returns the copy and {parameter: gradient value}."""
    graph = training.graph
    inputs = {vi.name: vi for vi in graph.input}
    gradients: dict[str, str] = {}
    dropped_outputs: set[str] = set()
    kept = []
    for node in graph.node:
        if (node.domain, node.op_type) != ACCUMULATOR:
            kept.append(node)
            continue
        buffer = node.input[0] if node.input else ""
        if not buffer.endswith(BUFFER_SUFFIX) or len(node.input) < 2 or buffer not in inputs:
            raise ModelError(f"{path}: InPlaceAccumulatorV2 '{node.name}' does not accumulate into a "
                             f"'<parameter>{BUFFER_SUFFIX}' input")
        param = buffer[: -len(BUFFER_SUFFIX)]
        if param not in inputs:
            raise ModelError(f"{path}: accumulation buffer {buffer!r} of no parameter input {param!r}")
        gradients[param] = node.input[1]
        dropped_outputs.update(o for o in node.output if o)
    if not gradients:
        raise ModelError(f"{path}: no InPlaceAccumulatorV2 node: not a generate_artifacts training model")
    readers = [n for n in kept if dropped_outputs & set(n.input)]
    if readers:
        raise ModelError(f"{path}: node '{readers[0].name}' reads an accumulator's output; a train step cannot "
                         "drop the accumulators")
    dropped_inputs = {p + BUFFER_SUFFIX for p in gradients} | {LAZY_RESET}
    if any(dropped_inputs & set(n.input) for n in kept):
        raise ModelError(f"{path}: a node other than the accumulators reads an accumulation buffer or {LAZY_RESET}")
    cut = onnx.ModelProto()
    cut.CopyFrom(training)
    del cut.graph.node[:]
    cut.graph.node.extend(kept)
    kept_inputs = [vi for vi in graph.input if vi.name not in dropped_inputs]
    del cut.graph.input[:]
    cut.graph.input.extend(kept_inputs)
    kept_outputs = [vi for vi in graph.output if vi.name not in dropped_outputs]
    del cut.graph.output[:]
    cut.graph.output.extend(kept_outputs)
    declared = {vi.name for vi in cut.graph.output}
    for param, gradient in gradients.items():
        if gradient not in declared:  # the gradient has its parameter's type
            cut.graph.output.append(_like(inputs[param], gradient))
            declared.add(gradient)
    return cut, gradients


def _optimizer_node(optimizer: onnx.ModelProto, path: Path) -> onnx.NodeProto:
    found = [n for n in optimizer.graph.node if n.domain == "com.microsoft" and n.op_type in OPTIMIZERS]
    if len(found) != 1:
        raise ModelError(f"{path}: expected one {' or '.join(OPTIMIZERS)} node, found {len(found)}")
    return found[0]


def _checkpoint_frozen(directory: Path) -> frozenset[str]:
    """The frozen parameters the directory's checkpoint holds (none when it has none or cannot be read: the
    trainer reports a damaged checkpoint itself)."""
    path = Path(directory) / "checkpoint"
    if not path.is_file():
        return frozenset()
    try:
        return frozenset(read_checkpoint(path).frozen)
    except CheckpointError:
        return frozenset()


def _interface(training: onnx.ModelProto, lowered: onnx.ModelProto, gradients: dict[str, str],
               optimizer: str, known_frozen: frozenset[str] = frozenset()) -> TrainStepInterface:
    graph = training.graph
    initialized = {t.name for t in graph.initializer}
    params = tuple(vi.name for vi in graph.input if vi.name in gradients)
    taken = {*params, *(p + BUFFER_SUFFIX for p in params), LAZY_RESET}
    others = [vi.name for vi in graph.input if vi.name not in taken and vi.name not in initialized]
    lowered_outputs = {vi.name for vi in lowered.graph.output}
    updated = tuple(n for n in others if f"{n}.updated" in lowered_outputs)
    # frozen values: inputs the training model's initial parameter source holds, i.e. not data; an updated
    # input is frozen state, the other non-parameter inputs before the first parameter are data
    # (or one the checkpoint holds as frozen: a frozen parameter may come before the first trainable one)
    frozen = tuple(n for n in others if n in updated or n in known_frozen or _is_frozen(graph, n, params))
    data = tuple(n for n in others if n not in frozen)
    return TrainStepInterface(data, params, optimizer == "AdamWOptimizer", frozen, updated,
                              graph.output[0].name, optimizer)


def _is_frozen(graph: onnx.GraphProto, name: str, params: tuple[str, ...]) -> bool:
    """generate_artifacts lists the data inputs first, then parameters (trainable and frozen) in the forward
    model's initializer order: an input after the first trainable parameter is a frozen parameter."""
    names = [vi.name for vi in graph.input]
    first_param = min((names.index(p) for p in params), default=len(names))
    return names.index(name) > first_param


def _append_updates(model: onnx.ModelProto, interface: TrainStepInterface, gradients: dict[str, str],
                    adamw: AdamW | None, portable: bool = False, flat_state: bool = False
                    ) -> tuple[TrainStepInterface, StepScalars | None]:
    """Append the unrolled optimizer update to the lowered training graph and set the interface's inputs
    and outputs; returns the interface (with its flat state groups in the flat state form) and AdamW's step
    scalars where they are [1] values of the onnxruntime target (else None)."""
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    taken = {vi.name for vi in (*graph.input, *graph.output, *graph.value_info)} | {t.name for t in graph.initializer}
    taken.update(o for n in graph.node for o in n.output)
    b = NodeBuilder(opset, "train_step", lambda name: name in taken, into=graph.node)
    inputs = {vi.name: vi for vi in graph.input}
    outputs = {vi.name: vi for vi in graph.output}
    groups = _flat_groups(interface.params, inputs)
    # learning_rate and step as fed, [1]: they broadcast against a flat buffer and any parameter of rank 1 or more
    # without changing its shape, so only a parameter of rank 0 (or of unknown rank) updated alone needs them as
    # scalars (two Reshapes); with [1] inputs AdamW's step scalars are stacked (13 -> 9 kernels per step), in the
    # flat state form their two bias corrections one Split (8; the per-parameter form's Splits stay its state's)
    one_d = all(len(g) > 1 or len(_static_shape(inputs[g[0]]) or ()) > 0 for g in groups)
    if one_d:
        lr, step = "learning_rate", "step"
    else:
        scalar_shape = b.const(np.array([], np.int64), hint="scalar_shape")
        lr, step = (b.op1("Reshape", [n, scalar_shape], hint=h) for n, h in (("learning_rate", "lr"), ("step", "step")))
    new_inputs = [helper.make_tensor_value_info("learning_rate", TensorProto.FLOAT, [1]),
                  helper.make_tensor_value_info("step", TensorProto.INT64, [1])]
    new_outputs = [outputs[interface.loss]]
    scalars = adamw.step_scalars(b, lr, step, stacked=one_d, portable=portable, split=flat_state) if adamw else None
    flat_groups = []
    # the values' static shapes, for the flat state's views (onnxruntime target: the portable one has no Split)
    shapes = static_shapes(model) if flat_state and not portable and any(len(g) > 1 for g in groups) else None
    for group in groups:
        if flat_state and len(group) > 1:
            flat_groups.append(_flat_state_update(b, lr, scalars, adamw, group, gradients, inputs, portable, taken,
                                                  graph, shapes))
        else:
            _flat_update(b, lr, scalars, adamw, group, gradients, inputs, portable)
    interface = dataclasses.replace(interface, flat=tuple(flat_groups))
    in_flat = {p for f in flat_groups for p in f.params}
    moment_inputs, moment_outputs = [], []
    for f in flat_groups:
        for name in f.names:
            moment_inputs.append(helper.make_tensor_value_info(name, f.elem_type, [f.size]))
            new_outputs.append(helper.make_tensor_value_info(f"{name}.updated", f.elem_type, [f.size]))
    for p in interface.params:
        if p in in_flat:
            continue
        if adamw is not None:
            m1, m2 = p + FIRST_MOMENT, p + SECOND_MOMENT
            moment_inputs += [_like(inputs[p], m1), _like(inputs[p], m2)]
            moment_outputs += [_like(inputs[p], f"{m1}.updated"), _like(inputs[p], f"{m2}.updated")]
        new_outputs.append(_like(inputs[p], f"{p}.updated"))
    new_outputs += moment_outputs + [outputs[f"{n}.updated"] for n in interface.updated_frozen]
    own = [inputs[p] for p in interface.params if p not in in_flat]
    ordered_inputs = [inputs[n] for n in interface.data] + new_inputs + own + moment_inputs + \
        [inputs[n] for n in interface.frozen]
    del graph.input[:]
    graph.input.extend(ordered_inputs)
    del graph.output[:]
    graph.output.extend(new_outputs)
    if flat_groups:  # the parameters cut out of the flat inputs come before the nodes reading them
        _sort_topologically(graph)
    _prune(graph)
    if flat_state:
        interface = dataclasses.replace(interface, flat_frozen=_flat_frozen_updates(graph, interface, taken, opset,
                                                                                    portable))
    return interface, scalars if one_d and not portable else None


def _flat_frozen_updates(graph: onnx.GraphProto, interface: TrainStepInterface, taken: set[str], opset: int,
                         portable: bool = False) -> tuple[FlatState, ...]:
    """The flat state form of the updated frozen values: where each ``<f>.updated`` is batch norm's running
    statistic update as the lowering emits it, ``Add(Mul(f, momentum), Mul(batch, 1 - momentum))`` with f read by
    nothing else, the values of one element type, shape and pair of constants become one flat input
    ``flat.frozen.<type>`` updated by one Mul, Mul, Add over a Concat of the batch statistics (the same
    arithmetic per element, so the same bits): 4 kernels instead of 3 per statistic."""
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    constants = constant_values(graph)
    inputs = {vi.name: vi for vi in graph.input}

    def scalar(name: str):
        value = constants.get(name)
        return None if value is None or value.size != 1 else value.reshape(()).tobytes() + value.dtype.str.encode()

    def source(value: str) -> str:  # through the Identity the in-place contract adds
        node = producer.get(value)
        return node.input[0] if node is not None and node.op_type == "Identity" else value

    groups: dict[tuple, list[tuple[str, str, tuple[int, ...], list[onnx.NodeProto]]]] = {}
    for f in interface.updated_frozen:
        shape = _static_shape(inputs[f]) if f in inputs else None
        add = producer.get(source(f"{f}.updated"))
        if shape is None or len(shape) != 1 or add is None or add.op_type != "Add" or len(add.input) != 2:
            continue
        muls = [producer.get(i) for i in add.input]
        if any(m is None or m.op_type != "Mul" or len(m.input) != 2 for m in muls):
            continue
        kept, new = muls if f in muls[0].input else muls[::-1]
        if list(kept.input).count(f) != 1 or len(readers.get(f, [])) != 1:
            continue
        momentum = scalar(next(i for i in kept.input if i != f))
        batch = [i for i in new.input if scalar(i) is None]
        one_minus = [scalar(i) for i in new.input if scalar(i) is not None]
        if momentum is None or len(batch) != 1 or len(one_minus) != 1 or len(readers.get(add.output[0], [])) > 1:
            continue
        elem = inputs[f].type.tensor_type.elem_type
        key = (elem, momentum, one_minus[0])
        groups.setdefault(key, []).append((f, batch[0], shape, (next(i for i in kept.input if i != f),
                                                                next(i for i in new.input if i not in batch))))
    states = []
    joined = []  # (Concat of batch statistics, [(statistic, size)]) of each flat group
    b = NodeBuilder(opset, "train_step", lambda name: name in taken or name in producer, into=graph.node)
    for key, members in groups.items():
        if len(members) < 2:
            continue
        elem = key[0]
        name = f"flat.frozen.{np.dtype(helper.tensor_dtype_to_np_dtype(elem)).name}"
        if states or name in inputs or name in taken:
            name = f"{name}.{len(states)}"
        state = FlatState(tuple(m[0] for m in members), tuple(m[2] for m in members), elem, (name,))
        momentum, one_minus = members[0][3]
        # Mul and Add are commutative bit for bit: the operands' order is the lowering's or not, the same bits
        batch = b.op1("Concat", [m[1] for m in members], axis=0, hint="flat_batch_statistics")
        b.op1("Add", [b.op1("Mul", [name, momentum]), b.op1("Mul", [batch, one_minus])], f"{name}.updated")
        joined.append((batch, [(m[1], int(np.prod(m[2]))) for m in members]))
        dropped = {m[0] for m in members}
        kept_inputs = [vi for vi in graph.input if vi.name not in dropped]
        kept_inputs.append(helper.make_tensor_value_info(name, elem, [state.size]))
        del graph.input[:]
        graph.input.extend(kept_inputs)
        kept_outputs = [vo for vo in graph.output if vo.name.removesuffix(".updated") not in dropped]
        kept_outputs.append(helper.make_tensor_value_info(f"{name}.updated", elem, [state.size]))
        del graph.output[:]
        graph.output.extend(kept_outputs)
        states.append(state)
    if states:
        _prune(graph)
    shared = 0 if portable else sum(_shared_inverse_deviations(b, graph, batch, members) for batch, members in joined)
    if shared:  # the shared chain's Split comes after the nodes that read its pieces
        _sort_topologically(graph)
    return tuple(states)


def _shared_inverse_deviations(b: NodeBuilder, graph: onnx.GraphProto, batch: str, members: list[tuple[str, int]]
                               ) -> int:
    """Batch norm's inverse standard deviations ``Reciprocal(Sqrt(Add(var, eps)))``, one chain of 3 kernels per
    layer, computed once over the Concat of the batch statistics that the flat running-statistics update has
    already made (``batch``: ``members``' values, (value, size) each, one after another) and Split back: 3 + 1
    kernels for all layers, the same operations on the same elements (the means' entries computed too and
    dropped). Taken where two or more batch statistics are read by such a chain alone, with one epsilon. First,
    a chain whose every reader is one of batch norm's gradient BatchNormalizations is folded into them instead
    (:func:`_fold_inverse_deviation`: no kernel left for it at all); returns how many layers were folded or joined."""
    readers = _readers(graph)
    constants = constant_values(graph)
    # a ConstantOfShape's one value stands for every element of its output
    constants.update({n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in graph.node
                      if n.op_type == "ConstantOfShape" and n.domain in ("", "ai.onnx") and len(n.attribute) == 1
                      and n.attribute[0].name == "value"})

    def only(value: str, op_type: str) -> onnx.NodeProto | None:
        """The one reader of ``value`` besides the Concat of the batch statistics, if it is an ``op_type``."""
        found = [r for r in readers.get(value, []) if batch not in r.output]
        if len(found) != 1 or found[0].op_type != op_type or found[0].domain not in ("", "ai.onnx"):
            return None
        return found[0]

    def epsilon(add: onnx.NodeProto) -> np.generic | None:
        value = constants.get(add.input[1])
        return None if value is None or value.size != 1 else value.reshape(-1)[0]

    chains: dict[str, tuple[onnx.NodeProto, ...]] = {}
    for value, _ in members:
        add = only(value, "Add")
        if add is None or len(add.input) != 2 or add.input[0] != value or epsilon(add) is None:
            continue
        sqrt = only(add.output[0], "Sqrt")
        reciprocal = only(sqrt.output[0], "Reciprocal") if sqrt is not None else None
        if reciprocal is not None:
            chains[value] = (add, sqrt, reciprocal)
    gone: set[int] = set()
    folded = 0
    for value, chain in list(chains.items()):
        eps = epsilon(chain[0])
        if eps.dtype != np.float32:  # the gradient forms' BatchNormalizations compute in f32 (f64 keeps its chain)
            continue
        taken = _fold_inverse_deviation(graph, readers, constants, value, chain[2].output[0], float(eps))
        if taken is not None:  # every reader now computes it itself: the chain (and the Muls) go
            gone.update(id(n) for n in (*chain, *taken))
            del chains[value]
            folded += 1
    joined = len(chains) >= 2 and len({(e.dtype, e) for e in (epsilon(c[0]) for c in chains.values())}) == 1
    if joined:
        eps = next(iter(chains.values()))[0].input[1]
        # named as the first layer's BatchNormInternal lowering (what the bench charges them to), not the update's
        first = next(iter(chains.values()))[2].name
        prefix = f"{first.rsplit('/', 1)[0]}/inverse_deviations" if "/" in first else "inverse_deviations"
        b = NodeBuilder(b.opset, prefix, b.is_taken, into=graph.node)
        inverse = b.op1("Reciprocal", [b.op1("Sqrt", [b.op1("Add", [batch, eps])])], hint="inverse_deviations")
        pieces = [chains[value][2].output[0] if value in chains else b.fresh("unused") for value, _ in members]
        sizes = [size for _, size in members]
        if b.opset < 13:  # the sizes an attribute
            b.op("Split", [inverse], pieces, axis=0, split=sizes)
        else:
            b.op("Split", [inverse, b.const(np.array(sizes, np.int64), hint="sizes")], pieces, axis=0)
        gone.update(id(n) for chain in chains.values() for n in chain)
    if gone:
        kept = [n for n in graph.node if id(n) not in gone]
        del graph.node[:]
        graph.node.extend(kept)
    return folded + (len(chains) if joined else 0)


def _fold_inverse_deviation(graph: onnx.GraphProto, readers: Mapping[str, list[onnx.NodeProto]],
                            constants: Mapping[str, np.ndarray], variance: str, inverse: str, epsilon: float
                            ) -> list[onnx.NodeProto] | None:
    """Where every reader of ``inverse`` = 1 / sqrt(``variance`` + ``epsilon``) is an inference BatchNormalization
    taking it (or its product with a per-channel vector p, read by such nodes alone) as its scale, with mean 0,
    variance 1 and epsilon 0 (batch norm's gradient forms), give those nodes ``variance`` and ``epsilon`` and scale 1
    (or p) instead: onnxruntime's BatchNormalization computes 1 / sqrt(var + eps) times the scale itself, in the
    same f32 operations (byte-equal on 300 random cases), one kernel fewer a product and the chain's 3 gone.
    ``constants``: the graph's constant values (a ConstantOfShape's by its one value). Returns the products' Mul
    nodes (to drop), or None where some reader is another kind (nothing changed)."""
    outputs = {o.name for o in graph.output}

    def filled(name: str, value: float) -> bool:
        """Whether ``name`` is an f32 constant of ``value`` throughout."""
        array = constants.get(name)
        return array is not None and array.dtype == np.float32 and bool(np.all(array == value))

    def normalization(node: onnx.NodeProto, scale: str) -> bool:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        return node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") and len(node.input) == 5 \
            and node.input[1] == scale and not attrs.get("training_mode", 0) and float(attrs.get("epsilon", 1e-5)) \
            == 0.0 and filled(node.input[3], 0.0) and filled(node.input[4], 1.0) and len(node.output) == 1

    plan: list[tuple[onnx.NodeProto, str]] = []  # (BatchNormalization, its new scale)
    products = []
    for reader in readers.get(inverse, []):
        if normalization(reader, inverse):
            plan.append((reader, reader.input[4]))  # the ones vector is the scale 1
            continue
        if reader.op_type != "Mul" or reader.domain not in ("", "ai.onnx") or len(reader.input) != 2 \
                or list(reader.input).count(inverse) != 1:
            return None
        other = reader.input[1] if reader.input[0] == inverse else reader.input[0]
        users = readers.get(reader.output[0], [])
        if not users or not all(normalization(u, reader.output[0]) for u in users) or reader.output[0] in outputs:
            return None
        plan += [(u, other) for u in users]
        products.append(reader)
    if not plan or inverse in outputs:
        return None
    for node, scale in plan:
        node.input[1], node.input[4] = scale, variance
        for attr in node.attribute:
            if attr.name == "epsilon":
                attr.f = epsilon
    return products


def _static_shape(value_info: onnx.ValueInfoProto) -> tuple[int, ...] | None:
    t = value_info.type.tensor_type
    if not t.HasField("shape") or not all(d.HasField("dim_value") for d in t.shape.dim):
        return None
    return tuple(d.dim_value for d in t.shape.dim)


def _flat_groups(params: tuple[str, ...], inputs: Mapping[str, onnx.ValueInfoProto]) -> list[list[str]]:
    """The parameters updated together over one flat buffer: those of static shape, by element type (in
    interface order); every other parameter alone."""
    by_type: dict[int, list[str]] = {}
    alone = []
    for p in params:
        if _static_shape(inputs[p]) is None:
            alone.append([p])
        else:
            by_type.setdefault(inputs[p].type.tensor_type.elem_type, []).append(p)
    return [g for g in by_type.values()] + alone


def _flat_update(b: NodeBuilder, lr: str, scalars: StepScalars | None, adamw: AdamW | None, group: list[str],
                 gradients: dict[str, str], inputs: Mapping[str, onnx.ValueInfoProto], portable: bool) -> None:
    """The optimizer update of ``group``'s parameters. Several: one elementwise chain over the Concat of their
    flattened values (gradients, parameters, moments), Split back and reshaped into the ``.updated`` outputs:
    about 20 kernels for any number of parameters instead of ~16 each (the per-kernel cost dominated the small
    CNN's step). The arithmetic per element is unchanged, so the results are the same bits. The portable target
    slices the pieces (Split is not among its ops)."""
    def moments(p: str) -> tuple[str, str]:
        return p + FIRST_MOMENT, p + SECOND_MOMENT

    if len(group) == 1:
        (p,) = group
        g = gradients[p]
        if adamw is None:
            b.op1("Identity", [sgd_update(b, lr, p, g)], f"{p}.updated")
            return
        m1, m2 = moments(p)
        for value, name in zip(adamw.update(b, scalars, p, g, m1, m2), (p, m1, m2), strict=True):
            b.op1("Identity", [value], f"{name}.updated")
        return
    flat_shape = b.const(np.array([-1], np.int64), hint="flat")
    sizes = [int(np.prod(_static_shape(inputs[p]), dtype=np.int64)) for p in group]

    flat = [len(_static_shape(inputs[p])) == 1 for p in group]  # 1-D already: no Reshape either way

    def concat(names: list[str], hint: str) -> str:
        pieces = [n if is_flat else b.op1("Reshape", [n, flat_shape]) for n, is_flat in zip(names, flat, strict=True)]
        return b.op1("Concat", pieces, axis=0, hint=hint)

    def split(flat_value: str, names: list[str]) -> None:
        # 1-D pieces are the outputs themselves; the others are reshaped into them
        targets = [f"{n}.updated" if is_flat else b.fresh("piece") for n, is_flat in zip(names, flat, strict=True)]
        if portable:
            ends = np.cumsum(sizes)
            for size, end, target in zip(sizes, ends, targets, strict=True):
                b.op1("Slice", [flat_value, b.const(np.array([end - size], np.int64), hint="start"),
                                b.const(np.array([end], np.int64), hint="end")], target)
        elif b.opset < 13:  # the sizes an attribute
            b.op("Split", [flat_value], targets, axis=0, split=sizes)
        else:
            b.op("Split", [flat_value, b.const(np.array(sizes, np.int64), hint="sizes")], targets, axis=0)
        for target, name, p, is_flat in zip(targets, names, group, flat, strict=True):
            if not is_flat:
                b.op1("Reshape", [target, b.const(np.array(_static_shape(inputs[p]), np.int64), hint="shape")],
                      f"{name}.updated")

    w, g = concat(list(group), "flat_params"), concat([gradients[p] for p in group], "flat_gradients")
    if adamw is None:
        split(sgd_update(b, lr, w, g), list(group))
        return
    m1 = concat([moments(p)[0] for p in group], "flat_first_moments")
    m2 = concat([moments(p)[1] for p in group], "flat_second_moments")
    w_new, m1_new, m2_new = adamw.update(b, scalars, w, g, m1, m2)
    split(w_new, list(group))
    split(m1_new, [moments(p)[0] for p in group])
    split(m2_new, [moments(p)[1] for p in group])


def _flat_state_update(b: NodeBuilder, lr: str, scalars: StepScalars | None, adamw: AdamW | None, group: list[str],
                       gradients: dict[str, str], inputs: Mapping[str, onnx.ValueInfoProto], portable: bool,
                       taken: set[str], graph: onnx.GraphProto, shapes: dict[str, list[int | None]] | None
                       ) -> FlatState:
    """The flat state form of :func:`_flat_update`: the group's parameters (and moments) arrive as one flat
    input each, the parameters are cut out of it for the forward and backward pass (one Split, a Reshape per
    parameter of rank other than 1), the gradients are flattened into one tensor (a Reshape per such gradient,
    one Concat), and the update's elementwise chain writes the flat outputs itself: about 2 kernels per
    parameter, against 7 when every parameter and moment is an input and an output of its own. With ``shapes``
    (the values' static shapes), the axis-0 Split / Concat chains the training graph runs on parameters and
    gradients (torch's recurrent gate reorders) are cut from the flat buffers as they are (:func:`_param_views`,
    :func:`_gradient_pieces`) and a [1, .., 1, D] parameter is read and summed as [D] where that broadcasts alike
    (:func:`_broadcast_views`)."""
    elem = inputs[group[0]].type.tensor_type.elem_type
    shapes_of = tuple(_static_shape(inputs[p]) for p in group)
    suffix = np.dtype(helper.tensor_dtype_to_np_dtype(elem)).name
    names = tuple(f"flat{kind}.{suffix}" for kind in (".params", *((FIRST_MOMENT, SECOND_MOMENT) if adamw else ())))
    clash = [n for n in names if n in taken or f"{n}.updated" in taken]
    if clash:
        raise ModelError(f"the training model already has a value named {clash[0]!r} (the train-step model's "
                         "flat state input)")
    state = FlatState(tuple(group), shapes_of, elem, names)
    sizes = list(state.sizes)
    starts = [int(x) for x in np.cumsum([0, *sizes[:-1]])]
    spans = {p: [(start, start + size)] for p, start, size in zip(group, starts, sizes, strict=True)}
    # {value: (flat ranges, shape)} to cut out of the flat input, and the training graph's nodes they replace
    views, replaced = _param_views(graph, spans, shapes) if shapes is not None else ({}, [])
    ids = {id(n) for n in replaced}
    readers = _readers(graph) if replaced else {}
    for p, shape in zip(group, shapes_of, strict=True):  # a parameter read by anything else: its own view
        if not replaced or _read_outside(readers, set(), p, ids):
            views[p] = (spans[p], shape)
    if replaced:
        kept = [n for n in graph.node if id(n) not in ids]
        del graph.node[:]
        graph.node.extend(kept)
    if shapes is not None:
        _broadcast_views(b, graph, views, shapes)
    bounds = sorted({0, state.size} | {x for ranges, _ in views.values() for r in ranges for x in r})
    cuts = list(zip(bounds[:-1], bounds[1:], strict=True))
    users = {c: sum(a <= c[0] and c[1] <= z for ranges, _ in views.values() for a, z in ranges) for c in cuts}
    # a 1-D view that is one piece read by no other view is the Split's output itself
    direct = {ranges[0]: v for v, (ranges, shape) in views.items()
              if len(ranges) == 1 and len(shape) == 1 and ranges[0] in users and users[ranges[0]] == 1}
    pieces = [direct.get(c) or b.fresh("piece") for c in cuts]
    if portable:
        for (start, end), piece in zip(cuts, pieces, strict=True):
            b.op1("Slice", [names[0], b.const(np.array([start], np.int64), hint="start"),
                            b.const(np.array([end], np.int64), hint="end")], piece)
    elif b.opset < 13:  # the sizes an attribute
        b.op("Split", [names[0]], pieces, axis=0, split=[z - a for a, z in cuts])
    else:
        b.op("Split", [names[0], b.const(np.array([z - a for a, z in cuts], np.int64), hint="sizes")], pieces, axis=0)
    piece_of = dict(zip(cuts, pieces, strict=True))
    joined_of: dict[tuple, str] = {}  # views of the same ranges in other shapes share their Concat
    for value, (ranges, shape) in views.items():
        if direct.get(ranges[0]) == value and len(ranges) == 1:
            continue
        parts = [piece_of[c] for a, z in ranges for c in cuts if a <= c[0] and c[1] <= z]
        if len(shape) == 1 and len(parts) > 1:
            # its own Concat: two 1-D views of the same ranges are identical nodes, which onnxruntime's
            # common-subexpression elimination merges along with what reads them (GRU's bias packing in the forward
            # and the gradient); a Reshape of the other view would keep the readers apart (gru +3 kernels)
            b.op1("Concat", parts, value, axis=0)
        elif len(shape) == 1:  # a piece another view reads too (onnxruntime drops the Identity)
            b.op1("Identity", parts, value)
        else:
            key = tuple(ranges)
            if key not in joined_of:
                joined_of[key] = b.op1("Concat", parts, axis=0, hint="view") if len(parts) > 1 else parts[0]
            b.op1("Reshape", [joined_of[key], b.const(np.array(shape, np.int64), hint="shape")], value)
    g = b.op1("Concat", _gradient_pieces(b, graph, [gradients[p] for p in group], shapes_of, shapes),
              axis=0, hint="flat_gradients")
    first = len(b.nodes)  # the update's nodes: their results are renamed to the outputs
    if adamw is None:
        results = (sgd_update(b, lr, names[0], g),)
    else:
        results = adamw.update(b, scalars, names[0], g, names[1], names[2])
    renamed = {value: f"{name}.updated" for value, name in zip(results, names, strict=True)}
    for node in b.nodes[first:]:  # fresh names, read only by the update's own later nodes
        node.input[:] = [renamed.get(n, n) for n in node.input]
        node.output[:] = [renamed.get(n, n) for n in node.output]
    return state


# -- the flat state's views: axis-0 Split / Concat chains on parameters and gradients ---------------------------

_VIEW_OPS = ("Reshape", "Squeeze", "Unsqueeze", "Identity", "Flatten")  # the same elements in the same order


def _reads(node: onnx.NodeProto) -> set[str]:
    """What a node reads: its inputs and its subgraphs' outer reads (recurrent Scan bodies read weights by name)."""
    reads = set(node.input)
    for attr in node.attribute:
        for body in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
            reads |= _outer_reads(body)
    return reads


def _readers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for value in _reads(node):
            readers.setdefault(value, []).append(node)
    return readers


def _read_outside(readers: Mapping[str, list[onnx.NodeProto]], outputs: set[str], value: str, ids: set[int]
                  ) -> bool:
    """Whether ``value`` is an output or read by a node whose id is not in ``ids``."""
    return value in outputs or any(id(n) not in ids for n in readers.get(value, ()))


def _axis0_view(node: onnx.NodeProto, shapes: Mapping[str, list[int | None]]) -> bool:
    """A node whose outputs are contiguous ranges of its inputs' elements (row-major), shapes static: a Split or
    Concat along axis 0, a Reshape-like."""
    if node.domain not in ("", "ai.onnx") or not node.input:
        return False
    data = list(node.input) if node.op_type == "Concat" else [node.input[0]]
    known = [shapes.get(v) for v in (*data, *node.output)]
    if any(s is None or None in s for s in known):
        return False
    if node.op_type in _VIEW_OPS:
        return True
    if node.op_type not in ("Split", "Concat"):
        return False
    axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
    return axis in (0, -len(known[0]))


def _cut(ranges: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """Elements [start, end) of the concatenation of ``ranges``."""
    out, offset = [], 0
    for a, z in ranges:
        lo, hi = max(start, offset), min(end, offset + z - a)
        if lo < hi:
            out.append((a + lo - offset, a + hi - offset))
        offset += z - a
    return _merged(out)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, z in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], z)
        else:
            out.append((a, z))
    return out


def _pieces(ranges: list[tuple[int, int]], bounds: set[int]) -> int:
    """How many pieces of the flat buffer cut at ``bounds`` make up ``ranges``."""
    return sum(1 + sum(a < x < z for x in bounds) for a, z in ranges)


def _components(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Union-find over values: {value: its component's representative}."""
    parent: dict[str, str] = {}

    def find(v: str) -> str:
        parent.setdefault(v, v)
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for a, z in pairs:
        parent[find(a)] = find(z)
    return {v: find(v) for v in list(parent)}


def _param_views(graph: onnx.GraphProto, spans: dict[str, list[tuple[int, int]]],
                 shapes: Mapping[str, list[int | None]]) -> tuple[dict, list[onnx.NodeProto]]:
    """The training graph's axis-0 Split / Concat chains on the flat state's parameters (torch's recurrent exports
    reorder the gates of every weight and bias: Split, Concat, Unsqueeze), as views of the flat input: ({value read
    by anything else: (its flat ranges, shape)}, the nodes they replace). Taken per connected chain where it runs
    fewer kernels than the parameters' own views plus the chain (each view a Reshape and, where it is not one
    range, a Concat of the flat Split's pieces): the same elements, so the same bits."""
    ranges = dict(spans)
    chain = []
    for node in graph.node:  # in order: a node's inputs come before it
        data = list(node.input) if node.op_type == "Concat" else list(node.input[:1])
        if not data or any(v not in ranges for v in data) or not _axis0_view(node, shapes):
            continue
        if node.op_type == "Split":
            offset = 0
            for out in node.output:
                size = int(np.prod(shapes[out], dtype=np.int64))
                ranges[out] = _cut(ranges[data[0]], offset, offset + size)
                offset += size
        elif node.op_type == "Concat":
            ranges[node.output[0]] = _merged([r for v in data for r in ranges[v]])
        else:
            ranges[node.output[0]] = ranges[data[0]]
        chain.append(node)
    if not chain:
        return {}, []
    component = _components((v, o) for n in chain for v in (n.input if n.op_type == "Concat" else n.input[:1])
                            for o in n.output)
    readers, outputs = _readers(graph), {o.name for o in graph.output}
    views, replaced = {}, []
    for root in {component[p] for p in spans if p in component}:
        nodes = [n for n in chain if component[n.output[0]] == root]
        ids = {id(n) for n in nodes}
        values = [v for v in ranges if component.get(v) == root]
        read = {v: (ranges[v], shapes[v]) for v in values
                if v not in spans and _read_outside(readers, outputs, v, ids)}
        params = [p for p in spans if component.get(p) == root]
        own = {p: (spans[p], None) for p in params if _read_outside(readers, outputs, p, ids)}
        bounds = {x for p in params for x in spans[p][0]} | {x for r, _ in (*read.values(), *own.values())
                                                               for a in r for x in a}

        rank = {p: len(shapes.get(p) or ()) for p in params}
        before = sum(rank[p] != 1 for p in params) + sum(n.op_type != "Identity" for n in nodes)
        # a Reshape per view of rank other than 1, one Concat per distinct range list of several pieces (views of
        # the same elements in other shapes, e.g. a stock LSTM's [1, 4H, H] R and the [4H, H] its gates read,
        # share it)
        taken = (*read.items(), *own.items())
        after = sum(s is None and rank[v] != 1 or s is not None and len(s) != 1 for v, (r, s) in taken) + \
            sum(_pieces(list(r), bounds) > 1 for r in {tuple(r) for _, (r, _) in taken})
        if after < before:
            views.update({v: (r, tuple(s)) for v, (r, s) in read.items()})
            replaced += nodes
    return views, replaced


_BROADCASTING = ("Add", "Sub", "Mul", "Div")


def _broadcast_views(b: NodeBuilder, graph: onnx.GraphProto, views: dict, shapes: Mapping[str, list[int | None]]
                     ) -> None:
    """A [1, .., 1, D] view read only where its leading ones change nothing (an Expand to a shape of its rank or
    more, an elementwise op whose other operand has its rank or more: a cls token, an initial state) is read as
    the flat Split's [D] piece itself, without its Reshape: numpy broadcasting gives the same result."""
    readers = _readers(graph)
    outputs = {o.name for o in graph.output}
    for value, (ranges, shape) in list(views.items()):
        if len(shape) < 2 or any(d != 1 for d in shape[:-1]) or value in outputs or not readers.get(value):
            continue
        if all(_broadcasts(n, value, len(shape), shapes) for n in readers[value]):
            flat = b.fresh("flat_view")
            for node in readers[value]:
                node.input[:] = [flat if i == value else i for i in node.input]
            del views[value]
            views[flat] = (ranges, (int(np.prod(shape, dtype=np.int64)),))


def _broadcasts(node: onnx.NodeProto, value: str, rank: int, shapes: Mapping[str, list[int | None]]) -> bool:
    """Whether ``node`` gives the same result with ``value`` (of ``rank``, every dim but the last 1) read flattened."""
    if node.domain not in ("", "ai.onnx") or list(node.input).count(value) != 1:
        return False
    if node.op_type == "Expand":
        length = shapes.get(node.input[1])
        return node.input[0] == value and length is not None and len(length) == 1 and (length[0] or 0) >= rank
    others = [shapes.get(i) for i in node.input if i != value]
    return node.op_type in _BROADCASTING and all(o is not None and len(o) >= rank for o in others)


def _gradient_pieces(b: NodeBuilder, graph: onnx.GraphProto, grads: list[str],
                     param_shapes: tuple[tuple[int, ...], ...], shapes: Mapping[str, list[int | None]] | None
                     ) -> list[str]:
    """The flat gradient's Concat inputs: each gradient flattened (a Reshape where its rank is not 1), or, where a
    gradient is an axis-0 Concat / Split chain read by nothing else (torch's recurrent gate reorders: Squeeze,
    Split, Concat), the pieces of its sources, flattened and split once each: the same elements in the same
    order, in fewer kernels (taken per connected chain where it runs fewer)."""
    flat_shape = None
    producer = {o: n for n in graph.node for o in n.output} if shapes is not None else {}
    readers = _readers(graph) if shapes is not None else {}
    # the gradients are the training graph's outputs until the train step's replace them
    outputs = {v.name for v in graph.output} - set(grads)

    def flat(value: str, rank: int, inside: set[int]) -> str:
        """``value`` flattened; a ReduceSum with keepdims of one axis longer than 1, read by nothing but ``inside``
        (the broadcast gradient of a [1, 1, D] parameter: a cls token, an initial state), summed without them
        instead (the same sums: onnxruntime sums the same elements in the same order, checked on 3,500 shapes
        [n, 1, d], [1, n, d], [n, 1, 1, d], [n, 2, 1, d], [1, 1, n, d])."""
        nonlocal flat_shape
        if rank == 1:
            return value
        source = value  # a view of a 1-D value (a gradient summed flat, then given the parameter's shape): that value
        while producer.get(source) is not None and producer[source].op_type in _VIEW_OPS and \
                producer[source].domain in ("", "ai.onnx"):
            source = producer[source].input[0]
            if len((shapes or {}).get(source) or ()) == 1:
                return source
        node, shape = producer.get(value), (shapes or {}).get(value)
        keep = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "keepdims"), 1) \
            if node is not None and node.op_type == "ReduceSum" and node.domain in ("", "ai.onnx") else 0
        if keep and shape and None not in shape and sum(d != 1 for d in shape) == 1 and \
                not _read_outside(readers, outputs, value, inside):
            axes = [i for i, d in enumerate(shape) if d == 1]
            if b.opset < 13:
                return b.op1("ReduceSum", [node.input[0]], axes=axes, keepdims=0)
            return b.op1("ReduceSum", [node.input[0], b.const(np.array(axes, np.int64), hint="axes")], keepdims=0)
        flat_shape = flat_shape or b.const(np.array([-1], np.int64), hint="flat")
        return b.op1("Reshape", [value, flat_shape])

    chain: dict[str, onnx.NodeProto] = {}
    if shapes is not None:
        stack = list(grads)
        while stack:
            node = producer.get(stack.pop())
            if node is not None and node.output[0] not in chain and _axis0_view(node, shapes):
                chain.update((o, node) for o in node.output)
                stack += list(node.input) if node.op_type == "Concat" else [node.input[0]]
        while True:  # a node stays in the chain while each of its outputs is read by chain nodes alone
            nodes = list({id(n): n for n in chain.values()}.values())
            inside = {id(n) for n in nodes}
            dropped = [n for n in nodes for o in n.output
                       if grads.count(o) > 1 or _read_outside(readers, outputs, o, inside)]
            if not dropped:
                break
            for n in dropped:
                for o in n.output:
                    chain.pop(o, None)

    def segments(value: str) -> list[tuple[str, int, int]]:
        node = chain.get(value)
        if node is None:
            return [(value, 0, int(np.prod(shapes[value] if shapes and value in shapes else (0,), dtype=np.int64)))]
        if node.op_type == "Concat":
            return [s for v in node.input for s in segments(v)]
        source = segments(node.input[0])
        if node.op_type != "Split":
            return source
        offset = sum(int(np.prod(shapes[o], dtype=np.int64)) for o in node.output[:list(node.output).index(value)])
        size = int(np.prod(shapes[value], dtype=np.int64))
        out, at = [], 0
        for root, a, z in source:
            lo, hi = max(offset, at), min(offset + size, at + z - a)
            if lo < hi:
                out.append((root, a + lo - at, a + hi - at))
            at += z - a
        return out

    per_grad = {g: segments(g) if g in chain else None for g in grads}
    component = _components((g, root) for g, segs in per_grad.items() if segs for root, _, _ in segs)
    taken: set[str] = set()
    for rep in set(component.values()):
        members = [g for g in grads if per_grad[g] and component.get(g) == rep]
        nodes = {id(n): n for v, n in chain.items() if any(v == g or _upstream(chain, g, v) for g in members)}
        roots = {root for g in members for root, _, _ in per_grad[g]}
        before = sum(len(shapes[g]) != 1 for g in members) + sum(n.op_type != "Identity" for n in nodes.values())
        after = 0
        for root in roots:
            segs = {(a, z) for g in members for r, a, z in per_grad[g] if r == root}
            size = int(np.prod(shapes[root], dtype=np.int64))
            after += (len(shapes[root]) != 1) + (segs != {(0, size)})
        if after < before:
            taken.update(members)
    # each root of the taken chains flattened and split once at every boundary its segments need
    cuts: dict[str, dict[tuple[int, int], str]] = {}
    chain_ids = {id(n) for n in chain.values()}  # a taken root's chain readers: all of its taken component
    for root in dict.fromkeys(r for g in grads if g in taken for r, _, _ in per_grad[g]):
        size = int(np.prod(shapes[root], dtype=np.int64))
        bounds = sorted({0, size} | {x for g in grads if g in taken for r, a, z in per_grad[g] if r == root
                                     for x in (a, z)})
        whole = flat(root, len(shapes[root]), chain_ids)
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        if len(spans) == 1:
            cuts[root] = {spans[0]: whole}
            continue
        outs = [b.fresh("piece") for _ in spans]
        if b.opset < 13:
            b.op("Split", [whole], outs, axis=0, split=[z - a for a, z in spans])
        else:
            b.op("Split", [whole, b.const(np.array([z - a for a, z in spans], np.int64), hint="sizes")], outs, axis=0)
        cuts[root] = dict(zip(spans, outs, strict=True))
    out = []
    for g, shape in zip(grads, param_shapes, strict=True):
        if g not in taken:
            out.append(flat(g, len(shape), set()))
            continue
        for root, a, z in per_grad[g]:
            out += [piece for (lo, hi), piece in cuts[root].items() if a <= lo and hi <= z]
    return out


def _upstream(chain: dict[str, onnx.NodeProto], value: str, target: str) -> bool:
    """Whether ``target`` is an output of a chain node ``value`` is computed through."""
    node = chain.get(value)
    if node is None:
        return False
    if target in node.output:
        return True
    reads = node.input if node.op_type == "Concat" else node.input[:1]
    return any(_upstream(chain, v, target) for v in reads)


def _like(value_info: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(value_info)
    copy.name = name
    copy.doc_string = ""
    return copy


def _prune(graph: onnx.GraphProto) -> None:
    """Drop the nodes no output needs (what only the removed outputs read, e.g. the accumulators' flags)."""
    needed = {vi.name for vi in graph.output}
    kept = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(node.input)
            for attr in node.attribute:  # subgraph bodies may read outer values by name
                for body in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                    needed.update(_outer_reads(body))
    del graph.node[:]
    graph.node.extend(reversed(kept))
    names = {vi.name for vi in graph.value_info if vi.name in needed}
    kept_info = [vi for vi in graph.value_info if vi.name in names]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)


def _sort_topologically(graph: onnx.GraphProto) -> None:
    """Reorder the nodes so that each comes after the producers of what it reads (a subgraph's outer reads
    included), keeping the given order wherever it already is one."""
    nodes = list(graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    readers: dict[int, list[int]] = {}
    waiting = []
    for i, node in enumerate(nodes):
        reads = set(node.input)
        for attr in node.attribute:
            for body in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                reads |= _outer_reads(body)
        needs = {producer[r] for r in reads if r in producer and producer[r] != i}
        for j in needs:
            readers.setdefault(j, []).append(i)
        waiting.append(len(needs))
    ready = [i for i, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in readers.get(i, ()):
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, j)
    if len(order) != len(nodes):
        raise ModelError("the train-step graph has a cycle")
    del graph.node[:]
    graph.node.extend(nodes[i] for i in order)


@dataclass(frozen=True)
class BoundModel:
    """The train-step model as :class:`BoundStep` runs it (:func:`bound_model`): the same step with fewer kernels,
    for a caller that binds memory rather than feeding tensors."""

    model: onnx.ModelProto
    # inputs bound to a range of a flat state input's own memory: {input: (flat input, start, end, shape)}
    views: dict[str, tuple[str, int, int, tuple[int, ...]]]
    # [1] f32 inputs the caller computes each step (:class:`StepScalarFeed`): {input: StepScalars field}
    scalars: dict[str, str]
    adamw: AdamW | None
    # inputs bound to buffers of their own whose values do not matter (BoundStep zeroes them before every run):
    # {input: (elem type, shape)}
    scratch: dict[str, tuple[int, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    # flat state inputs held in another order than the train-step model's (:func:`_joined_layouts`): {flat
    # parameter input: index}, the bound buffer's element k is the written layout's element index[k], and so for
    # that FlatState's moments
    layouts: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def bound_model(step: TrainStep, *, single_thread: bool = False) -> BoundModel:
    """``step``'s model with the kernels a binding caller does without (``step``'s model is left as it is, the
    tensor-in, tensor-out interface of the module docstring):

    1. the parameters the flat state form cuts out of its flat input (one Split, a Reshape per parameter of rank
       other than 1) become inputs of their own, which :class:`BoundStep` binds to the flat input's memory at
       their offsets. onnxruntime may write a node's output into an input's buffer (in place, where that node is
       the input's last reader: the update's nodes, for the flat input), so this is done only where every reader
       of a view comes before the update (an ancestor of the flat gradient, which the update waits for);
    2. AdamW's step scalars (bias corrections, corrected learning rate, learning rate times weight decay: 8
       kernels) become [1] inputs computed in Python by the same operations (:class:`StepScalarFeed`);
    3. batch norm's training-mode BatchNormalization with momentum 0 (BatchNormInternal's lowering) reads its
       running-statistics inputs only times 0: they are per-node buffers (the kernel may write its statistics
       into them) of finite values, two Muls of the scale a node in the model, scratch inputs here;
    4. ``single_thread`` (a session of one intra-op thread): each per-channel sum done in two stages (a ReduceSum
       over the spatial axes, then one over the batch: batch norm's small gradient form) is one ReduceSum over
       all of them (:func:`merge_staged_sums`)."""
    model = onnx.ModelProto()
    model.CopyFrom(step.model)
    graph = model.graph
    constants = constant_values(graph)
    flats = {f.names[0]: f for f in step.interface.flat}
    outputs = {vo.name for vo in graph.output}
    readers = _readers(graph)
    dropped: set[int] = set()
    views: dict[str, tuple[str, int, int, tuple[int, ...]]] = {}
    for node in graph.node:
        if node.op_type != "Split" or not node.input or node.input[0] not in flats:
            continue
        flat = flats[node.input[0]]
        sizes = constants.get(node.input[1]) if len(node.input) > 1 and node.input[1] else next(
            (onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "split"), None)
        if sizes is None or len(sizes) != len(node.output) or any(o in outputs for o in node.output):
            continue
        dropped.add(id(node))
        start = 0
        for piece, size in zip(node.output, (int(s) for s in sizes), strict=True):
            end = start + size
            kept = []
            for reader in readers.get(piece, []):
                shape = _view_shape(reader, size, constants)
                if shape is None or reader.output[0] in outputs or id(reader) in dropped:
                    kept.append(reader)
                    continue
                dropped.add(id(reader))
                views[reader.output[0]] = (flat.names[0], start, end, shape)
            if kept:
                views[piece] = (flat.names[0], start, end, (size,))
            start = end
    if views and not _read_before_update(graph, readers, views, dropped):
        views, dropped = {}, set()
    layouts = _joined_layouts(model, views, flats, outputs, dropped) if views else {}
    new_inputs = [helper.make_tensor_value_info(name, flats[flat].elem_type, list(shape))
                  for name, (flat, _, _, shape) in views.items()]
    fed: dict[str, str] = {}
    if step.scalars is not None and step.adamw is not None:
        produced = {o for n in graph.node for o in n.output}
        for field in step.adamw.computed_fields():
            name = getattr(step.scalars, field)
            if name in produced and name not in fed:
                fed[name] = field
                new_inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [1]))
        dropped.update(id(n) for n in graph.node if n.output and all(o in fed for o in n.output if o))
    scratch = _batch_norm_scratch(graph, views, flats, readers)
    for name, (elem, shape) in scratch.items():
        new_inputs.append(helper.make_tensor_value_info(name, elem, list(shape)))
    dropped.update(id(n) for n in graph.node if n.output and all(o in scratch for o in n.output if o))
    kept_nodes = [n for n in graph.node if id(n) not in dropped]
    del graph.node[:]
    graph.node.extend(kept_nodes)
    _prune(graph)
    read = {v for n in graph.node for v in _reads(n)} | outputs
    kept_inputs = [vi for vi in graph.input if vi.name in read or vi.name not in ("learning_rate", "step")]
    del graph.input[:]
    graph.input.extend([*kept_inputs, *new_inputs])
    if single_thread:  # last: it rebuilds the node list, whose identities the steps above go by
        merge_staged_sums(graph)
    return BoundModel(model, views, fed, step.adamw, scratch, layouts)


def _joined_layouts(model: onnx.ModelProto, views: dict[str, tuple[str, int, int, tuple[int, ...]]],
                    flats: Mapping[str, FlatState], outputs: set[str], dropped: set[int]) -> dict[str, np.ndarray]:
    """Where the step joins views of the flat parameter input by a Concat (torch's recurrent gate reorders: the
    [4H, I] weight's gate blocks i, f, g, o read as the ONNX kernel's i, o, f, c), the bound buffer holds those
    pieces in the joined order instead, so the join is one bound view and no kernel. The flat gradient's Concat
    takes its pieces in the same order, and a Split whose outputs it then takes one after another, all of them in
    order (the gradient cut in gate blocks only to be put in torch's order), is its input again: no Split either.
    The update is elementwise over the flat buffers, so any one order of the parameters, the moments and the
    gradient together is the same update, element for element. Taken for one flat parameter input and its flat
    gradient, where every view and every gradient piece stays one range in the new order and every reader of a
    new view runs before the update (as for every view: :func:`_read_before_update`). Mutates ``views``,
    ``dropped`` and the flat gradient's Concat; returns {flat input: index} (:class:`BoundModel`'s ``layouts``).
    Held-out lstm_sensor: 6 Concats / Splits a step fewer."""
    graph = model.graph
    gradients = _flat_gradients(graph)
    if len(flats) != 1 or len(gradients) != 1:
        return {}
    ((name, flat),) = flats.items()
    mine = {v: (start, end) for v, (f, start, end, _) in views.items() if f == name}
    joins = [n for n in graph.node if n.op_type == "Concat" and n.domain in ("", "ai.onnx") and id(n) not in dropped
             and len(n.input) > 1 and n.output[0] not in outputs
             and all(i in mine and len(views[i][3]) == 1 for i in n.input)]
    if not joins:
        return {}
    gradient = gradients[0]
    shapes = static_shapes(model)
    pieces, offset = [], 0
    for value in gradient.input:
        shape = shapes.get(value)
        if shape is None or None in shape:
            return {}
        size = int(np.prod(shape, dtype=np.int64))
        pieces.append((offset, offset + size))
        offset += size
    if offset != flat.size:
        return {}
    ranges = [*mine.values(), *pieces]
    bounds = sorted({0, flat.size} | {x for r in ranges for x in r})
    atoms = list(zip(bounds[:-1], bounds[1:], strict=True))

    def within(start: int, end: int) -> list[tuple[int, int]]:
        return [a for a in atoms if start <= a[0] and a[1] <= end]

    def parts_of(join: onnx.NodeProto) -> list[tuple[int, int]]:
        return [a for value in join.input for a in within(*mine[value])]

    # atom: the join it is placed with, the longest first; a join of atoms all placed already (the same pieces
    # joined again, or some of them: GRU's R_zr of R) must find them in its order (checked below)
    joined: dict[tuple[int, int], int] = {}
    for index in sorted(range(len(joins)), key=lambda k: -len(parts_of(joins[k]))):
        parts = parts_of(joins[index])
        if all(a in joined for a in parts):
            continue
        if any(a in joined for a in parts):
            return {}
        joined.update((a, index) for a in parts)
    order, placed = [], set()
    for atom in atoms:
        if atom in placed:
            continue
        run = parts_of(joins[joined[atom]]) if atom in joined else [atom]
        order += run
        placed.update(run)
    position, at = {}, 0
    for atom in order:
        position[atom] = at
        at += atom[1] - atom[0]

    def placed_range(parts: list[tuple[int, int]]) -> tuple[int, int] | None:
        """Where ``parts`` lie in the new order, None where they are no longer one range in their order (or none:
        a zero-size parameter is no reason for a layout)."""
        if not parts or any(position[b] != position[a] + a[1] - a[0] for a, b in zip(parts, parts[1:], strict=False)):
            return None
        return position[parts[0]], position[parts[0]] + sum(z - a for a, z in parts)

    new_views = {v: placed_range(within(*r)) for v, r in mine.items()}
    new_views.update((join.output[0], placed_range(parts_of(join))) for join in joins)
    new_pieces = [placed_range(within(*r)) for r in pieces]
    if order == atoms or None in new_views.values() or None in new_pieces:
        return {}
    join_ids = {id(n) for n in joins}
    readers = {v: [r for r in rs if id(r) not in dropped and id(r) not in join_ids]
               for v, rs in _readers(graph).items()}
    if not _read_before_update(graph, readers, dict.fromkeys(new_views), dropped | join_ids):
        return {}
    for value, (start, end) in new_views.items():
        shape = views[value][3] if value in views else (end - start,)
        if value in mine and not readers.get(value):
            del views[value]  # a piece only a join read
        else:
            views[value] = (name, start, end, shape)
    dropped |= join_ids
    inputs = [v for _, v in sorted(zip((r[0] for r in new_pieces), gradient.input, strict=True))]
    producer = {o: n for n in graph.node for o in n.output}
    collapsed, splits, k = [], [], 0
    while k < len(inputs):
        split = producer.get(inputs[k])
        outs = list(split.output) if split is not None and split.op_type == "Split" else []
        if outs and inputs[k:k + len(outs)] == outs and len(shapes.get(split.input[0]) or ()) == 1:
            collapsed.append(split.input[0])
            splits.append(split)
            k += len(outs)
        else:
            collapsed.append(inputs[k])
            k += 1
    del gradient.input[:]
    gradient.input.extend(collapsed)
    read = {v for n in graph.node if id(n) not in dropped for v in _reads(n)} | outputs
    dropped.update(id(split) for split in splits if not read & set(split.output))  # read by nothing else now
    return {name: np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in order])}


def merge_staged_sums(graph: onnx.GraphProto) -> int:
    """Replace each ``ReduceSum(ReduceSum(x, S), [0])`` (both without keepdims, S the axes after 0, the inner one
    read by the outer one alone) by one ``ReduceSum(x, [0, *S])``; returns how many. onnxruntime sums the kept
    axis's rows the same way in both (each contiguous run of S, then the rows over axis 0 in order: byte-equal on
    5-step trainings of the held-out CNNs), 2 kernels fewer a batch-norm gradient, but with a second intra-op
    thread it hands the one reduction over and it is slower (1.33-1.44x a layer), so only for one thread: 0.89-0.96x
    a layer at one."""
    constants = constant_values(graph)
    producer = {o: n for n in graph.node for o in n.output}
    readers = _readers(graph)
    outputs = {vo.name for vo in graph.output}

    def sum_axes(node: onnx.NodeProto) -> list[int] | None:
        if node.op_type != "ReduceSum" or node.domain not in ("", "ai.onnx"):
            return None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("keepdims", 1) != 0 or attrs.get("noop_with_empty_axes", 0):
            return None
        if len(node.input) > 1 and node.input[1]:
            axes = constants.get(node.input[1])
            return None if axes is None else [int(a) for a in axes.reshape(-1)]
        return [int(a) for a in attrs["axes"]] if "axes" in attrs else None

    merged = 0
    gone: set[int] = set()
    for node in graph.node:
        if sum_axes(node) != [0]:
            continue
        inner = producer.get(node.input[0])
        axes = sum_axes(inner) if inner is not None and id(inner) not in gone else None
        if not axes or any(a <= 0 for a in axes) or len(readers.get(inner.output[0], [])) != 1 or \
                inner.output[0] in outputs:
            continue
        node.input[0] = inner.input[0]
        if len(node.input) > 1 and node.input[1]:
            name = f"{node.output[0]}.axes"
            graph.initializer.append(onnx.numpy_helper.from_array(np.array([0, *sorted(axes)], np.int64), name))
            node.input[1] = name
        else:
            for attr in node.attribute:
                if attr.name == "axes":
                    attr.CopyFrom(helper.make_attribute("axes", [0, *sorted(axes)]))
        gone.add(id(inner))
        merged += 1
    if gone:
        kept = [n for n in graph.node if id(n) not in gone]
        del graph.node[:]
        graph.node.extend(kept)
    return merged


def _flat_gradients(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The Concats that make the flat state's gradients (one per flat group, :func:`_flat_state_update`)."""
    return [n for n in graph.node if n.op_type == "Concat" and n.name.startswith("train_step/")
            and any("flat_gradients" in o for o in n.output)]


def _read_before_update(graph: onnx.GraphProto, readers: Mapping[str, list[onnx.NodeProto]],
                        views: Mapping[str, tuple], dropped: set[int]) -> bool:
    """Whether every reader of the views is an ancestor of each flat gradient (the updates' Concats), so that it
    runs before any update node can overwrite a flat input in place."""
    producer = {o: n for n in graph.node for o in n.output}
    concats = _flat_gradients(graph)
    if not concats:
        return False
    common: set[int] | None = None
    for concat in concats:
        ancestors: set[int] = set()
        stack = list(concat.input)
        while stack:
            node = producer.get(stack.pop())
            if node is None or id(node) in ancestors:
                continue
            ancestors.add(id(node))
            stack.extend(_reads(node))
        common = ancestors if common is None else common & ancestors
    return all(id(r) in common for v in views for r in readers.get(v, []) if id(r) not in dropped)


def _batch_norm_scratch(graph: onnx.GraphProto, views: Mapping[str, tuple], flats: Mapping[str, FlatState],
                        readers: Mapping[str, list[onnx.NodeProto]]) -> dict[str, tuple[int, tuple[int, ...]]]:
    """{value: (elem type, shape)}: the running-statistics inputs of training-mode BatchNormalizations with momentum
    0 whose scale is a parameter view (its shape and type known), each read by that node alone."""
    scratch: dict[str, tuple[int, tuple[int, ...]]] = {}
    for node in graph.node:
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx") or len(node.input) != 5:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        scale = node.input[1]
        if attrs.get("training_mode") != 1 or float(attrs.get("momentum", 0.9)) != 0.0 or scale not in views:
            continue
        stats = node.input[3:5]
        if stats[0] == stats[1] or any(len(readers.get(v, [])) != 1 or v in scratch for v in stats):
            continue
        for value in stats:
            scratch[value] = (flats[views[scale][0]].elem_type, tuple(views[scale][3]))
    return scratch


class StepScalarFeed:
    """AdamW's step scalars for :func:`bound_model`'s inputs, written each step into [1] f32 arrays (``arrays``,
    by input name) that the bound inputs share: the learning-rate-free parts tabulated for ``CHUNK`` steps at a
    time (:meth:`AdamW.step_table`), so a step costs a few element writes (about 0.5 us; the 8 kernels it
    replaces cost about 3.5)."""

    CHUNK = 1024

    def __init__(self, adamw: AdamW, fed: Mapping[str, str]) -> None:
        self.adamw = adamw
        self.arrays = {name: np.zeros(1, np.float32) for name in fed}
        self._writes = [(field, self.arrays[name]) for name, field in fed.items()]
        self._decay = float(np.float32(adamw.weight_decay))
        self._start = -self.CHUNK  # the first step of the table
        self._table: dict[str, list[float]] = {}

    def write(self, lr: float, step: int) -> None:
        i = step - self._start
        if not 0 <= i < self.CHUNK:
            self._start, i = step, 0
            self._table = self.adamw.step_table(np.arange(step, step + self.CHUNK, dtype=np.int64))
        lr = float(lr)
        for field, array in self._writes:  # a product of two f32 values is exact in a double: one rounding
            if field == "lr_corrected":
                array[0] = lr * self._table["ratio"][i]
            elif field == "lr_decay":
                array[0] = lr * self._decay
            else:
                array[0] = self._table[field][i]


def _view_shape(node: onnx.NodeProto, size: int, constants: Mapping[str, np.ndarray]) -> tuple[int, ...] | None:
    """The shape ``node`` gives a 1-D value of ``size`` elements when it only views it (an Identity, or a
    Reshape to a constant shape without 0 dims), else None."""
    if node.op_type == "Identity":
        return (size,)
    if node.op_type != "Reshape" or len(node.input) < 2 or node.input[1] not in constants:
        return None
    target = [int(d) for d in constants[node.input[1]].reshape(-1)]
    if 0 in target or target.count(-1) > 1:
        return None
    try:
        return tuple(np.empty(size, np.int8).reshape(target).shape)
    except ValueError:
        return None


def _loss_buffers(session, loss: str) -> list[np.ndarray]:
    """Two arrays (one per binding) for the loss to be written into, where its declared shape is static and its
    type a NumPy one; else none (onnxruntime then allocates the output each step)."""
    declared = next((o for o in session.get_outputs() if o.name == loss), None)
    if declared is None or not all(isinstance(d, int) for d in declared.shape):
        return []
    types = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16}
    dtype = types.get(declared.type)
    return [np.zeros(declared.shape, dtype) for _ in range(2)] if dtype is not None else []


def _outer_reads(body: onnx.GraphProto) -> set[str]:
    reads = set()
    for node in body.node:
        reads.update(node.input)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                reads |= _outer_reads(sub)
    return reads


class BoundStep:
    """The train-step model in an onnxruntime session, run with IOBinding: the state (parameters, moments,
    updated frozen values) lives in two sets of OrtValues that swap roles each step (step k reads set k mod 2
    and writes its ``.updated`` outputs into the other), so no state crosses the Python boundary unless it
    is read; each step copies in only the batch, the step number and (bound_model) the step scalars."""

    def __init__(self, session, interface: TrainStepInterface, state: Mapping[str, np.ndarray],
                 constants: Mapping[str, np.ndarray], learning_rate: np.ndarray, bound: BoundModel | None = None
                 ) -> None:
        """``bound``: the session runs ``bound.model`` (:func:`bound_model`) rather than the train-step model."""
        import onnxruntime as ort

        self._ort = ort
        self.session, self.interface = session, interface
        self._bound_views = bound.views if bound is not None else {}
        # flat inputs the bound model holds in another order (BoundModel.layouts): {flat input: (index, inverse)}
        self._layouts = {}
        for f in interface.flat:
            index = bound.layouts.get(f.names[0]) if bound is not None else None
            if index is not None:
                self._layouts.update({n: (index, np.argsort(index)) for n in f.names})
        # the step scalars computed here, in [1] f32 arrays shared with their OrtValues
        self._feed = StepScalarFeed(bound.adamw, bound.scalars) if bound is not None and bound.scalars else None
        self._fed_values = {name: ort.OrtValue.ortvalue_from_numpy(array)
                            for name, array in (self._feed.arrays.items() if self._feed else ())}
        # bound_model's batch-norm scratch inputs: ranges of one buffer, zeroed before every run. onnxruntime writes
        # each batch's statistics into them, and a NaN left there from one batch would spoil every later step (x 0
        # is NaN still), restored state or not
        self._scratch: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}
        size = 0
        for name, (elem, shape) in (bound.scratch.items() if bound is not None else ()):
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem))
            self._scratch[name] = (dtype, tuple(shape), size)
            size += -(-int(np.prod(shape, dtype=np.int64)) * dtype.itemsize // 64) * 64  # 64-byte aligned ranges
        self._scratch_buffer = np.zeros(size, np.uint8)
        self._names = interface.state_inputs
        # the flat state form: per-parameter state names are views into the flat inputs
        self._views = interface.views()
        initial = {n: state[n] for n in self._names if n in state}
        for f in (*interface.flat, *interface.flat_frozen):
            for name in f.names:
                pieces = [np.asarray(state[p]).reshape(-1) for p, (flat, *_) in self._views.items() if flat == name]
                initial[name] = np.concatenate(pieces).astype(helper.tensor_dtype_to_np_dtype(f.elem_type))
                initial[name] = self._bound_order(name, initial[name])
        self._sets = [{n: ort.OrtValue.ortvalue_from_numpy(np.array(initial[n], copy=True)) for n in self._names}
                      for _ in range(2)]
        self._constants = {n: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v)) for n, v in constants.items()}
        # the learning rate, the step number and (where its shape is static) the loss live in NumPy arrays whose
        # memory their OrtValues share: a step writes and reads them in place (on mlp_act, 12 of a 48 us step went
        # to OrtValue.update_inplace, get_outputs() and .numpy() before)
        self._lr_value = np.array(learning_rate, np.float32).reshape(1)
        self._lr = ort.OrtValue.ortvalue_from_numpy(self._lr_value)
        self._step_value = np.zeros(1, np.int64)
        self._step = ort.OrtValue.ortvalue_from_numpy(self._step_value)
        self._loss_name = interface.loss
        self._losses = _loss_buffers(session, interface.loss)
        self._loss_values = [ort.OrtValue.ortvalue_from_numpy(v) for v in self._losses] if self._losses else []
        self._data: dict = {}
        self._data_arrays: dict[str, np.ndarray] = {}  # the memory of the data OrtValues
        self._bindings: list = []
        self._current = 0  # the set holding the current state

    def replace_session(self, session) -> None:
        """Run the same model in ``session`` from now on (other options); the state stays in its OrtValues."""
        self.session = session
        self._bindings = []  # rebuilt by the next run

    def _bind(self) -> None:
        """(Re)build both bindings: after the data OrtValues were (re)allocated."""
        self._bindings = []
        inputs = {i.name for i in self.session.get_inputs()}
        for i in range(2):
            binding = self.session.io_binding()
            for name, value in {**self._constants, **self._data, "learning_rate": self._lr, "step": self._step,
                                **self._fed_values, **self._sets[i]}.items():
                if name in inputs:
                    binding.bind_ortvalue_input(name, value)
            base = self._scratch_buffer.ctypes.data
            for name, (dtype, shape, offset) in self._scratch.items():
                binding.bind_input(name, "cpu", 0, dtype, list(shape), base + offset)
            for name, (flat, start, _, shape) in self._bound_views.items():
                held = self._sets[i][flat]
                dtype = held.numpy().dtype
                binding.bind_input(name, "cpu", 0, dtype, list(shape), held.data_ptr() + start * dtype.itemsize)
            if self._loss_values:
                binding.bind_ortvalue_output(self._loss_name, self._loss_values[i])
            else:
                binding.bind_output(self._loss_name, "cpu")
            for name, value in self._sets[1 - i].items():
                binding.bind_ortvalue_output(f"{name}.updated", value)
            self._bindings.append(binding)

    def run(self, batch: Mapping[str, np.ndarray], step: int) -> float:
        rebind = not self._bindings
        for name in self.interface.data:
            # the batch copied into an array whose memory its OrtValue shares (np.copyto: 2.6 -> 1.1 us a step for
            # mlp_ce_inmodel's two inputs against OrtValue.shape() and update_inplace)
            value = batch[name]
            if not isinstance(value, np.ndarray):
                value = np.asarray(value)
            held = self._data_arrays.get(name)
            if held is None or held.shape != value.shape or held.dtype != value.dtype:
                held = self._data_arrays[name] = np.array(value, copy=True, order="C")
                self._data[name] = self._ort.OrtValue.ortvalue_from_numpy(held)
                rebind = True
            else:
                np.copyto(held, value)
        if rebind:
            self._bind()
        self._step_value[0] = step
        if self._feed is not None:
            self._feed.write(self._lr_value[0], step)
        if self._scratch:
            self._scratch_buffer.fill(0)
        binding = self._bindings[self._current]
        self.session.run_with_iobinding(binding)
        loss = self._losses[self._current] if self._losses else binding.get_outputs()[0].numpy()
        self._current = 1 - self._current
        return float(loss.reshape(-1)[0])

    def set_learning_rate(self, learning_rate: float) -> None:
        self._lr_value[0] = learning_rate

    def read(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """The current values of state (or constant) inputs, as NumPy copies; a parameter (or moment) the flat
        state holds by its own name, cut out of its flat input."""
        current = self._sets[self._current]
        out = {}
        for n in names:
            if n in self._views:
                flat, start, end, shape = self._views[n]
                out[n] = np.array(self._written_order(flat, current[flat].numpy())[start:end],
                                  copy=True).reshape(shape)
            else:
                # .numpy() of a CPU OrtValue may share its memory, which the next step overwrites: copy
                held = (current[n] if n in current else self._constants[n]).numpy()
                out[n] = np.array(self._written_order(n, held), copy=True)
        return out

    def write(self, values: Mapping[str, np.ndarray]) -> None:
        """Replace state (or constant) values; shapes must stay. A parameter (or moment) the flat state holds is
        written into its place in the flat input."""
        current = self._sets[self._current]
        flats: dict[str, np.ndarray] = {}
        for name, value in values.items():
            if name in self._views:
                flat, start, end, shape = self._views[name]
                if flat not in flats:
                    flats[flat] = np.array(self._written_order(flat, current[flat].numpy()), copy=True)
                if tuple(np.shape(value)) != tuple(shape):
                    raise ValueError(f"{name}: shape {list(np.shape(value))}; the parameter has {list(shape)}")
                flats[flat][start:end] = np.asarray(value, flats[flat].dtype).reshape(-1)
                continue
            held = current[name] if name in current else self._constants[name]
            held.update_inplace(np.ascontiguousarray(self._bound_order(name, np.asarray(value, held.numpy().dtype))))
        for flat, array in flats.items():
            current[flat].update_inplace(self._bound_order(flat, array))

    def _bound_order(self, flat: str, values: np.ndarray) -> np.ndarray:
        """A flat input's values (in the train-step model's order) in the bound buffer's order."""
        return values[self._layouts[flat][0]] if flat in self._layouts else values

    def _written_order(self, flat: str, values: np.ndarray) -> np.ndarray:
        """A flat input's values in the train-step model's order (the bound buffer's own where it is that)."""
        return values[self._layouts[flat][1]] if flat in self._layouts else values
