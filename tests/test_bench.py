"""``oplower bench``'s machinery on a tiny workload (no timing assertions)."""

from __future__ import annotations

import json

import numpy as np

from lowering import bench
from lowering.bench import runtimes as bench_runtimes
from lowering.cli import main


def test_bench_tiny_writes_well_formed_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--shapes", "tiny", "--no-torch", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"machine", "copy_gbps", "cases", "summary", "pass"} <= set(result)
    assert result["copy_gbps"] > 0
    assert {(c["layout"], c["dtype"]) for c in result["cases"]} == {
        (layout, dtype) for layout in ("NCX", "NXC") for dtype in ("f32", "bf16", "f16")}
    for case in result["cases"]:
        assert case["ms"] > 0 and case["gbps"] > 0 and case["vs_bound"] > 0
        assert case["torch_ms"] is None and case["vs_torch"] is None
    assert [(r["layout"], r["channels"], r["size"]) for r in result["in_graph"]] == [("NCX", 4, 5), ("NXC", 4, 5)]
    assert all(r["ms"] > 0 and r["torch_ms"] is None for r in result["in_graph"])
    assert [row["nodes"] for row in result["pass"]] == [1, 10]
    assert all(row["ms_per_node"] > 0 and row["distinct_ms_per_node"] > 0 and row["lowered_nodes"] > row["nodes"]
               for row in result["pass"])
    printed = capsys.readouterr()
    assert "| layout | dtype |" in printed.out and "onnxruntime" in printed.out
    assert "In a training graph (f32)" in printed.out
    assert "copy bandwidth" in printed.err  # progress goes to stderr


def test_onednn_model_lowers_to_standard_ops():
    from onnx import TensorProto

    lowered = bench.lowered_model((2, 3, 4, 4), "NXC", TensorProto.BFLOAT16)
    assert {n.domain for n in lowered.graph.node} <= {""}
    assert [o.name for o in lowered.graph.output] == ["diff_src_0", "diff_gamma_0", "diff_beta_0"]


def test_read_by_a_node_makes_diff_src_internal():
    """The in-graph benchmark model: diff_src is read by a ReduceSum, so the NCX lowering takes the in-place
    Conv form (group = C) that it never takes for a graph output; both run."""
    from onnx import TensorProto

    from lowering import lower_model
    from runtime.session import run_model

    shape = (2, 3, 14, 14)
    plain = bench.lowered_model(shape, "NCX", TensorProto.FLOAT)
    read = lower_model(bench.read_by_a_node(bench.onednn_model(shape, "NCX", TensorProto.FLOAT)))

    def depthwise(model):
        return [n for n in model.graph.node if n.op_type == "Conv" and n.attribute[0].i == 3]

    assert not depthwise(plain) and len(depthwise(read)) == 1
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    vec = np.ones(3, np.float32)
    feeds = {"src": x, "diff_dst": x[::-1].copy(), "mean": x.mean(axis=(0, 2, 3)), "variance": vec, "gamma": vec}
    np.testing.assert_allclose(run_model(read, feeds)["dx_sum"], run_model(plain, feeds)["diff_src_0"].sum(),
                               rtol=1e-4, atol=1e-4)


def test_bench_runtimes_table_for_both_targets(tmp_path, capsys):
    """--runtimes: a row per runtime; tract refuses the onnxruntime target (computed BatchNormalization
    parameters) and runs the portable one; the others run both."""
    for target in ("onnxruntime", "portable"):
        out = tmp_path / f"{target}.json"
        assert main(["bench", "--shapes", "tiny", "--no-torch", "--runtimes", "--target", target,
                     "--json", str(out)]) == 0
        result = json.loads(out.read_text())
        assert result["target"] == target
        rows = {(r["runtime"], r["layout"]): r for r in result["runtimes"]}
        assert set(rows) == {(rt, layout) for rt in bench_runtimes.RUNTIMES for layout in ("NCX", "NXC")}
        for (runtime, _), row in rows.items():
            if runtime == "tract" and target == "onnxruntime":
                assert row["ms"] is None and "Params are not const" in row["status"]
            else:
                assert row["status"] == "ok" and row["ms"] > 0
        assert "| runtime | target |" in capsys.readouterr().out
