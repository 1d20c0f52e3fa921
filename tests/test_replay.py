"""Nodes with the same lowering key are emitted by copying the first one's lowering (lowering/passes.py).

Every test checks the lowered model the hard way: onnx.checker (full_check), value and node names unique,
and onnxruntime's results against the float64 reference evaluator of the original model, node by node,
with each node reading its own data so that a copied lowering wired to the wrong value shows.
"""

from __future__ import annotations

import numpy as np
import onnx
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper

from lowering.numerics import compare
from lowering.passes import lower_model, lower_model_with_report
from runtime.reference_eval import evaluate
from runtime.session import run_model

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
NP = {F32: np.float32, F16: np.float16}
vi = helper.make_tensor_value_info


def _bn(i: int, inputs: list[str], name: str | None = None, layout: str = "NCX") -> onnx.NodeProto:
    return helper.make_node("BatchNormTrainingBackward", inputs, [f"dx_{i}", f"dg_{i}", f"db_{i}"],
                            name=f"bn_{i}" if name is None else name, domain="onednn", epsilon=1e-3,
                            data_format=layout)


def _own_inputs(i: int, shape, elem=F32) -> tuple[list[str], list[onnx.ValueInfoProto]]:
    c = shape[1]
    names = [f"x_{i}", f"dy_{i}", f"m_{i}", f"v_{i}", f"g_{i}"]
    return names, [vi(names[0], elem, shape), vi(names[1], elem, shape)] + [vi(n, F32, [c]) for n in names[2:]]


def _own_nodes(count: int, shape) -> tuple[list[onnx.NodeProto], list[onnx.ValueInfoProto]]:
    """``count`` f32 nodes ``bn_<i>``, each reading its own graph inputs."""
    nodes, inputs = [], []
    for i in range(count):
        names, infos = _own_inputs(i, shape)
        nodes.append(_bn(i, names))
        inputs += infos
    return nodes, inputs


def _outputs(i: int, shape, elem=F32, which=(0, 1, 2)) -> list[onnx.ValueInfoProto]:
    c = shape[1]
    all_three = [vi(f"dx_{i}", elem, shape), vi(f"dg_{i}", F32, [c]), vi(f"db_{i}", F32, [c])]
    return [all_three[k] for k in which]


def _model(nodes, inputs, outputs, functions=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "replay", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("onednn", 1)],
                              functions=list(functions))
    model.ir_version = 10
    return model


def _feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        t = value.type.tensor_type
        shape = [d.dim_value for d in t.shape.dim]
        if t.elem_type == TensorProto.BOOL:
            feeds[value.name] = np.array(True)
            continue
        a = rng.standard_normal(shape)
        if value.name.startswith("v_"):
            a = np.abs(a) + 0.5
        feeds[value.name] = a.astype(NP[t.elem_type])
    return feeds


def _check(model: onnx.ModelProto) -> onnx.ModelProto:
    lowered = lower_model(model)
    onnx.checker.check_model(lowered, full_check=True)
    graphs = [lowered.graph] + [a.g for n in lowered.graph.node for a in n.attribute if a.g.name]
    for graph in graphs:
        values = [o for n in graph.node for o in n.output]
        names = [n.name for n in graph.node]
        assert len(values) == len(set(values)) and len(names) == len(set(names))
    feeds = _feeds(model)
    got = run_model(lowered, feeds)
    want = evaluate(model, feeds)
    types = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
    bad = [r.describe() for name in want
           if not (r := compare(name, want[name], got[name], types[name], 2e-6)).ok]
    assert not bad, "\n".join(bad)
    return lowered


def _ops(graph: onnx.GraphProto, prefix: str) -> list[tuple]:
    return [(n.op_type, tuple(a.SerializeToString() for a in n.attribute)) for n in graph.node
            if n.name.startswith(prefix + "/") and n.op_type != "Constant"]


def test_copies_are_wired_to_their_own_values():
    shape = [2, 3, 4, 5]
    nodes, inputs = _own_nodes(4, shape)
    outputs = [o for i in range(4) for o in _outputs(i, shape)]
    model = _model(nodes, inputs, outputs)
    lowered = _check(model)
    first = _ops(lowered.graph, "bn_0")
    assert len(first) > 10
    for i in range(1, 4):
        assert _ops(lowered.graph, f"bn_{i}") == first  # same nodes, same attributes: a copy, renamed


