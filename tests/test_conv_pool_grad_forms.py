"""Issue 31's ConvGrad and pool-gradient forms with fewer kernels per small training step: dW's per-image products
in W's own layout (at most SMALL_POSITIONS positions per image), the small depthwise dW as a Conv correlating X's
planes with dY's, AveragePoolGrad as one grouped ConvTranspose and MaxPoolGrad's spare element (N and C static).
Each is taken where it applies and gives the other form's bits (the depthwise correlation: the reference's
numbers, its rounding differs)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from _one_node import F32, MS, close, one_node_model
from onnx import TensorProto, helper

import lowering.rules.conv_grad as conv_grad
from lowering.passes import lower_model
from runtime import reference_training as ref
from runtime.session import run_model

I64 = TensorProto.INT64


def _conv_model(x_shape, w_shape, attrs, outputs=("dx", "dw", "db"), seed=5):
    geometry = {k: attrs.get(k) for k in ("strides", "dilations", "pads")}
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    dy = rng.standard_normal(ref.conv(x, w, group=attrs.get("group", 1), **geometry).shape).astype(np.float32)
    node = helper.make_node("ConvGrad", ["dy", "x", "w"], list(outputs), domain=MS, name="cg", **attrs)
    declared = {"dx": list(x_shape), "dw": list(w_shape), "db": [w_shape[0]]}
    model = one_node_model(node, [("dy", F32, list(dy.shape)), ("x", F32, list(x_shape)), ("w", F32, list(w_shape))],
                           [(o, F32, declared[o]) for o in outputs if o])
    expected = ref.conv_grad(dy, x, w, group=attrs.get("group", 1), **geometry)
    return model, {"dy": dy, "x": x, "w": w}, dict(zip(("dx", "dw", "db"), expected, strict=True))


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node if n.op_type != "Constant"]


SMALL_CASES = [  # (X shape, W shape, attributes): every one at most SMALL_POSITIONS positions per image
    ((4, 8, 8, 8), (8, 8, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((4, 8, 8, 8), (8, 8, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ((4, 8, 4, 4), (8, 4, 3, 3), {"pads": [1, 1, 1, 1], "group": 2}),
    ((4, 3, 8, 8), (8, 3, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((4, 16, 4, 4), (12, 16, 1, 1), {}),
    ((4, 3, 11), (6, 3, 3), {"pads": [1, 1]}),
    ((4, 6, 6), (6, 2, 3), {"pads": [1, 1], "strides": [2], "group": 3}),
]


@pytest.mark.parametrize("x_shape, w_shape, attrs", SMALL_CASES)
def test_small_dw_in_the_weights_layout_gives_the_transposed_forms_bits(x_shape, w_shape, attrs, monkeypatch):
    """dY times the windows' transpose per image: no Transpose of the sum (one Transpose left, which onnxruntime
    fuses into the MatMul), a group-1 1-D conv without views; the same bits as the windows times dY's transpose."""
    model, feeds, expected = _conv_model(x_shape, w_shape, attrs)
    small = lower_model(model)
    monkeypatch.setattr(conv_grad, "SMALL_POSITIONS", 0)
    large = lower_model(model)
    assert _ops(small).count("Transpose") == _ops(large).count("Transpose") - 1
    if len(x_shape) == 3 and attrs.get("group", 1) == 1:  # the ones-MatMul's rows and dW: no views of X or dY
        assert _ops(small).count("Reshape") == 2
    got, want = run_model(small, feeds), run_model(large, feeds)
    for name in ("dx", "dw", "db"):
        assert np.array_equal(got[name], want[name]), name
        close(got[name], expected[name], F32, name)


