"""Test models of batch-norm backward nodes in any registered dialect, built with onnx.helper.

Values are named after the canonical role they play (``src``, ``diff_dst``, ``mean`` ...); an argument
with no canonical role (nGraph's ``beta``) keeps the spec's name. Models import ("", 17) and the
custom domain at version 1, and declare IR version 10 so onnxruntime can load them.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import TensorProto, helper

from opdef.node import TensorType
from opdef.registry import Entry

F32, F16, BF16, F64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE

ONEDNN = ("onednn", "BatchNormTrainingBackward")
OPSET_V0 = ("onednn", "BatchNormTrainingBackprop")
NGRAPH = ("ngraph", "BatchNormTrainingBackprop")
DIRECTML = ("directml", "BATCH_NORMALIZATION_GRAD")
SEED_OPS = (ONEDNN, OPSET_V0, NGRAPH, DIRECTML)

DATA_ROLES = ("src", "diff_dst", "diff_src")


def role_of(entry: Entry, spec_name: str) -> str | None:
    for role, name in entry.binding.roles:
        if name == spec_name:
            return role
    return None


def value_name(entry: Entry, spec_name: str) -> str:
    return role_of(entry, spec_name) or spec_name


def stats_shape(entry: Entry, shape: Sequence, layout: str | None = None) -> tuple:
    """The statistics' shape for src ``shape``: [C], or for DirectML the broadcast shape [1,C,1,...]."""
    binding = entry.binding
    if binding.layout == "stats_broadcast":
        if len(shape) == 1:
            return (shape[0],)
        return tuple(d if i == 1 else 1 for i, d in enumerate(shape))
    if binding.layout == "data_format" and (layout or "NXC") == "NXC":
        return (shape[-1],)
    return (shape[1],)


def attributes(entry: Entry, layout: str | None = None, epsilon=1e-5) -> dict:
    out = {entry.binding.arg("epsilon"): epsilon}
    if layout is not None and entry.binding.layout_attribute:
        out[entry.binding.layout_attribute] = layout
    return out


def bn_node(entry: Entry, *, name: str = "bn", gamma: bool = True, grads: bool = True,
            attrs: dict | None = None, layout: str | None = None, epsilon=1e-5) -> onnx.NodeProto:
    """The node with every input present (``gamma=False`` omits an optional gamma) and every output
    requested (``grads=False`` omits optional parameter gradients)."""
    schema, binding = entry.schema, entry.binding
    inputs = []
    for arg in schema.inputs:
        skip = not gamma and arg.optional and role_of(entry, arg.name) == "gamma"
        inputs.append("" if skip else value_name(entry, arg.name))
    outputs = []
    for arg in schema.outputs:
        skip = not grads and arg.optional and role_of(entry, arg.name) in ("diff_gamma", "diff_beta")
        outputs.append("" if skip else value_name(entry, arg.name))
    while inputs and not inputs[-1]:
        inputs.pop()
    while outputs and not outputs[-1]:
        outputs.pop()
    attrs = attributes(entry, layout, epsilon) if attrs is None else attrs
    return helper.make_node(binding.op_type, inputs, outputs, name=name, domain=binding.domain, **attrs)


def value_types(entry: Entry, shape: Sequence | None, t1: int = F32, t2: int | None = None,
                layout: str | None = None, stat_shape: Sequence | None = None) -> dict[str, TensorType]:
    """Types of every input value: data tensors ``t1`` with ``shape``, statistics ``t2`` (default t1)."""
    t2 = t1 if t2 is None else t2
    if stat_shape is None and shape is not None:
        stat_shape = stats_shape(entry, shape, layout)
    out = {}
    for arg in entry.schema.inputs:
        role = role_of(entry, arg.name)
        if role in DATA_ROLES:
            out[value_name(entry, arg.name)] = TensorType(t1, None if shape is None else tuple(shape))
        else:
            out[value_name(entry, arg.name)] = TensorType(t2, None if stat_shape is None else tuple(stat_shape))
    return out


def bn_model(entry: Entry, shape: Sequence, t1: int = F32, t2: int | None = None, *, layout: str | None = None,
             gamma: bool = True, grads: bool = True, epsilon=1e-5, node_name: str = "bn",
             ir_version: int = 10) -> onnx.ModelProto:
    """A model whose only node is the batch-norm backward node; graph outputs declare their expected types."""
    t2 = t1 if t2 is None else t2
    node = bn_node(entry, name=node_name, gamma=gamma, grads=grads, layout=layout, epsilon=epsilon)
    types = value_types(entry, shape, t1, t2, layout)
    stat = stats_shape(entry, shape, layout)
    graph_inputs = [helper.make_tensor_value_info(v, types[v].elem_type, list(types[v].shape))
                    for v in node.input if v]
    graph_outputs = []
    for v, arg in zip(node.output, entry.schema.outputs, strict=False):
        if not v:
            continue
        is_data = role_of(entry, arg.name) in DATA_ROLES
        graph_outputs.append(helper.make_tensor_value_info(v, t1 if is_data else t2,
                                                           list(shape if is_data else stat)))
    graph = helper.make_graph([node], "bn_graph", graph_inputs, graph_outputs)
    return make_model(graph, entry.binding.domain, ir_version=ir_version)


def make_model(graph: onnx.GraphProto, *domains: str, ir_version: int = 10,
               functions: Sequence[onnx.FunctionProto] = ()) -> onnx.ModelProto:
    opsets = [helper.make_opsetid("", 17)] + [helper.make_opsetid(d, 1) for d in dict.fromkeys(domains)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=ir_version, functions=list(functions))


def output_types(model: onnx.ModelProto) -> dict[str, tuple[int, tuple]]:
    """Graph outputs and value_info of an (inferred) model: name -> (elem type, dims as int/str/None)."""
    out = {}
    for vi in list(model.graph.value_info) + list(model.graph.output):
        tt = vi.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param if d.HasField("dim_param") else None
                     for d in tt.shape.dim) if tt.HasField("shape") else None
        out[vi.name] = (tt.elem_type, dims)
    return out
