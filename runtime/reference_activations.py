"""Float64 NumPy references of onnxruntime-training's activation family (TanhGrad, LeakyReluGrad, QuickGelu,
QuickGeluGrad, GeluGrad, FastGeluGrad, Gelu, BiasGelu, BiasGeluGrad_dX, BiasFastGeluGrad_dX, DropoutGrad) and of
the forward activations they differentiate (for finite-difference tests).

Written from the math of each spec document (``specs/com.microsoft/``), not from the lowering: every input
is cast to float64 first. erf is the C library's, element by element (no SciPy in the project).
"""

from __future__ import annotations

import math

import numpy as np

from runtime.reference_training import sigmoid

FAST_GELU_A = math.sqrt(2.0 / math.pi)  # the tanh approximation's sqrt(2/pi)
FAST_GELU_G = 0.044715
_ERF = np.frompyfunc(math.erf, 1, 1)


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def erf(x) -> np.ndarray:
    x = _f64(x)
    return np.asarray(_ERF(x), dtype=np.float64).reshape(x.shape)


def tanh_grad(dy, y) -> np.ndarray:
    """From the forward output y = tanh(x)."""
    y = _f64(y)
    return _f64(dy) * (1 - y * y)


def leaky_relu(x, alpha: float = 0.01) -> np.ndarray:
    x = _f64(x)
    return np.where(x > 0, x, alpha * x)


def leaky_relu_grad(dy, y, alpha: float = 0.01) -> np.ndarray:
    """From the forward output y; where y is 0 the slope is alpha."""
    dy = _f64(dy)
    return np.where(_f64(y) > 0, dy, alpha * dy)


def quick_gelu(x, alpha: float = 1.702) -> np.ndarray:
    x = _f64(x)
    return x * sigmoid(alpha * x)


def quick_gelu_grad(dy, x, alpha: float = 1.702) -> np.ndarray:
    x = _f64(x)
    s = sigmoid(alpha * x)
    return _f64(dy) * s * (1 + alpha * x * (1 - s))


def gelu(x) -> np.ndarray:
    """The exact GELU, x * Phi(x)."""
    x = _f64(x)
    return 0.5 * x * (1 + erf(x / math.sqrt(2.0)))


def gelu_grad(dy, x) -> np.ndarray:
    x = _f64(x)
    cdf = 0.5 * (1 + erf(x / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return _f64(dy) * (cdf + x * pdf)


def fast_gelu(x) -> np.ndarray:
    """The tanh approximation of GELU."""
    x = _f64(x)
    return 0.5 * x * (1 + np.tanh(FAST_GELU_A * (x + FAST_GELU_G * x ** 3)))


def fast_gelu_grad(dy, x) -> np.ndarray:
    x = _f64(x)
    t = np.tanh(FAST_GELU_A * (x + FAST_GELU_G * x ** 3))
    return _f64(dy) * 0.5 * (1 + t + (1 - t * t) * (FAST_GELU_A * x + 3 * FAST_GELU_A * FAST_GELU_G * x ** 3))


def bias_gelu(a, b) -> np.ndarray:
    return gelu(_f64(a) + _f64(b))


def bias_gelu_grad(dy, x, b) -> np.ndarray:
    return gelu_grad(dy, _f64(x) + _f64(b))


def bias_fast_gelu_grad(dy, x, b) -> np.ndarray:
    return fast_gelu_grad(dy, _f64(x) + _f64(b))


def dropout_grad(dy, mask, ratio=None) -> np.ndarray:
    """dy / (1 - ratio) where mask, 0 elsewhere; ratio 0.5 when None; ratio 0 passes dy unchanged. The ratio is
    read as an f32 value and 1 - ratio formed in f32 (the spec)."""
    dy = _f64(dy)
    r = np.float32(0.5 if ratio is None else np.asarray(ratio).reshape(-1)[0])
    if r == 0:
        return dy
    return np.where(np.asarray(mask, dtype=bool), dy / float(np.float32(1) - r), 0.0)