@pytest.mark.parametrize("x_shape, w_shape, attrs, taken", [
    ((4, 8, 4, 4), (8, 1, 3, 3), {"pads": [1, 1, 1, 1], "group": 8}, True),
    ((4, 16, 4, 4), (16, 1, 3, 3), {"pads": [1, 1, 1, 1], "group": 16, "strides": [2, 2]}, True),
    ((2, 6, 10), (6, 1, 3), {"pads": [1, 0], "group": 6, "strides": [2], "dilations": [2]}, True),
    ((2, 4, 8, 8), (4, 1, 3, 3), {"pads": [1, 1, 0, 0], "group": 4, "strides": [2, 2]}, True),
    ((2, 4, 8, 8), (4, 1, 3, 3), {"pads": [1, 1, 1, 1], "group": 4, "strides": [2, 2]}, True),  # end pad unread
    ((2, 4, 6, 6), (4, 1, 3, 3), {"group": 4, "strides": [2, 2]}, False),  # X's last row read by no window, no pad
    ((4, 16, 8, 8), (16, 1, 3, 3), {"pads": [1, 1, 1, 1], "group": 16}, False),  # 64 positions per image
])
def test_small_depthwise_dw_correlates_the_planes(x_shape, w_shape, attrs, taken):
    model, feeds, expected = _conv_model(x_shape, w_shape, attrs)
    lowered = lower_model(model)
    planes = x_shape[0] * x_shape[1]
    correlations = [n for n in lowered.graph.node if n.op_type == "Conv"
                    and any(a.name == "group" and a.i == planes for a in n.attribute)]
    assert len(correlations) == taken
    got = run_model(lowered, feeds)
    for name in ("dx", "dw", "db"):
        close(got[name], expected[name], F32, name)


def _pool_model(op, dy_shape, dx_shape, attrs, symbolic):
    """dY (and Indices) with N and C symbolic or static; dX declared with its spatial dims."""
    lead = ["N", "C"] if symbolic else list(dy_shape[:2])
    inputs = [("dY", F32, lead + list(dy_shape[2:]))]
    if op == "MaxPoolGrad":
        inputs.append(("Indices", I64, lead + list(dy_shape[2:])))
    node = helper.make_node(op, [n for n, _, _ in inputs], ["dX"], name="pg", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info("dX", F32, lead + list(dx_shape[2:]))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return lower_model(model)


@pytest.mark.parametrize("dy_shape, dx_shape, attrs, ops", [
    ((4, 8, 2, 2), (4, 8, 4, 4), {"kernel_shape": [2, 2], "strides": [2, 2]}, ["ConvTranspose"]),
    ((2, 3, 5, 5), (2, 3, 5, 5), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1},
     ["ConvTranspose"]),
    ((2, 3, 5, 5), (2, 3, 5, 5), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, ["Mul", "ConvTranspose"]),
    ((4, 6, 3), (4, 6, 3), {"kernel_shape": [3], "pads": [1, 1]}, ["Mul", "ConvTranspose"]),
])
def test_average_pool_grad_with_static_channels_is_one_grouped_conv_transpose(dy_shape, dx_shape, attrs, ops):
    static = _pool_model("AveragePoolGrad", dy_shape, dx_shape, attrs, symbolic=False)
    assert _ops(static) == ops
    dy = np.random.default_rng(3).standard_normal(dy_shape).astype(np.float32)
    got = run_model(static, {"dY": dy})["dX"]
    want = run_model(_pool_model("AveragePoolGrad", dy_shape, dx_shape, attrs, symbolic=True), {"dY": dy})["dX"]
    assert np.array_equal(got, want)


def test_max_pool_grad_with_static_shapes_sends_bad_indices_to_a_spare_element():
    dy_shape, dx_shape = (2, 3, 4, 4), (2, 3, 8, 8)
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2]}
    static = _pool_model("MaxPoolGrad", dy_shape, dx_shape, attrs, symbolic=False)
    ops = _ops(static)
    assert "Clip" in ops and "Where" not in ops and "Equal" not in ops and ops.count("ScatterElements") == 1
    rng = np.random.default_rng(4)
    dy = rng.standard_normal(dy_shape).astype(np.float32)
    size = int(np.prod(dx_shape))
    indices = rng.integers(0, size, dy_shape).astype(np.int64)
    indices.flat[:5] = [-1, -size, size, size + 7, 2**40]  # bad: add nothing
    got = run_model(static, {"dY": dy, "Indices": indices})["dX"]
    want = run_model(_pool_model("MaxPoolGrad", dy_shape, dx_shape, attrs, symbolic=True),
                     {"dY": dy, "Indices": indices})["dX"]
    assert np.array_equal(got, want)
    reference = np.zeros(size, np.float64)
    good = (indices >= 0) & (indices < size)
    np.add.at(reference, indices[good], dy[good].astype(np.float64))
    np.testing.assert_allclose(got.reshape(-1), reference, rtol=1e-6, atol=1e-6)
