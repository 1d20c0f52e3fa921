"""One-node cases of DivGrad (com.microsoft), recorded with onnxruntime-training 1.19.2:

    /work/ortt-venv/bin/python tools/ort_training/make_fixtures.py --family div_grad

onnxruntime-training has no CPU kernel for DivGrad; its CPU runs the op's function body (Shape,
BroadcastGradientArgs, Div, ReduceSumTraining, Reshape, Mul, Neg), so these record that. Shapes as Div's
gradient sees them, tiny: equal shapes; the dividend broadcast; the divisor per channel; both broadcast; a
scalar divisor; a LayerNorm2d-like divisor ([N, 1, H, W], ConvNeXt's (x - mean) / sqrt(var + eps)); only dA
and only dB requested (the gradient builder's form when only B needs a gradient); f32, f64 and f16. The
divisor stays away from 0 (magnitudes 0.5 to 2, either sign). Not recorded: bf16, which the function body's
ReduceSumTraining refuses (the session fails to load).
"""

from __future__ import annotations

import sys

import numpy as np

make_fixtures = sys.modules.get("make_fixtures") or sys.modules["__main__"]  # the recorder that imports us

SEED = 2031

# (variant, A's shape, B's shape, outputs, dtype)
CASES = [
    ("same_shape", (2, 3, 4), (2, 3, 4), ["dA", "dB"], np.float32),
    ("a_broadcast", (1, 3, 1), (2, 3, 4), ["dA", "dB"], np.float32),
    ("b_per_channel", (2, 3, 4, 4), (1, 3, 1, 1), ["dA", "dB"], np.float32),
    ("b_lower_rank", (2, 3, 4), (3, 1), ["dA", "dB"], np.float32),
    ("both_broadcast", (2, 1, 4), (3, 1), ["dA", "dB"], np.float32),
    ("scalar_b", (2, 3, 5), (), ["dA", "dB"], np.float32),
    ("layer_norm_2d", (2, 4, 3, 3), (2, 1, 3, 3), ["dA", "dB"], np.float32),
    ("only_dA", (2, 3, 4), (3, 1), ["dA", ""], np.float32),
    ("only_dB", (2, 3, 4), (1, 3, 1), ["", "dB"], np.float32),
    ("b_per_channel_f64", (2, 3, 4, 4), (1, 3, 1, 1), ["dA", "dB"], np.float64),
    ("both_broadcast_f16", (2, 1, 4), (3, 1), ["dA", "dB"], np.float16),
]


def make(rng) -> None:
    record = make_fixtures.record
    for variant, a_shape, b_shape, outputs, dtype in CASES:
        a = rng.standard_normal(a_shape).astype(dtype)
        b = (rng.uniform(0.5, 2.0, b_shape) * rng.choice([-1.0, 1.0], b_shape)).astype(dtype)
        dy = rng.standard_normal(np.broadcast_shapes(a_shape, b_shape)).astype(dtype)
        record("DivGrad", variant, {"dY": dy, "A": a, "B": b}, outputs)
