"""The pass does O(1) amortized work per lowered node (issue 5), and leaves untouched nodes as they were.

No wall-clock assertions: the work is counted (whole-model helpers called once, per-graph helpers once per
graph, shape inference only when a type is missing and then once), and the output is checked node for node.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from lowering import graphs, passes
from lowering.bench import onednn_model
from lowering.passes import lower_model

F32 = TensorProto.FLOAT
SHAPE = [2, 4, 3, 3]


def _count_calls(monkeypatch, owner, name: str) -> list[int]:
    calls = [0]
    original = getattr(owner, name)

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


def _per_node() -> tuple[int, int]:
    """Nodes one batch-norm node becomes: alone, and when an earlier node already emitted its constants."""
    one = lower_model(onednn_model(tuple(SHAPE), "NCX", F32, nodes=1)).graph.node
    return len(one), sum(n.op_type != "Constant" for n in one)


def test_lowering_2000_nodes_does_linear_work(monkeypatch):
    first, later = _per_node()
    assert first > later > 10
    names = _count_calls(monkeypatch, graphs, "names_in_use")
    reads = _count_calls(monkeypatch, graphs, "names_read")
    types = _count_calls(monkeypatch, passes, "value_types_of_graph")
    inferred = _count_calls(monkeypatch, graphs, "inferred_types")
    verified = _count_calls(monkeypatch, passes, "infer_node")
    n = 2000
    model = onednn_model(tuple(SHAPE), "NCX", F32, nodes=n)
    lowered, report = passes.lower_model_with_report(model)
    assert len(lowered.graph.node) == first + (n - 1) * later  # constants are emitted once per graph
    assert report.lowered == {"onednn::BatchNormTrainingBackward": n}
    assert report.nodes_before == n and report.nodes_after == len(lowered.graph.node)
    assert names[0] == 1 and reads[0] == 1 and types[0] == 1
    assert inferred[0] == 0  # every type is declared: no shape inference at all
    assert sum(n.op_type == "Constant" for n in lowered.graph.node) == first - later
    # identical nodes but for their value names are verified once; the others get that result renamed
    assert verified[0] == 1
    assert {o for node in lowered.graph.node for o in node.output} >= {f"diff_src_{i}" for i in range(n)}


def _bn(i: int, src: str = "src") -> onnx.NodeProto:
    return helper.make_node("BatchNormTrainingBackward", [src, "diff_dst", "mean", "variance", "gamma"],
                            [f"dx_{i}", f"dg_{i}", f"db_{i}"], name=f"bn_{i}", domain="onednn", epsilon=1e-5,
                            data_format="NCX")


def _inputs():
    vi = helper.make_tensor_value_info
    return [vi("src", F32, SHAPE), vi("diff_dst", F32, SHAPE), vi("cond", TensorProto.BOOL, [])] + [
        vi(name, F32, [4]) for name in ("mean", "variance", "gamma")]


def test_subgraphs_and_functions_are_each_looked_at_once(monkeypatch):
    """k If nodes (a batch-norm node in each branch) and a function called k times: per-graph helpers run
    once per graph, call-site types once per function, and the output has the expected node count."""
    vi = helper.make_tensor_value_info
    k = 50
    nodes, outputs = [], []
    for i in range(k):
        branches = {}
        for side in ("then", "else"):
            bn = _bn(f"{side}{i}")
            branches[side] = helper.make_graph([bn], f"{side}_{i}", [], [vi(bn.output[0], F32, SHAPE)])
        nodes.append(helper.make_node("If", ["cond"], [f"if_{i}"], name=f"if_{i}",
                                      then_branch=branches["then"], else_branch=branches["else"]))
        nodes.append(helper.make_node("Backward", [f"if_{i}", "diff_dst", "mean", "variance", "gamma"],
                                      [f"call_{i}"], name=f"call_{i}", domain="local"))
        outputs.append(vi(f"call_{i}", F32, SHAPE))
    bn = _bn("fn", src="x")  # function inputs carry no types: they come from the k call sites
    bn.output[:] = ["y", "", ""]
    function = helper.make_function("local", "Backward", ["x", "diff_dst", "mean", "variance", "gamma"], ["y"],
                                    [bn], [helper.make_opsetid("", 17), helper.make_opsetid("onednn", 1)])
    if_types = [vi(f"if_{i}", F32, SHAPE) for i in range(k)]
    model = helper.make_model(helper.make_graph(nodes, "g", _inputs(), outputs, value_info=if_types),
                              functions=[function],
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("onednn", 1),
                                             helper.make_opsetid("local", 1)])
    names = _count_calls(monkeypatch, graphs, "names_in_use")
    reads = _count_calls(monkeypatch, graphs, "names_read")
    types = _count_calls(monkeypatch, passes, "value_types_of_graph")
    sites = _count_calls(monkeypatch, graphs, "call_site_input_types")
    inferred = _count_calls(monkeypatch, graphs, "inferred_types")
    lowered, report = passes.lower_model_with_report(model)
    assert report.lowered == {"onednn::BatchNormTrainingBackward": 2 * k + 1}
    assert names[0] == 1 and sites[0] == 1 and inferred[0] == 0
    assert reads[0] == 1 + 2 * k + 1  # main graph, each branch (one walk over the tree), the function
    assert types[0] == 1 + 2 * k + 1  # main graph, each branch, the function
    onnx.checker.check_model(lowered, full_check=True)
    assert {o.domain for o in lowered.opset_import} == {"", "local"}
    assert [o.domain for o in lowered.functions[0].opset_import] == [""]
    # a branch reads only diff_src: as many nodes as one such node alone in a graph (its own constants)
    alone = helper.make_model(helper.make_graph([_bn("x")], "alone", _inputs(), [vi("dx_x", F32, SHAPE)]),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("onednn", 1)])
    first = len(lower_model(alone).graph.node)
    branch_nodes = [len(n.attribute[0].g.node) for n in lowered.graph.node if n.op_type == "If"]
    assert branch_nodes == [first] * k  # each branch is its own graph: its own constants


def test_shape_inference_runs_once_when_types_are_missing(monkeypatch):
    """Batch-norm inputs without declared types (Identity outputs, no value_info): one shape inference for
    all nodes."""
    n = 200
    nodes = [helper.make_node("Identity", ["src"], ["src_copy"], name="copy")] + [_bn(i, "src_copy")
                                                                                  for i in range(n)]
    outputs = [helper.make_tensor_value_info(f"dx_{i}", F32, SHAPE) for i in range(n)]
    model = helper.make_model(helper.make_graph(nodes, "g", _inputs(), outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("onednn", 1)])
    inferred = _count_calls(monkeypatch, graphs, "inferred_types")
    lowered, report = passes.lower_model_with_report(model)
    assert inferred[0] == 1
    assert report.lowered == {"onednn::BatchNormTrainingBackward": n}
    onnx.checker.check_model(lowered, full_check=True)


def _dropout(x: str, y: str, name: str):
    return helper.make_node("Dropout", [x], [y, ""], name=name)  # a trailing empty output (no mask)


def test_untouched_nodes_keep_trailing_empty_outputs_in_subgraphs_and_functions():
    vi = helper.make_tensor_value_info
    shape = [2, 4, 3, 3]
    bn = helper.make_node("BatchNormTrainingBackward", ["src", "diff_dst", "mean", "variance", "gamma"],
                          ["diff_src", "", ""], name="bn", domain="onednn", epsilon=1e-5, data_format="NCX")
    then_branch = helper.make_graph([_dropout("diff_src", "t", "then_drop")], "then", [], [vi("t", F32, shape)])
    else_branch = helper.make_graph([_dropout("src", "e", "else_drop")], "else", [], [vi("e", F32, shape)])
    function = helper.make_function("local", "Drop", ["x"], ["y"], [_dropout("x", "y", "fn_drop")],
                                    [helper.make_opsetid("", 17)])
    nodes = [bn, _dropout("diff_src", "d", "main_drop"),
             helper.make_node("If", ["cond"], ["branch"], name="if", then_branch=then_branch, else_branch=else_branch),
             helper.make_node("Drop", ["d"], ["f"], name="call", domain="local")]
    inputs = [vi("src", F32, shape), vi("diff_dst", F32, shape), vi("cond", TensorProto.BOOL, [])] + [
        vi(name, F32, [4]) for name in ("mean", "variance", "gamma")]
    graph = helper.make_graph(nodes, "g", inputs, [vi("branch", F32, shape), vi("f", F32, shape)])
    model = helper.make_model(graph, functions=[function], opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("onednn", 1), helper.make_opsetid("local", 1)])
    lowered = lower_model(model)
    by_name = {n.name: n for n in lowered.graph.node}
    assert "bn" not in by_name
    for name in ("main_drop", "if", "call"):
        assert by_name[name] == next(n for n in model.graph.node if n.name == name), name
    assert list(lowered.functions[0].node) == list(function.node)


def test_unnamed_nodes_share_a_prefix_and_names_stay_unique():
    """Unnamed nodes all name their intermediates after the op type: numbering carries on from one node to
    the next (no per-name lookups), so no two names meet; a prefix some model name already uses under a
    slash is looked up name by name instead (tests/test_lowering.py::test_fresh_names_never_collide)."""
    model = onednn_model(tuple(SHAPE), "NCX", F32, nodes=3)
    for node in model.graph.node:
        node.name = ""
    lowered = lower_model(model)
    node_names = [n.name for n in lowered.graph.node]
    values = [o for n in lowered.graph.node for o in n.output]
    assert len(set(node_names)) == len(node_names) and len(set(values)) == len(values)
    assert all(name.startswith("BatchNormTrainingBackward/") for name in node_names)
    onnx.checker.check_model(lowered, full_check=True)
