"""ConvGrad's forms of issue 31's fourth pass (session 33): the windows of a strided 1x1 kernel without padding are
X's strided subsample by a 1x1 AveragePool (x / 1, X's own values), not a one-hot Conv (which onnxruntime ran as
NCHWc between a ReorderInput and a ReorderOutput). Taken where it applies, with the bits of the same conv at stride 1
on the subsampled X (whose windows are X itself)."""

from __future__ import annotations

import numpy as np
import pytest
from _one_node import F32, close
from test_conv_pool_grad_forms import _conv_model, _ops

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
