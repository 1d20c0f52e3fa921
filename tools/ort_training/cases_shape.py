"""One-node cases of the shape and matmul family (FusedMatMul, GatherGrad, SliceGrad, ConcatTraining,
SplitTraining), recorded with onnxruntime-training 1.19.2:

    /work/ortt-venv/bin/python tools/ort_training/make_fixtures.py --family shape

Shapes as BERT/GPT graphs have them, tiny: FusedMatMul 3-D x 2-D (a Linear on a transposed input) and
4-D x 4-D (attention scores) with every one of the 16 flag combinations; GatherGrad as an embedding
(repeated ids) and as ``x[:, -1]`` (a scalar negative index on axis 1); SliceGrad as ``pos[:, :T]`` and with
negative, clamped and strided bounds. Not recorded: what the 1.19.2 kernels refuse (SliceGrad with a
negative step or f16, FusedMatMul f64, SplitTraining other than f32 or with an omitted output, which stops the
process).
"""

from __future__ import annotations

import itertools
import sys

import numpy as np

make_fixtures = sys.modules.get("make_fixtures") or sys.modules["__main__"]  # the recorder that imports us

SEED = 1919


def _i64(*values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _arranged_shape(shape: tuple[int, ...], trans_batch: int, trans: int) -> tuple[int, ...]:
    """The shape an operand must have so that, rearranged by the flags, it has ``shape``."""
    shape = list(shape)
    if trans:
        shape[-1], shape[-2] = shape[-2], shape[-1]
    if trans_batch:  # the operand's axis 0 ends up at rank - 2
        shape = [shape[-2], *shape[:-2], shape[-1]]
    return tuple(shape)


def fused_matmul(rng) -> None:
    record = make_fixtures.record
    for trans_a, trans_b, batch_a, batch_b in itertools.product((0, 1), repeat=4):
        # attention-like: rearranged A [2, 3, 4, 5] times rearranged B [2, 3, 5, 6]
        a = rng.standard_normal(_arranged_shape((2, 3, 4, 5), batch_a, trans_a)).astype(np.float32)
        b = rng.standard_normal(_arranged_shape((2, 3, 5, 6), batch_b, trans_b)).astype(np.float32)
        attrs = {"transA": trans_a, "transB": trans_b, "transBatchA": batch_a, "transBatchB": batch_b,
                 "alpha": 0.125 if (trans_a + trans_b + batch_a + batch_b) % 2 else 1.0}
        record("FusedMatMul", f"4d_tA{trans_a}_tB{trans_b}_tbA{batch_a}_tbB{batch_b}", {"A": a, "B": b}, ["Y"],
               attrs)
    for trans_a, trans_b in itertools.product((0, 1), repeat=2):
        a = rng.standard_normal(_arranged_shape((2, 4, 6), 0, trans_a)).astype(np.float32)
        b = rng.standard_normal(_arranged_shape((6, 5), 0, trans_b)).astype(np.float32)
        record("FusedMatMul", f"3d_2d_tA{trans_a}_tB{trans_b}", {"A": a, "B": b}, ["Y"],
               {"transA": trans_a, "transB": trans_b, "alpha": 2.0})
    a = rng.standard_normal((3, 1, 4, 5)).astype(np.float16)  # a broadcast batch axis, f16
    b = rng.standard_normal((2, 6, 5)).astype(np.float16)
    record("FusedMatMul", "broadcast_f16", {"A": a, "B": b}, ["Y"], {"transB": 1, "alpha": 0.5})


def gather_grad(rng) -> None:
    record = make_fixtures.record
    ids = rng.integers(0, 10, size=(2, 6)).astype(np.int64)
    ids[1, :3] = ids[0, 0]  # repeated ids accumulate
    record("GatherGrad", "embedding", {"shape": _i64(10, 4), "indices": ids,
                                      "dY": rng.standard_normal((2, 6, 4)).astype(np.float32)}, ["dX"], {"axis": 0})
    record("GatherGrad", "last_token_axis1", {"shape": _i64(2, 5, 4), "indices": np.array(-1, np.int64),
                                             "dY": rng.standard_normal((2, 4)).astype(np.float32)}, ["dX"],
           {"axis": 1})
    record("GatherGrad", "axis1_vector_negative", {"shape": _i64(3, 6, 2), "indices": _i64(-1, 2, 2, 0),
                                                  "dY": rng.standard_normal((3, 4, 2)).astype(np.float32)}, ["dX"],
           {"axis": 1})
    record("GatherGrad", "axis_minus1_int32", {"shape": _i64(3, 5), "indices": np.array([4, 0, 4], np.int32),
                                              "dY": rng.standard_normal((3, 3)).astype(np.float32)}, ["dX"],
           {"axis": -1})
    record("GatherGrad", "embedding_f16", {"shape": _i64(8, 3), "indices": _i64(1, 7, 1, 3),
                                          "dY": rng.standard_normal((4, 3)).astype(np.float16)}, ["dX"], {"axis": 0})
    record("GatherGrad", "embedding_f64", {"shape": _i64(8, 3), "indices": _i64(-8, 7, 7),
                                          "dY": rng.standard_normal((3, 3))}, ["dX"], {"axis": 0})


def slice_grad(rng) -> None:
    record = make_fixtures.record
    f32 = np.float32
    record("SliceGrad", "pos_prefix", {"dY": rng.standard_normal((1, 5, 4)).astype(f32), "shape": _i64(1, 8, 4),
                                      "starts": _i64(0), "ends": _i64(5), "axes": _i64(1), "steps": _i64(1)}, ["dX"])
    record("SliceGrad", "negative_clamped", {"dY": rng.standard_normal((4, 2)).astype(f32), "shape": _i64(6, 5),
                                            "starts": _i64(-100, -2), "ends": _i64(4, 1000)}, ["dX"])
    record("SliceGrad", "steps_negative_axes", {"dY": rng.standard_normal((2, 3, 2)).astype(f32),
                                               "shape": _i64(2, 7, 4), "starts": _i64(1, 0), "ends": _i64(7, 100),
                                               "axes": _i64(-2, 2), "steps": _i64(2, 3)}, ["dX"])
    record("SliceGrad", "omitted_axes_with_steps", {"dY": rng.standard_normal((2, 5)).astype(f32),
                                                   "shape": _i64(4, 5), "starts": _i64(0, 0), "ends": _i64(4, 5),
                                                   "axes": None, "steps": _i64(2, 1)}, ["dX"])
    record("SliceGrad", "int32_f64", {"dY": rng.standard_normal((3, 2)), "shape": _i64(3, 6),
                                     "starts": np.array([-3], np.int32), "ends": np.array([-1], np.int32),
                                     "axes": np.array([1], np.int32)}, ["dX"])


def concat_split(rng) -> None:
    record = make_fixtures.record
    f32 = np.float32
    record("ConcatTraining", "two_axis1_lengths", {"x0": rng.standard_normal((2, 3, 4)).astype(f32),
                                                   "x1": rng.standard_normal((2, 1, 4)).astype(f32)},
           ["y", "per_input_length"], {"axis": 1})
    record("ConcatTraining", "three_axis_minus1", {"x0": rng.standard_normal((2, 2)).astype(f32),
                                                   "x1": rng.standard_normal((2, 3)).astype(f32),
                                                   "x2": rng.standard_normal((2, 1)).astype(f32)}, ["y"], {"axis": -1})
    record("ConcatTraining", "f16_axis0", {"x0": rng.standard_normal((1, 3)).astype(np.float16),
                                           "x1": rng.standard_normal((2, 3)).astype(np.float16)},
           ["y", "per_input_length"], {"axis": 0})
    record("ConcatTraining", "int64", {"x0": rng.integers(-5, 5, (2, 2)), "x1": rng.integers(-5, 5, (2, 1))},
           ["y", "per_input_length"], {"axis": 1})
    record("SplitTraining", "two_axis1", {"input": rng.standard_normal((2, 4, 3)).astype(f32), "split": _i64(3, 1)},
           ["y0", "y1"], {"axis": 1})
    record("SplitTraining", "three_axis_minus1", {"input": rng.standard_normal((2, 6)).astype(f32),
                                                  "split": _i64(1, 2, 3)}, ["y0", "y1", "y2"], {"axis": -1})
    record("SplitTraining", "default_axis", {"input": rng.standard_normal((5, 2)).astype(f32),
                                                 "split": _i64(2, 3)}, ["y0", "y1"])


def make(rng) -> None:
    fused_matmul(rng)
    gather_grad(rng)
    slice_grad(rng)
    concat_split(rng)
