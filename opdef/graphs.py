"""Walking an ONNX model's graphs: the main graph, If/Loop/Scan bodies (GRAPH and GRAPHS attributes, at any
depth) and model-local functions. The one walker every layer uses; it reads, never changes, what it walks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import onnx
from onnx import AttributeProto

GraphLike = onnx.GraphProto | onnx.FunctionProto


def subgraph_attributes(node: onnx.NodeProto) -> Iterator[tuple[str, onnx.GraphProto]]:
    """(attribute name, graph) for each If/Loop/Scan body of ``node`` (any graph-valued attribute)."""
    for attr in node.attribute:
        if attr.type == AttributeProto.GRAPH:
            yield attr.name, attr.g
        elif attr.type == AttributeProto.GRAPHS:
            for graph in attr.graphs:
                yield attr.name, graph


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The If/Loop/Scan bodies (any graph-valued attribute) of ``node``."""
    for _, graph in subgraph_attributes(node):
        yield graph


def all_nodes(graph: GraphLike) -> Iterator[onnx.NodeProto]:
    """Every node of ``graph`` and of its subgraphs (recursively), a node's subgraphs right after it."""
    for node in graph.node:
        yield node
        if node.attribute:
            for sub in subgraphs(node):
                yield from all_nodes(sub)


def all_graphs(graph: GraphLike) -> Iterator[GraphLike]:
    """``graph`` and every subgraph inside it (recursively)."""
    yield graph
    for node in graph.node:
        if node.attribute:
            for sub in subgraphs(node):
                yield from all_graphs(sub)


def model_graphs(model: onnx.ModelProto) -> Iterator[GraphLike]:
    """The main graph and its subgraphs, then each model-local function and its subgraphs."""
    yield from all_graphs(model.graph)
    for function in model.functions:
        yield from all_graphs(function)


def model_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Every node of the model: main graph, subgraphs, model-local functions."""
    yield from all_nodes(model.graph)
    for function in model.functions:
        yield from all_nodes(function)


def first_output(node: onnx.NodeProto) -> str:
    """The node's first output that is not omitted; "" when there is none."""
    return next((o for o in node.output if o), "")


def node_display_name(node: onnx.NodeProto) -> str:
    """How messages name a node: its name, else ``<first output>``."""
    if node.name:
        return node.name
    first = first_output(node)
    return f"<{first}>" if first else "<unnamed>"


NodeLabel = Callable[[onnx.NodeProto, int], str]


def _display_label(node: onnx.NodeProto, index: int) -> str:
    return node_display_name(node)


def located_nodes(model: onnx.ModelProto,
                  label: NodeLabel = _display_label) -> Iterator[tuple[onnx.NodeProto, int, str]]:
    """Every node of the model as (node, index in its node list, where): ``where`` is "" in the main graph,
    "in the body of 'loop'" in a subgraph (outer nodes named by ``label(node, index)``, innermost first), and
    ends in "in function domain::name" in a model-local function."""
    yield from _located(model.graph.node, "", label)
    for function in model.functions:
        yield from _located(function.node, f"in function {function.domain}::{function.name}", label)


def _located(nodes: Iterable[onnx.NodeProto], where: str,
             label: NodeLabel) -> Iterator[tuple[onnx.NodeProto, int, str]]:
    for index, node in enumerate(nodes):
        yield node, index, where
        for attr_name, graph in subgraph_attributes(node):
            inner = f"in the {attr_name} of '{label(node, index)}'"
            yield from _located(graph.node, f"{inner} {where}".strip(), label)
