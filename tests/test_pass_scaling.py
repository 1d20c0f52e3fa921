"""The pass does O(1) amortized work per lowered node (issue 5), and leaves untouched nodes as they were.

No wall-clock assertions: the work is counted (whole-graph helpers called once, graph outputs scanned a
bounded number of times per output), and the output is checked node for node.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx import TensorProto, helper
from onnx_ir import _graph_containers

from lowering import graphs, passes
from lowering.bench import onednn_model
from lowering.passes import lower_model

F32 = TensorProto.FLOAT


def _count_calls(monkeypatch, owner, name: str) -> list[int]:
    calls = [0]
    original = getattr(owner, name)

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


def test_lowering_2000_nodes_does_linear_work(monkeypatch):
    per_node = len(lower_model(onednn_model((2, 4, 3, 3), "NCX", F32, nodes=1)).graph.node)
    names = _count_calls(monkeypatch, graphs, "names_in_use")
    call_sites = _count_calls(monkeypatch, graphs, "call_site_input_types")
    inferred = _count_calls(monkeypatch, graphs, "inferred_types")
    removals = _count_calls(monkeypatch, ir.Graph, "remove")
    output_reads = _count_calls(monkeypatch, _graph_containers.GraphOutputs, "__getitem__")
    n = 2000
    model = onednn_model((2, 4, 3, 3), "NCX", F32, nodes=n)
    lowered, report = passes.lower_model_with_report(model)
    assert len(lowered.graph.node) == n * per_node
    assert report.lowered == {"onednn::BatchNormTrainingBackward": n}
    assert report.nodes_before == n and report.nodes_after == n * per_node
    assert names[0] == 1 and call_sites[0] == 1 and removals[0] == 1
    assert inferred[0] == 0  # every type is declared: no shape inference at all
    outputs = len(model.graph.output)  # 3 per node, all lowered; quadratic scans would read ~outputs**2 / 2
    assert output_reads[0] <= 8 * outputs, output_reads[0]


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
