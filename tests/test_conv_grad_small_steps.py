"""ConvGrad's forms of issue 31's fourth pass (session 33): the windows of a strided 1x1 kernel without padding are
X's strided subsample by a 1x1 AveragePool (x / 1, X's own values), not a one-hot Conv (which onnxruntime ran as
NCHWc between a ReorderInput and a ReorderOutput); up to PLANE_POSITIONS output positions per image, the windows of
a kernel of 9 offsets and more come from X's planes ([n*C, 1, ...]) through one Conv with K one-hot kernels. Each is
taken where it applies, with the bits of the form it replaces (the AveragePool's: the same conv at stride 1 on the
subsampled X, whose windows are X itself)."""

from __future__ import annotations

import numpy as np
import pytest
from _one_node import F32, close
from test_conv_pool_grad_forms import _conv_model, _ops

import lowering.rules.conv_grad as conv_grad
from lowering.passes import lower_model
from runtime.session import run_model


@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((4, 8, 8, 8), (16, 8, 1, 1), {"strides": [2, 2]}),  # resnet_basic's shortcut
    ((4, 16, 7, 9), (8, 16, 1, 1), {"strides": [2, 3]}),  # odd sizes: the floor division drops the last row
    ((4, 8, 8, 8), (8, 2, 1, 1), {"strides": [2, 2], "group": 4}),
    ((3, 6, 11), (4, 6, 1), {"strides": [3], "dilations": [2]}),  # 1-D; a 1x1 kernel's dilation reads nothing else
    ((2, 4, 4, 6, 6), (4, 4, 1, 1, 1), {"strides": [2, 2, 2]}),  # 3-D
    ((32, 16, 8, 8), (32, 16, 1, 1), {"strides": [2, 2]}),  # batch 32 (a ResNet's shortcut at full size)
])
def test_strided_one_by_one_windows_are_an_average_pool(x_shape, w_shape, attrs):
    model, feeds, expected = _conv_model(x_shape, w_shape, attrs)
    lowered = lower_model(model)
    ops = _ops(lowered)
    assert "AveragePool" in ops and "Conv" not in ops  # no one-hot Conv (dX is the ConvTranspose)
    got = run_model(lowered, feeds)
    strides = attrs["strides"]
    subsample = feeds["x"][(slice(None), slice(None), *(slice(None, None, s) for s in strides))]
    subsample = subsample[(slice(None), slice(None), *(slice(0, d) for d in feeds["dy"].shape[2:]))]
    plain, plain_feeds, _ = _conv_model(subsample.shape, w_shape, {k: v for k, v in attrs.items() if k == "group"})
    assert "AveragePool" not in _ops(lower_model(plain))  # its windows: X itself
    same = run_model(lower_model(plain), {**plain_feeds, "dy": feeds["dy"], "x": np.ascontiguousarray(subsample),
                                          "w": feeds["w"]})
    assert np.array_equal(got["dw"], same["dw"]) and np.array_equal(got["db"], same["db"])
    for name in ("dx", "dw", "db"):
        close(got[name], expected[name], F32, name)


def test_padded_one_by_one_windows_keep_the_one_hot_conv():
    model, _, _ = _conv_model((4, 8, 6, 6), (8, 8, 1, 1), {"strides": [2, 2], "pads": [1, 1, 1, 1]})
    ops = _ops(lower_model(model))
    assert "AveragePool" not in ops and ops.count("Conv") == 1


def _plane_windows(model) -> int:
    """How many Convs read a [-1, 1, ...] view (of X or of its image parts: the planes' windows)."""
    shapes = {n.output[0]: n for n in model.graph.node if n.op_type == "Constant"}
    reshaped = set()
    for n in model.graph.node:
        if n.op_type == "Reshape" and n.input[1] in shapes:
            value = shapes[n.input[1]].attribute[0].t
            if list(np.frombuffer(value.raw_data, np.int64)[:2]) == [-1, 1]:
                reshaped.add(n.output[0])
    return sum(1 for n in model.graph.node if n.op_type == "Conv" and n.input[0] in reshaped)


