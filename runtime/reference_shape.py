"""Float64 NumPy references of the shape and matmul ops of onnxruntime-training's graphs (FusedMatMul,
GatherGrad, SliceGrad, ConcatTraining, SplitTraining) and of the forward ops the gradients belong to
(Gather, Slice: for finite-difference tests).

Written from the spec documents (``specs/com.microsoft/``), not from the lowering: floating inputs are cast
to float64 first; the gradients are written as explicit loops over indices, the forward ops with NumPy
indexing, so the two are independent.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def _ints(a) -> list[int]:
    return [int(v) for v in np.asarray(a).reshape(-1)]


def _batch_moved(x: np.ndarray) -> np.ndarray:
    """Axis 0 moved to position rank - 2 (transBatch)."""
    perm = [*range(1, x.ndim - 1), 0, x.ndim - 1]
    return x.transpose(perm)


def fused_matmul(a, b, *, alpha: float = 1.0, trans_a: int = 0, trans_b: int = 0, trans_batch_a: int = 0,
                 trans_batch_b: int = 0) -> np.ndarray:
    a, b = _f64(a), _f64(b)
    if trans_batch_a or trans_batch_b:
        if a.ndim != b.ndim or a.ndim < 3:
            raise ValueError(f"transBatchA/transBatchB need A and B of one rank >= 3, not {a.ndim} and {b.ndim}")
    if trans_batch_a:
        a = _batch_moved(a)
    if trans_batch_b:
        b = _batch_moved(b)
    if trans_a and a.ndim > 1:
        a = np.swapaxes(a, -1, -2)
    if trans_b and b.ndim > 1:
        b = np.swapaxes(b, -1, -2)
    return float(np.float32(alpha)) * np.matmul(a, b)


def _axis(axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise ValueError(f"axis {axis} is out of range for rank {rank}")
    return axis % rank


def gather(x, indices, axis: int = 0) -> np.ndarray:
    """ONNX Gather (negative indices count from the end)."""
    x = _f64(x)
    return np.take(x, np.asarray(indices), axis=_axis(axis, x.ndim))


def gather_grad(shape, indices, dy, axis: int = 0) -> np.ndarray:
    """dX: zeros of ``shape``; each slice of dY added at its index along ``axis`` (repeats accumulate)."""
    shape = tuple(_ints(shape))
    axis = _axis(axis, len(shape))
    idx = np.asarray(indices).astype(np.int64).reshape(-1)
    size = shape[axis]
    outer, inner = int(np.prod(shape[:axis])), int(np.prod(shape[axis + 1:]))
    dy3 = _f64(dy).reshape(outer, idx.size, inner)
    dx3 = np.zeros((outer, size, inner))
    for j, k in enumerate(idx):
        if not -size <= k < size:
            raise ValueError(f"index {k} is out of range for axis {axis} of size {size}")
        dx3[:, k % size, :] += dy3[:, j, :]
    return dx3.reshape(shape)


def _slice_positions(size: int, start: int, end: int, step: int) -> list[int]:
    """The positions ONNX Slice reads along one axis (its clamping rules)."""
    if step == 0:
        raise ValueError("a step is 0")
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    if step > 0:
        start, end = min(max(start, 0), size), min(max(end, 0), size)
        return list(range(start, end, step))
    start, end = min(max(start, 0), size - 1), min(max(end, -1), size - 1)
    return list(range(start, end, step))


def _slice_index(shape: Sequence[int], starts, ends, axes, steps) -> tuple:
    rank = len(shape)
    starts, ends = _ints(starts), _ints(ends)
    axes = list(range(len(starts))) if axes is None else [_axis(a, rank) for a in _ints(axes)]
    steps = [1] * len(starts) if steps is None else _ints(steps)
    index: list = [slice(None)] * rank
    for axis, start, end, step in zip(axes, starts, ends, steps, strict=True):
        index[axis] = _slice_positions(shape[axis], start, end, step)
    return tuple(index)


def slice_forward(x, starts, ends, axes=None, steps=None) -> np.ndarray:
    """ONNX Slice."""
    x = _f64(x)
    index = _slice_index(x.shape, starts, ends, axes, steps)
    for axis, positions in enumerate(index):  # one axis at a time: lists in several axes would pair up
        if not isinstance(positions, slice):
            x = np.take(x, np.asarray(positions, dtype=np.int64), axis=axis)
    return x


def slice_grad(dy, shape, starts, ends, axes=None, steps=None) -> np.ndarray:
    """dX: zeros of ``shape`` with dY written where the forward Slice read."""
    shape = tuple(_ints(shape))
    index = _slice_index(shape, starts, ends, axes, steps)
    dy = _f64(dy)
    dx = np.zeros(shape)
    grids = [np.arange(n) if isinstance(p, slice) else np.asarray(p, dtype=np.int64)
             for p, n in zip(index, shape, strict=True)]
    sliced = tuple(len(g) for g in grids)
    if dy.shape != sliced:  # onnxruntime's kernel copies dY's elements in order into the slice (a flattened dY)
        if dy.size != int(np.prod(sliced)):
            raise ValueError(f"dY has shape {list(dy.shape)} ({dy.size} elements); the slice has shape "
                             f"{list(sliced)}")
        dy = dy.reshape(sliced)
    dx[np.ix_(*grids)] = dy
    return dx


def concat_training(inputs: Sequence[np.ndarray], axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(the concatenation, the inputs' lengths along ``axis`` as int64); values keep their dtype."""
    arrays = [np.asarray(x) for x in inputs]
    axis = _axis(axis, arrays[0].ndim)
    return np.concatenate(arrays, axis=axis), np.array([x.shape[axis] for x in arrays], dtype=np.int64)


def split_training(x, split, axis: int = 0, count: int | None = None) -> list[np.ndarray]:
    """Consecutive pieces of ``x`` along ``axis`` with the lengths ``split``; an empty ``split`` cuts ``count``
    equal pieces (onnxruntime's kernel: as many as the node has outputs)."""
    x = np.asarray(x)
    axis = _axis(axis, x.ndim)
    lengths = _ints(split)
    if not lengths and count is not None:
        if count < 1 or x.shape[axis] % count:
            raise ValueError(f"split is empty and axis {axis} of size {x.shape[axis]} does not cut into {count} "
                             "equal pieces")
        lengths = [x.shape[axis] // count] * count
    if any(n < 0 for n in lengths) or sum(lengths) != x.shape[axis]:
        raise ValueError(f"split {lengths} does not cut axis {axis} of size {x.shape[axis]}")
    cuts = np.cumsum(lengths)[:-1]
    return list(np.split(x, cuts, axis=axis))
