"""Float64 NumPy references of onnxruntime-training's gradient ops (ReluGrad, SigmoidGrad, DivGrad, Scale,
ConvGrad, SoftmaxCrossEntropyLossGrad) and of the forward ops they differentiate (for finite-difference tests).

Written from the math of each spec document (``specs/com.microsoft/``), not from the lowering: every
input is cast to float64 first. Conv is written as a sum over kernel offsets of strided slices of the
padded input, so the gradients are its exact adjoints, also for groups, strides, dilations and pads.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def relu_grad(dy, x) -> np.ndarray:
    return np.where(_f64(x) > 0, _f64(dy), 0.0)


def sigmoid(x) -> np.ndarray:
    x = _f64(x)
    return np.where(x >= 0, 1 / (1 + np.exp(-np.abs(x))), np.exp(-np.abs(x)) / (1 + np.exp(-np.abs(x))))


def sigmoid_grad(dy, y) -> np.ndarray:
    """From the forward output y = sigmoid(x)."""
    y = _f64(y)
    return _f64(dy) * y * (1 - y)


def sum_to(grad: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """``grad`` (of a broadcast result's shape) summed over the axes an input of ``shape`` was broadcast along."""
    shape = tuple(shape)
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape) if d == 1 and grad.shape[lead + i] != 1)
    return np.sum(grad, axis=axes, keepdims=True).reshape(shape)


def div_grad(dy, a, b) -> tuple[np.ndarray, np.ndarray]:
    """(dA, dB) of Y = A / B, each summed back to its input's shape."""
    dy, a, b = _f64(dy), _f64(a), _f64(b)
    return sum_to(dy / b, a.shape), sum_to(-dy * a / (b * b), b.shape)


def scale(values, factor, scale_down: int = 0) -> np.ndarray:
    s = _f64(factor).reshape(())
    return _f64(values) / s if scale_down else _f64(values) * s


# -- convolution -----------------------------------------------------------------------------------

def _geometry(x_shape, w_shape, strides, dilations, pads):
    k = len(x_shape) - 2
    strides = tuple(strides or (1,) * k)
    dilations = tuple(dilations or (1,) * k)
    pads = tuple(pads or (0,) * (2 * k))
    out = tuple((x_shape[2 + a] + pads[a] + pads[a + k] - dilations[a] * (w_shape[2 + a] - 1) - 1) // strides[a] + 1
                for a in range(k))
    return k, strides, dilations, pads, out


def _windows(k, kernel, strides, dilations, out):
    """(kernel offset, slices into the padded input that offset reads for every output position)."""
    for offset in itertools.product(*(range(n) for n in kernel)):
        yield offset, tuple(slice(offset[a] * dilations[a], offset[a] * dilations[a] + strides[a] * (out[a] - 1) + 1,
                                  strides[a]) for a in range(k))


def conv(x, w, b=None, *, group: int = 1, strides: Sequence[int] | None = None,
         dilations: Sequence[int] | None = None, pads: Sequence[int] | None = None) -> np.ndarray:
    """ONNX Conv (NCHW..., explicit pads) in float64."""
    x, w = _f64(x), _f64(w)
    k, strides, dilations, pads, out = _geometry(x.shape, w.shape, strides, dilations, pads)
    xp = np.pad(x, [(0, 0), (0, 0)] + [(pads[a], pads[a + k]) for a in range(k)])
    n, c = x.shape[:2]
    m, cg = w.shape[:2]
    mg = m // group
    y = np.zeros((n, m, *out))
    for offset, window in _windows(k, w.shape[2:], strides, dilations, out):
        patch = xp[(slice(None), slice(None), *window)]  # [N, C, O...]
        for g in range(group):
            wk = w[(slice(g * mg, (g + 1) * mg), slice(None), *offset)]  # [Mg, Cg]
            y[:, g * mg:(g + 1) * mg] += np.einsum("mc,nc...->nm...", wk, patch[:, g * cg:(g + 1) * cg])
    if b is not None:
        y += _f64(b).reshape((1, m) + (1,) * k)
    return y


