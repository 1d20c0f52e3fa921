"""Example models with batch-norm training backward nodes of any bundled dialect, and their float64 answers.

Nodes are laid out from the registry (the schema's argument order, the binding's roles, attribute names),
never from per-dialect Python literals. Used by ``oplower demo`` and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from lowering.numerics import np_type
from opdef.registry import Entry, Registry
from runtime.reference import batch_norm_backward as reference_backward

PARAM_GRADS = ("diff_gamma", "diff_beta")
OUTPUT_ROLES = ("diff_src", "diff_gamma", "diff_beta")


@dataclass(frozen=True)
class BnCase:
    """One node: which op, the src shape and layout, types, which optional arguments, what data."""

    op: tuple[str, str]  # (domain, op_type)
    shape: tuple[int, ...]
    layout: str = "NCX"  # NCX | NXC (data_format ops; others have a fixed layout)
    io_type: int = TensorProto.FLOAT
    stat_type: int | None = None  # None: io_type
    gamma: bool = True
    outputs: tuple[str, ...] = OUTPUT_ROLES  # roles the node declares (required ones are added)
    consumed: tuple[str, ...] | None = None  # roles that are graph outputs (None: all declared)
    reduce_axes: tuple[int, ...] | None = None  # keep-rank stats (DirectML): default all axes but 1
    symbolic: tuple[int, ...] = ()  # axes of src declared as symbolic dims
    epsilon: float = 1e-5
    conditioning: float = 0.0  # |mean|/std of src per channel; 0: mean ~ N(0, 1), std ~ U(0.5, 2)
    name: str = "bn"
    seed: int = 0
    data: dict = field(default=None, compare=False, hash=False)  # explicit arrays by role (overrides random)


@dataclass
class Example:
    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]  # graph output name -> float64 reference
    output_types: dict[str, int]
    cases: list[BnCase]
    output_roles: dict[str, tuple[str, str]]  # graph output name -> (case name, role)


def case_geometry(entry: Entry, case: BnCase) -> tuple[int | None, tuple[int, ...], tuple[int, ...]]:
    """(channel axis or None, reduce axes, shape of the statistics tensors) for ``case`` under ``entry``."""
    rank = len(case.shape)
    layout = entry.binding.layout
    if layout == "stats_broadcast":
        axes = case.reduce_axes if case.reduce_axes is not None else (
            tuple(a for a in range(rank) if a != 1) if rank > 1 else (0,))
        return None, tuple(axes), tuple(1 if a in axes else d for a, d in enumerate(case.shape))
    channel = rank - 1 if layout == "data_format" and case.layout == "NXC" else 1
    return channel, tuple(a for a in range(rank) if a != channel), (case.shape[channel],)


def build_example(cases: list[BnCase], registry: Registry, *, opset: int = 17, ir_version: int | None = None,
                  onednn_single_output: str = "spec") -> Example:
    nodes, inputs, outputs = [], [], []
    feeds, expected, types, roles_of = {}, {}, {}, {}
    for case in cases:
        entry = registry.get(*case.op)
        if entry is None:
            raise KeyError(f"no bundled op {case.op[0]}::{case.op[1]}")
        node, graph_inputs, graph_outputs, case_feeds, case_expected, case_types, case_roles = _one(
            entry, case, onednn_single_output)
        nodes.append(node)
        inputs += graph_inputs
        outputs += graph_outputs
        feeds.update(case_feeds)
        expected.update(case_expected)
        types.update(case_types)
        roles_of.update(case_roles)
    graph = helper.make_graph(nodes, "examples", inputs, outputs)
    domains = sorted({c.op[0] for c in cases})
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]
                              + [helper.make_opsetid(d, 1) for d in domains])
    if ir_version is not None:
        model.ir_version = ir_version
    return Example(model, feeds, expected, types, list(cases), roles_of)


def _one(entry: Entry, case: BnCase, option: str):
    schema, binding = entry.schema, entry.binding
    rng = np.random.default_rng(case.seed)
    channel, axes, stat_shape = case_geometry(entry, case)
    io_type = case.io_type
    stat_type = case.stat_type if case.stat_type is not None else io_type
    stat_role = binding.stat_input
    data = _data(case, rng, axes, stat_shape, io_type, stat_type, stat_role)

    role_of = {spec: role for role, spec in binding.roles}
    declared = set(case.outputs) | {role_of[a.name] for a in schema.outputs if not a.optional and a.name in role_of}
    consumed = set(case.consumed) if case.consumed is not None else declared
    src_dims = [f"{case.name}_d{a}" if a in case.symbolic else d for a, d in enumerate(case.shape)]
    stat_dims = list(stat_shape) if binding.layout != "stats_broadcast" else [
        1 if a in axes else src_dims[a] for a in range(len(case.shape))]
    if binding.layout != "stats_broadcast" and channel in case.symbolic:
        stat_dims = [src_dims[channel]]

    def value(role: str) -> str:
        return f"{case.name}.{role}"

    graph_inputs, feeds = [], {}
    node_inputs = []
    for arg in schema.inputs:
        role = role_of.get(arg.name, arg.name)
        if role == "gamma" and not case.gamma:
            node_inputs.append("")
            continue
        if role not in data:  # an input the math does not use (nGraph's beta): any [C] tensor
            data[role] = rng.standard_normal(stat_shape).astype(np.float32).astype(np_type(stat_type))
        is_io = role in ("src", "diff_dst")
        graph_inputs.append(helper.make_tensor_value_info(
            value(role), io_type if is_io else stat_type, src_dims if is_io else stat_dims))
        feeds[value(role)] = data[role]
        node_inputs.append(value(role))
    while node_inputs and not node_inputs[-1]:
        node_inputs.pop()
    node_outputs = [value(role_of[a.name]) if role_of.get(a.name) in declared else "" for a in schema.outputs]
    while node_outputs and not node_outputs[-1]:
        node_outputs.pop()
    attrs = {binding.arg("epsilon") or "epsilon": float(case.epsilon)}
    if binding.layout == "data_format" and binding.layout_attribute:
        attrs[binding.layout_attribute] = case.layout
    node = helper.make_node(binding.op_type, node_inputs, node_outputs, name=case.name, domain=binding.domain,
                            **attrs)

    single_output = binding.paired_param_grads and not (declared & set(PARAM_GRADS))
    statistics = "frozen" if single_output and option == "upstream" else binding.statistics
    wanted = [r for r in OUTPUT_ROLES if r in consumed]
    ref = reference_backward(data["src"], data["diff_dst"], data["mean"], data[stat_role],
                             None if (single_output or not case.gamma) else data["gamma"],
                             epsilon=case.epsilon, reduce_axes=axes, statistics=statistics,
                             stat_input=stat_role, outputs=wanted) if wanted else {}
    graph_outputs, expected, types, roles = [], {}, {}, {}
    for role in wanted:
        elem = io_type if role == "diff_src" else stat_type
        graph_outputs.append(helper.make_tensor_value_info(value(role), elem,
                                                           src_dims if role == "diff_src" else stat_dims))
        expected[value(role)] = ref[role]
        types[value(role)] = elem
        roles[value(role)] = (case.name, role)
    return node, graph_inputs, graph_outputs, feeds, expected, types, roles


def _data(case: BnCase, rng, axes, stat_shape, io_type, stat_type, stat_role) -> dict[str, np.ndarray]:
    """src, diff_dst, mean, variance|inv_std, gamma; mean and variance are src's batch statistics."""
    given = dict(case.data or {})
    io, st = np_type(io_type), np_type(stat_type)
    shape = case.shape
    bshape = tuple(1 if a in axes else d for a, d in enumerate(shape))
    std = rng.uniform(0.5, 2.0, bshape)
    centre = (case.conditioning * std * rng.choice([-1.0, 1.0], bshape) if case.conditioning
              else rng.standard_normal(bshape))
    src = np.asarray(given.get("src", centre + std * rng.standard_normal(shape))).astype(np.float32).astype(io)
    x = src.astype(np.float64)
    mean = x.mean(axis=axes, keepdims=True)
    variance = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    out = {
        "src": src,
        "diff_dst": np.asarray(given.get("diff_dst", rng.standard_normal(shape))).astype(np.float32).astype(io),
        "mean": np.asarray(given.get("mean", mean.reshape(stat_shape))).astype(np.float32).astype(st),
        "gamma": np.asarray(given.get("gamma", rng.uniform(0.5, 1.5, stat_shape))).astype(np.float32).astype(st),
    }
    var = np.asarray(given.get("variance", variance.reshape(stat_shape)), dtype=np.float64)
    if stat_role == "inv_std":
        var = given.get("inv_std", 1.0 / np.sqrt(var + case.epsilon))
    out[stat_role] = np.asarray(var).astype(np.float32).astype(st)
    return out