def test_the_key_includes_types_and_shared_arguments():
    shape = [2, 3, 4, 5]
    nodes, inputs, outputs = [], [], []
    for i, (elem, share) in enumerate([(F32, False), (F32, False), (F16, False), (F32, True), (F32, True)]):
        names, infos = _own_inputs(i, shape, elem)
        if share:  # src and diff_dst are one value
            names[1] = names[0]
            infos.pop(1)
        nodes.append(_bn(i, names))
        inputs += infos
        outputs += _outputs(i, shape, elem)
    lowered = _check(_model(nodes, inputs, outputs))
    ops = [_ops(lowered.graph, f"bn_{i}") for i in range(len(nodes))]
    assert ops[0] == ops[1] and ops[3] == ops[4]
    assert ops[2] != ops[0]  # f16: Casts


def _declared(model: onnx.ModelProto, shape, count: int) -> onnx.ModelProto:
    """Every output's type declared (value_info, as after onnx shape inference): the types in the key no
    longer tell which outputs are read or are graph outputs."""
    declared = {o.name for o in model.graph.output}
    for i in range(count):
        model.graph.value_info.extend(v for v in _outputs(i, shape) if v.name not in declared)
    return model


def test_the_key_includes_which_outputs_are_wanted():
    """Two identical nodes, every output type declared: node 0's parameter gradients are read by nobody,
    node 1's by Relu nodes. A copy of node 0's lowering would leave node 1's unproduced."""
    shape = [2, 3, 4, 5]
    nodes, inputs = _own_nodes(2, shape)
    nodes += [helper.make_node("Relu", ["dg_1"], ["r_dg"], name="r_dg"),
              helper.make_node("Relu", ["db_1"], ["r_db"], name="r_db")]
    outputs = _outputs(0, shape, which=(0,)) + _outputs(1, shape, which=(0,)) + [vi("r_dg", F32, [3]),
                                                                                  vi("r_db", F32, [3])]
    lowered = _check(_declared(_model(nodes, inputs, outputs), shape, 2))
    produced = {o for n in lowered.graph.node for o in n.output}
    assert {"dg_1", "db_1"} <= produced and not {"dg_0", "db_0"} & produced


def test_nodes_that_share_a_name_or_have_none():
    shape = [2, 3, 4, 5]
    nodes, inputs, outputs = [], [], []
    for i, name in enumerate(["same", "same", "", "", "same"]):
        names, infos = _own_inputs(i, shape)
        nodes.append(_bn(i, names, name=name))
        inputs += infos
        outputs += _outputs(i, shape)
    lowered = _check(_model(nodes, inputs, outputs))
    # one counter per prefix numbers node and value names alike: a number is never handed out twice
    for prefix in ("same/", "BatchNormTrainingBackward/"):
        names = [n for node in lowered.graph.node for n in [node.name, *node.output] if n.startswith(prefix)]
        numbers = [int(n.rpartition("_")[2]) for n in names]
        assert len(names) > 40 and len(numbers) == len(set(numbers)), prefix


def test_copies_avoid_names_the_model_already_uses():
    """The model holds names the copies would be given (``bn_1/...``): the copies must pick others."""
    shape = [2, 3, 4, 5]
    plain = _model(*_two_nodes(shape))
    generated = [o for n in lower_model(plain).graph.node for o in n.output if o.startswith("bn_1/")]
    assert generated
    nodes, inputs, outputs = _two_nodes(shape)
    for k, taken in enumerate(generated):  # the model defines every one of them before the custom nodes
        nodes.insert(0, helper.make_node("Identity", ["x_0"], [taken], name=f"bn_1/taken_{k}"))
    outputs.append(vi(generated[-1], F32, shape))
    lowered = _check(_model(nodes, inputs, outputs))
    mine = [o for n in lowered.graph.node if n.name.startswith("bn_1/") and "taken" not in n.name
            for o in n.output]
    assert not set(mine) & set(generated)


def _two_nodes(shape):
    nodes, inputs = _own_nodes(2, shape)
    return nodes, inputs, _outputs(0, shape) + _outputs(1, shape)


