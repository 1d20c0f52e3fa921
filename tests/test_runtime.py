"""runtime.session: onnxruntime execution of standard models, bf16 I/O, IR downgrade, custom-node refusal."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from opdef.errors import ModelError, RuntimeFailure
from runtime import session
from runtime.session import PreparedModel, find_custom_nodes, ort_message, required_ir_version, run_model

BF16 = TensorProto.BFLOAT16
F32 = TensorProto.FLOAT


def _model(nodes, inputs, outputs, *, opset=17, ir_version=None, functions=(), extra_opsets=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    imports = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, 1) for d in extra_opsets)]
    model = helper.make_model(graph, opset_imports=imports, functions=list(functions))
    if ir_version is not None:
        model.ir_version = ir_version
    return model


def _vi(name, elem_type, shape):
    return helper.make_tensor_value_info(name, elem_type, shape)


def _bf16_model():
    """x (bf16 [n,3]) -> y = bf16(f32(x)), f = f32(x), z = Reshape(x, s) with an unknown output shape."""
    return _model(
        [helper.make_node("Cast", ["x"], ["f"], to=F32), helper.make_node("Cast", ["f"], ["y"], to=BF16),
         helper.make_node("Reshape", ["x", "s"], ["z"])],
        [_vi("x", BF16, ["n", 3]), _vi("s", TensorProto.INT64, [None])],
        [_vi("y", BF16, ["n", 3]), _vi("f", F32, None), _vi("z", BF16, None)])


def _bf16(values):
    return np.asarray(values, dtype=np.float32).astype(ml_dtypes.bfloat16)


def test_bf16_round_trip_including_a_dynamic_output_shape():
    x = _bf16(np.arange(6).reshape(2, 3) + 0.5)
    out = run_model(_bf16_model(), {"x": x, "s": np.array([3, 2])})
    assert out["y"].dtype == ml_dtypes.bfloat16 and out["z"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out["y"].astype(np.float32), x.astype(np.float32))
    np.testing.assert_array_equal(out["f"], x.astype(np.float32))
    assert out["z"].shape == (3, 2)
    np.testing.assert_array_equal(out["z"].astype(np.float32), x.astype(np.float32).reshape(3, 2))


def test_bf16_values_survive_exactly():
    # Every bf16 bit pattern of a finite value goes in and comes back unchanged.
    bits = np.arange(0, 0x7F80, 7, dtype=np.uint16)
    x = np.concatenate([bits, bits | 0x8000]).view(ml_dtypes.bfloat16).reshape(-1, 2)
    x = np.concatenate([x, x[:, :1]], axis=1)  # [k, 3]
    out = run_model(_bf16_model(), {"x": x, "s": np.array([-1])})
    np.testing.assert_array_equal(out["y"].view(np.uint16), x.view(np.uint16))
    np.testing.assert_array_equal(out["z"].view(np.uint16), x.view(np.uint16).reshape(-1))


def test_f16_and_f64_run_through_plain_session():
    model = _model([helper.make_node("Add", ["a", "a"], ["b"]), helper.make_node("Cast", ["a"], ["c"], to=11)],
                   [_vi("a", TensorProto.FLOAT16, [2])], [_vi("b", TensorProto.FLOAT16, [2]),
                                                           _vi("c", TensorProto.DOUBLE, [2])])
    out = run_model(model, {"a": np.array([1.5, -2.25], np.float16)})
    assert out["b"].dtype == np.float16 and out["c"].dtype == np.float64
    np.testing.assert_array_equal(out["b"], np.array([3.0, -4.5], np.float16))
    assert list(out) == ["b", "c"]
    assert list(run_model(model, {"a": np.zeros(2, np.float16)}, ["c"])) == ["c"]


def _identity(ir_version=None):
    return _model([helper.make_node("Identity", ["x"], ["y"])], [_vi("x", F32, [2])], [_vi("y", F32, [2])],
                  ir_version=ir_version)


def test_ir14_model_runs_and_callers_model_is_untouched():
    model = _identity()
    assert model.ir_version == 14
    before = model.SerializeToString()
    out = run_model(model, {"x": np.array([1.0, 2.0], np.float32)})
    np.testing.assert_array_equal(out["y"], [1.0, 2.0])
    assert model.ir_version == 14 and model.SerializeToString() == before


def test_newer_ir_than_onnxruntime_reads_is_lowered_on_a_copy():
    model = _identity(ir_version=99)
    prepared = PreparedModel(model)
    assert prepared.ir_version < 99
    np.testing.assert_array_equal(prepared.run({"x": np.ones(2, np.float32)})["y"], [1.0, 1.0])
    assert model.ir_version == 99


def test_required_ir_version_sees_opsets_and_element_types():
    assert required_ir_version(_identity()) == (8, "its opset imports")
    model = _model([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT8E8M0)], [_vi("x", F32, [2])],
                   [_vi("y", F32, [2])], opset=21)
    assert required_ir_version(model) == (12, "element type FLOAT8E8M0")


def test_newer_ir_is_refused_when_the_model_needs_it(monkeypatch):
    # No element type yet needs more than onnxruntime reads: pretend FLOAT8E8M0 needs IR 50.
    monkeypatch.setitem(session._ELEM_TYPE_IR, TensorProto.FLOAT8E8M0, 50)
    model = _model([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT8E8M0)], [_vi("x", F32, [2])],
                   [_vi("y", F32, [2])], opset=24, ir_version=99)
    with pytest.raises(RuntimeFailure, match=r"^model IR version 99 is newer than onnxruntime \S+ reads \(at most "
                                             r"\d+\) and cannot be lowered: element type FLOAT8E8M0 needs IR 50$"):
        PreparedModel(model)


def _custom_bn(name="bn1"):
    return helper.make_node("BatchNormTrainingBackward", ["x", "x", "m", "v"], ["y"], name=name, domain="onednn",
                            epsilon=1e-5)


def test_custom_node_is_refused_before_session_creation():
    model = _model([_custom_bn()], [_vi("x", F32, [2, 3]), _vi("m", F32, [3]), _vi("v", F32, [3])],
                   [_vi("y", F32, [2, 3])], extra_opsets=["onednn"])
    with pytest.raises(RuntimeFailure) as info:
        run_model(model, {})
    assert str(info.value) == ("model contains custom node 'bn1' (onednn::BatchNormTrainingBackward): "
                               "lower it first (oplower lower, lowering.lower_model)")


def test_custom_node_in_a_subgraph_is_found():
    then_branch = helper.make_graph([_custom_bn("inner")], "then", [], [_vi("y", F32, [2, 3])])
    else_branch = helper.make_graph([helper.make_node("Identity", ["x"], ["y2"])], "else", [], [_vi("y2", F32, [2, 3])])
    node = helper.make_node("If", ["c"], ["out"], name="if1", then_branch=then_branch, else_branch=else_branch)
    model = _model([node], [_vi("c", TensorProto.BOOL, []), _vi("x", F32, [2, 3]), _vi("m", F32, [3]),
                            _vi("v", F32, [3])], [_vi("out", F32, [2, 3])], extra_opsets=["onednn"])
    with pytest.raises(RuntimeFailure, match=r"custom node 'inner' \(onednn::BatchNormTrainingBackward\) "
                                             r"in the then_branch of 'if1': lower it first"):
        run_model(model, {})


def test_custom_node_in_a_function_and_training_ops_are_found():
    body = [helper.make_node("BatchNormalizationGrad", ["dy", "x", "s", "m", "i"], ["dx"], name="grad",
                             domain="com.microsoft")]
    fn = helper.make_function("local", "f", ["dy", "x", "s", "m", "i"], ["dx"], body,
                              [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    call = helper.make_node("f", ["x", "x", "s", "s", "s"], ["y"], domain="local", name="call")
    internal = helper.make_node("BatchNormInternal", ["x", "s", "s", "s", "s"], ["y2"], domain="com.microsoft")
    model = _model([call, internal], [_vi("x", F32, [2, 3]), _vi("s", F32, [3])],
                   [_vi("y", F32, [2, 3]), _vi("y2", F32, [2, 3])], functions=[fn],
                   extra_opsets=["local", "com.microsoft"])
    found = {(c.name, c.domain, c.op_type, c.where) for c in find_custom_nodes(model)}
    assert found == {("#1 -> y2", "com.microsoft", "BatchNormInternal", ""),
                     ("grad", "com.microsoft", "BatchNormalizationGrad", "in function local::f")}
    with pytest.raises(RuntimeFailure, match=r"\(and 1 more\)"):
        run_model(model, {})


def test_implemented_contrib_ops_and_local_functions_are_not_custom():
    fn = helper.make_function("local", "twice", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])],
                              [helper.make_opsetid("", 17)])
    model = _model([helper.make_node("twice", ["x"], ["t"], domain="local"),
                    helper.make_node("FastGelu", ["t"], ["y"], domain="com.microsoft")],
                   [_vi("x", F32, [2])], [_vi("y", F32, [2])], functions=[fn],
                   extra_opsets=["local", "com.microsoft"])
    assert find_custom_nodes(model) == []
    out = run_model(model, {"x": np.array([0.0, 1.0], np.float32)})
    assert out["y"][0] == 0.0 and 1.9 < out["y"][1] < 2.0


@pytest.mark.parametrize(("feeds", "message"), [
    ({"s": np.array([6])}, r"^missing input 'x' \(bfloat16 \[n,3\]\)$"),
    ({"x": np.zeros((2, 3), np.float32), "s": np.array([6])}, r"^input 'x' has dtype float32; the model expects"),
    ({"x": _bf16(np.zeros(3)), "s": np.array([3])}, r"^input 'x' has rank 1 \(shape \[3\]\); the model expects rank 2"),
    ({"x": _bf16(np.zeros((2, 4))), "s": np.array([8])}, r"^input 'x' has shape \[2, 4\].*dim.* 1 is 4, expected 3"),
    ({"x": _bf16(np.zeros((2, 3))), "s": np.array([6]), "q": np.zeros(1)}, r"^unknown input 'q'; the model's inputs"),
])
def test_wrong_feeds_name_the_input(feeds, message):
    with pytest.raises(RuntimeFailure, match=message):
        run_model(_bf16_model(), feeds)


def test_onnxruntime_errors_become_one_line():
    with pytest.raises(RuntimeFailure) as info:
        run_model(_bf16_model(), {"x": _bf16(np.zeros((2, 3))), "s": np.array([4, 2])})
    text = str(info.value)
    assert "\n" not in text and text.startswith("onnxruntime failed to run the model:")
    assert "cannot be reshaped" in text and ".cc:" not in text and "Traceback" not in text
    with pytest.raises(RuntimeFailure, match=r"^onnxruntime cannot load the model: "):
        run_model(_model([helper.make_node("NoSuchOp", ["x"], ["y"])], [_vi("x", F32, [2])], [_vi("y", F32, [2])]),
                  {"x": np.zeros(2, np.float32)})
    with pytest.raises(RuntimeFailure, match=r"^unknown output 'nope'"):
        run_model(_identity(), {"x": np.zeros(2, np.float32)}, ["nope"])


def test_ort_message_drops_source_locations_and_signatures():
    raw = ("[ONNXRuntimeError] : 1 : FAIL : /onnxruntime_src/onnxruntime/core/graph/model.cc:256 "
           "onnxruntime::Model::Model(onnx::ModelProto&&, const onnxruntime::PathString&, const "
           "onnxruntime::ModelOptions&) Unsupported model IR version: 15, max supported IR version: 14\n")
    assert ort_message(RuntimeError(raw)) == "Unsupported model IR version: 15, max supported IR version: 14"


def test_model_from_path_and_unreadable_file(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_identity(), path)
    np.testing.assert_array_equal(run_model(path, {"x": np.ones(2, np.float32)})["y"], [1.0, 1.0])
    np.testing.assert_array_equal(run_model(str(path), {"x": np.ones(2, np.float32)})["y"], [1.0, 1.0])
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\xff\x00garbage")
    with pytest.raises(ModelError):
        run_model(bad, {})
    with pytest.raises(ModelError, match="no such file"):
        run_model(tmp_path / "absent.onnx", {})


def test_bound_run_writes_into_preallocated_buffers():
    prepared = PreparedModel(_bf16_model(), intra_op_threads=1, allow_spinning=False)
    x = _bf16(np.arange(6).reshape(2, 3))
    feeds = {"x": x, "s": np.array([3, 2])}
    outputs = prepared.allocate_outputs(feeds)
    assert outputs["z"].shape == (3, 2) and outputs["y"].dtype == ml_dtypes.bfloat16
    addresses = {name: a.ctypes.data for name, a in outputs.items()}
    prepared.bind(feeds, outputs)
    result = prepared.run_bound()
    assert all(result[name] is outputs[name] for name in outputs)
    np.testing.assert_array_equal(outputs["f"], x.astype(np.float32))
    x[0, 0] = 7.0  # inputs are bound by reference: a new value in place is seen by the next run
    prepared.run_bound()
    assert outputs["y"][0, 0] == 7.0 and outputs["z"][0, 0] == 7.0 and outputs["f"][0, 0] == 7.0
    assert {name: a.ctypes.data for name, a in outputs.items()} == addresses


def test_bind_checks_output_buffers():
    prepared = PreparedModel(_bf16_model())
    feeds = {"x": _bf16(np.zeros((2, 3))), "s": np.array([6])}
    with pytest.raises(RuntimeFailure, match=r"output buffer for 'y' has dtype float32"):
        prepared.bind(feeds, {"y": np.zeros((2, 3), np.float32)})
    with pytest.raises(RuntimeFailure, match=r"output buffer for 'y' has shape \[2, 4\]"):
        prepared.bind(feeds, {"y": _bf16(np.zeros((2, 4)))})
    with pytest.raises(RuntimeFailure, match="C-contiguous"):
        prepared.bind(feeds, {"f": np.zeros((3, 2), np.float32).T})
    prepared.bind(feeds, {"f": np.zeros((3, 3), np.float32)})
    with pytest.raises(RuntimeFailure, match="^onnxruntime failed to run the model"):
        prepared.run_bound()
    with pytest.raises(RuntimeFailure, match="before bind"):
        PreparedModel(_bf16_model()).run_bound()


def test_sequence_outputs_and_untyped_bf16_outputs():
    # A sequence output goes through the plain path; an output declared without a type that turns out
    # to be bf16 still comes back as ml_dtypes.bfloat16.
    split = helper.make_node("SplitToSequence", ["x"], ["parts"], axis=0)
    cast = helper.make_node("Cast", ["x"], ["b"], to=BF16)
    graph = helper.make_graph([split, cast], "g", [_vi("x", F32, [2, 2])],
                              [helper.make_tensor_sequence_value_info("parts", F32, None),
                               helper.make_value_info("b", onnx.TypeProto())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    out = run_model(model, {"x": x}, ["parts"])
    assert isinstance(out["parts"], list) and len(out["parts"]) == 2
    np.testing.assert_array_equal(out["parts"][1], x[1:])
    b = run_model(model, {"x": x}, ["b"])["b"]
    assert b.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(b.astype(np.float32), x)