@pytest.mark.parametrize("x_shape, w_shape, attrs, taken", [
    ((4, 8, 8, 8), (8, 8, 3, 3), {"pads": [1, 1, 1, 1]}, True),  # resnet_basic's 3x3 at 8^2: 64 positions
    ((4, 8, 8, 8), (16, 8, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}, True),
    ((4, 3, 16, 16), (8, 3, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}, True),  # a first conv, stride 2
    ((4, 16, 4, 4), (16, 4, 3, 3), {"pads": [1, 1, 1, 1], "group": 4}, True),  # regnet's grouped 3x3
    ((4, 16, 8, 8), (16, 1, 3, 3), {"pads": [1, 1, 1, 1], "group": 16}, True),  # depthwise past the correlation
    ((4, 4, 3, 3), (6, 4, 3, 3), {}, True),  # one position per image: the outer products
    ((2, 4, 9, 9), (4, 4, 3, 3), {"dilations": [2, 2], "pads": [1, 2, 2, 1]}, True),
    ((2, 2, 4, 4, 4), (3, 2, 3, 3, 3), {"pads": [1, 1, 1, 1, 1, 1]}, True),  # 3-D
    ((4, 3, 16, 16), (8, 3, 3, 3), {"pads": [1, 1, 1, 1]}, False),  # 256 positions
    ((4, 8, 8, 8), (16, 8, 2, 2), {"strides": [2, 2]}, False),  # 4 offsets
    ((4, 3, 11), (6, 3, 3), {"pads": [1, 1]}, False),  # 1-D: its windows need no view
    ((32, 64, 8, 8), (64, 64, 3, 3), {"pads": [1, 1, 1, 1]}, False),  # windows past PLANE_WINDOWS (full size)
    ((16, 64, 8, 8), (64, 64, 3, 3), {"pads": [1, 1, 1, 1]}, True),  # 589,824 window elements: within it
])
def test_few_positions_take_the_windows_of_the_planes(x_shape, w_shape, attrs, taken, monkeypatch):
    model, feeds, expected = _conv_model(x_shape, w_shape, attrs)
    lowered = lower_model(model)
    assert _plane_windows(lowered) == int(taken)
    got = run_model(lowered, feeds)
    monkeypatch.setattr(conv_grad, "PLANE_POSITIONS", 0)
    grouped = lower_model(model)
    assert _plane_windows(grouped) == 0
    if taken:  # one view of X more
        assert _ops(lowered).count("Reshape") == _ops(grouped).count("Reshape") + 1
    want = run_model(grouped, feeds)
    for name in ("dx", "dw", "db"):
        assert np.array_equal(got[name], want[name]), name
        close(got[name], expected[name], F32, name)


@pytest.mark.parametrize("small_positions", [0, 128])
def test_planes_windows_in_both_orientations_and_image_parts(small_positions, monkeypatch):
    """dW's per-image products in either orientation (W's layout or its transpose), and the windows made a few
    images at a time past WINDOWS_LIMIT: the planes' windows give the grouped windows' bits."""
    model, feeds, _ = _conv_model((6, 8, 6, 6), (12, 4, 3, 3), {"pads": [1, 1, 1, 1], "group": 2})
    monkeypatch.setattr(conv_grad, "SMALL_POSITIONS", small_positions)
    monkeypatch.setattr(conv_grad, "WINDOWS_LIMIT", 8 * 9 * 36 * 4 * 2)  # two images' windows a part
    lowered = lower_model(model)
    assert _plane_windows(lowered) == 3 and "Split" in _ops(lowered)
    got = run_model(lowered, feeds)
    monkeypatch.setattr(conv_grad, "PLANE_POSITIONS", 0)
    want = run_model(lower_model(model), feeds)
    for name in ("dx", "dw", "db"):
        assert np.array_equal(got[name], want[name]), name


def test_planes_need_x_spatial_sizes():
    """X of unknown shape (dY's known): the grouped windows, no planes."""
    model, feeds, expected = _conv_model((4, 8, 8, 8), (8, 8, 3, 3), {"pads": [1, 1, 1, 1]})
    x = next(i for i in model.graph.input if i.name == "x")
    x.type.tensor_type.ClearField("shape")
    lowered = lower_model(model)
    assert _plane_windows(lowered) == 0
    got = run_model(lowered, feeds)
    for name in ("dx", "dw", "db"):
        close(got[name], expected[name], F32, name)
