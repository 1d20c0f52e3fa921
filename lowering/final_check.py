"""The last step before ``oplower lower`` writes: the lowered model passes ``onnx.checker`` (full_check) and,
when no custom node is left in it, onnxruntime loads it. Otherwise one error line saying what is wrong and,
when the fault lies in the model's own standard part (a node or graph value oplower did not touch), saying so
and naming it.

Externally stored initializers are never read: for both checks they are declared as graph inputs of the same
type and shape instead (onnx.checker on a ModelProto would look for their files relative to the current
directory; onnxruntime needs them only to run). The CLI has checked that the files exist beforehand.
"""

from __future__ import annotations

import re

import onnx
from onnx import external_data_helper

from opdef.errors import LoweringError, ModelError
from opdef.graphs import all_nodes

_NODE_NAME = re.compile(r'node name: ([^)]*)\)|[Nn]ode \(([^)]*)\)|In Node, \("([^"]*)"')


def check_lowered(lowered: onnx.ModelProto, original: onnx.ModelProto | None = None) -> None:
    """Raise ModelError (a fault in the model as given) or LoweringError unless ``lowered`` passes
    ``onnx.checker.check_model(full_check=True)`` and, when it has no custom node left, loads in onnxruntime.
    ``original``, the model before lowering, lets the error say whose fault it is."""
    from runtime.session import find_custom_nodes

    model = _without_external_data(lowered)
    _check_graph_values(model, original)
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as exc:  # ValidationError, InferenceError, ...
        raise _blame("onnx.checker refuses", exc, lowered, original) from None
    if find_custom_nodes(lowered):
        return  # onnxruntime cannot load it anyway; the checker is all there is
    _check_loads(model, lowered, original)


def _check_loads(model: onnx.ModelProto, lowered: onnx.ModelProto, original: onnx.ModelProto | None) -> None:
    import onnxruntime as ort

    from runtime.session import ort_message

    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # graph resolution and kernels
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise _blame("onnxruntime cannot load the lowered model:", exc, lowered, original,
                     message=ort_message(exc)) from None


def _blame(what: str, exc: Exception, lowered: onnx.ModelProto, original: onnx.ModelProto | None, *,
           message: str | None = None) -> Exception:
    text = message or " ".join(str(exc).split()) or type(exc).__name__
    node = _untouched_node(text, lowered, original)
    if node is not None:
        return ModelError(f"{what.removesuffix(':')} node '{node.name}' ({node.domain or 'ai.onnx'}::{node.op_type}) "
                          f"of the model as given (not a node oplower lowered): {text}")
    if what.endswith(":"):
        return LoweringError(f"{what} {text}")
    return LoweringError(f"{what} the lowered model: {text}")


def _untouched_node(text: str, lowered: onnx.ModelProto, original: onnx.ModelProto | None) -> onnx.NodeProto | None:
    """The node a checker or onnxruntime message names, when the model as given has it unchanged."""
    if original is None:
        return None
    names = {next(g for g in m.groups() if g is not None) for m in _NODE_NAME.finditer(text)}
    names.discard("")
    if not names:
        return None
    before = {n.name: n for n in _nodes(original) if n.name in names}
    for node in _nodes(lowered):
        if node.name in before and before[node.name] == node:
            return node
    return None


def _nodes(model: onnx.ModelProto):
    yield from all_nodes(model.graph)
    for function in model.functions:
        yield from all_nodes(function)


def _check_graph_values(model: onnx.ModelProto, original: onnx.ModelProto | None) -> None:
    """onnx.checker's rules for the main graph's inputs and outputs, naming the value (its own message does
    not): a type; a tensor's element type and shape; a sequence's or optional's element type."""
    given = set() if original is None else {vi.name for vi in [*original.graph.input, *original.graph.output]}
    for kind, values in (("input", model.graph.input), ("output", model.graph.output)):
        for vi in values:
            problem = _value_problem(vi.type)
            if problem is None:
                continue
            required = "required on the main graph's inputs and outputs"
            if vi.name not in given:
                raise LoweringError(f"onnx.checker refuses graph {kind} '{vi.name}' of the lowered model: {problem}")
            if kind == "input" or _untouched_producer(vi.name, model, original):
                raise ModelError(f"onnx.checker refuses graph {kind} '{vi.name}' of the model as given (not a node "
                                 f"oplower lowered): {problem} ({required})")
            raise ModelError(f"onnx.checker refuses graph {kind} '{vi.name}' as the model declares it: {problem} "
                             f"({required}), and oplower cannot infer it from the node that writes it; declare it")


def _untouched_producer(name: str, model: onnx.ModelProto, original: onnx.ModelProto) -> bool:
    """Whether the main-graph node writing ``name`` is the same in the model as given (not lowered)."""
    before = next((n for n in original.graph.node if name in n.output), None)
    return before is not None and any(n == before for n in model.graph.node if name in n.output)


def _value_problem(tp: onnx.TypeProto) -> str | None:
    kind = tp.WhichOneof("value")
    if kind is None:
        return "it declares no type"
    if kind in ("tensor_type", "sparse_tensor_type"):
        tensor = getattr(tp, kind)
        if not tensor.elem_type:
            return "its tensor type has no element type"
        if not tensor.HasField("shape"):
            return "its tensor type has no shape (an unknown rank)"
    elif kind in ("sequence_type", "optional_type"):
        inner = getattr(tp, kind)
        if not inner.HasField("elem_type"):
            return f"its {kind.split('_')[0]} type has no element type"
    return None


def _without_external_data(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` itself, or a copy whose externally stored main-graph initializers are graph inputs instead."""
    external = [t for t in model.graph.initializer if external_data_helper.uses_external_data(t)]
    if not external:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    declared = {vi.name for vi in copy.graph.input}
    kept = [t for t in copy.graph.initializer if not external_data_helper.uses_external_data(t)]
    for tensor in external:
        if tensor.name not in declared:
            copy.graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type,
                                                                       list(tensor.dims)))
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(kept)
    return copy
