"""One-node cases of the softmax and normalization family (issue 19), recorded with onnxruntime-training 1.19.2:

    /work/ortt-venv/bin/python tools/ort_training/make_fixtures.py --family normalization

SoftmaxGrad / LogSoftmaxGrad (pre-13: the sum runs over every axis from ``axis`` on) and their ``_13`` forms (over
``axis`` alone) on the same inputs with axis 1, where the two semantics differ, plus each op's default axis and
f16; LayerNormalizationGrad with the statistics a forward LayerNormalization returns (normalized axes kept as 1,
and flat), rows far from 0, axis 0, f16 and f64 (with f32 statistics: the kernel's U is f32);
SimplifiedLayerNormalizationGrad and the forward SimplifiedLayerNormalization (default domain) that
``generate_artifacts`` writes for a hand-written RMSNorm. Every statistic comes from a float64 forward pass.
"""

from __future__ import annotations

import make_fixtures
import numpy as np

SEED = 1919
F16, F64 = np.float16, np.float64


def _softmax(x, axes):
    e = np.exp(x - x.max(axis=axes, keepdims=True))
    return e / e.sum(axis=axes, keepdims=True)


def _softmax_cases(rng) -> None:
    shape = (2, 3, 4)
    logits = rng.standard_normal(shape) * 2
    dy = rng.standard_normal(shape).astype(np.float32)
    trailing = _softmax(logits, (1, 2))  # what Softmax-1..12 with axis 1 returns
    last = _softmax(logits, (2,))  # Softmax-13 with its default axis -1
    one = _softmax(logits, (1,))  # Softmax-13 with axis 1
    cases = [
        # (op, variant, forward output, attributes, dtype)
        ("SoftmaxGrad", "default_axis", trailing, {}, np.float32),
        ("SoftmaxGrad", "axis0", _softmax(logits, (0, 1, 2)), {"axis": 0}, np.float32),
        ("SoftmaxGrad", "axis_last", last, {"axis": -1}, np.float32),
        ("SoftmaxGrad", "axis1_same_inputs", one, {"axis": 1}, np.float32),
        ("SoftmaxGrad", "default_axis_f16", trailing, {}, F16),
        ("SoftmaxGrad", "default_axis_f64", trailing, {}, F64),
        ("SoftmaxGrad_13", "default_axis", last, {}, np.float32),
        ("SoftmaxGrad_13", "axis1_same_inputs", one, {"axis": 1}, np.float32),
        ("SoftmaxGrad_13", "axis0", _softmax(logits, (0,)), {"axis": 0}, np.float32),
        ("SoftmaxGrad_13", "default_axis_f16", last, {}, F16),
        ("LogSoftmaxGrad", "default_axis", np.log(trailing), {}, np.float32),
        ("LogSoftmaxGrad", "axis1_same_inputs", np.log(one), {"axis": 1}, np.float32),
        ("LogSoftmaxGrad", "default_axis_f16", np.log(trailing), {}, F16),
        ("LogSoftmaxGrad_13", "default_axis", np.log(last), {}, np.float32),
        ("LogSoftmaxGrad_13", "axis1_same_inputs", np.log(one), {"axis": 1}, np.float32),
        ("LogSoftmaxGrad_13", "default_axis_f16", np.log(last), {}, F16),
    ]
    for op, variant, forward, attrs, dtype in cases:
        second = "X" if op.startswith("Log") else "Y"
        make_fixtures.record(op, variant, {"dY": dy.astype(dtype), second: forward.astype(dtype)}, ["dX"], attrs)


def _row_stats(x, axis, simplified=False):
    axes = tuple(range(axis % x.ndim, x.ndim))
    mean = 0.0 if simplified else x.mean(axis=axes, keepdims=True)
    inv = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + 1e-5)
    return (None if simplified else mean.astype(np.float32)), inv.astype(np.float32)


def _layer_norm_cases(rng) -> None:
    outs = ["X_grad", "scale_grad", "bias_grad"]
    cases = [
        # (variant, X shape, axis, row offset, dtype, flat statistics)
        ("3d_axis_last", (2, 3, 8), -1, 0.0, np.float32, False),
        ("3d_axis1", (2, 3, 8), 1, 0.0, np.float32, False),
        ("3d_flat_stats", (2, 3, 8), -1, 0.0, np.float32, True),
        ("2d_axis0", (4, 6), 0, 0.0, np.float32, False),
        ("rows_far_from_zero", (4, 16), -1, 1e3, np.float32, False),
        ("3d_axis_last_f16", (2, 3, 8), -1, 0.0, F16, False),
        ("3d_axis_last_f64", (2, 3, 8), -1, 0.0, F64, False),
    ]
    for variant, shape, axis, offset, dtype, flat in cases:
        x = (rng.standard_normal(shape) + offset).astype(dtype)
        x64 = x.astype(np.float64)
        mean, inv = _row_stats(x64, axis)
        if flat:
            mean, inv = mean.reshape(shape[:axis % len(shape)]), inv.reshape(shape[:axis % len(shape)])
        scale = (rng.standard_normal(shape[axis % len(shape):]) + 1).astype(dtype)
        dy = rng.standard_normal(shape).astype(dtype)
        make_fixtures.record("LayerNormalizationGrad", variant,
                             {"Y_grad": dy, "X": x, "scale": scale, "mean": mean, "inv_std_var": inv}, outs,
                             {"axis": axis, "epsilon": 1e-5, "stash_type": 1})


def _simplified_cases(rng) -> None:
    cases = [("3d_axis_last", (2, 3, 8), -1, np.float32), ("3d_axis1", (2, 3, 8), 1, np.float32),
             ("3d_axis_last_f16", (2, 3, 8), -1, F16)]
    for variant, shape, axis, dtype in cases:
        x = rng.standard_normal(shape).astype(dtype)
        _, inv = _row_stats(x.astype(np.float64), axis, simplified=True)
        scale = (rng.standard_normal(shape[axis % len(shape):]) + 1).astype(dtype)
        dy = rng.standard_normal(shape).astype(dtype)
        make_fixtures.record("SimplifiedLayerNormalizationGrad", variant,
                             {"Y_grad": dy, "X": x, "scale": scale, "inv_std_var": inv}, ["X_grad", "scale_grad"],
                             {"axis": axis, "epsilon": 1e-6, "stash_type": 1})
        # the forward op, default domain, as the fused RMSNorm of a generate_artifacts training model
        make_fixtures.record("SimplifiedLayerNormalization", variant, {"X": x, "scale": scale},
                             ["Y", "inv_std_var"], {"axis": axis, "epsilon": 1e-6, "stash_type": 1}, domain="")
    x = rng.standard_normal((3, 5)).astype(np.float32)
    make_fixtures.record("SimplifiedLayerNormalization", "2d_y_only", {"X": x, "scale": rng.standard_normal(5)
                                                                        .astype(np.float32)}, ["Y"], {}, domain="")


def make(rng) -> None:
    _softmax_cases(rng)
    _layer_norm_cases(rng)
    _simplified_cases(rng)
