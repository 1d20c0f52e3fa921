"""Left ops are never silent: non-standard ops without a lowering rule stay, and say so.

``oplower lower`` prints one warning line per left op type (count, first node, whether plain onnxruntime
runs it); ``--strict`` makes that an error (exit 1, no output, input untouched). The library's report
lists them (``LoweringReport.left``); ``strict=True`` raises. The onnx-ir pass keeps today's behaviour: the
nodes it has no rule for stay byte-identical.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from lowering import LeftOpsError, LowerCustomOpsPass, left_ops, lower_model, lower_model_with_report
from lowering.cli import main
from lowering.demo.examples import BnCase, build_example
from opdef.registry import load_schemas

MS = "com.microsoft"
ONEDNN = ("onednn", "BatchNormTrainingBackward")
# no rule here and none planned: a made-up training op (plain onnxruntime has no kernel for it) and
# onnxruntime's own contrib op Inverse (onnxruntime runs it; no other runtime does)
UNKNOWN, CONTRIB = "NoSuchTrainingOp", "Inverse"


@pytest.fixture(scope="module")
def registry():
    return load_schemas()


def _with_left_ops(registry, top_level: bool = True) -> onnx.ModelProto:
    """A oneDNN batch-norm backward (lowered) whose output goes through two unknown nodes and an Inverse
    (``top_level``), and an If whose then-branch holds one more unknown node."""
    model = build_example([BnCase(ONEDNN, (2, 3, 4, 4), layout="NCX")], registry).model
    graph = model.graph
    out = graph.output[0].name
    shape = [d.dim_value for d in graph.output[0].type.tensor_type.shape.dim]  # the lowered model is checked:
    # main-graph outputs need a type and shape
    branch_in = "m2" if top_level else out
    branch = helper.make_graph([helper.make_node(UNKNOWN, [branch_in], ["b"], name="inner", domain=MS)], "then",
                               [], [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)])
    else_branch = helper.make_graph([helper.make_node("Identity", [branch_in], ["e"])], "else", [],
                                    [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    if top_level:
        graph.node.extend([
            helper.make_node(UNKNOWN, [out], ["m1"], name="first_unknown", domain=MS, alpha=0.5),
            helper.make_node(UNKNOWN, ["m1"], ["m2"], domain=MS),
            helper.make_node(CONTRIB, ["sq"], ["inv"], name="inverse", domain=MS),
        ])
        graph.input.append(helper.make_tensor_value_info("sq", TensorProto.FLOAT, [2, 2]))
        graph.output.extend([helper.make_tensor_value_info("m2", TensorProto.FLOAT, shape),
                             helper.make_tensor_value_info("inv", TensorProto.FLOAT, [2, 2])])
    graph.node.append(helper.make_node("If", ["cond"], ["branch_out"], name="choose", then_branch=branch,
                                       else_branch=else_branch))
    graph.input.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    graph.output.append(helper.make_tensor_value_info("branch_out", TensorProto.FLOAT, shape))
    if not any(o.domain == MS for o in model.opset_import):
        model.opset_import.add(domain=MS, version=1)
    return model


@pytest.fixture
def model_path(registry, tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(_with_left_ops(registry), path)
    return path


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- library -------------------------------------------------------------------------------------------

def test_report_lists_each_left_op_type_with_count_first_node_and_runtime(registry):
    lowered, report = lower_model_with_report(_with_left_ops(registry), registry=registry)
    assert report.lowered == {"onednn::BatchNormTrainingBackward": 1}
    assert [(op.op, op.count, op.onnxruntime_runs) for op in report.left] == [
        (f"{MS}::{UNKNOWN}", 3, False), (f"{MS}::{CONTRIB}", 1, True)]
    assert report.left[0].first == "'first_unknown'"
    assert "plain onnxruntime cannot run it" in report.left[0].describe()
    assert "only onnxruntime runs it" in report.left[1].describe()
    assert "4 non-standard node(s) left (2 op type(s))" in report.summary()
    assert left_ops(lowered) == report.left  # the report describes the model it came with


def test_left_op_in_a_subgraph_names_where_it_sits(registry):
    (op,) = lower_model_with_report(_with_left_ops(registry, top_level=False), registry=registry)[1].left
    assert op.count == 1 and op.first == "'inner' in the then_branch of 'choose'"


def test_a_fully_lowered_model_leaves_nothing(registry):
    model = build_example([BnCase(ONEDNN, (2, 3, 4, 4), layout="NCX")], registry).model
    lowered, report = lower_model_with_report(model, registry=registry, strict=True)
    assert report.left == () and "left" not in report.summary()
    assert {n.domain for n in lowered.graph.node} == {""}


def test_strict_library_call_raises_naming_every_left_op(registry):
    with pytest.raises(LeftOpsError) as info:
        lower_model(_with_left_ops(registry), registry=registry, strict=True)
    message = str(info.value)
    assert f"3 x {MS}::{UNKNOWN} (first: node 'first_unknown')" in message
    assert f"1 x {MS}::{CONTRIB}" in message
    assert [op.op for op in info.value.left] == [f"{MS}::{UNKNOWN}", f"{MS}::{CONTRIB}"]


def test_ir_pass_keeps_unknown_nodes_byte_identical_and_reports_them(registry):
    proto = _with_left_ops(registry)
    before = {n.name: n.SerializeToString() for n in proto.graph.node if n.domain == MS}
    model = ir.serde.deserialize_model(proto)
    lowering_pass = LowerCustomOpsPass(registry)
    result = lowering_pass(model)
    assert result.modified
    after = ir.to_proto(result.model)
    kept = {n.name: n.SerializeToString() for n in after.graph.node if n.domain == MS}
    assert kept == before
    assert [op.count for op in lowering_pass.report.left] == [3, 1]


def test_strict_on_an_ir_model_refuses_and_leaves_it_unmodified(registry):
    proto = _with_left_ops(registry)
    model = ir.serde.deserialize_model(proto)
    before = ir.to_proto(model).SerializeToString()
    with pytest.raises(LeftOpsError):
        lower_model(model, registry=registry, strict=True)
    assert ir.to_proto(model).SerializeToString() == before


def test_strict_on_a_fully_lowerable_ir_model_lowers_it(registry):
    model = ir.serde.deserialize_model(build_example([BnCase(ONEDNN, (2, 3, 4, 4), layout="NCX")], registry).model)
    lowered, report = lower_model_with_report(model, registry=registry, strict=True)
    assert lowered is model and report.left == ()
    assert {n.domain for n in model.graph} == {""}


# -- CLI -----------------------------------------------------------------------------------------------

def test_lower_warns_once_per_left_op_type_and_still_writes(model_path, tmp_path, capsys):
    before = _digest(model_path)
    out = tmp_path / "out.onnx"
    assert main(["lower", str(model_path), "-o", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert err[0] == (f"oplower lower: warning: {model_path}: 3 x {MS}::{UNKNOWN} left without a lowering rule "
                      "(first: node 'first_unknown'); plain onnxruntime cannot run it")
    assert err[1].startswith(f"oplower lower: warning: {model_path}: 1 x {MS}::{CONTRIB} left")
    assert "only onnxruntime runs it" in err[1]
    assert _digest(model_path) == before
    lowered = onnx.load(out)
    assert sum(n.op_type == UNKNOWN for n in lowered.graph.node) == 2
    assert not any(n.op_type == "BatchNormTrainingBackward" for n in lowered.graph.node)


def test_strict_exits_1_writes_nothing_and_leaves_the_input(model_path, tmp_path, capsys):
    before = _digest(model_path)
    out = tmp_path / "out.onnx"
    assert main(["lower", str(model_path), "-o", str(out), "--strict"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"oplower lower: error: {model_path}: --strict: 2 op type(s)")
    assert f"3 x {MS}::{UNKNOWN} (first: node 'first_unknown')" in err and f"{out} not written" in err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["model.onnx"]
    assert _digest(model_path) == before


def test_strict_passes_a_model_it_lowers_completely(registry, tmp_path, capsys):
    path = tmp_path / "bn.onnx"
    onnx.save(build_example([BnCase(ONEDNN, (2, 3, 4, 4), layout="NCX")], registry).model, path)
    out = tmp_path / "out.onnx"
    assert main(["lower", str(path), "-o", str(out), "--strict"]) == 0
    assert capsys.readouterr().err == ""
    assert {n.domain for n in onnx.load(out).graph.node} == {""}


def test_warning_comes_before_a_verify_failure_message(model_path, tmp_path, capsys):
    """--verify on a model that keeps a kernel-less op cannot run it; the warning has said why first."""
    out = tmp_path / "out.onnx"
    code = main(["lower", str(model_path), "-o", str(out), "--verify"])
    err = capsys.readouterr().err.splitlines()
    assert code == 1 and not out.exists()
    assert err[0].startswith("oplower lower: warning:") and f"{UNKNOWN}" in err[0]


# -- oplower train (lowering.training.lower_artifacts) ----------------------------------------------------------

def test_training_refuses_kernel_less_ops_and_the_portable_target_every_left_op(tmp_path):
    """onnxruntime's own contrib ops run on plain onnxruntime, so `oplower train` keeps them; the portable
    target promises ops every runtime runs, so it refuses them too. Ops without any kernel are refused by both."""
    from lowering.training.trainer import lower_artifacts
    from opdef.errors import LoweringError

    tiny = Path(__file__).resolve().parent / "fixtures" / "tiny_mlp"
    shutil.copytree(tiny, tmp_path / "art")
    path = tmp_path / "art" / "training_model.onnx"
    model = onnx.load(path)
    model.graph.node.append(helper.make_node(CONTRIB, ["sq"], ["inv"], domain=MS, name="inverse"))
    model.graph.input.append(helper.make_tensor_value_info("sq", TensorProto.FLOAT, [2, 2]))
    onnx.save(model, path)
    assert any(n.op_type == CONTRIB for n in lower_artifacts(tmp_path / "art").training.graph.node)
    with pytest.raises(LoweringError, match=f"the portable target cannot run {MS}::{CONTRIB} .*node 'inverse'"):
        lower_artifacts(tmp_path / "art", target="portable")
    model.graph.node.append(helper.make_node(UNKNOWN, ["sq"], ["u"], domain=MS, name="unknown"))
    onnx.save(model, path)
    with pytest.raises(LoweringError, match=f"plain onnxruntime cannot run {MS}::{UNKNOWN} .*node 'unknown'"):
        lower_artifacts(tmp_path / "art")