def conv_grad(dy, x, w, *, group: int = 1, strides: Sequence[int] | None = None,
              dilations: Sequence[int] | None = None, pads: Sequence[int] | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dX, dW, dB) of ONNX Conv: the adjoints of :func:`conv`."""
    dy, x, w = _f64(dy), _f64(x), _f64(w)
    k, strides, dilations, pads, out = _geometry(x.shape, w.shape, strides, dilations, pads)
    if tuple(dy.shape[2:]) != out:
        raise ValueError(f"dY spatial shape {dy.shape[2:]} is not the forward output {out}")
    xp = np.pad(x, [(0, 0), (0, 0)] + [(pads[a], pads[a + k]) for a in range(k)])
    dxp = np.zeros_like(xp)
    dw = np.zeros_like(w)
    m, cg = w.shape[:2]
    mg = m // group
    for offset, window in _windows(k, w.shape[2:], strides, dilations, out):
        index = (slice(None), slice(None), *window)
        patch = xp[index]
        for g in range(group):
            channels, outs = slice(g * cg, (g + 1) * cg), slice(g * mg, (g + 1) * mg)
            wk = w[(outs, slice(None), *offset)]
            dys, patches = dy[:, outs].reshape(dy.shape[0], mg, -1), patch[:, channels].reshape(dy.shape[0], cg, -1)
            dw[(outs, slice(None), *offset)] += np.einsum("nmo,nco->mc", dys, patches)
            dxp[(slice(None), channels, *window)] += np.einsum("mc,nm...->nc...", wk, dy[:, outs])
    crop = (slice(None), slice(None), *(slice(pads[a], pads[a] + x.shape[2 + a]) for a in range(k)))
    db = dy.sum(axis=(0, *range(2, dy.ndim)))
    return dxp[crop], dw, db


# -- softmax cross-entropy -----------------------------------------------------------------------------

def _sample_weights(label: np.ndarray, classes: int, weight, ignore_index: int | None) -> np.ndarray:
    label = np.asarray(label).astype(np.int64)
    ignored = np.zeros(label.shape, bool) if ignore_index is None else label == ignore_index
    safe = np.where(ignored, 0, label)
    w = np.ones(label.shape) if weight is None else _f64(weight)[safe]
    return np.where(ignored, 0.0, w)


def _class_last(a: np.ndarray) -> np.ndarray:
    return np.moveaxis(a, 1, -1)


def softmax_cross_entropy_loss(scores, label, weight=None, *, reduction: str = "mean",
                               ignore_index: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """ONNX SoftmaxCrossEntropyLoss in float64: (loss, log_prob)."""
    s = _f64(scores)
    shifted = s - s.max(axis=1, keepdims=True)
    log_prob = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    label = np.asarray(label).astype(np.int64)
    w = _sample_weights(label, s.shape[1], weight, ignore_index)
    safe = np.where(w == 0, 0, label) if ignore_index is not None else label
    picked = np.take_along_axis(_class_last(log_prob), safe[..., None], axis=-1)[..., 0]
    loss = -picked * w
    if reduction == "none":
        return loss, log_prob
    total = loss.sum()
    if reduction == "mean":
        denominator = w.sum()
        total = total / denominator if denominator != 0 else total
    return np.asarray(total), log_prob


def softmax_cross_entropy_loss_grad(dy, log_prob, label, weight=None, *, reduction: str = "mean",
                                    ignore_index: int | None = None) -> np.ndarray:
    """d_logits as the spec document states it."""
    lp = _f64(log_prob)
    label = np.asarray(label).astype(np.int64)
    classes = lp.shape[1]
    w = _sample_weights(label, classes, weight, ignore_index)
    if reduction == "none":
        g = _f64(dy) * w
    else:
        g = _f64(dy).reshape(()) * w
        if reduction == "mean" and w.sum() != 0:
            g = g / w.sum()
    onehot = np.zeros(_class_last(lp).shape)
    safe = np.where(w == 0, 0, label) if ignore_index is not None else label
    np.put_along_axis(onehot, safe[..., None], 1.0, axis=-1)
    d = (np.exp(_class_last(lp)) - onehot) * g[..., None]
    return np.moveaxis(d, -1, 1)


# -- pooling -------------------------------------------------------------------------------------------

def _pool_windows(spatial, outputs, kernel, strides, pads):
    """(output position, slices of the window inside the input, positions inside) for every output."""
    for o in itertools.product(*(range(n) for n in outputs)):
        starts = [o[a] * strides[a] - pads[a] for a in range(len(o))]
        window = tuple(slice(max(s, 0), min(s + kernel[a], spatial[a])) for a, s in enumerate(starts))
        yield o, window, int(np.prod([w.stop - w.start for w in window]))


def max_pool(x, kernel, strides, pads, output_shape):
    """MaxPool in float64 with onnxruntime's indices (flat positions in the whole input); ``output_shape``
    gives the spatial output size (floor or ceil mode decided by the caller)."""
    x = _f64(x)
    n, c = x.shape[:2]
    y = np.zeros((n, c, *output_shape))
    indices = np.zeros(y.shape, np.int64)
    flat_index = np.arange(x.size).reshape(x.shape)
    for o, window, _ in _pool_windows(x.shape[2:], output_shape, kernel, strides, pads):
        patch = x[(slice(None), slice(None), *window)].reshape(n, c, -1)
        where = patch.argmax(axis=-1)
        y[(slice(None), slice(None), *o)] = np.take_along_axis(patch, where[..., None], -1)[..., 0]
        positions = flat_index[(slice(None), slice(None), *window)].reshape(n, c, -1)
        indices[(slice(None), slice(None), *o)] = np.take_along_axis(positions, where[..., None], -1)[..., 0]
    return y, indices


def max_pool_grad(dy, indices, x_shape) -> np.ndarray:
    dx = np.zeros(int(np.prod(x_shape)))
    np.add.at(dx, np.asarray(indices).ravel(), _f64(dy).ravel())
    return dx.reshape(x_shape)


def average_pool(x, kernel, strides, pads, output_shape, count_include_pad: int = 0) -> np.ndarray:
    x = _f64(x)
    y = np.zeros((*x.shape[:2], *output_shape))
    for o, window, inside in _pool_windows(x.shape[2:], output_shape, kernel, strides, pads):
        count = int(np.prod(kernel)) if count_include_pad else inside
        y[(slice(None), slice(None), *o)] = x[(slice(None), slice(None), *window)].sum(
            axis=tuple(range(2, x.ndim))) / count
    return y


def average_pool_grad(dy, x_shape, kernel, strides, pads, count_include_pad: int = 0) -> np.ndarray:
    dy = _f64(dy)
    dx = np.zeros(x_shape)
    for o, window, inside in _pool_windows(x_shape[2:], dy.shape[2:], kernel, strides, pads):
        count = int(np.prod(kernel)) if count_include_pad else inside
        g = dy[(slice(None), slice(None), *o)] / count
        dx[(slice(None), slice(None), *window)] += g.reshape(g.shape + (1,) * (len(x_shape) - 2))
    return dx
