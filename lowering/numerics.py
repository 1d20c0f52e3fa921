"""Comparing a lowered model's outputs with a float64 reference, and random inputs to run both on.

Tolerances: f32 (and f64) results must be within ``F32_REL`` of the output's scale (its largest magnitude);
f16/bf16 results are computed in f32 and rounded once, so each element may also be off by one unit in the
last place of the output type at its own magnitude.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper

from opdef.types import ONNX_ELEM_TYPE, TYPE_CLASSES, type_name
from runtime.session import np_dtype

F32_REL = 2e-6
# Relative size of one unit in the last place (the spacing of numbers near 1.0): bf16 has 8 significant bits.
_ULP = {TensorProto.FLOAT16: 2.0 ** -10, TensorProto.BFLOAT16: 2.0 ** -7}
# The element types compared with a tolerance and given random normal inputs: f32, f16, bf16, f64.
FLOAT_TYPES = frozenset(ONNX_ELEM_TYPE[name] for name in TYPE_CLASSES["real"])


@dataclass(frozen=True)
class Comparison:
    name: str
    elem_type: int
    max_abs: float  # largest |got - reference|
    max_rel: float  # max_abs relative to the output's scale (largest |reference|)
    ok: bool
    worst_ratio: float  # largest error / allowed error over all elements (<= 1 passes)

    def describe(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        shown = type_name(self.elem_type) if self.elem_type in FLOAT_TYPES else self.elem_type
        return (f"{self.name}: {shown} max abs err {self.max_abs:.3g}, "
                f"max rel err {self.max_rel:.3g} (error/tolerance {self.worst_ratio:.2g}) {verdict}")


def np_type(elem_type: int) -> np.dtype:
    if elem_type not in FLOAT_TYPES:
        raise ValueError(f"no float type for ONNX element type {elem_type}")
    return np_dtype(elem_type)


def compare(name: str, reference, got, elem_type: int, rel: float = F32_REL) -> Comparison:
    """``got`` (the lowered model's output) against the float64 ``reference``."""
    ref = np.asarray(reference, dtype=np.float64)
    out = np.asarray(got).astype(np.float64)
    if ref.shape != out.shape:
        return Comparison(name, elem_type, float("inf"), float("inf"), False, float("inf"))
    if ref.size == 0:
        return Comparison(name, elem_type, 0.0, 0.0, True, 0.0)
    err = np.abs(out - ref)
    scale = float(np.max(np.abs(ref)))
    allowed = rel * scale + _ULP.get(elem_type, 0.0) * np.abs(ref)
    allowed = np.maximum(allowed, np.finfo(np.float64).tiny)
    ratio = float(np.max(np.where(np.isfinite(err), err / allowed, np.inf)))
    max_abs = float(np.max(err))
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    return Comparison(name, elem_type, max_abs, max_rel, ratio <= 1.0, ratio)


def symbolic_sizes(names: Sequence[str], first: int = 2) -> dict[str, int]:
    """Small, distinct sizes for symbolic dims (distinct so that a mix-up of two dims shows)."""
    return {name: first + i for i, name in enumerate(sorted(set(names)))}


def random_feeds(inputs: Sequence[tuple[str, int, tuple]], rng: np.random.Generator,
                 positive: Callable[[str], bool] = lambda _: False, default_dim: int = 2) -> dict[str, np.ndarray]:
    """Random arrays for ``(name, elem_type, shape)`` inputs; symbolic dims (str) get consistent small sizes,
    unknown dims (None) ``default_dim``; inputs for which ``positive(name)`` holds (variances) are in [0.5, 2)."""
    sizes = symbolic_sizes([d for _, _, shape in inputs for d in shape if isinstance(d, str)])
    feeds = {}
    for name, elem_type, shape in inputs:
        dims = tuple(d if isinstance(d, int) else sizes.get(d, default_dim) if d is not None else default_dim
                     for d in shape)
        if elem_type == TensorProto.BOOL:
            feeds[name] = rng.random(dims) < 0.5
        elif elem_type in FLOAT_TYPES:
            values = rng.uniform(0.5, 2.0, dims) if positive(name) else rng.standard_normal(dims)
            feeds[name] = values.astype(np.float32).astype(np_dtype(elem_type))
        else:
            feeds[name] = rng.integers(0, 3, dims).astype(helper.tensor_dtype_to_np_dtype(elem_type))
    return feeds

