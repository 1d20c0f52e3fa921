"""The onnx-ir side of :class:`~lowering.passes.LowerCustomOpsPass`: an ``ir.Model`` to a proto and back.

The pass lowers protos; these helpers serialize the given model and swap the lowered result into that same
model object (its graph, functions and IR version), so a pass pipeline keeps holding the model it gave.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
from onnx_ir.traversal import RecursiveGraphIterator

GraphLike = ir.Graph | ir.Function


def to_proto(model: ir.Model) -> onnx.ModelProto:
    """``model`` serialized, nodes keeping their trailing empty outputs (onnx-ir's serializer drops them:
    ConvGrad's ``['', 'dW', '']`` comes out as ``['', 'dW']``, equivalent, but a node the pass does not
    touch must come back as it was)."""
    proto = ir.to_proto(model)
    _restore_graph(model.graph, proto.graph)
    for function, function_proto in zip(model.functions.values(), proto.functions, strict=True):
        _restore_graph(function, function_proto)
    return proto


def swap_into(model: ir.Model, lowered: onnx.ModelProto) -> None:
    """Make ``model`` the lowered one, in place. Initializers keep their tensor objects (an externally
    stored tensor keeps its base directory; nothing is copied again)."""
    new = ir.serde.deserialize_model(lowered)
    tensors = {name: value.const_value for graph in _graphs(model) for name, value in graph.initializers.items()}
    for graph in _graphs(new):
        for name, value in graph.initializers.items():
            if tensors.get(name) is not None:
                value.const_value = tensors[name]
    model.graph = new.graph
    model.functions.clear()
    model.functions.update(new.functions)
    model.ir_version = new.ir_version


def _graphs(model: ir.Model) -> list[ir.Graph]:
    found = [model.graph]
    for node in RecursiveGraphIterator(model.graph):
        for attr in node.attributes.values():
            if isinstance(attr, ir.Attr) and attr.type == ir.AttributeType.GRAPH:
                found.append(attr.value)
            elif isinstance(attr, ir.Attr) and attr.type == ir.AttributeType.GRAPHS:
                found.extend(attr.value)
    return found


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
