"""Float64 NumPy references: the canonical batch-norm backward (DESIGN.md section 4) and
onnxruntime-training's BatchNormInternal forward.

Whatever the input dtype (f32, f16, ml_dtypes bf16), everything is computed in float64, in the centred
form ``sum(dy * (x - mean))`` so that |mean| >> std does not cancel. These are oracles: lowered graphs and
onnxruntime results are compared against them, never the other way round.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

BACKWARD_OUTPUTS = ("diff_src", "diff_gamma", "diff_beta")


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def _normalize_axes(axes: Iterable[int], rank: int) -> tuple[int, ...]:
    out = []
    for axis in axes:
        a = int(axis)
        if not -rank <= a < rank:
            raise ValueError(f"axis {axis} out of range for rank {rank}")
        out.append(a % rank)
    if len(set(out)) != len(out):
        raise ValueError(f"repeated axis in {list(axes)}")
    return tuple(sorted(out))


def broadcast_shape(src_shape: Sequence[int], reduce_axes: Sequence[int]) -> tuple[int, ...]:
    """The keep-rank shape of per-channel statistics: 1 on every reduced axis, the src size elsewhere."""
    return tuple(1 if axis in reduce_axes else int(n) for axis, n in enumerate(src_shape))


def _as_broadcast(name: str, value: np.ndarray, src_shape: tuple[int, ...],
                  reduce_axes: tuple[int, ...]) -> np.ndarray:
    """A [C] vector or a keep-rank array, reshaped to broadcast against src."""
    target = broadcast_shape(src_shape, reduce_axes)
    if value.ndim == len(src_shape):
        if value.shape != target:
            raise ValueError(f"{name} has shape {list(value.shape)}; expected {list(target)} "
                             f"(src {list(src_shape)} reduced over axes {list(reduce_axes)})")
        return value
    kept = [axis for axis in range(len(src_shape)) if axis not in reduce_axes]
    if value.ndim == 1 and len(kept) == 1 and value.shape[0] == src_shape[kept[0]]:
        return value.reshape(target)
    if value.ndim == 1 and not kept and value.shape[0] == 1:
        return value.reshape(target)
    channels = [src_shape[a] for a in kept]
    raise ValueError(f"{name} has shape {list(value.shape)}; expected [C] = {channels} "
                     f"or the keep-rank shape {list(target)}")


def batch_norm_backward(src, diff_dst, mean, stat, gamma=None, *, epsilon: float, reduce_axes: Sequence[int],
                        statistics: str = "batch", stat_input: str = "variance",
                        outputs: Sequence[str] = BACKWARD_OUTPUTS) -> dict[str, np.ndarray]:
    """The canonical batch-norm training backward in float64.

    ``mean``/``stat``/``gamma`` are [C] vectors (the channel axis is the one axis not in ``reduce_axes``)
    or keep-rank arrays (DirectML). ``stat`` is the variance, or 1/sqrt(variance + epsilon) when
    ``stat_input="inv_std"`` (epsilon is then not applied again). ``statistics="frozen"`` treats mean
    and variance as constants. Returns the requested ``outputs``: diff_src shaped like src, diff_gamma
    and diff_beta shaped like the given mean.
    """
    if statistics not in ("batch", "frozen"):
        raise ValueError(f"statistics must be 'batch' or 'frozen', not {statistics!r}")
    if stat_input not in ("variance", "inv_std"):
        raise ValueError(f"stat_input must be 'variance' or 'inv_std', not {stat_input!r}")
    unknown = [o for o in outputs if o not in BACKWARD_OUTPUTS]
    if unknown:
        raise ValueError(f"unknown output(s) {unknown}; expected some of {list(BACKWARD_OUTPUTS)}")
    x, dy = _f64(src), _f64(diff_dst)
    if x.shape != dy.shape:
        raise ValueError(f"diff_dst has shape {list(dy.shape)}; expected src's {list(x.shape)}")
    axes = _normalize_axes(reduce_axes, x.ndim)
    stats_shape = np.shape(mean)
    mu = _as_broadcast("mean", _f64(mean), x.shape, axes)
    s = _as_broadcast(stat_input, _f64(stat), x.shape, axes)
    g = 1.0 if gamma is None else _as_broadcast("gamma", _f64(gamma), x.shape, axes)
    inv = s if stat_input == "inv_std" else 1.0 / np.sqrt(s + float(epsilon))
    m = float(np.prod([x.shape[a] for a in axes], dtype=np.float64))

    centred = x - mu
    diff_beta = dy.sum(axis=axes, keepdims=True)
    diff_gamma = inv * (dy * centred).sum(axis=axes, keepdims=True)
    result: dict[str, np.ndarray] = {}
    if "diff_src" in outputs:
        if statistics == "frozen":
            result["diff_src"] = g * inv * dy
        else:
            result["diff_src"] = g * inv * (dy - diff_beta / m - centred * inv * diff_gamma / m)
    if "diff_gamma" in outputs:
        result["diff_gamma"] = diff_gamma.reshape(stats_shape)
    if "diff_beta" in outputs:
        result["diff_beta"] = diff_beta.reshape(stats_shape)
    return {name: result[name] for name in outputs}


def batch_norm_forward(x, mean, variance, gamma=None, beta=None, *, epsilon: float,
                       reduce_axes: Sequence[int]) -> np.ndarray:
    """y = gamma * (x - mean) / sqrt(variance + epsilon) + beta, in float64 (stats [C] or keep-rank)."""
    x = _f64(x)
    axes = _normalize_axes(reduce_axes, x.ndim)
    mu = _as_broadcast("mean", _f64(mean), x.shape, axes)
    var = _as_broadcast("variance", _f64(variance), x.shape, axes)
    g = 1.0 if gamma is None else _as_broadcast("gamma", _f64(gamma), x.shape, axes)
    b = 0.0 if beta is None else _as_broadcast("beta", _f64(beta), x.shape, axes)
    return g * (x - mu) / np.sqrt(var + float(epsilon)) + b


def batch_statistics(x, *, reduce_axes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Batch mean and biased variance over ``reduce_axes``, as [C] vectors (float64, centred form)."""
    x = _f64(x)
    axes = _normalize_axes(reduce_axes, x.ndim)
    mean = x.mean(axis=axes, keepdims=True)
    variance = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    return mean.reshape(-1), variance.reshape(-1)


