"""onnxruntime 1.23 (the last release for Python 3.10) runs three standard forms wrongly; ``lower_model`` rewrites
them when it is the installed runtime (``lowering.compat.old_runtime_forms``). Here the rewrites are checked on
any runtime: the two exact ones against onnx.reference, the AveragePool correction against a numpy model of
1.23's kernel; the suite's gradient tests run them for real on Python 3.10."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.reference
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from lowering import compat
from lowering.passes import lower_model
from runtime.session import run_model

F32 = TensorProto.FLOAT


def _model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F32, s) for n, s in inputs],
                              [helper.make_tensor_value_info(n, F32, None) for n in outputs], list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _rewritten(model):
    copy = onnx.ModelProto.FromString(model.SerializeToString())
    assert compat.old_runtime_forms(copy)
    return copy


def test_identity_transpose_becomes_identity_and_gemm_gradient_stays_right():
    """1.23 fuses an identity Transpose into a Gemm as a swap: the rewritten graph has no such Transpose."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((6, 5)).astype(np.float32), rng.standard_normal((6, 4)).astype(np.float32)
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 1]),
             helper.make_node("Gemm", ["xt", "w"], ["y"], transA=1),
             helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0])]
    model = _model(nodes, [("x", [6, 5]), ("w", [6, 4])], ["y", "wt"])
    rewritten = _rewritten(model)
    ops = [(n.op_type, [a.ints for a in n.attribute]) for n in rewritten.graph.node]
    assert ops[0] == ("Identity", []) and ops[2][0] == "Transpose"  # a real transpose is left alone
    want = onnx.reference.ReferenceEvaluator(model).run(None, {"x": x, "w": w})
    got = run_model(rewritten, {"x": x, "w": w})
    np.testing.assert_allclose(got["y"], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got["wt"], want[1])


@pytest.mark.parametrize("op,opset", [("ReduceSum", 13), ("ReduceMean", 18), ("ReduceMax", 18)])
def test_noop_reduction_without_axes_gets_an_empty_axes_input(op, opset):
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    model = _model([helper.make_node(op, ["x"], ["y"], noop_with_empty_axes=1)], [("x", [3, 4])], ["y"], opset=opset)
    rewritten = _rewritten(model)
    reduce = next(n for n in rewritten.graph.node if n.op_type == op)
    assert len(reduce.input) == 2
    np.testing.assert_array_equal(run_model(rewritten, {"x": x})["y"], x)  # no reduction at all
    # with axes given, or noop off, or an opset with axes as an attribute: nothing to do
    for node, version in ((helper.make_node(op, ["x"], ["y"], keepdims=1), opset),
                          (helper.make_node("ReduceMean", ["x"], ["y"], noop_with_empty_axes=1), 17)):
        assert not compat.old_runtime_forms(_model([node], [("x", [3, 4])], ["y"], opset=version))


def _pool_as_onnxruntime_1_23(x, kernel, strides, pads, counts):
    """onnxruntime 1.23's AveragePool with ceil_mode and count_include_pad: each window's sum over the input,
    divided by the whole kernel size (also where the window runs past the padded input); ``counts`` windows per
    spatial axis."""
    spatial = len(kernel)
    out = np.zeros(x.shape[:2] + tuple(counts))
    for index in np.ndindex(*counts):
        window = tuple(slice(max(o * s - b, 0), max(o * s - b + k, 0)) for o, s, b, k in
                       zip(index, strides, pads[:spatial], kernel, strict=True))
        out[(Ellipsis, *index)] = x[(Ellipsis, *window)].sum(axis=tuple(range(2, 2 + spatial))) / np.prod(kernel)
    return out


@pytest.mark.parametrize("shape,kernel,strides,pads", [
    ((2, 2, 7, 8), [3, 3], [2, 3], [0, 0, 0, 0]),
    ((2, 2, 8, 6), [3, 2], [2, 2], [1, 1, 1, 1]),
    ((1, 3, 6), [3], [2], [1, 1]),
    ((1, 1, 5, 6), [2, 3], [2, 2], [0, 1, 0, 1]),
])
def test_ceil_average_pool_correction(shape, kernel, strides, pads):
    """The rewritten pool on 1.23's kernel (modelled in numpy) equals ONNX's AveragePool (onnx.reference)."""
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    attrs = dict(kernel_shape=kernel, strides=strides, pads=pads, ceil_mode=1, count_include_pad=1)
    model = _model([helper.make_node("AveragePool", ["x"], ["y"], **attrs)], [("x", list(shape))], ["y"])
    want = onnx.reference.ReferenceEvaluator(model).run(None, {"x": x})[0]
    rewritten = _rewritten(model)
    assert [n.op_type for n in rewritten.graph.node] == ["AveragePool", "Constant", "Mul"]
    factor = numpy_helper.to_array(rewritten.graph.node[1].attribute[0].t)
    got = _pool_as_onnxruntime_1_23(x.astype(np.float64), kernel, strides, pads, want.shape[2:]) * factor
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(factor, 1.0)  # the case has windows past the padded input


def test_pools_left_alone():
    """No window past the padded input, count_include_pad off, or spatial sizes unknown: nothing rewritten."""
    cases = [((1, 1, 8, 8), dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1, count_include_pad=1)),
             ((1, 1, 7, 7), dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
             ((1, 1, "h", 7), dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1, count_include_pad=1))]
    for shape, attrs in cases:
        model = _model([helper.make_node("AveragePool", ["x"], ["y"], **attrs)], [("x", list(shape))], ["y"])
        assert not compat.old_runtime_forms(model), attrs


@pytest.mark.parametrize("version,rewritten", [("1.23.2", True), ("1.24.0", False), ("1.32.0", False)])
def test_lower_model_rewrites_for_onnxruntime_1_23_only(monkeypatch, version, rewritten):
    model = _model([helper.make_node("Transpose", ["x"], ["y"], perm=[0, 1])], [("x", [2, 3])], ["y"])
    monkeypatch.setattr(onnxruntime, "__version__", version)
    ops = [n.op_type for n in lower_model(model).graph.node]
    assert ops == (["Identity"] if rewritten else ["Transpose"])
