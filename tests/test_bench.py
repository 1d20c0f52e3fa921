"""``oplower bench``'s machinery on a tiny workload (no timing assertions)."""

from __future__ import annotations

import json

from lowering import bench
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
    assert [row["nodes"] for row in result["pass"]] == [1, 10]
    assert all(row["ms_per_node"] > 0 and row["distinct_ms_per_node"] > 0 and row["lowered_nodes"] > row["nodes"]
               for row in result["pass"])
    printed = capsys.readouterr()
    assert "| layout | dtype |" in printed.out and "onnxruntime" in printed.out
    assert "copy bandwidth" in printed.err  # progress goes to stderr


def test_onednn_model_lowers_to_standard_ops():
    from onnx import TensorProto

    lowered = bench.lowered_model((2, 3, 4, 4), "NXC", TensorProto.BFLOAT16)
    assert {n.domain for n in lowered.graph.node} <= {""}
    assert [o.name for o in lowered.graph.output] == ["diff_src_0", "diff_gamma_0", "diff_beta_0"]
