"""Float64 NumPy references of onnxruntime-training's in-place update ops (``specs/com.microsoft/``):
InPlaceAccumulatorV2, AdamWOptimizer, SGDOptimizerV2. Oracles for the lowered graphs, written from the
spec documents' formulas; the hyper-parameters are taken as given (pass the f32-rounded attribute values
to match a graph whose attributes are stored as f32)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def in_place_accumulator(buffer, value, overwrite: bool | None = None) -> tuple[bool, np.ndarray]:
    """(updated, new buffer): ``value`` when ``overwrite`` (lazy_reset_grad), else ``buffer + value``."""
    new = _f64(value) if overwrite else _f64(buffer) + _f64(value)
    return True, new


def sgd_optimizer(lr: float, weights: Sequence, gradients: Sequence,
                  update_signal: bool | None = None) -> tuple[bool, list[np.ndarray]]:
    if len(weights) != len(gradients):
        raise ValueError(f"{len(weights)} weights but {len(gradients)} gradients")
    if update_signal is not None and not update_signal:
        return False, [_f64(w) for w in weights]
    return True, [_f64(w) - lr * _f64(g) for w, g in zip(weights, gradients, strict=True)]


def adamw_optimizer(lr: float, step: int, weights: Sequence, gradients: Sequence, momentums_1: Sequence,
                    momentums_2: Sequence, *, alpha: float, beta: float, epsilon: float, weight_decay: float,
                    adam_mode: int, correct_bias: int,
                    update_signal: bool | None = None) -> tuple[bool, list, list, list]:
    """(updated, weights, first moments, second moments) after one step. Every hyperparameter is given:
    the op's defaults are spec data (specs/com.microsoft/AdamWOptimizer.rst), not this module's."""
    lists = [list(map(_f64, s)) for s in (weights, gradients, momentums_1, momentums_2)]
    if len({len(s) for s in lists}) != 1:
        raise ValueError("weights, gradients and both moment sequences must have the same length")
    if update_signal is not None and not update_signal:
        return False, lists[0], lists[2], lists[3]
    c1 = 1.0 - alpha ** step if correct_bias else 1.0
    c2 = 1.0 - beta ** step if correct_bias else 1.0
    out_w, out_m1, out_m2 = [], [], []
    for w, g, m1, m2 in zip(*lists, strict=True):
        m1 = alpha * m1 + (1.0 - alpha) * g
        m2 = beta * m2 + (1.0 - beta) * g * g
        if adam_mode == 0:
            w = w - lr * weight_decay * w
            w = w - lr * m1 / (c1 * (np.sqrt(m2 / c2) + epsilon))
        elif adam_mode == 1:
            w = w - lr * np.sqrt(c2) / c1 * m1 / (np.sqrt(m2) + epsilon)
            w = w - lr * weight_decay * w
        else:
            raise ValueError(f"adam_mode {adam_mode} is not 0 or 1")
        out_w.append(w)
        out_m1.append(m1)
        out_m2.append(m2)
    return True, out_w, out_m1, out_m2