def batch_norm_internal(x, scale, bias, running_mean, running_var, *, epsilon: float, momentum: float,
                        channel_axis: int = 1, training: bool = True) -> dict[str, np.ndarray]:
    """onnxruntime-training's BatchNormInternal forward, in float64.

    Training mode: Y uses the batch statistics; running_mean = momentum * running_mean + (1 - momentum) *
    batch mean; running_var likewise with the *biased* batch variance; saved_mean is the batch mean and
    saved_inv_std = 1 / sqrt(biased batch variance + epsilon). Stats are [C] vectors.
    ``training=False``: Y normalized with running_mean/running_var, and only Y is returned.
    """
    x = _f64(x)
    if not -x.ndim <= channel_axis < x.ndim:
        raise ValueError(f"channel_axis {channel_axis} out of range for rank {x.ndim}")
    channel = channel_axis % x.ndim
    axes = tuple(a for a in range(x.ndim) if a != channel)
    if training:
        mean, variance = batch_statistics(x, reduce_axes=axes)
    else:
        mean, variance = _f64(running_mean).reshape(-1), _f64(running_var).reshape(-1)
    inv_std = 1.0 / np.sqrt(variance + float(epsilon))
    shape = broadcast_shape(x.shape, axes)
    y = (x - mean.reshape(shape)) * inv_std.reshape(shape) * _f64(scale).reshape(shape) + _f64(bias).reshape(shape)
    if not training:
        return {"Y": y}
    momentum = float(momentum)
    return {
        "Y": y,
        "running_mean": momentum * _f64(running_mean) + (1.0 - momentum) * mean,
        "running_var": momentum * _f64(running_var) + (1.0 - momentum) * variance,
        "saved_mean": mean,
        "saved_inv_std": inv_std,
    }
