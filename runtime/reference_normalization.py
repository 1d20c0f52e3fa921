"""Float64 NumPy references of onnxruntime-training's softmax and normalization gradients (SoftmaxGrad,
SoftmaxGrad_13, LogSoftmaxGrad, LogSoftmaxGrad_13, LayerNormalizationGrad, SimplifiedLayerNormalizationGrad) and
of the forward ops they differentiate (Softmax, LogSoftmax, LayerNormalization, SimplifiedLayerNormalization), for
finite-difference tests and ``reference_eval``.

Written from the math of each spec document (``specs/com.microsoft/``, ``specs/onnx.training/``), not from the
lowering: every input is cast to float64 first. ``axis`` is the op's own: with ``trailing`` (the pre-13 softmax
ops) the sums run over every axis from ``axis`` on, otherwise over ``axis`` alone; the normalizations always
normalize the axes from ``axis`` on.
"""

from __future__ import annotations

import numpy as np


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def _axes(rank: int, axis: int, trailing: bool) -> tuple[int, ...]:
    axis %= rank
    return tuple(range(axis, rank)) if trailing else (axis,)


def softmax(x, axis: int = -1, trailing: bool = False) -> np.ndarray:
    x = _f64(x)
    axes = _axes(x.ndim, axis, trailing)
    e = np.exp(x - x.max(axis=axes, keepdims=True))
    return e / e.sum(axis=axes, keepdims=True)


def log_softmax(x, axis: int = -1, trailing: bool = False) -> np.ndarray:
    x = _f64(x)
    axes = _axes(x.ndim, axis, trailing)
    shifted = x - x.max(axis=axes, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axes, keepdims=True))


def softmax_grad(dy, y, axis: int = -1, trailing: bool = False) -> np.ndarray:
    """From the forward output y: dX = y * (dy - sum(dy * y))."""
    dy, y = _f64(dy), _f64(y)
    return y * (dy - (dy * y).sum(axis=_axes(y.ndim, axis, trailing), keepdims=True))


def log_softmax_grad(dy, log_y, axis: int = -1, trailing: bool = False) -> np.ndarray:
    """From the forward output log_y: dX = dy - exp(log_y) * sum(dy)."""
    dy, log_y = _f64(dy), _f64(log_y)
    return dy - np.exp(log_y) * dy.sum(axis=_axes(log_y.ndim, axis, trailing), keepdims=True)


# -- layer normalization ---------------------------------------------------------------------------------------

def _split(x: np.ndarray, axis: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(the normalized axis, the row axes, the normalized axes)."""
    axis %= x.ndim
    return axis, tuple(range(axis)), tuple(range(axis, x.ndim))


def _per_row(stat, x: np.ndarray, axis: int) -> np.ndarray:
    """A per-row statistic (row dims, optionally followed by 1s) shaped to broadcast against x."""
    return _f64(stat).reshape(x.shape[:axis] + (1,) * (x.ndim - axis))


def layer_norm(x, scale, bias=None, axis: int = -1, epsilon: float = 1e-5):
    """ONNX LayerNormalization: (Y, Mean, InvStdDev), the statistics with the normalized axes kept as 1."""
    x = _f64(x)
    axis, _, norm = _split(x, axis)
    mean = x.mean(axis=norm, keepdims=True)
    inv = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=norm, keepdims=True) + epsilon)
    y = (x - mean) * inv * _f64(scale)
    return (y if bias is None else y + _f64(bias)), mean, inv


def layer_norm_grad(dy, x, scale, mean, inv_std, axis: int = -1):
    """(X_grad, scale_grad, bias_grad) from the forward node's Mean and InvStdDev, as given."""
    dy, x, scale = _f64(dy), _f64(x), _f64(scale)
    axis, rows, norm = _split(x, axis)
    inv = _per_row(inv_std, x, axis)
    xhat = (x - _per_row(mean, x, axis)) * inv
    g = dy * scale
    dx = inv * (g - g.mean(axis=norm, keepdims=True) - xhat * (g * xhat).mean(axis=norm, keepdims=True))
    return dx, (dy * xhat).sum(axis=rows), dy.sum(axis=rows)


def simplified_layer_norm(x, scale, axis: int = -1, epsilon: float = 1e-5):
    """SimplifiedLayerNormalization (RMSNorm): (Y, inv_std_var), inv_std_var with the normalized axes kept as 1."""
    x = _f64(x)
    axis, _, norm = _split(x, axis)
    inv = 1.0 / np.sqrt((x * x).mean(axis=norm, keepdims=True) + epsilon)
    return x * inv * _f64(scale), inv


def simplified_layer_norm_grad(dy, x, scale, inv_std, axis: int = -1):
    """(X_grad, scale_grad) from the forward node's inv_std_var, as given."""
    dy, x, scale = _f64(dy), _f64(x), _f64(scale)
    axis, rows, norm = _split(x, axis)
    inv = _per_row(inv_std, x, axis)
    xhat = x * inv
    g = dy * scale
    dx = inv * (g - xhat * (g * xhat).mean(axis=norm, keepdims=True))
    return dx, (dy * xhat).sum(axis=rows)
