"""Semantically wrong training graphs (issue 24): each is refused with one line, or lowered correctly.

One test (or a few) per fault the issue lists: non-tensor types, an untyped graph input, conflicting opset
imports, an ignore_index the label type cannot hold, MaxPoolGrad's window and grouped expansion below opset 16,
and the final check that every model ``oplower lower`` writes is one onnx.checker and onnxruntime accept.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _recorded import FIXTURES, recorded_cases
from onnx import TensorProto, helper, numpy_helper

from lowering.cli import main
from lowering.passes import lower_model
from opdef.errors import OplowerError
from opdef.registry import load_schemas
from runtime.reference_training import softmax_cross_entropy_loss_grad

ARTIFACTS = FIXTURES / "artifacts"


def _case_model(op_type: str, variant: str | None = None) -> onnx.ModelProto:
    cases = recorded_cases(op_type)
    case = next(c for c in cases if variant is None or c["variant"] == variant)
    return onnx.load(FIXTURES / case["model"])


def _value(model: onnx.ModelProto, name: str) -> onnx.ValueInfoProto:
    return next(vi for vi in [*model.graph.input, *model.graph.output, *model.graph.value_info] if vi.name == name)


def _as(vi: onnx.ValueInfoProto, kind: str, elem: int | None = None) -> None:
    """Re-declare ``vi`` as a sequence or optional of its tensor type (``elem`` replaces the element type)."""
    inner = onnx.TypeProto()
    inner.CopyFrom(vi.type if vi.type.HasField("tensor_type") else vi.type.sequence_type.elem_type)
    if elem is not None:
        inner.tensor_type.elem_type = elem
    vi.type.Clear()
    if kind == "tensor":
        vi.type.CopyFrom(inner)
    else:
        getattr(vi.type, kind).elem_type.CopyFrom(inner)


def _cli(tmp_path, model: onnx.ModelProto, capsys, *args: str) -> tuple[int, str, str, bool]:
    """``oplower lower`` (or ``check`` when args[0] == "check") on ``model``: exit code, stdout, stderr,
    whether the output file exists."""
    source = tmp_path / "model.onnx"
    onnx.save(model, source)
    target = tmp_path / "lowered.onnx"
    if args and args[0] == "check":
        code = main(["check", str(source), *args[1:]])
    else:
        code = main(["lower", str(source), "-o", str(target), *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err, target.exists()


def _refused(tmp_path, model, capsys, *fragments: str, check: bool = True) -> str:
    """Both ``check`` and ``lower`` (only ``lower`` with ``check=False``: a limit of the lowering, not a fault
    the verifier sees) refuse ``model`` with one line holding every fragment; nothing written."""
    lines = []
    for command in (("check",), ()) if check else ((),):
        code, out, err, written = _cli(tmp_path, model, capsys, *command)
        assert code == 1 and not written, (command, out, err)
        assert "verified" not in out
        assert len(err.strip().splitlines()) == 1 and "internal error" not in err, err
        for fragment in fragments:
            assert fragment in err, err
        lines.append(err)
    return lines[-1]


# -- non-tensor types -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["sequence_type", "optional_type"])
def test_a_sequence_or_optional_where_a_tensor_is_required_is_refused(tmp_path, capsys, kind):
    model = _case_model("ReluGrad")
    _as(_value(model, "X"), kind)
    spelled = "a seq(tensor(f32))" if kind == "sequence_type" else "an optional(tensor(f32))"
    _refused(tmp_path, model, capsys, "ReluGrad", "X is " + spelled, "a tensor is required", "f32")


def test_a_sequence_where_a_tensor_flag_is_required_is_refused(tmp_path, capsys):
    model = _case_model("InPlaceAccumulatorV2")
    _as(_value(model, "overwrite_flag"), "optional_type")
    _refused(tmp_path, model, capsys, "overwrite_flag is an optional(tensor(boolean))", "a tensor is required")


def test_a_sequence_declared_for_a_tensor_output_is_refused(tmp_path, capsys):
    model = _case_model("InPlaceAccumulatorV2")
    _as(_value(model, "accumulation_buffer_out"), "sequence_type")
    _refused(tmp_path, model, capsys, "accumulation_buffer_out", "declared seq(tensor(f32))", "a tensor")


def test_an_optimizer_sequence_of_the_wrong_element_type_is_refused(tmp_path, capsys):
    model = _case_model("AdamWOptimizer")
    _as(_value(model, "weights"), "sequence_type", TensorProto.INT64)
    _refused(tmp_path, model, capsys, "weights has element type s64", "seq(f32)")


def test_a_tensor_where_an_optimizer_takes_a_sequence_is_refused(tmp_path, capsys):
    model = _case_model("SGDOptimizerV2")
    _as(_value(model, "gradients"), "tensor")
    _refused(tmp_path, model, capsys, "gradients is a tensor(f32)", "a sequence is required", "seq(f32)")


def test_optimizer_sequence_outputs_check_as_sequences(tmp_path, capsys):
    code, out, err, _ = _cli(tmp_path, _case_model("AdamWOptimizer"), capsys, "check")
    assert code == 0, err
    assert "updated_weights: seq(f32)" in out and "1 custom node verified" in out


# -- an untyped graph input -----------------------------------------------------------------------------

def test_a_graph_input_without_a_type_is_refused(tmp_path, capsys):
    model = _case_model("ReluGrad")
    _value(model, "X").ClearField("type")
    _refused(tmp_path, model, capsys, "input 'X' declares no type")


# -- opset imports --------------------------------------------------------------------------------------

def test_conflicting_default_opset_imports_are_refused(tmp_path, capsys):
    model = _case_model("ReluGrad")
    model.opset_import.add(domain="ai.onnx", version=7)
    _refused(tmp_path, model, capsys, "'' 17", "'ai.onnx' 7")


def test_equal_opset_imports_are_merged(tmp_path, capsys):
    model = _case_model("ReluGrad")
    model.opset_import.add(domain="ai.onnx", version=17)
    model.opset_import.add(domain="com.microsoft", version=1)
    code, _, err, written = _cli(tmp_path, model, capsys)
    assert code == 0 and written, err
    lowered = onnx.load(tmp_path / "lowered.onnx")
    assert [(o.domain, o.version) for o in lowered.opset_import] == [("", 17)]


# -- SoftmaxCrossEntropyLossGrad: an ignore_index the label type cannot hold ------------------------------

@pytest.mark.parametrize("ignore_index", [2**31, -(2**31) - 1])
def test_an_ignore_index_an_int32_label_cannot_hold_matches_no_label(ignore_index):
    rng = np.random.default_rng(24)
    log_prob = np.log(rng.dirichlet(np.ones(5), size=4)).astype(np.float32)
    label = np.array([0, 4, 2, 1], np.int32)
    dy = np.array(1.5, np.float32)
    node = helper.make_node("SoftmaxCrossEntropyLossGrad", ["dY", "log_prob", "label"], ["d_logits"],
                            domain="com.microsoft", reduction="mean", ignore_index=ignore_index)
    vi = helper.make_tensor_value_info
    graph = helper.make_graph([node], "sce", [vi("dY", TensorProto.FLOAT, []),
                                              vi("log_prob", TensorProto.FLOAT, [4, 5]),
                                              vi("label", TensorProto.INT32, [4])],
                              [vi("d_logits", TensorProto.FLOAT, [4, 5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)], ir_version=10)
    lowered = lower_model(model, registry=load_schemas())
    onnx.checker.check_model(lowered, full_check=True)
    got = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"dY": dy, "log_prob": log_prob, "label": label})[0]
    # no label equals the index: the same as no ignore_index at all (the reference, in float64)
    expected = softmax_cross_entropy_loss_grad(dy.astype(np.float64), log_prob.astype(np.float64),
                                               label.astype(np.int64), reduction="mean")
    np.testing.assert_allclose(got, expected, atol=1e-6)


# -- MaxPoolGrad below opset 16 ---------------------------------------------------------------------------

def _max_pool_grad_model(kernel: int, dx: int, dy: int, opset: int, stride: int = 1) -> onnx.ModelProto:
    node = helper.make_node("MaxPoolGrad", ["dY", "Indices"], ["dX"], kernel_shape=[kernel, kernel],
                            strides=[stride, stride])
    vi = helper.make_tensor_value_info
    graph = helper.make_graph([node], "pool", [vi("dY", TensorProto.FLOAT, [1, 1, dy, dy]),
                                               vi("Indices", TensorProto.INT64, [1, 1, dy, dy])],
                              [vi("dX", TensorProto.FLOAT, [1, 1, dx, dx])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


@pytest.mark.parametrize("opset", [15, 17])
def test_max_pool_grad_window_is_checked_against_dx(tmp_path, capsys, opset):
    """A 100-wide kernel cannot have pooled a 12x12 dX into 3x3 outputs."""
    err = _refused(tmp_path, _max_pool_grad_model(100, 12, 3, opset), capsys, "MaxPoolGrad", check=False)
    assert "dY has 3 positions on axis 2" in err and "kernel 100" in err


def test_max_pool_grad_grouped_expansion_is_bounded_below_opset_16(tmp_path, capsys):
    """A consistent geometry whose grouped form would need 400 groups (20x20 overlapping windows, stride 1):
    refused naming opset 16, instead of thousands of nodes."""
    err = _refused(tmp_path, _max_pool_grad_model(20, 40, 21, 15), capsys, "MaxPoolGrad", check=False)
    assert "400 groups" in err and "opset 16" in err
    # at opset 16 the same node is one ScatterElements
    code, _, err, written = _cli(tmp_path, _max_pool_grad_model(20, 40, 21, 16), capsys)
    assert code == 0 and written, err


def test_max_pool_grad_small_overlap_still_lowers_below_opset_16():
    model = _max_pool_grad_model(3, 12, 10, 15)
    lowered = lower_model(model, registry=load_schemas())
    onnx.checker.check_model(lowered, full_check=True)
    assert len(lowered.graph.node) < 100


def test_portable_pool_forms_are_bounded(tmp_path, capsys):
    """The portable forms spread every kernel offset separately: a 40x40 window (1,600 offsets) is refused."""
    node = helper.make_node("AveragePoolGrad", ["dY"], ["dX"], kernel_shape=[40, 40])
    vi = helper.make_tensor_value_info
    graph = helper.make_graph([node], "pool", [vi("dY", TensorProto.FLOAT, [1, 1, 1, 1])],
                              [vi("dX", TensorProto.FLOAT, [1, 1, 40, 40])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    code, _, err, written = _cli(tmp_path, model, capsys, "--target", "portable")
    assert code == 1 and not written and len(err.strip().splitlines()) == 1
    assert "1600 window offsets" in err and "--target onnxruntime" in err
    code, _, err, written = _cli(tmp_path, model, capsys)
    assert code == 0 and written, err


# -- the final check --------------------------------------------------------------------------------------

def test_lower_never_writes_a_model_the_checker_refuses(tmp_path, capsys):
    """A fault in the model's own standard part (a graph output without a shape, which onnx.checker refuses
    on the main graph) is refused with one line saying so, and nothing is written."""
    model = _case_model("ReluGrad")
    model.graph.output.add(name="extra").type.tensor_type.elem_type = TensorProto.FLOAT
    model.graph.node.add(op_type="Identity", input=["dY"], output=["extra"], name="passthrough")
    code, _, err, written = _cli(tmp_path, model, capsys)
    assert code == 1 and not written and len(err.strip().splitlines()) == 1, err
    assert "output 'extra'" in err and "not a node oplower lowered" in err


def test_lower_never_writes_a_model_onnxruntime_refuses(tmp_path, capsys):
    """onnxruntime refuses a default opset it does not know; the checker does not: the final load says so."""
    model = _case_model("ReluGrad")
    for o in model.opset_import:
        if o.domain == "":
            o.version = 99
    code, _, err, written = _cli(tmp_path, model, capsys)
    assert code == 1 and not written and len(err.strip().splitlines()) == 1, err
    assert "onnxruntime cannot load the lowered model" in err


def test_final_check_keeps_external_data_unloaded(tmp_path):
    """The final check of a model whose initializers are external data never reads the data file."""
    from lowering.final_check import check_lowered

    model = _case_model("ReluGrad")
    x = _value(model, "X")
    weights = numpy_helper.from_array(np.ones([d.dim_value for d in x.type.tensor_type.shape.dim], np.float32), "X")
    model.graph.initializer.append(weights)
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, size_threshold=0, location="data.bin")
    (tmp_path / "data.bin").unlink()  # nothing may read it
    lowered = lower_model(onnx.load(tmp_path / "m.onnx", load_external_data=False), registry=load_schemas())
    check_lowered(lowered, onnx.load(tmp_path / "m.onnx", load_external_data=False))


def test_final_check_names_the_cost_of_a_clean_model():
    """The committed cnn artifact passes the final check (its cost is measured in the notes)."""
    from lowering.final_check import check_lowered

    model = onnx.load(ARTIFACTS / "cnn" / "training_model.onnx")
    check_lowered(lower_model(model, registry=load_schemas()), model)
    with pytest.raises(OplowerError):
        broken = lower_model(model, registry=load_schemas())
        broken.graph.node[0].op_type = "NoSuchOp"
        check_lowered(broken, model)


def test_a_lowered_nodes_graph_output_without_a_shape_gets_the_inferred_one(tmp_path, capsys):
    """onnx.checker requires a shape on main-graph outputs; for an output of a lowered node the pass fills in
    what it inferred, so the final check passes instead of refusing the model."""
    model = _case_model("ReluGrad")
    _value(model, "dX").type.tensor_type.ClearField("shape")
    code, _, err, written = _cli(tmp_path, model, capsys)
    assert code == 0 and written, err
    lowered = onnx.load(tmp_path / "lowered.onnx")
    dims = [d.dim_value for d in _value(lowered, "dX").type.tensor_type.shape.dim]
    assert dims == [d.dim_value for d in _value(model, "X").type.tensor_type.shape.dim]


def test_an_untyped_optimizer_sequence_output_gets_its_sequence_type(tmp_path, capsys):
    model = _case_model("SGDOptimizerV2")
    _value(model, "updated_weights").ClearField("type")
    code, _, err, written = _cli(tmp_path, model, capsys)
    assert code == 0 and written, err
    declared = _value(onnx.load(tmp_path / "lowered.onnx"), "updated_weights").type
    assert declared.sequence_type.elem_type.tensor_type.elem_type == TensorProto.FLOAT


def test_the_cost_tool_runs(capsys):
    """tools/final_check_cost.py (the numbers in the notes) runs against the current package."""
    import importlib.util

    path = FIXTURES.parent.parent.parent / "tools" / "final_check_cost.py"
    spec = importlib.util.spec_from_file_location("final_check_cost", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.main(1)
    out = capsys.readouterr().out
    assert "cnn/training_model: 58 -> " in out and "final check" in out
