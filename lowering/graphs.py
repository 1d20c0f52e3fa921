"""Graph plumbing the pass needs, on ONNX protos: walking graphs, names in use, value types, opsets.

Nothing here knows about any particular op. Every helper is one walk over what it is given.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import onnx

from opdef.graphs import GraphLike, all_graphs, all_nodes, model_graphs, subgraphs
from opdef.model_verify import infer_shapes
from opdef.node import TensorType
from opdef.registry import Registry
from opdef.verify import tensor_type_from_proto

FunctionKey = tuple[str, str, str]  # (domain, name, overload), as a calling node spells it


def function_key(function: onnx.FunctionProto) -> FunctionKey:
    return function.domain, function.name, function.overload


def call_key(node: onnx.NodeProto) -> FunctionKey:
    return node.domain, node.op_type, node.overload


def names_in_use(model: onnx.ModelProto) -> set[str]:
    """Every value, node, graph input/initializer name anywhere in the model (subgraphs, functions)."""
    names: set[str] = set()
    for graph in model_graphs(model):
        if isinstance(graph, onnx.FunctionProto):
            names.update(graph.input)
            names.update(graph.output)
        else:
            names.update(v.name for v in graph.input)
            names.update(v.name for v in graph.output)
            names.update(t.name for t in graph.initializer)
            names.update(t.values.name for t in graph.sparse_initializer)
        for node in graph.node:
            names.add(node.name)
            names.update(node.input)
            names.update(node.output)
    names.discard("")
    return names


def names_read(graph: GraphLike) -> set[str]:
    """Names something reads: a node of the graph or of a subgraph (implicit captures included), or an output.

    Names are unique across a graph and its subgraphs (SSA), so one set serves the whole tree.
    """
    read: set[str] = set(graph.output) if isinstance(graph, onnx.FunctionProto) else {v.name for v in graph.output}
    for node in graph.node:
        read.update(node.input)
        if node.attribute:
            for sub in subgraphs(node):
                read |= names_read(sub)
    read.discard("")
    return read


def call_site_input_types(function: onnx.FunctionProto, sites: Iterable[tuple[TensorType | None, ...]],
                          declared: Mapping[str, TensorType | None]) -> dict[str, TensorType]:
    """Types for a model-local function's inputs that all its call sites agree on (functions declare none).

    ``sites`` holds, per call site, the types of its arguments; ``declared`` what the function declares.
    """
    sites = list(sites)
    found: dict[str, TensorType] = {}
    if not sites:
        return found
    for i, param in enumerate(function.input):
        if declared.get(param) is not None:
            continue
        seen = {site[i] if i < len(site) else None for site in sites}
        if len(seen) == 1 and None not in seen:
            found[param] = seen.pop()
    return found


def functions_callers_first(model: onnx.ModelProto) -> list[onnx.FunctionProto]:
    """The model-local functions, each after every function that calls it (functions cannot recurse), so
    that a function's call sites are all lowered, and their argument types known, before it is."""
    by_key = {function_key(f): f for f in model.functions}
    callees = {key: {call_key(n) for n in all_nodes(f)} & by_key.keys() for key, f in by_key.items()}
    callers: dict[FunctionKey, int] = dict.fromkeys(by_key, 0)
    for key, called in callees.items():
        for callee in called - {key}:
            callers[callee] += 1
    order: list[onnx.FunctionProto] = []
    ready = [key for key in by_key if callers[key] == 0]
    while ready:
        key = ready.pop(0)
        order.append(by_key[key])
        for callee in sorted(callees[key] - {key}):
            callers[callee] -= 1
            if callers[callee] == 0:
                ready.append(callee)
    seen = {id(f) for f in order}
    return order + [f for f in model.functions if id(f) not in seen]  # a call cycle (invalid): model order


def inferred_types(model: onnx.ModelProto, registry: Registry) -> dict[str, TensorType]:
    """Types onnx shape inference finds in the main graph and its subgraphs, by value name.

    Used only when a custom node's inputs declare no type (no value_info). Tensors stored externally stay
    references; an inference failure just means no extra information.
    """
    try:
        proto = infer_shapes(model, registry)
    except Exception:  # noqa: BLE001 -- best effort: the verifier reports what stays unknown
        return {}
    found: dict[str, TensorType] = {}
    for graph in all_graphs(proto.graph):
        for info in [*graph.input, *graph.value_info, *graph.output]:
            t = tensor_type_from_proto(info.type)
            if t is not None and t.elem_type is not None:
                found.setdefault(info.name, t)
    return found


def constant_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """The graph's initializers that are no graph input, and its Constant nodes' (``value``) values, by name."""
    inputs = {i.name for i in graph.input}
    values = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer if t.name not in inputs}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = onnx.numpy_helper.to_array(node.attribute[0].t)
    return values


def opset_versions(opset_import: Iterable[onnx.OperatorSetIdProto]) -> dict[str, int]:
    return {o.domain: o.version for o in opset_import}


def default_opset(opset_import: Iterable[onnx.OperatorSetIdProto]) -> int | None:
    versions = opset_versions(opset_import)
    return versions.get("", versions.get("ai.onnx"))


def merge_opsets(opset_import) -> bool:
    """Keep the first of several imports of one domain ("" and "ai.onnx" are one; the versions are equal,
    :func:`lowering.modelio.check_structure` refuses others); returns whether any was dropped."""
    seen: set[str] = set()
    kept = []
    for o in opset_import:
        key = "" if o.domain == "ai.onnx" else o.domain
        if key not in seen:
            seen.add(key)
            kept.append((o.domain, o.version))
    if len(kept) == len(opset_import):
        return False
    del opset_import[:]
    opset_import.extend(onnx.OperatorSetIdProto(domain=d, version=v) for d, v in kept)
    return True


def drop_opsets(opset_import, domains: Iterable[str]) -> None:
    """Remove the imports of ``domains`` from a repeated OperatorSetIdProto field."""
    drop = set(domains)
    keep = [o for o in opset_import if o.domain not in drop]
    if len(keep) != len(opset_import):
        kept = [(o.domain, o.version) for o in keep]
        del opset_import[:]
        opset_import.extend(onnx.OperatorSetIdProto(domain=d, version=v) for d, v in kept)
