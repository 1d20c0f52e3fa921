"""ConvGrad's forms of issue 31's third pass: one output position per image (an SE block's 1x1 convs: dW as outer
products summed by one ReduceSum, dB one ReduceSum), dW in W's layout past SMALL_POSITIONS where onnxruntime's GEMM
blocks the positions alike in both orientations, and depthwise kernels of 5x5 and up (dX by ConvTranspose at
stride 1, dW by the correlation at any size). Each is taken where it applies and gives the bits it claims: the
images added one by one in order (onnxruntime-training's kernel's order), the transposed form's bits, or the
reference's numbers."""

from __future__ import annotations

import numpy as np
import pytest
from _one_node import F32, close
from test_conv_pool_grad_forms import _conv_model as _seeded_conv_model
from test_conv_pool_grad_forms import _ops

import lowering.rules.conv_grad as conv_grad
from lowering.passes import lower_model
from runtime.session import run_model


def _conv_model(x_shape, w_shape, attrs, outputs=("dx", "dw", "db"), seed=7):
    return _seeded_conv_model(x_shape, w_shape, attrs, outputs, seed)


def _in_order(values: np.ndarray) -> np.ndarray:
    """values [N, ...] (f32) added image by image in order, each sum rounded to f32."""
    total = values[0].copy()
    for v in values[1:]:
        total = (total + v).astype(np.float32)
    return total


@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((4, 16, 1, 1), (4, 16, 1, 1), {}),  # an SE block's squeeze
    ((8, 4, 1, 1), (16, 4, 1, 1), {}),  # its excitation, 8 images (the ones MatMul associates otherwise there)
    ((5, 6, 1), (3, 6, 1), {}),  # 1-D
    ((3, 4, 1, 1, 1), (5, 4, 1, 1, 1), {}),  # 3-D
    ((4, 3, 3, 3), (6, 3, 3, 3), {}),  # a 3x3 kernel over a 3x3 input: one window
    ((4, 2, 5, 5), (5, 2, 3, 3), {"strides": [2, 2], "pads": [0, 0, 0, 0], "dilations": [2, 2]}),
])
def test_one_position_per_image_sums_outer_products_image_by_image(x_shape, w_shape, attrs):
    model, feeds, expected = _conv_model(x_shape, w_shape, attrs)
    lowered = lower_model(model)
    ops = _ops(lowered)
    assert "FusedMatMul" not in ops and ops.count("MatMul") == 0  # no per-image GEMM, no ones MatMul
    assert ops.count("ReduceSum") == 2 and ops.count("Mul") == 1  # dB's and dW's image sums, the outer products
    got = run_model(lowered, feeds)
    n, m = feeds["dy"].shape[:2]
    dy = feeds["dy"].reshape(n, m)
    windows = feeds["x"].reshape(n, -1)  # the one window reads all of X here (no padding): c, then the offsets
    if attrs:  # strided and dilated: the one window reads every other row and column of the 5x5 planes
        windows = feeds["x"][:, :, ::2, ::2].reshape(n, -1)
    products = (dy[:, :, None] * windows[:, None, :]).astype(np.float32)  # round(dy * x), as the GEMM's one product
    assert np.array_equal(got["dw"], _in_order(products).reshape(w_shape))
    assert np.array_equal(got["db"], _in_order(dy))
    for name in ("dx", "dw", "db"):
        close(got[name], expected[name], F32, name)


def test_one_position_per_image_in_image_parts(monkeypatch):
    """Past WINDOWS_LIMIT the outer products of each part of the images are summed as the other forms' parts are."""
    model, feeds, expected = _conv_model((6, 16, 1, 1), (4, 16, 1, 1), {})
    whole = run_model(lower_model(model), feeds)
    monkeypatch.setattr(conv_grad, "WINDOWS_LIMIT", 16 * 4 * 4 * 2)  # two images' products a part
    lowered = lower_model(model)
    assert _ops(lowered).count("Mul") == 3 and "Split" in _ops(lowered)
    got = run_model(lowered, feeds)
    assert np.array_equal(got["dx"], whole["dx"]) and np.array_equal(got["db"], whole["db"])
    for name in ("dx", "dw", "db"):
        close(got[name], expected[name], F32, name)


