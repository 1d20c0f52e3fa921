"""Sliding windows as plain tensor ops, for the portable forms of ConvGrad, MaxPoolGrad and AveragePoolGrad.

``im2col`` reads, for every kernel offset, the strided view of the (padded) input that offset sees: one Pad with
constant pads and one strided Slice per offset. ``col2im`` is its adjoint: every offset's [.., O...] piece is
put back where it was read from and the pieces are added (see :func:`col2im`); the forward pads are cropped
off at the end. Exact (no interpolation, no data-dependent weights), so every conforming runtime runs it with
runtime tensors; the price is one output-sized Pad and Add per kernel offset.

Spatial axes are the trailing ones and must be static; leading axes (batch, channel, offset) may be dynamic.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lowering.emit_common import Emitter


@dataclass(frozen=True)
class Windows:
    """The window geometry over the static spatial axes: input sizes, kernel, strides, dilations, pads (all
    begins, then all ends) and the number of output positions per axis."""

    sizes: tuple[int, ...]
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads: tuple[int, ...]
    outputs: tuple[int, ...]

    @property
    def rank(self) -> int:
        return len(self.sizes)

    def offsets(self) -> list[tuple[int, ...]]:
        """Every kernel offset, row-major (the order of a flattened kernel)."""
        return list(itertools.product(*(range(k) for k in self.kernel)))

    def first(self, offset: tuple[int, ...], axis: int) -> int:
        """Where, in padded coordinates, ``offset`` reads for output position 0."""
        return offset[axis] * self.dilations[axis]

    def span(self, axis: int) -> int:
        """How many padded positions the strided view of one offset covers, first to last inclusive."""
        return (self.outputs[axis] - 1) * self.strides[axis] + 1

    def extent(self, axis: int) -> int:
        """The padded length: the input with its pads, or further when a last window (ceil_mode) reaches past."""
        padded = self.pads[axis] + self.sizes[axis] + self.pads[axis + self.rank]
        reach = self.first(tuple(k - 1 for k in self.kernel), axis) + self.span(axis)
        return max(padded, reach)

    def input_positions(self) -> np.ndarray:
        """[K, O...] int64: for each offset and output position, the row-major flat index of the input
        position the window reads there, or -1 where it reads padding."""
        k = self.rank
        result = np.empty((math.prod(self.kernel), *self.outputs), np.int64)
        grids = np.meshgrid(*(np.arange(o) for o in self.outputs), indexing="ij")
        for i, offset in enumerate(self.offsets()):
            coords = [grids[a] * self.strides[a] + self.first(offset, a) - self.pads[a] for a in range(k)]
            inside = np.ones(self.outputs, bool)
            for a in range(k):
                inside &= (coords[a] >= 0) & (coords[a] < self.sizes[a])
            flat = np.ravel_multi_index([np.clip(c, 0, s - 1) for c, s in zip(coords, self.sizes, strict=True)],
                                        self.sizes)
            result[i] = np.where(inside, flat, -1)
        return result


def unsqueeze(e: Emitter, name: str, axis: int) -> str:
    if e.b.opset < 13:
        return e.b.op1("Unsqueeze", [name], axes=[axis])
    return e.b.op1("Unsqueeze", [name, e.ints([axis], "axes")])


def _pad(e: Emitter, name: str, rank: int, begins: dict[int, int], ends: dict[int, int],
         output: str | None = None) -> str:
    """Zero padding of the given axes (constant pads: a static input of Pad, which every runtime takes); no
    op when there is nothing to pad and no ``output`` name to write."""
    if not any(begins.values()) and not any(ends.values()) and (output is None or name == output):
        return name
    if not any(begins.values()) and not any(ends.values()):
        return e.b.op1("Identity", [name], output)
    pads = [begins.get(a, 0) for a in range(rank)] + [ends.get(a, 0) for a in range(rank)]
    return e.b.op1("Pad", [name, e.ints(pads, "pads")], output)


def _slice(e: Emitter, name: str, starts: list[int], ends: list[int], axes: list[int],
           steps: list[int] | None = None, output: str | None = None) -> str:
    inputs = [name, e.ints(starts, "starts"), e.ints(ends, "ends"), e.ints(axes, "axes")]
    if steps is not None and any(s != 1 for s in steps):
        inputs.append(e.ints(steps, "steps"))
    return e.b.op1("Slice", inputs, output)


def im2col(e: Emitter, x: str, rank: int, w: Windows) -> str:
    """[lead..., D...] (``rank`` axes) -> [lead..., K, O...]: what each kernel offset reads per output."""
    lead = rank - w.rank
    spatial = list(range(lead, rank))
    padded = _pad(e, x, rank, {lead + a: w.pads[a] for a in range(w.rank)},
                  {lead + a: w.extent(a) - w.pads[a] - w.sizes[a] for a in range(w.rank)})
    pieces = []
    for offset in w.offsets():
        starts = [w.first(offset, a) for a in range(w.rank)]
        ends = [s + w.span(a) for a, s in enumerate(starts)]
        whole = not any(starts) and ends == [w.extent(a) for a in range(w.rank)] and set(w.strides) == {1}
        # a 1x1 window reads everything: no Slice (a no-op op is wasted work, and some runtimes
        # merge the names of its input and output)
        piece = padded if whole else _slice(e, padded, starts, ends, spatial, list(w.strides))
        pieces.append(unsqueeze(e, piece, lead))
    return pieces[0] if len(pieces) == 1 else e.b.op1("Concat", pieces, axis=lead)


def col2im(e: Emitter, piece: Callable[[int], str], rank: int, w: Windows, output: str | None = None) -> str:
    """The adjoint of :func:`im2col`: the sum, over kernel offsets, of each offset's values put back where that
    offset read them, cropped to the input.

    ``piece(i)`` emits the values of the i-th offset of :meth:`Windows.offsets`, [lead..., O...] (``rank``
    axes). The result is [lead..., D...], written to ``output`` when given.

    Output position o of an offset that starts at padded position ``f = q*s + r`` (stride s) lands at
    ``(o + q)*s + r``: the offsets with the same residues r are added on the output grid, each shifted by q
    (Pads of output-grid size, not input size), then the s residue classes of an axis are interleaved (stacked
    on a unit axis after it and merged by a Reshape) into padded coordinates.
    """
    out_lead = rank - w.rank
    k = w.rank
    offsets = w.offsets()
    steps = [max(w.first(offset, a) // w.strides[a] for offset in offsets) for a in range(k)]
    grid = [w.outputs[a] + steps[a] for a in range(k)]  # per residue class, in strides
    sizes = [grid[a] * w.strides[a] for a in range(k)]  # padded coordinates covered after the interleave
    keep = [(min(w.pads[a], sizes[a]), min(w.pads[a] + w.sizes[a], sizes[a])) for a in range(k)]
    tails = [w.sizes[a] - (keep[a][1] - keep[a][0]) for a in range(k)]  # input no window reaches: zeros
    crop = [a for a in range(k) if keep[a] != (0, sizes[a])]
    interleaved = any(s > 1 for s in w.strides)
    finished = not crop and not any(tails)  # the interleave or the last sum writes ``output``

    classes: dict[tuple[int, ...], list[int]] = {}
    for i, offset in enumerate(offsets):
        classes.setdefault(tuple(w.first(offset, a) % w.strides[a] for a in range(k)), []).append(i)
    sums: dict[tuple[int, ...], str] = {}
    for residue, members in classes.items():
        total = None
        for n, i in enumerate(members):
            last = finished and not interleaved and n == len(members) - 1
            shift = [w.first(offsets[i], a) // w.strides[a] for a in range(k)]
            placed = _pad(e, piece(i), out_lead + k, {out_lead + a: shift[a] for a in range(k)},
                          {out_lead + a: steps[a] - shift[a] for a in range(k)}, output if last and n == 0 else None)
            if total is None:
                total = placed
            else:
                total = e.b.op1("Add", [total, placed], output if last else None)
        sums[residue] = total

    if interleaved:
        zeros = None
        current = sums
        dims = list(grid)
        for a in reversed(range(k)):  # the last axis first: its residue is the last in every key
            s = w.strides[a]
            merged: dict[tuple[int, ...], str] = {}
            for prefix in itertools.product(*(range(w.strides[b]) for b in range(a))):
                parts = []
                for r in range(s):
                    part = current.get(prefix + (r,))
                    if part is None:  # no offset starts at this residue: zeros shaped like the others
                        if a != k - 1 or zeros is None:
                            zeros = _zeros_like(e, next(iter(current.values())))
                        part = zeros
                    parts.append(part)
                if s == 1:
                    merged[prefix] = parts[0]
                    continue
                axis = out_lead + a + 1
                stacked = e.b.op1("Concat", [unsqueeze(e, p, axis) for p in parts], axis=axis)
                dims[a] = grid[a] * s
                last = finished and a == min(b for b in range(k) if w.strides[b] > 1)
                merged[prefix] = e.b.op1("Reshape", [stacked, e.ints([0] * out_lead + dims, "interleaved")],
                                         output if last else None)
            current = merged
        total = current[()]
    if finished:
        return total
    if crop:
        total = _slice(e, total, [keep[a][0] for a in crop], [keep[a][1] for a in crop], [out_lead + a for a in crop],
                       output=None if any(tails) else output)
    if any(tails):
        total = _pad(e, total, out_lead + k, {}, {out_lead + a: tails[a] for a in range(k)}, output)
    return total


def _zeros_like(e: Emitter, name: str) -> str:
    return e.b.op1("Expand", [e.scalar(0.0, "zero"), e.b.op1("Shape", [name])])
