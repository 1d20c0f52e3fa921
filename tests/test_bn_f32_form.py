"""BatchNormalizationGrad's f32 small form (issue 31, ``_Fast.emit_f32``): small static NCX f32 tensors with
onnxruntime-training's inv_std statistic take 12 kernels per node (11 without gamma) with the per-channel math
in f32, as accurate as the float64 formula allows; everything else keeps its form."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
from onnx import TensorProto

from lowering.builder import NodeBuilder
from lowering.rules.batch_norm_backward.emit import F32_SUMS_UPTO, SMALL_TENSOR, BatchNormBackwardPlan
from lowering.rules.batch_norm_backward.portable import emit_batch_norm_backward_portable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_bn_emit import check  # noqa: E402

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
CONSTANTS = ("Constant", "ConstantOfShape")  # folded by onnxruntime at load: no kernel runs


def _kernels(model) -> Counter:
    return Counter(n.op_type for n in model.graph.node if n.op_type not in CONSTANTS)


# the committed and held-out artifacts' layers (batch 4), a 3-d and a 5-d one, the recorded case's, the largest
# per-channel count taken, and rows from CONV_MIN_SPATIAL on (the Conv forms' sizes before)
@pytest.mark.parametrize("shape", [(4, 16, 4, 4), (4, 8, 8, 8), (4, 12, 2, 2), (4, 8, 16, 16), (4, 6, 11),
                                   (2, 4, 3, 2, 5), (3, 4, 5, 5), (16, 16, 8, 8)])
@pytest.mark.parametrize("offset", [0.0, 3.0])
def test_taken_with_twelve_kernels_and_the_reference_numbers(shape, offset):
    """No Cast (no f64 vectors), no Reshape: BatchNormalization 4, ReduceSum 4, Mul 3, Sub 1. Every output within
    3e-7 of its largest entry from the float64 formula (measured at most 2.7e-7, diff_beta of [4, 6, 11], where
    onnxruntime-training's kernel is off by the same)."""
    for seed in range(4):
        model, _, _ = check(shape, channel_axis=1, stat_input="inv_std", offset=offset, seed=seed, tol=3e-7)
    assert _kernels(model) == Counter({"BatchNormalization": 4, "ReduceSum": 4, "Mul": 3, "Sub": 1})


@pytest.mark.parametrize("outputs", [("diff_src",), ("diff_src", "diff_gamma"), ("diff_src", "diff_beta")])
@pytest.mark.parametrize("gamma", [True, False])
def test_optional_outputs_and_gamma(outputs, gamma):
    """The sums are computed whether or not their outputs are requested (diff_src reads them); without gamma, a is
    inv_std itself (no Mul)."""
    model, _, _ = check((4, 16, 4, 4), channel_axis=1, stat_input="inv_std", outputs=outputs, gamma=gamma,
                        tol=3e-7)
    assert sum(_kernels(model).values()) == (12 if gamma else 11)
    assert "Cast" not in _kernels(model)


@pytest.mark.parametrize("case", [
    {"shape": (4, 16, 4, 4), "stat_input": "variance"},  # the other dialects keep the f64 vectors
    {"shape": (32, 16, 7, 7), "stat_input": "inv_std"},  # 1,568 a channel > F32_SUMS_UPTO
    {"shape": (4, 64, 16, 16), "stat_input": "inv_std"},  # > SMALL_TENSOR elements
    {"shape": (4, 16, 4, 4), "stat_input": "inv_std", "io_type": F16},
    {"shape": (4, 16, 4, 4), "stat_input": "inv_std", "symbolic": True},
    {"shape": (4, 16, 4, 4), "stat_input": "inv_std", "statistics": "frozen"},
    {"shape": (4, 4, 4, 16), "stat_input": "inv_std", "channel_axis": 3},  # NXC
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_not_taken_elsewhere(case):
    case = dict(case)
    channel_axis = case.pop("channel_axis", 1)
    assert 32 * 7 * 7 > F32_SUMS_UPTO and 32 * 16 * 7 * 7 <= SMALL_TENSOR < 4 * 64 * 16 * 16  # the cases' premises
    model, _, _ = check(case.pop("shape"), channel_axis=channel_axis, **case)
    kernels = _kernels(model)
    assert kernels != Counter({"BatchNormalization": 4, "ReduceSum": 4, "Mul": 3, "Sub": 1})
    if case.get("statistics") != "frozen" and case.get("io_type", F32) == F32:
        assert "Cast" in kernels  # the f64 per-channel vectors


def test_portable_target_keeps_standard_ops():
    """The portable target has no BatchNormalization with computed inputs: the f64 form with Sub and Mul."""
    b = NodeBuilder(17, "bn")
    emit_batch_norm_backward_portable(b, BatchNormBackwardPlan(
        src="src", diff_dst="diff_dst", mean="mean", stat="stat", gamma="gamma", diff_src="dx", diff_gamma="dg",
        diff_beta="db", rank=4, channel_axis=1, reduce_axes=None, stats_keep_rank=False, statistics="batch",
        stat_input="inv_std", epsilon=1e-5, io_type=F32, stat_type=F32, src_shape=(4, 16, 4, 4)))
    ops = {n.op_type for n in b.nodes}
    assert "BatchNormalization" not in ops and "Cast" in ops
