"""``generate_artifacts``: a forward model to the four files onnxruntime-training 1.19.2 writes, without it.

Same signature and argument names as ``onnxruntime.training.artifacts.generate_artifacts`` (a script changes
only its import), same files (``training_model.onnx``, ``eval_model.onnx``, ``optimizer_model.onnx``,
``checkpoint``) with the same graph inputs and outputs:

- training model inputs: the forward model's inputs, the loss block's label input (``labels`` or ``target``),
  the parameters (trainable and frozen, in the forward model's initializer order), one
  ``<p>_grad.accumulation.buffer`` per trainable parameter, ``lazy_reset_grad``; outputs: the loss, the
  additional outputs, one ``<p>_grad.accumulation.out`` flag per trainable parameter (InPlaceAccumulatorV2);
- eval model: the forward model and the loss block in inference mode (BatchNormalization with one output,
  Dropout without training mode), the same inputs but the buffers and ``lazy_reset_grad``;
- optimizer model: see :mod:`lowering.training.optimizers`; checkpoint: the parameters in onnxruntime-training's
  FlatBuffers format (trainable and frozen).

The gradient graph comes from :mod:`lowering.training.autodiff` with the rules of
:mod:`lowering.training.gradients`; every custom node it emits is one of the training ops the project's specs
define, so ``oplower check`` verifies the result and ``oplower train`` (or onnxruntime-training's own
runtime) trains it.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from lowering.modelio import load_model
from lowering.training.autodiff import differentiate, prepare_forward
from lowering.training.checkpoint import Checkpoint, encode_checkpoint_buffer
from lowering.training.gradients import NO_GRADIENT, rule_for
from lowering.training.gradients.context import FLOAT_TYPES, ForwardContext
from lowering.training.losses import LABEL_INPUT, LossType, Tokens, add_loss
from lowering.training.optimizers import OptimType, optimizer_model
from opdef.errors import ModelError, OplowerError

__all__ = ["Artifacts", "LossType", "OptimType", "build_artifacts", "generate_artifacts"]

BUFFER = "_grad.accumulation.buffer"
FLAG = "_grad.accumulation.out"
LAZY_RESET = "lazy_reset_grad"
PROTOBUF_LIMIT = 2**31 - 1
_MS = "com.microsoft"


class ArtifactError(ModelError):
    """Bad arguments or a forward model the generator cannot use (one line, exit 1)."""


@dataclass
class Artifacts:
    training: onnx.ModelProto
    eval: onnx.ModelProto
    optimizer: onnx.ModelProto | None
    checkpoint: Checkpoint
    trainable: list[str]
    frozen: list[str]
    loss: str
    notes: list[str] = field(default_factory=list)


def _opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    raise ArtifactError("the forward model imports no default-domain opset")


def _below_limit(model: onnx.ModelProto) -> bool:
    """Whether ``model`` serialises within the 2 GB protobuf limit. upb's ByteSize of a whole model costs about as
    much as serialising it (8-22 ms for MobileNetV2's 2.4 MB, asked three times per build) while its parts' sizes
    are cheap: an upper bound from them decides, the exact size only near the limit."""
    return _size_bound(model) < PROTOBUF_LIMIT or model.ByteSize() < PROTOBUF_LIMIT


def _serialized_below_limit(model: onnx.ModelProto) -> bytes | None:
    """``model``'s bytes when they are fewer than the protobuf limit, else None. The generated models hold no
    weights (the parameters are graph inputs): serialising them costs less than bounding their size part by part
    (0.2 against 1.0 ms, MobileNetV2's training model); their initializers' sizes first, so that a model whose
    tensors alone reach the limit is never serialised whole."""
    if sum(t.ByteSize() for t in model.graph.initializer) >= PROTOBUF_LIMIT:
        return None
    try:
        data = model.SerializeToString()
    except Exception:  # noqa: BLE001 -- beyond what protobuf can encode (a node's giant attribute)
        return None
    return data if len(data) < PROTOBUF_LIMIT else None


def _size_bound(message) -> int:
    """An upper bound of ``message``'s serialised size: its fields' own sizes, each with a tag and a length prefix
    of at most 11 bytes (a graph's fields one by one; nothing is copied)."""
    total = 0
    for fd, value in message.ListFields():
        repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED  # protobuf < 5.29
        for v in (value if repeated else [value]):
            if fd.type == fd.TYPE_MESSAGE:
                size = _size_bound(v) if fd.message_type.name == "GraphProto" else v.ByteSize()
            elif isinstance(v, bytes):
                size = len(v)
            elif isinstance(v, str):
                size = len(v.encode())
            else:
                size = 10
            total += size + 11
    return total


def _inference_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with large initializers replaced by typed graph inputs (shape inference needs only their types;
    a >2 GB model cannot be serialised for it). Built field by field: the weights are never copied (a whole
    copy of MobileNetV2 CIFAR's 2.4 MB model, then dropping them, cost 2.5 ms a time)."""
    light = onnx.ModelProto()
    for fd, value in model.ListFields():
        if fd.name != "graph":
            _copy_field(light, fd, value)
    declared = {vi.name for vi in model.graph.input}
    kept, typed = [], []
    for t in model.graph.initializer:
        if math.prod(t.dims) > 4096 or t.data_location == onnx.TensorProto.EXTERNAL:
            if t.name not in declared:
                typed.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            kept.append(t)
    g = light.graph
    for fd, value in model.graph.ListFields():
        if fd.name == "initializer":
            g.initializer.extend(kept)
        else:
            _copy_field(g, fd, value)
    g.input.extend(typed)
    return light


def _copy_field(message, fd, value) -> None:
    repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED  # protobuf < 5.29
    if repeated:
        getattr(message, fd.name).extend(value)
    elif fd.type == fd.TYPE_MESSAGE:
        getattr(message, fd.name).CopyFrom(value)
    else:
        setattr(message, fd.name, value)


def _infer(light: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(light, strict_mode=False, data_prop=True)
    except Exception as exc:  # noqa: BLE001 -- inference failing on a custom op is not fatal
        del exc
        return light


def _collect(types: dict[str, onnx.TypeProto], inferred: onnx.ModelProto) -> None:
    for vi in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output):
        if vi.type.WhichOneof("value") is not None:
            types[vi.name] = vi.type


def _types(model: onnx.ModelProto) -> tuple[dict[str, onnx.TypeProto], onnx.ModelProto]:
    inferred = _infer(_inference_copy(model))
    types: dict[str, onnx.TypeProto] = {}
    _collect(types, inferred)
    for t in model.graph.initializer:
        if t.name not in types:  # the large ones are typed inputs already
            types[t.name] = helper.make_tensor_type_proto(t.data_type, list(t.dims))
    return types, inferred


def _block_types(model: onnx.ModelProto, first_node: int, first_input: int, first_init: int,
                 types: dict[str, onnx.TypeProto], inferred: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """``_types(model)`` after the loss block (``model``'s nodes, inputs and initializers from ``first_*`` on) was
    appended to the model ``types`` and ``inferred`` describe: onnx's inference of the block alone, its inputs
    typed as they are there (inference runs forward: nothing before the block changes). One whole-model inference
    fewer (MobileNetV2 CIFAR: 5 ms)."""
    out = dict(types)
    graph = model.graph
    block = graph.node[first_node:]
    added_inits = graph.initializer[first_init:]
    if not block and len(graph.input) == first_input and not added_inits:
        return out
    light = onnx.ModelProto()
    for fd, value in model.ListFields():
        if fd.name != "graph":
            _copy_field(light, fd, value)
    g = light.graph
    g.name = graph.name
    g.input.extend(graph.input[first_input:])
    seen = {vi.name for vi in g.input}
    produced = {o for n in block for o in n.output if o}
    inits = {t.name: t for t in graph.initializer} if block else {}
    for node in block:
        for v in node.input:
            if v and v not in produced and v not in seen:
                seen.add(v)
                t = inits.get(v)
                if t is not None and t.data_location != onnx.TensorProto.EXTERNAL and \
                        math.prod(t.dims) <= 4096:
                    g.initializer.append(t)  # as the whole model's inference copy keeps it: its values are data
                elif v in types:
                    g.input.append(onnx.ValueInfoProto(name=v, type=types[v]))
    g.node.extend(block)
    # the symbols onnx makes up for unknown dims (unk__<n>) are numbered past the ones the graph already holds
    if any(d.dim_param.startswith("unk__") for vi in inferred.graph.value_info for d in vi.type.tensor_type.shape.dim
           if vi.type.HasField("tensor_type")):
        g.value_info.extend(inferred.graph.value_info)
        g.output.extend(inferred.graph.output)
    _collect(out, _infer(light))
    for t in added_inits:
        if t.name not in out:
            out[t.name] = helper.make_tensor_type_proto(t.data_type, list(t.dims))
    return out


def _constants(model: onnx.ModelProto, params: set[str]) -> dict[str, np.ndarray]:
    values: dict[str, np.ndarray] = {}
    for t in model.graph.initializer:
        if t.name not in params and math.prod(t.dims) <= 4096 and \
                t.data_location != onnx.TensorProto.EXTERNAL:
            values[t.name] = numpy_helper.to_array(t)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output:
            for a in node.attribute:
                if a.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(a.t)
                elif a.name in ("value_float", "value_int"):
                    values[node.output[0]] = np.asarray(helper.get_attribute_value(a))
                elif a.name in ("value_floats", "value_ints"):
                    values[node.output[0]] = np.asarray(helper.get_attribute_value(a))
    return values


def _loss_ancestors(nodes: Sequence[onnx.NodeProto], loss: str) -> set[str]:
    """Every value the loss is reachable from through inputs a gradient can flow through."""
    wanted = {loss}
    for node in reversed(nodes):
        if not any(o in wanted for o in node.output if o):
            continue
        if node.op_type in NO_GRADIENT and node.domain in ("", "ai.onnx"):
            continue
        rule = rule_for(node.domain, node.op_type)
        positions = rule.differentiable if rule is not None else range(len(node.input))
        wanted.update(node.input[i] for i in positions if i < len(node.input) and node.input[i])
    return wanted


def _check_names(model: onnx.ModelProto, requires_grad, frozen_params) -> tuple[list[str] | None, list[str]]:
    inits = {t.name: t for t in model.graph.initializer}
    for what, names in (("requires_grad", requires_grad), ("frozen_params", frozen_params)):
        if names is None:
            continue
        if isinstance(names, str):
            raise ArtifactError(f"{what} must be a list of parameter names, not the string {names!r}")
        for name in names:
            if name not in inits:
                close = [n for n in inits if n.lower() == str(name).lower()]
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ArtifactError(f"{what}: {name!r} is not an initializer of the forward model{hint}")
    if requires_grad is not None and frozen_params is not None:
        both = [n for n in requires_grad if n in set(frozen_params)]
        if both:
            raise ArtifactError(f"parameter {both[0]!r} is both in requires_grad and in frozen_params")
    for name in requires_grad or ():
        if inits[name].data_type not in FLOAT_TYPES:
            kind = helper.tensor_dtype_to_np_dtype(inits[name].data_type)
            raise ArtifactError(f"requires_grad: {name!r} is a {kind} initializer; only floating-point parameters "
                                "can be trained")
    return (None if requires_grad is None else list(dict.fromkeys(requires_grad)),
            list(dict.fromkeys(frozen_params or ())))


def _forward_outputs(model: onnx.ModelProto, loss_input_names) -> list[str]:
    if loss_input_names:
        names = list(loss_input_names)
        known = {o for n in model.graph.node for o in n.output} | {vi.name for vi in model.graph.input}
        for n in names:
            if n not in known:
                raise ArtifactError(f"loss_input_names: {n!r} is not a value of the forward model")
        return names
    return [o.name for o in model.graph.output]


def build_artifacts(model: onnx.ModelProto | str | os.PathLike, requires_grad: Sequence[str] | None = None,
                    frozen_params: Sequence[str] | None = None, loss: LossType | None = None,
                    optimizer: OptimType | None = None, additional_output_names: Sequence[str] | None = None,
                    loss_input_names: Sequence[str] | None = None, *,
                    keep_inference_batch_norm: Sequence[str] = (), source: str = "", verify: bool = True
                    ) -> Artifacts:
    """The four artifacts as objects (``generate_artifacts`` writes them). ``keep_inference_batch_norm``: names
    of BatchNormalization nodes that stay in inference mode (frozen statistics). ``verify``: check every custom
    node of the training model against the project's schemas (a failure is a bug of a gradient rule)."""
    try:
        return _build(model, requires_grad, frozen_params, loss, optimizer, additional_output_names,
                      loss_input_names, keep_inference_batch_norm, verify)
    except OplowerError as exc:
        if source and not str(exc).startswith(source):
            raise type(exc)(f"{source}: {exc}") from None
        raise


def _build(model, requires_grad, frozen_params, loss, optimizer, additional_output_names, loss_input_names,
           keep_inference_batch_norm, verify) -> Artifacts:
    forward = load_model(model) if isinstance(model, (str, os.PathLike)) else model
    if not isinstance(forward, onnx.ModelProto):
        raise ArtifactError(f"model must be an onnx.ModelProto or a path, not {type(forward).__name__}")
    if loss is not None and not isinstance(loss, LossType):
        raise ArtifactError(f"loss must be a LossType or None, not {loss!r}")
    if optimizer is not None and not isinstance(optimizer, OptimType):
        raise ArtifactError(f"optimizer must be an OptimType or None, not {optimizer!r}")
    requires, frozen = _check_names(forward, requires_grad, frozen_params)
    opset = _opset(forward)
    tokens = Tokens()

    # the forward model with the loss block on top, shape-inferred
    base = onnx.ModelProto()
    base.CopyFrom(forward) if _below_limit(forward) else _copy_large(forward, base)
    initializer_names = {t.name for t in base.graph.initializer}
    # graph inputs that are initializers (IR < 4 style) are not data inputs
    data_inputs = [vi for vi in base.graph.input if vi.name not in initializer_names]
    del base.graph.input[:]
    base.graph.input.extend(data_inputs)
    outputs = _forward_outputs(base, loss_input_names)
    # onnxruntime-training hands every forward output to the loss block, so a second output would become its
    # labels; oplower's block reads the first output only (``loss_input_names`` names the labels explicitly).
    # With no loss block the model's other outputs stay outputs after the loss, as there.
    if loss is not None and not loss_input_names:
        outputs = outputs[:1]
    extra_outputs = list(outputs[1:]) if loss is None else []
    additional_output_names = extra_outputs + [n for n in additional_output_names or () if n not in extra_outputs]
    if not outputs:
        raise ArtifactError("the forward model has no output")
    forward_types, inferred = _types(base)
    base.graph.ClearField("value_info")
    base.graph.value_info.extend(inferred.graph.value_info)
    base.graph.ClearField("output")
    base.graph.output.extend(inferred.graph.output)
    marks = len(base.graph.node), len(base.graph.input), len(base.graph.initializer)
    loss_name = add_loss(base, loss, outputs, tokens)
    types = _block_types(base, *marks, forward_types, inferred)
    loss_type = types.get(loss_name)
    if loss_type is None or loss_type.tensor_type.elem_type not in FLOAT_TYPES:
        raise ArtifactError(f"the loss {loss_name!r} is not a floating-point value (the model's first output must be"
                            " a float tensor: the scores or, with no loss block, the loss itself)")
    for name in additional_output_names or ():
        if name not in types:
            raise ArtifactError(f"additional_output_names: {name!r} is not a value of the forward model")
    _check_labels(loss, base, outputs, types)

    nodes = list(base.graph.node)
    floats = [t.name for t in base.graph.initializer if t.data_type in FLOAT_TYPES and t.name in initializer_names]
    if requires is None:
        reach = _loss_ancestors(nodes, loss_name)
        requires = [n for n in floats if n not in frozen and n in reach]
        stats = {n.input[i] for n in nodes if n.op_type == "BatchNormalization" for i in (3, 4) if len(n.input) > i}
        frozen = frozen + [n for n in floats if n in stats and n not in frozen and n not in requires]
    if not requires:
        raise ArtifactError("no parameter to train: requires_grad is empty and no float initializer reaches the loss")
    param_set = set(requires) | set(frozen)
    ordered = [t.name for t in base.graph.initializer if t.name in param_set]

    taken = {n for node in nodes for n in list(node.input) + list(node.output)} | initializer_names | \
        {vi.name for vi in base.graph.input}
    # a frozen parameter that is no float (a hand-built graph's pads, sizes or axes, frozen as onnxruntime's
    # tutorials freeze every other initializer) can change in no step: the rules may read it as a constant
    requires_set, frozen_set = set(requires), set(frozen)
    changing = requires_set | {t.name for t in base.graph.initializer if t.name in frozen_set
                               and t.data_type in FLOAT_TYPES}
    f = ForwardContext(taken, opset, dict(types), _constants(base, changing))
    keep = frozenset(keep_inference_batch_norm)
    prepared = prepare_forward(nodes, f, keep=keep)
    prepare_nodes = list(f.nodes)
    f.nodes.clear()
    graph = differentiate(prepare_nodes + prepared, loss_name, requires, f)

    # the training model
    training = onnx.ModelProto()
    _copy_header(base, training)
    g = training.graph
    g.name = base.graph.name or "main_graph"
    params_vi = _param_inputs(base, ordered)
    g.input.extend(list(base.graph.input) + params_vi)
    inits = [t for t in base.graph.initializer if t.name not in param_set]
    g.initializer.extend(inits + f.initializers)
    g.node.extend(graph.forward + graph.backward)
    flags = []
    by_name = {vi.name: vi for vi in params_vi}
    for index, p in enumerate(requires, start=1 + len(additional_output_names or ())):
        buffer = g.input.add()
        buffer.CopyFrom(by_name[p])
        buffer.name = f"{p}{BUFFER}"
        g.node.append(helper.make_node("InPlaceAccumulatorV2", [buffer.name, graph.gradients[p], LAZY_RESET],
                                       [f"{p}{FLAG}"], name=f"GradientAccumulator{index}", domain=_MS))
        flags.append(helper.make_tensor_value_info(f"{p}{FLAG}", onnx.TensorProto.BOOL, [1]))
    g.input.append(helper.make_tensor_value_info(LAZY_RESET, onnx.TensorProto.BOOL, [1]))
    g.output.extend([_output(types, loss_name)] + [_output(types, n) for n in additional_output_names or ()] + flags)
    _ensure_opset(training, _MS, 1)
    # ConvGrad's dW and dB undeclared, as in onnxruntime-training's own graphs: its runtime (1.19.2) leaves a
    # declared dW of a 1-D grouped ConvGrad that also computes dX at zeros
    _value_infos(training.graph, f.types, skip={o for n in g.node if n.op_type == "ConvGrad" for o in n.output[1:]})

    # the eval model
    ev = onnx.ModelProto()
    _copy_header(base, ev)
    ev.graph.name = g.name
    fe = ForwardContext(set(taken) | set(f.taken), opset, dict(types), {})
    eval_nodes = prepare_forward(nodes, fe, eval_model=True)
    ev.graph.node.extend(fe.nodes + eval_nodes)
    ev.graph.input.extend(list(base.graph.input) + params_vi)
    ev.graph.initializer.extend(inits + fe.initializers)
    ev.graph.output.extend([_output(types, loss_name)] + [_output(types, n) for n in additional_output_names or ()])
    _prune(ev.graph)
    _value_infos(ev.graph, types)
    if any(n.domain == _MS for n in ev.graph.node):
        _ensure_opset(ev, _MS, 1)

    if verify:
        _verify(training)
    values = {t.name: numpy_helper.to_array(t, base_dir="") for t in base.graph.initializer if t.name in param_set}
    ckpt = Checkpoint(params={p: values[p] for p in ordered if p in requires_set},
                      frozen={p: values[p] for p in ordered if p in frozen_set})
    elem = next(t.data_type for t in base.graph.initializer if t.name == requires[0])
    opt = optimizer_model(optimizer, elem, opset, tokens) if optimizer is not None else None
    trainable_sorted = [p for p in ordered if p in requires_set]
    return Artifacts(training, ev, opt, ckpt, trainable_sorted, [p for p in ordered if p in frozen_set], loss_name)


def _verify(training: onnx.ModelProto) -> None:
    """Every custom node of the training model against the project's schemas, with the types the model declares
    (:mod:`lowering.training.generated_check`; 2-5x cheaper than a whole-model shape inference, the same
    per-node verification); a model the declared types do not suit goes through ``verify_model``."""
    from lowering.training.generated_check import verify_generated  # noqa: PLC0415
    from opdef.errors import VerificationError  # noqa: PLC0415
    from opdef.model_verify import InvalidNodes, verify_model  # noqa: PLC0415

    try:
        if verify_generated(training) is None:
            verify_model(_inference_copy(training))  # the weights' types suffice (and >2 GB cannot be inferred)
    except (VerificationError, InvalidNodes) as exc:
        raise OplowerError(f"the generated training model fails verification (a gradient rule's bug, please report "
                           f"it): {exc}") from None


def _copy_large(model: onnx.ModelProto, into: onnx.ModelProto) -> None:
    for fname in ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(into, fname, getattr(model, fname))
    into.opset_import.extend(model.opset_import)
    into.functions.extend(model.functions)
    into.metadata_props.extend(model.metadata_props)
    into.graph.CopyFrom(model.graph)


def _copy_header(src: onnx.ModelProto, dst: onnx.ModelProto) -> None:
    dst.ir_version = src.ir_version
    dst.producer_name = src.producer_name or "oplower"
    dst.producer_version = src.producer_version
    dst.opset_import.extend(src.opset_import)
    dst.functions.extend(src.functions)


def _ensure_opset(model: onnx.ModelProto, domain: str, version: int) -> None:
    if not any(o.domain == domain for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(domain, version))


def _param_inputs(model: onnx.ModelProto, ordered: list[str]) -> list[onnx.ValueInfoProto]:
    by_name = {t.name: t for t in model.graph.initializer}
    made: dict[tuple, onnx.TypeProto] = {}  # a network's parameters share a few dozen shapes
    out = []
    for p in ordered:
        t = by_name[p]
        key = (t.data_type, tuple(t.dims))
        tp = made.get(key)
        if tp is None:
            tp = made[key] = helper.make_tensor_type_proto(t.data_type, list(t.dims))
        out.append(onnx.ValueInfoProto(name=p, type=tp))
    return out


def _output(types: dict[str, onnx.TypeProto], name: str) -> onnx.ValueInfoProto:
    vi = onnx.ValueInfoProto(name=name)
    if name in types:
        vi.type.CopyFrom(types[name])
    return vi


def _value_infos(graph: onnx.GraphProto, types: dict[str, onnx.TypeProto], skip: set[str] = frozenset()) -> None:
    """The forward values' inferred types as value_info (onnxruntime-training's graphs carry them too): the
    lowering of the training ops reads static shapes from shape inference, which cannot always see through
    the custom ops in between."""
    declared = {vi.name for vi in graph.input} | {vi.name for vi in graph.output} | {t.name for t in graph.initializer}
    produced = [o for n in graph.node for o in n.output if o and o not in declared and o not in skip]
    for name in dict.fromkeys(produced):
        t = types.get(name)
        if t is not None and t.HasField("tensor_type") and t.tensor_type.elem_type:
            vi = graph.value_info.add()
            vi.name = name
            vi.type.CopyFrom(t)


def _prune(graph: onnx.GraphProto) -> None:
    """Drop nodes nothing reads (the eval model has no use for the training-only outputs)."""
    live = {o.name for o in graph.output}
    kept = []
    for node in reversed(graph.node):
        if any(o in live for o in node.output if o):
            kept.append(node)
            live.update(node.input)
            for a in node.attribute:
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    from lowering.builder import outer_reads  # noqa: PLC0415
                    live.update(outer_reads(sub))
    del graph.node[:]
    graph.node.extend(reversed(kept))
    used = live
    inits = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(inits)


def _check_labels(loss: LossType | None, model: onnx.ModelProto, outputs: list[str], types) -> None:
    if loss is None:
        return
    label = outputs[1] if len(outputs) > 1 else LABEL_INPUT[loss]
    scores = types.get(outputs[0])
    given = types.get(label)
    if scores is None or given is None or not scores.tensor_type.HasField("shape") or \
            not given.tensor_type.HasField("shape"):
        return
    srank, lrank = len(scores.tensor_type.shape.dim), len(given.tensor_type.shape.dim)
    want = srank - 1 if loss is LossType.CrossEntropyLoss else srank
    if lrank != want:
        raise ArtifactError(f"{loss.name}: the label input {label!r} has rank {lrank}, the scores {outputs[0]!r} rank "
                            f"{srank}: expected labels of rank {want}")


def generate_artifacts(model: onnx.ModelProto | str | os.PathLike, requires_grad: list[str] | None = None,
                       frozen_params: list[str] | None = None, loss: LossType | None = None,
                       optimizer: OptimType | None = None, artifact_directory: str | os.PathLike | None = None,
                       prefix: str = "", ort_format: bool = False, custom_op_library=None,
                       additional_output_names: list[str] | None = None, nominal_checkpoint: bool = False,
                       loss_input_names: list[str] | None = None) -> None:
    """Write ``training_model.onnx``, ``eval_model.onnx``, ``checkpoint`` and (with an optimizer)
    ``optimizer_model.onnx`` into ``artifact_directory`` (default: the working directory), each name prefixed
    with ``prefix`` -- as onnxruntime-training 1.19.2's function of the same name does. ``ort_format``,
    ``custom_op_library`` and ``nominal_checkpoint`` are accepted for signature compatibility and refused when
    set (onnxruntime-specific formats oplower does not write)."""
    if ort_format:
        raise ArtifactError("ort_format=True: oplower writes ONNX files only (convert them with onnxruntime's "
                            "convert_onnx_models_to_ort if you need the ORT format)")
    if custom_op_library is not None:
        raise ArtifactError("custom_op_library: oplower has no gradient rules for a custom op library's ops")
    if nominal_checkpoint:
        raise ArtifactError("nominal_checkpoint=True is not supported: oplower writes the complete checkpoint")
    artifacts = build_artifacts(model, requires_grad, frozen_params, loss, optimizer, additional_output_names,
                                loss_input_names)
    write_artifacts(artifacts, Path(artifact_directory) if artifact_directory is not None else Path.cwd(), prefix)


def write_artifacts(artifacts: Artifacts, directory: Path, prefix: str = "") -> list[Path]:
    """Write the files all or none: into a temporary folder beside them first, then moved into place (a
    failure leaves no partial file behind and the directory's old files untouched). A training or eval model
    beyond protobuf's 2 GB limit is written with its tensors in ``<file>.data`` beside it."""
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OplowerError(f"{directory}: cannot create the artifact directory: {exc.strerror or exc}") from None
    staging = Path(tempfile.mkdtemp(prefix=".oplower-artifacts-", dir=directory))
    try:
        names: list[str] = []
        for name, model in (("training_model.onnx", artifacts.training), ("eval_model.onnx", artifacts.eval),
                            ("optimizer_model.onnx", artifacts.optimizer)):
            if model is None:
                continue
            target = staging / f"{prefix}{name}"
            data = _serialized_below_limit(model)
            if data is None and len(model.graph.initializer):
                model = copy.deepcopy(model)  # save_model moves the tensors out of the proto it is given
                onnx.save_model(model, str(target), save_as_external_data=True, all_tensors_to_one_file=True,
                                location=f"{target.name}.data", size_threshold=0)
                names.append(f"{target.name}.data")
            else:
                target.write_bytes(data if data is not None else model.SerializeToString())
            names.append(target.name)
        (staging / f"{prefix}checkpoint").write_bytes(encode_checkpoint_buffer(artifacts.checkpoint))
        names.append(f"{prefix}checkpoint")
        names = [n for n in names if (staging / n).exists()]
        for name in names:
            os.replace(staging / name, directory / name)
    except OSError as exc:
        raise OplowerError(f"{directory}: cannot write the artifacts: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [directory / n for n in names if not n.endswith(".data")]