def test_a_subgraph_gets_its_own_constants():
    """The same node in the main graph and in both If branches: a branch cannot read the main graph's
    lowering's constants unless they come before it, and the branch copy must not point at a main-graph
    value of the first lowering."""
    shape = [2, 3, 4, 5]
    names, infos = _own_inputs(0, shape)
    main_bn = _bn(0, names)
    branch_nodes = [_bn(1, names), _bn(2, names)]
    branch = helper.make_graph(branch_nodes, "branch", [], _outputs(1, shape, which=(0,)))
    cond = helper.make_node("If", ["cond"], ["dx_1"], then_branch=branch, else_branch=branch, name="if")
    # the If comes first: the main graph's node is lowered after the branches
    model = _model([cond, main_bn, helper.make_node("Identity", ["dx_1"], ["out"])],
                   infos + [vi("cond", TensorProto.BOOL, [])], _outputs(0, shape) + [vi("out", F32, shape)])
    _check(model)


def test_copies_inside_a_model_local_function():
    shape = [2, 3, 4, 5]
    names = ["x", "dy", "m", "v", "g"]
    body = [helper.make_node("BatchNormTrainingBackward", names, [f"dx{i}", "", ""], name="inner",
                             domain="onednn", epsilon=1e-3, data_format="NCX") for i in range(2)]
    body.append(helper.make_node("Add", ["dx0", "dx1"], ["y"]))
    function = helper.make_function("local", "twice", names, ["y"], body,
                                    opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("onednn", 1)])
    call_names, infos = _own_inputs(0, shape)
    call = helper.make_node("twice", call_names, ["dx_0"], domain="local")
    model = _model([call], infos, _outputs(0, shape, which=(0,)), functions=[function])
    model.opset_import.append(helper.make_opsetid("local", 1))
    lowered, report = lower_model_with_report(model)
    assert report.lowered == {"onednn::BatchNormTrainingBackward": 2}
    _check(model)
    inner = lowered.functions[0].node
    assert len({o for n in inner for o in n.output}) == sum(len(n.output) for n in inner)


def test_the_key_includes_which_outputs_are_graph_outputs():
    """Identical nodes, every output type declared: a diff_src that is a graph output, one read by a node:
    f32 NCX adds the second's depthwise Conv to a*dy in place, the first's to dy and scales by a last
    (lowering/rules/batch_norm_backward/emit.py), and each is exact."""
    shape = [2, 3, 14, 14]
    nodes, inputs = _own_nodes(4, shape)
    nodes += [helper.make_node("Relu", ["dx_1"], ["relu1"], name="relu1"),
              helper.make_node("Relu", ["dx_3"], ["relu3"], name="relu3")]
    outputs = (_outputs(0, shape) + _outputs(1, shape, which=(1, 2)) + _outputs(2, shape)
               + _outputs(3, shape, which=(1, 2)) + [vi("relu1", F32, shape), vi("relu3", F32, shape)])
    lowered = _check(_declared(_model(nodes, inputs, outputs), shape, 4))
    convs = [n for n in lowered.graph.node if n.op_type == "Conv" and n.attribute[0].i == 3]
    assert [n.name.split("/")[0] for n in convs] == ["bn_0", "bn_1", "bn_2", "bn_3"]  # group = C (the other
    # Conv, group = N*C, sums dy*xc in all)
    adds = {n.output[0]: n for n in lowered.graph.node if n.op_type == "Add" and any(c.output[0] in n.input
                                                                                    for c in convs)}
    scaled_last = [n.name.split("/")[0] for n in lowered.graph.node if n.op_type == "Mul" and set(adds) & set(n.input)]
    assert scaled_last == ["bn_0", "bn_2"]  # the graph outputs


def test_a_lowering_with_subgraphs_is_never_copied(monkeypatch):
    """A rule whose If branches read the node's input by name from the outer graph: a renamed copy would
    keep reading the first node's value, so each node is lowered afresh."""
    import lowering.rules.batch_norm_backward  # noqa: F401  (the real rule registered first)
    from lowering import rules

    def rule(b, request):
        src, dx = request.input("src"), request.output("diff_src")
        branch = helper.make_graph([helper.make_node("Identity", [src], ["y_" + dx])], "branch", [],
                                   [vi("y_" + dx, F32, None)])
        b.op("If", [b.const(np.array(True), hint="cond")], [dx], then_branch=branch, else_branch=branch)

    monkeypatch.setitem(rules._RULES, "batch_norm_backward", rule)
    shape = [2, 3, 4, 5]
    nodes, inputs = _own_nodes(3, shape)
    outputs = [o for i in range(3) for o in _outputs(i, shape, which=(0,))]
    lowered = lower_model(_model(nodes, inputs, outputs))
    feeds = _feeds(_model(nodes, inputs, outputs))
    got = run_model(lowered, feeds)
    for i in range(3):
        np.testing.assert_array_equal(got[f"dx_{i}"], feeds[f"x_{i}"])


