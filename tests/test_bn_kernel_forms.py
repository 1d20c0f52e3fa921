"""Batch norm's small-step forms (issue 31): fewer kernels, the same bits.

BatchNormalizationGrad sums each (sample, channel) row with one ReduceSum over the spatial axes as they are (no
Reshape view); BatchNormInternal's kernel form feeds BatchNormalization's running-statistics inputs two Muls of
scale (no Slice / Reshape of X)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from lowering.builder import NodeBuilder
from lowering.rules.batch_norm_internal import BatchNormInternalPlan, emit_batch_norm_internal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_bn_emit import check  # noqa: E402

F32 = TensorProto.FLOAT
OUTPUTS = ("Y", "running_mean", "running_var", "saved_mean", "saved_inv_std")


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("shape", [(4, 8, 8, 8), (4, 16, 4, 4), (4, 6, 11), (2, 4, 3, 2, 5), (8, 32, 12, 12)])
def test_reduce_sum_over_the_spatial_axes_is_the_sum_over_a_view(shape):
    """The premise of the Reshape-free row sums: onnxruntime's ReduceSum over the trailing axes of [N, C, ...]
    gives the bits of a ReduceSum over the last axis of its [N, C, X] view."""
    rank = len(shape)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 3 + 1
    nodes = [helper.make_node("ReduceSum", ["x", "spatial"], ["direct"], keepdims=0),
             helper.make_node("Reshape", ["x", "view"], ["viewed"]),
             helper.make_node("ReduceSum", ["viewed", "last"], ["staged"], keepdims=0)]
    inits = [numpy_helper.from_array(np.arange(2, rank, dtype=np.int64), "spatial"),
             numpy_helper.from_array(np.array([0, 0, -1], np.int64), "view"),
             numpy_helper.from_array(np.array([2], np.int64), "last")]
    graph = helper.make_graph(nodes, "sums", [helper.make_tensor_value_info("x", F32, shape)],
                              [helper.make_tensor_value_info(n, F32, None) for n in ("direct", "staged")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    direct, staged = _session(model).run(None, {"x": x})
    assert np.array_equal(direct, staged)


@pytest.mark.parametrize("shape", [(4, 8, 8, 8), (4, 12, 2, 2), (4, 6, 11), (2, 4, 3, 2, 5), (32, 16, 32, 32)])
@pytest.mark.parametrize("io_type", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_batch_norm_grad_row_sums_need_no_view(shape, io_type):
    """NCX with static dims whose spatial axes make one row: every ReduceSum reads a tensor of src's shape (no
    Reshape view; small tensors have no Reshape at all), and the numbers of the float64 formula."""
    model, _, _ = check(shape, channel_axis=1, io_type=io_type, stat_input="inv_std")
    producers = {o: n.op_type for n in model.graph.node for o in n.output}
    sums = [n for n in model.graph.node if n.op_type == "ReduceSum"]
    assert sums and all(producers.get(n.input[0]) != "Reshape" for n in sums)
    if np.prod(shape) <= 1 << 15:
        assert "Reshape" not in producers.values()


def _internal_model(shape: tuple[int, ...], x_shape) -> onnx.ModelProto:
    b = NodeBuilder(17, "bni")
    c = shape[1]
    emit_batch_norm_internal(b, BatchNormInternalPlan(
        x="X", scale="scale", bias="B", input_mean="mean", input_var="var", y="Y", running_mean="running_mean",
        running_var="running_var", saved_mean="saved_mean", saved_inv_std="saved_inv_std", training=True,
        epsilon=1e-5, momentum=0.9, io_type=F32, stat_type=F32, rank=len(shape), x_shape=x_shape))
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        b.nodes, "bni", [vi("X", F32, list(shape)), *(vi(n, F32, [c]) for n in ("scale", "B", "mean", "var"))],
        [vi(n, F32, None) for n in OUTPUTS])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("static", [True, False], ids=["static", "symbolic"])
def test_batch_norm_internal_kernel_form(static):
    """The running-statistics inputs of the training-mode BatchNormalization are scale * 0 and scale * 0.5: two
    tensors of this node's own (Mul outputs, nothing else reads them), no Slice or Reshape of X. The outputs are
    the native kernel's: bit-equal to onnxruntime's BatchNormalization with zero running statistics, and a NaN
    batch leaves nothing behind for the next run."""
    shape = (4, 3, 5, 5)
    model = _internal_model(shape, shape if static else ("N", 3, "H", "W"))
    ops = [n.op_type for n in model.graph.node if n.op_type != "Constant"]
    assert "Slice" not in ops and "Reshape" not in ops and ops.count("BatchNormalization") == 1
    (bn,) = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    producers = {o: n for n in model.graph.node for o in n.output}
    assert len(set(bn.input[3:])) == 2
    for name in bn.input[3:]:
        assert producers[name].op_type == "Mul" and producers[name].input[0] == "scale"
        assert sum(name in n.input for n in model.graph.node) == 1

    rng = np.random.default_rng(3)
    feeds = {"X": (rng.standard_normal(shape) * 2 + 3).astype(np.float32),
             "scale": rng.standard_normal(3).astype(np.float32), "B": rng.standard_normal(3).astype(np.float32),
             "mean": rng.standard_normal(3).astype(np.float32), "var": rng.uniform(0.5, 2, 3).astype(np.float32)}
    session = _session(model)
    bad = dict(feeds, X=np.where(np.arange(np.prod(shape)).reshape(shape) % 7 == 0, np.nan, feeds["X"])
               .astype(np.float32))
    assert np.isnan(session.run(["saved_mean"], bad)[0]).all()
    got = dict(zip(OUTPUTS, session.run(list(OUTPUTS), feeds), strict=True))

    native = helper.make_graph(
        [helper.make_node("BatchNormalization", ["X", "scale", "B", "zeros", "ones"], ["Y", "m", "v"],
                          epsilon=1e-5, momentum=0.0, training_mode=1)],
        "native", [helper.make_tensor_value_info(n, F32, None) for n in ("X", "scale", "B")],
        [helper.make_tensor_value_info(n, F32, None) for n in ("Y", "m", "v")],
        [numpy_helper.from_array(np.zeros(3, np.float32), "zeros"),
         numpy_helper.from_array(np.ones(3, np.float32), "ones")])
    native_model = helper.make_model(native, opset_imports=[helper.make_opsetid("", 17)])
    native_model.ir_version = 8
    y, mean, variance = _session(native_model).run(None, {k: feeds[k] for k in ("X", "scale", "B")})
    assert np.array_equal(got["Y"], y) and np.array_equal(got["saved_mean"], mean)
    inv_std = np.float32(1) / np.sqrt(variance + np.float32(1e-5))
    assert np.array_equal(got["saved_inv_std"], inv_std)
    assert np.isfinite(got["running_mean"]).all() and np.isfinite(got["running_var"]).all()