def test_one_position_with_groups_keeps_the_grouped_products():
    model, feeds, expected = _conv_model((4, 8, 1, 1), (8, 4, 1, 1), {"group": 2})
    lowered = lower_model(model)
    assert "Mul" not in _ops(lowered) and _ops(lowered).count("ReduceSum") == 1  # dB's only
    got = run_model(lowered, feeds)
    for name in ("dx", "dw", "db"):
        close(got[name], expected[name], F32, name)


@pytest.mark.parametrize("columns, depth, block", [
    (27, 256, 512), (8, 256, 1024), (72, 256, 128), (144, 144, 128), (256, 100, 128), (300, 60, 64), (16, 4096, 1024),
])
def test_gemm_k_block(columns, depth, block):
    assert conv_grad._gemm_k_block(columns, depth) == block


@pytest.mark.parametrize("x_shape, w_shape, attrs, taken", [
    ((4, 3, 16, 16), (8, 3, 3, 3), {"pads": [1, 1, 1, 1]}, True),  # a first conv at 16^2: blocks of 512 and 1024
    ((3, 3, 20, 20), (4, 3, 3, 3), {"pads": [1, 1, 1, 1]}, True),  # 400 positions
    ((4, 4, 16, 16), (8, 4, 1, 1), {}, True),
    ((4, 8, 16, 16), (8, 8, 3, 3), {"pads": [1, 1, 1, 1]}, False),  # C*K 72: blocks of 128, M 8: 1024
    ((4, 3, 32, 32), (8, 3, 3, 3), {"pads": [1, 1, 1, 1]}, False),  # past 8 * SMALL_POSITIONS
])
def test_weights_layout_past_small_positions_where_the_gemm_blocks_agree(x_shape, w_shape, attrs, taken, monkeypatch):
    model, feeds, expected = _conv_model(x_shape, w_shape, attrs)
    wide = lower_model(model)
    monkeypatch.setattr(conv_grad, "SMALL_POSITIONS", 0)
    transposed = lower_model(model)
    assert _ops(wide).count("Transpose") == _ops(transposed).count("Transpose") - taken
    got, want = run_model(wide, feeds), run_model(transposed, feeds)
    for name in ("dx", "dw", "db"):
        assert np.array_equal(got[name], want[name]), name
        close(got[name], expected[name], F32, name)


@pytest.mark.parametrize("x_shape, kernel, attrs, wide", [
    ((4, 16, 4, 4), 7, {"pads": [3, 3, 3, 3]}, True),  # ConvNeXt's 7x7 at 4^2
    ((4, 8, 8, 8), 7, {"pads": [3, 3, 3, 3]}, True),  # 64 positions, 100,352 products: the correlation still
    ((2, 4, 8, 8), 5, {"pads": [2, 2, 2, 2]}, True),
    ((2, 4, 9, 9), 5, {"pads": [1, 2, 1, 2], "strides": [2, 2]}, True),  # strided: dX is a ConvTranspose anyway
    ((4, 16, 8, 8), 3, {"pads": [1, 1, 1, 1]}, False),  # 3x3: the Conv for dX, the windows for dW (64 positions)
])
def test_wide_depthwise_kernels(x_shape, kernel, attrs, wide):
    channels = x_shape[1]
    spatial = len(x_shape) - 2
    model, feeds, expected = _conv_model(x_shape, (channels, 1, *[kernel] * spatial), {**attrs, "group": channels})
    lowered = lower_model(model)
    ops = _ops(lowered)
    planes = x_shape[0] * channels
    correlations = [n for n in lowered.graph.node if n.op_type == "Conv"
                    and any(a.name == "group" and a.i == planes for a in n.attribute)]
    assert len(correlations) == wide
    assert ("ConvTranspose" in ops) == (wide or "strides" in attrs)
    assert ("Slice" in ops) == (not wide and "strides" not in attrs)  # the flipped kernels of dX's Conv
    got = run_model(lowered, feeds)
    for name in ("dx", "dw", "db"):
        close(got[name], expected[name], F32, name)