class _NeverCopy(dict):
    """A replay table that never finds anything: every node is lowered by its rule."""

    def get(self, key, default=None):
        return None


def _canonical(graph: onnx.GraphProto) -> list[tuple]:
    """The graph's nodes with every name replaced by its order of first appearance (constants' own tensor
    names blanked): two lowerings that differ only in naming compare equal."""
    names: dict[str, str] = {"": ""}

    def name(s: str) -> str:
        return names.setdefault(s, f"v{len(names)}")

    for value in graph.input:
        name(value.name)
    out = []
    for node in graph.node:
        attributes = []
        for a in node.attribute:
            copy = onnx.AttributeProto()
            copy.CopyFrom(a)
            if copy.HasField("t"):
                copy.t.name = ""
            attributes.append(copy.SerializeToString())
        out.append((node.op_type, tuple(map(name, node.input)), tuple(map(name, node.output)), tuple(attributes)))
    return out


@st.composite
def _random_models(draw):
    nodes, inputs, outputs, kinds = [], [], [], []
    # most nodes alike (so that keys repeat and copies happen), a few different
    usual_shape = draw(st.sampled_from([[2, 3, 14, 14], [2, 3, 4, 5]]))
    usual_elem = draw(st.sampled_from([F32, F16]))
    usual_use = draw(st.sampled_from(["output", "read", None]))
    for i in range(draw(st.integers(2, 6))):
        odd = draw(st.integers(0, 3)) == 0
        shape = [2, 3, 4, 5] if odd and usual_shape[2] == 14 else [2, 3, 14, 14] if odd else usual_shape
        elem = usual_elem if not draw(st.integers(0, 3)) == 0 else (F16 if usual_elem == F32 else F32)
        kinds.append((shape, elem))
        names, infos = _own_inputs(i, shape, elem)
        if draw(st.integers(0, 3)) == 0:  # gamma absent
            names, infos = names[:4], infos[:4]
        if draw(st.integers(0, 4)) == 0:  # src and diff_dst one value
            names[1] = names[0]
            infos.pop(1)
        outs = [f"dx_{i}", f"dg_{i}", f"db_{i}"] if draw(st.integers(0, 3)) else [f"dx_{i}"]
        nodes.append(helper.make_node("BatchNormTrainingBackward", names, outs, domain="onednn", epsilon=1e-3,
                                      data_format="NCX", name=draw(st.sampled_from([f"bn_{i}", "bn", "", "a/b"]))))
        inputs += infos
        for k, o in enumerate(outs):
            info = _outputs(i, shape, elem)[k]
            # diff_src's use drawn per node, the parameter gradients' mostly per model
            how = draw(st.sampled_from(["output", "read", "both", "unused"])) if k == 0 or not usual_use \
                else usual_use
            if how in ("output", "both"):
                outputs.append(info)
            if how in ("read", "both"):
                nodes.append(helper.make_node("Identity", [o], [f"read_{o}"], name=f"read_{o}"))
                outputs.append(helper.make_tensor_value_info(f"read_{o}", info.type.tensor_type.elem_type, None))
    if not outputs:
        outputs.append(_outputs(0, *kinds[0])[0])
    model = _model(nodes, inputs, outputs)
    if draw(st.booleans()):  # every type declared: then only the key's flags tell the nodes apart
        declared = {o.name for o in outputs}
        produced = {o for n in nodes for o in n.output}
        for i, (shape, elem) in enumerate(kinds):
            model.graph.value_info.extend(v for v in _outputs(i, shape, elem)
                                          if v.name in produced and v.name not in declared)
    return model


@given(model=_random_models())
def test_a_copy_is_what_the_rule_would_have_emitted(model):
    """Lowered with copies and lowered with every node through its rule: the same nodes, attributes and
    wiring, names aside."""
    from unittest import mock

    from lowering import passes

    with_copies = lower_model(model)
    real_init = passes._Scope.__post_init__

    def never_copy(self):
        real_init(self)
        self.replays = _NeverCopy()

    with mock.patch.object(passes._Scope, "__post_init__", never_copy):
        without = lower_model(model)
    assert _canonical(with_copies.graph) == _canonical(without.graph)
