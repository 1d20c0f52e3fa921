"""onnx-ir graph plumbing the pass needs: walking every graph, names in use, known value types, opsets.

Nothing here knows about any particular op.
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx
import onnx_ir as ir
from onnx_ir.traversal import RecursiveGraphIterator

from opdef.node import TensorType

GraphLike = ir.Graph | ir.Function


def all_nodes(model: ir.Model) -> Iterator[tuple[ir.Function | None, ir.Node]]:
    """Every node of the model: main graph, If/Loop/Scan bodies (recursively), model-local functions.

    Yields ``(function, node)``, ``function`` being the model-local function the node lives in (None in
    the main graph or its subgraphs). Order: the main graph first, each graph in node order with a
    node's subgraphs right after the node, so producers come before consumers.
    """
    for node in RecursiveGraphIterator(model.graph):
        yield None, node
    for function in model.functions.values():
        for node in RecursiveGraphIterator(function):
            yield function, node


def names_in_use(model: ir.Model) -> set[str]:
    """Every value, node, graph input/initializer name anywhere in the model (subgraphs, functions)."""
    names: set[str] = set()

    def graph_names(graph: GraphLike) -> None:
        names.update(v.name for v in graph.inputs if v.name)
        names.update(v.name for v in graph.outputs if v.name)
        if isinstance(graph, ir.Graph):
            names.update(graph.initializers)

    graph_names(model.graph)
    for function in model.functions.values():
        graph_names(function)
    for _, node in all_nodes(model):
        if node.name:
            names.add(node.name)
        names.update(v.name for v in node.inputs if v is not None and v.name)
        names.update(v.name for v in node.outputs if v.name)
        for attr in node.attributes.values():
            if isinstance(attr, ir.Attr) and attr.type == ir.AttributeType.GRAPH:
                graph_names(attr.value)
            elif isinstance(attr, ir.Attr) and attr.type == ir.AttributeType.GRAPHS:
                for graph in attr.value:
                    graph_names(graph)
    return names


def tensor_type(value: ir.Value | None) -> TensorType | None:
    """The value's declared tensor type, or None when it declares nothing useful."""
    if value is None or value.type is None or not isinstance(value.type, ir.TensorType):
        return None
    elem = int(value.type.dtype) or None
    shape = None
    if value.shape is not None:
        shape = tuple(d if isinstance(d, int) else (d.value or None) for d in value.shape)
    return TensorType(elem, shape)


def set_tensor_type(value: ir.Value, t: TensorType | None) -> None:
    if t is None or t.elem_type is None:
        return
    value.type = ir.TensorType(ir.DataType(t.elem_type))
    if t.shape is not None:
        value.shape = ir.Shape(list(t.shape))


def is_consumed(value: ir.Value) -> bool:
    """Consumed by a node (here or in a subgraph) or an output of its graph or function."""
    return bool(value.uses()) or value.is_graph_output()


def call_site_input_types(model: ir.Model, types: dict[ir.Value, TensorType]) -> None:
    """Give a model-local function's inputs the types all its call sites agree on (functions declare none)."""
    calls: dict[tuple[str, str, str], list[ir.Node]] = {}
    for _, node in all_nodes(model):
        calls.setdefault((node.domain, node.op_type, node.overload), []).append(node)
    for key, function in model.functions.items():
        sites = calls.get(key, [])
        for i, param in enumerate(function.inputs):
            if tensor_type(param) is not None or not sites:
                continue
            seen = set()
            for site in sites:
                arg = site.inputs[i] if i < len(site.inputs) else None
                seen.add((types.get(arg) or tensor_type(arg)) if arg is not None else None)
            if len(seen) == 1 and None not in seen:
                types[param] = seen.pop()


def inferred_types(model: ir.Model) -> dict[str, TensorType]:
    """Types onnx shape inference finds in the main graph and its subgraphs, by value name.

    Used only when a custom node's inputs declare no type (no value_info). Tensors stored externally stay
    references; an inference failure just means no extra information.
    """
    try:
        proto = onnx.shape_inference.infer_shapes(ir.to_proto(model))
    except Exception:  # noqa: BLE001 -- best effort: the verifier reports what stays unknown
        return {}
    found: dict[str, TensorType] = {}

    def visit(graph: onnx.GraphProto) -> None:
        for info in [*graph.input, *graph.value_info, *graph.output]:
            t = _proto_tensor_type(info.type)
            if t is not None:
                found.setdefault(info.name, t)
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    visit(attr.g)
                for sub in attr.graphs:
                    visit(sub)

    visit(proto.graph)
    return found


def _proto_tensor_type(type_proto: onnx.TypeProto) -> TensorType | None:
    if not type_proto.HasField("tensor_type") or not type_proto.tensor_type.elem_type:
        return None
    tensor = type_proto.tensor_type
    shape = None
    if tensor.HasField("shape"):
        shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
    return TensorType(tensor.elem_type, shape)


def domains_used(graph: GraphLike) -> set[str]:
    return {node.domain for node in RecursiveGraphIterator(graph)}


def drop_unused_opsets(model: ir.Model, removable: frozenset[str]) -> None:
    """Remove opset imports of the ``removable`` domains that no node (model or function) uses any more."""
    model_used = domains_used(model.graph)
    for function in model.functions.values():
        used = domains_used(function)
        model_used |= used
        for domain in [d for d in function.opset_imports if d in removable and d not in used]:
            del function.opset_imports[domain]
    for domain in [d for d in model.opset_imports if d in removable and d not in model_used]:
        del model.opset_imports[domain]


def restore_trailing_outputs(model: ir.Model, proto: onnx.ModelProto) -> None:
    """Give every node of ``proto`` (``model`` serialized) back the trailing empty outputs it has in ``model``.

    onnx-ir's serializer drops them (ConvGrad's ``['', 'dW', '']`` comes out as ``['', 'dW']``): equivalent
    ONNX, but a node the pass did not touch must come back as it was. One walk, nodes in the same order.
    """
    _restore_graph(model.graph, proto.graph)
    for function, function_proto in zip(model.functions.values(), proto.functions, strict=True):
        _restore_graph(function, function_proto)


def _restore_graph(graph: GraphLike, graph_proto: onnx.GraphProto | onnx.FunctionProto) -> None:
    for node, node_proto in zip(graph, graph_proto.node, strict=True):
        missing = len(node.outputs) - len(node_proto.output)
        if missing > 0:
            node_proto.output.extend([""] * missing)
        for attr_proto in node_proto.attribute:
            attr = node.attributes.get(attr_proto.name)
            if not isinstance(attr, ir.Attr):
                continue
            if attr.type == ir.AttributeType.GRAPH:
                _restore_graph(attr.value, attr_proto.g)
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub, sub_proto in zip(attr.value, attr_proto.graphs, strict=True):
                    _restore_graph(sub, sub_proto)
