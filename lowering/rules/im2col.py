"""Sliding windows as plain tensor ops, for the portable forms of ConvGrad, MaxPoolGrad and AveragePoolGrad.

``im2col`` reads, for every kernel offset, the strided view of the (padded) input that offset sees: one Pad with
constant pads and one strided Slice per offset. ``col2im`` is its adjoint: every offset's [.., O...] piece is
spread back to the positions it was read from (zeros interleaved by a Pad on a unit axis and a Reshape, then
a Pad that places it) and the pieces are added; the forward pads are cropped off at the end. Exact (no
interpolation, no data-dependent weights), so every conforming runtime runs it with runtime tensors; the
price is one input-sized tensor per kernel offset.

Spatial axes are the trailing ones and must be static; leading axes (batch, channel, offset) may be dynamic.
"""

from __future__ import annotations

import itertools
import math
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


def _pad(e: Emitter, name: str, rank: int, begins: dict[int, int], ends: dict[int, int]) -> str:
    """Zero padding of the given axes (constant pads: a static input of Pad, which every runtime takes)."""
    if not any(begins.values()) and not any(ends.values()):
        return name
    pads = [begins.get(a, 0) for a in range(rank)] + [ends.get(a, 0) for a in range(rank)]
    return e.b.op1("Pad", [name, e.ints(pads, "pads")])


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


def col2im(e: Emitter, cols: str, rank: int, w: Windows, *, per_offset: bool, output: str | None = None) -> str:
    """The adjoint of :func:`im2col`: the sum, over kernel offsets, of each offset's values put back where that
    offset read them, cropped to the input.

    ``cols`` is [lead..., K, O...] (``rank`` axes) when ``per_offset``, else [lead..., O...]: the same values
    for every offset (AveragePoolGrad). The result is [lead..., D...],
    written to ``output`` when given."""
    lead = rank - w.rank
    # interleave stride-1 zeros after every position: [.., O, ..] -> [.., O, 1, ..] -> [.., O, s, ..] -> [.., O*s, ..]
    spread = cols
    dims = list(w.outputs)
    for a in range(w.rank):
        s = w.strides[a]
        if s == 1 or w.outputs[a] == 1:
            continue
        axis = lead + a
        spread = _pad(e, unsqueeze(e, spread, axis + 1), rank + 1, {}, {axis + 1: s - 1})
        dims[a] = w.outputs[a] * s
        spread = e.b.op1("Reshape", [spread, e.ints([0] * lead + dims, "spread_shape")])
    # the trailing zeros of the last position may reach past the padded extent: cut them where they do
    cut = {a: w.span(a) for a in range(w.rank) if dims[a] > w.span(a)}
    if cut:
        spread = _slice(e, spread, [0] * len(cut), list(cut.values()), [lead + a for a in cut])
        for a, length in cut.items():
            dims[a] = length
    out_lead = lead - 1 if per_offset else lead  # the offset axis goes
    crop = [a for a in range(w.rank) if w.pads[a] or w.extent(a) != w.sizes[a]]
    offsets = w.offsets()
    total = None
    for i, offset in enumerate(offsets):
        piece = spread
        if per_offset:
            piece = e.b.op1("Gather", [spread, e.ints(i, "offset")], axis=out_lead)
        begins = {out_lead + a: w.first(offset, a) for a in range(w.rank)}
        ends = {out_lead + a: w.extent(a) - w.first(offset, a) - dims[a] for a in range(w.rank)}
        placed = _pad(e, piece, out_lead + w.rank, begins, ends)
        last = i == len(offsets) - 1 and not crop
        if total is None:
            total = placed if not last or output is None else e.b.op1("Identity", [placed], output)
        else:
            total = e.b.op1("Add", [total, placed], output if last else None)
    if not crop:
        return total
    return _slice(e, total, [w.pads[a] for a in crop], [w.pads[a] + w.sizes[a] for a in crop],
                  [out_lead + a for a in crop], output=output)
