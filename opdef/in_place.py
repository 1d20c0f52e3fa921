"""The in-place contract for training ops (DESIGN.md section 9), applied by the pass around a rule.

onnxruntime-training's InPlaceAccumulatorV2 and optimizers overwrite some of their inputs. A standard ONNX
graph cannot, so the updated value becomes an extra output of the **main graph** named
``<input value name>.updated``. Which output is the update of which input is binding data
(``"in_place": {"<output role>": "<input role>"}`` in ``specs/bindings.json``); the rule just computes that
output like any other. The node's own outputs (the update flags) stay.

Inside a subgraph (If/Loop/Scan body) or a model-local function there is no graph output to add: the node
is lowered like any other, and the update is visible only through the optional outputs the node itself
names. (Exposing it would change the enclosing op's signature.)
"""

from __future__ import annotations

import onnx
from onnx import helper

from opdef.errors import LoweringError
from opdef.registry import Registry


def expose(node: onnx.NodeProto, registry: Registry, graph: onnx.GraphProto, taken: set[str],
           types: dict) -> tuple[onnx.NodeProto, frozenset[str], list[tuple[str, str]]]:
    """For a node of the main graph: the node with each in-place output named (a copy when that changes
    it), the output names its rule must produce for them, and the (node output, graph output) pairs an
    Identity must join because the node already named the output. The graph outputs are declared here,
    typed like the input they update."""
    entry = registry.get(node.domain, node.op_type)
    if entry is None or not entry.binding.in_place:
        return node, frozenset(), []
    schema, binding = entry.schema, entry.binding
    if any(_attribute(node, schema, binding.arg(role)) == value for role, value in binding.in_place_unless):
        return node, frozenset(), []
    outputs = list(node.output)
    exposed: list[str] = []
    produce: list[str] = []
    joins: list[tuple[str, str]] = []
    for out_role, in_role in binding.in_place:
        in_index = schema.input_index(binding.arg(in_role))
        source = node.input[in_index] if in_index < len(node.input) else ""
        if not source:
            continue  # an omitted optional input has nothing to update
        name = f"{source}.updated"
        label = f"{node.domain} {node.op_type} '{node.name or '?'}'"
        if name in taken or name in exposed:
            raise LoweringError(f"{label}: cannot expose the in-place update of {source!r} as graph output "
                                f"{name!r}: the model already uses that name (or another node updates the same input)")
        out_index = schema.output_index(binding.arg(out_role))
        outputs += [""] * (out_index + 1 - len(outputs))
        if outputs[out_index]:
            joins.append((outputs[out_index], name))
        else:
            outputs[out_index] = name
        produce.append(outputs[out_index])
        graph.output.add(name=name).type.CopyFrom(_type_of(source, graph, label))
        types.setdefault(name, None)  # declared as a graph output: no value_info for it
        exposed.append(name)
    taken.update(exposed)  # fresh names of later rules never take these
    if outputs == list(node.output):
        return node, frozenset(produce), joins
    named = onnx.NodeProto()
    named.CopyFrom(node)
    del named.output[:]
    named.output.extend(outputs)
    return named, frozenset(produce), joins


def _attribute(node: onnx.NodeProto, schema, name: str):
    """The node's value of attribute ``name``, else the spec's default."""
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return schema.attribute(name).default


def _type_of(value: str, graph: onnx.GraphProto, label: str) -> onnx.TypeProto:
    """The declared type of ``value`` (an updated value has the type of the value it updates)."""
    for info in (*graph.input, *graph.value_info, *graph.output):
        if info.name == value and info.HasField("type"):
            return info.type
    for init in graph.initializer:
        if init.name == value:
            tp = onnx.TypeProto()
            tp.tensor_type.elem_type = init.data_type
            for d in init.dims:
                tp.tensor_type.shape.dim.add(dim_value=d)
            return tp
    raise LoweringError(f"{label}: {value!r} is updated in place but the graph declares no type for it; "
                        f"declare it (graph input or value_info) so its '.updated' output can be typed")
