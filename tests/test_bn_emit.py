"""The batch-norm backward emitter: tiny models around it, run by onnxruntime, against the float64 formula."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import onnx
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from lowering.builder import NodeBuilder
from lowering.rules.batch_norm_backward.emit import BatchNormBackwardPlan, emit_batch_norm_backward
from runtime.reference import batch_norm_backward as reference
from runtime.session import run_model

F32, F16, BF16, F64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE
NP = {F32: np.float32, F16: np.float16, BF16: ml_dtypes.bfloat16, F64: np.float64}
# error bound relative to the largest magnitude of the reference output
TOL = {F32: 2e-5, F16: 2e-3, BF16: 1.6e-2, F64: 1e-12}
OUTPUTS = ("diff_src", "diff_gamma", "diff_beta")


def build(plan: BatchNormBackwardPlan, opset: int, input_shape, stats_shape) -> onnx.ModelProto:
    b = NodeBuilder(opset, "bn")
    emit_batch_norm_backward(b, plan)
    vi = helper.make_tensor_value_info
    inputs = [vi(plan.src, plan.io_type, input_shape), vi(plan.diff_dst, plan.io_type, input_shape),
              vi(plan.mean, plan.stat_type, stats_shape), vi(plan.stat, plan.stat_type, stats_shape)]
    if plan.gamma:
        inputs.append(vi(plan.gamma, plan.stat_type, stats_shape))
    outputs = []
    if plan.diff_src:
        outputs.append(vi(plan.diff_src, plan.io_type, input_shape))
    for name in (plan.diff_gamma, plan.diff_beta):
        if name:
            outputs.append(vi(name, plan.stat_type, stats_shape))
    graph = helper.make_graph(b.nodes, "bn", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def make_data(shape, channel_axis, reduce_axes, keep_rank, io_type, stat_type, *, offset=0.0, seed=0,
              stat_input="variance", epsilon=1e-5):
    rng = np.random.default_rng(seed)
    stats_shape = tuple(1 if a in reduce_axes else d for a, d in enumerate(shape)) if keep_rank \
        else (shape[channel_axis],)
    bshape = [1] * len(shape)
    bshape[channel_axis] = shape[channel_axis]
    centre = (offset + rng.normal(size=stats_shape)).reshape(stats_shape)
    std = rng.uniform(0.5, 2.0, size=stats_shape)
    x = rng.normal(size=shape) * std.reshape(bshape if not keep_rank else stats_shape) \
        + centre.reshape(bshape if not keep_rank else stats_shape)
    dy = rng.normal(size=shape) + 0.3 * (x - centre.reshape(bshape if not keep_rank else stats_shape))
    x = x.astype(NP[io_type])
    dy = dy.astype(NP[io_type])
    mean = x.astype(np.float64).mean(axis=tuple(reduce_axes), keepdims=True).reshape(stats_shape)
    var = x.astype(np.float64).var(axis=tuple(reduce_axes), keepdims=True).reshape(stats_shape)
    stat = 1.0 / np.sqrt(var + epsilon) if stat_input == "inv_std" else var
    gamma = rng.uniform(0.5, 1.5, size=stats_shape)
    return x, dy, mean.astype(NP[stat_type]), stat.astype(NP[stat_type]), gamma.astype(NP[stat_type])


def check(shape, *, channel_axis, io_type=F32, stat_type=F32, keep_rank=False, reduce_axes=None, gamma=True,
          outputs=OUTPUTS, statistics="batch", stat_input="variance", opset=17, offset=0.0,
          rank_known=True, symbolic=False, tol=None, seed=0, internal=False, symbolic_batch=False):
    rank = len(shape)
    axes = tuple(reduce_axes) if reduce_axes is not None else tuple(a for a in range(rank) if a != channel_axis)
    x, dy, mean, stat, g = make_data(shape, channel_axis, axes, keep_rank, io_type, stat_type, offset=offset,
                                     seed=seed, stat_input=stat_input)
    plan = BatchNormBackwardPlan(
        src="src", diff_dst="diff_dst", mean="mean", stat="stat", gamma="gamma" if gamma else None,
        diff_src="dx" if "diff_src" in outputs else None, diff_gamma="dg" if "diff_gamma" in outputs else None,
        diff_beta="db" if "diff_beta" in outputs else None,
        rank=rank if rank_known else None,
        channel_axis=channel_axis if rank_known or channel_axis != rank - 1 else None,
        reduce_axes=tuple(reduce_axes) if reduce_axes is not None else None, stats_keep_rank=keep_rank,
        statistics=statistics, stat_input=stat_input, epsilon=1e-5, io_type=io_type, stat_type=stat_type,
        src_shape=None if symbolic or not rank_known else ("n", *shape[1:]) if symbolic_batch else tuple(shape),
        channel_last=(channel_axis == rank - 1 and rank > 1 and not rank_known), diff_src_internal=internal)
    # onnx.checker wants graph inputs to have a shape: an unknown rank is the emitter's view only
    if symbolic or not rank_known:
        input_shape = [f"d{i}" for i in range(rank)]
    else:
        input_shape = ["n", *shape[1:]] if symbolic_batch else list(shape)
    stats_shape = [f"s{i}" for i in range(mean.ndim)] if symbolic or not rank_known else list(mean.shape)
    model = build(plan, opset, input_shape, stats_shape)
    feeds = {"src": x, "diff_dst": dy, "mean": mean, "stat": stat}
    if gamma:
        feeds["gamma"] = g
    got = run_model(model, feeds)
    want = reference(x, dy, mean, stat, g if gamma else None, epsilon=1e-5, reduce_axes=axes,
                     statistics=statistics, stat_input=stat_input, outputs=outputs)
    names = {"diff_src": "dx", "diff_gamma": "dg", "diff_beta": "db"}
    assert set(got) == {names[o] for o in outputs}
    for out in outputs:
        value = got[names[out]]
        expected_type = io_type if out == "diff_src" else stat_type
        assert value.dtype == np.dtype(NP[expected_type]), out
        assert value.shape == want[out].shape, out
        scale = np.abs(want[out]).max() + 1e-30
        err = np.abs(value.astype(np.float64) - want[out]).max() / scale
        limit = tol if tol is not None else TOL[io_type if out == "diff_src" else stat_type]
        assert err <= limit, f"{out}: relative error {err:.3g} > {limit}"
    return model, got, want


SHAPES = {2: (16, 5), 3: (4, 6, 7), 4: (3, 5, 4, 6), 5: (2, 4, 3, 2, 5)}


@pytest.mark.parametrize("rank", [2, 3, 4, 5])
@pytest.mark.parametrize("layout", ["NCX", "NXC"])
def test_layouts_f32(rank, layout):
    check(SHAPES[rank], channel_axis=1 if layout == "NCX" else rank - 1)


@pytest.mark.parametrize("io_type,stat_type", [(F16, F32), (BF16, F32), (BF16, BF16), (F64, F64)],
                         ids=["f16", "bf16", "bf16-bf16stats", "f64"])
@pytest.mark.parametrize("layout", ["NCX", "NXC"])
def test_dtypes(io_type, stat_type, layout):
    check((4, 8, 5, 6) if layout == "NCX" else (4, 5, 6, 8), channel_axis=1 if layout == "NCX" else 3,
          io_type=io_type, stat_type=stat_type)


@pytest.mark.parametrize("outputs", [("diff_src",), ("diff_gamma",), ("diff_beta",), ("diff_gamma", "diff_beta"),
                                     ("diff_src", "diff_beta"), ("diff_src", "diff_gamma")])
@pytest.mark.parametrize("gamma", [True, False])
@pytest.mark.parametrize("statistics", ["batch", "frozen"])
def test_optional_outputs_and_gamma(outputs, gamma, statistics):
    check((3, 4, 5, 2), channel_axis=1, outputs=outputs, gamma=gamma, statistics=statistics)


@pytest.mark.parametrize("layout", ["NCX", "NXC"])
@pytest.mark.parametrize("statistics", ["batch", "frozen"])
def test_inv_std(layout, statistics):
    check((4, 6, 5), channel_axis=1 if layout == "NCX" else 2, stat_input="inv_std", statistics=statistics)


@pytest.mark.parametrize("rank", range(1, 9))
def test_keep_rank_stats(rank):
    shape = (3, 4, 2, 3, 2, 2, 3, 2)[:rank]
    reduce_axes = tuple(a for a in range(rank) if a != 1) if rank > 1 else (0,)
    check(shape, channel_axis=min(1, rank - 1), keep_rank=True, reduce_axes=reduce_axes, statistics="frozen")
    check(shape, channel_axis=min(1, rank - 1), keep_rank=True, reduce_axes=reduce_axes, statistics="batch")


def test_keep_rank_several_kept_axes():
    # reduce over axes 0 and 2 only: axes 1 and 3 are both kept (per-(c, w) statistics)
    check((4, 3, 5, 2), channel_axis=1, keep_rank=True, reduce_axes=(0, 2))


@pytest.mark.parametrize("layout", ["NCX", "NXC"])
@pytest.mark.parametrize("rank_known", [True, False], ids=["symbolic-dims", "unknown-rank"])
def test_symbolic_dims(layout, rank_known):
    check((3, 4, 5, 6) if layout == "NCX" else (3, 5, 6, 4), channel_axis=1 if layout == "NCX" else 3,
          symbolic=True, rank_known=rank_known)


@pytest.mark.parametrize("opset", [12, 13, 17])
@pytest.mark.parametrize("layout", ["NCX", "NXC"])
def test_opsets(opset, layout):
    check((3, 4, 5) if layout == "NCX" else (3, 5, 4), channel_axis=1 if layout == "NCX" else 2, opset=opset)
    check((3, 4, 5), channel_axis=1, opset=opset, symbolic=True, rank_known=False)


@pytest.mark.parametrize("layout", ["NCX", "NXC"])
@pytest.mark.parametrize("io_type", [F32, BF16])
def test_ill_conditioned(layout, io_type):
    # |mean|/std = 1e4: sum(dy*x) - mean*sum(dy) would lose every digit of diff_gamma in f32
    shape = (16, 8, 12, 12) if layout == "NCX" else (16, 12, 12, 8)
    tol = 2e-5 if io_type == F32 else None
    check(shape, channel_axis=1 if layout == "NCX" else 3, offset=1e4, io_type=io_type, tol=tol)


def test_nothing_requested_emits_nothing():
    b = NodeBuilder(17, "bn")
    emit_batch_norm_backward(b, BatchNormBackwardPlan(
        "x", "dy", "m", "v", None, None, None, None, rank=4, channel_axis=1, reduce_axes=None,
        stats_keep_rank=False, statistics="batch", stat_input="variance", epsilon=1e-5, io_type=F32, stat_type=F32))
    assert b.nodes == []


@pytest.mark.parametrize("form", ["affine", "muladd"])
@pytest.mark.parametrize("layout", ["NCX", "NXC"])
@pytest.mark.parametrize("io_type", [F32, BF16])
def test_every_dx_formulation(monkeypatch, form, layout, io_type):
    import lowering.rules.batch_norm_backward.emit as bn_emit

    monkeypatch.setitem(bn_emit.DX_FORM, layout, form)
    check((4, 6, 5, 3) if layout == "NCX" else (4, 5, 3, 6), channel_axis=1 if layout == "NCX" else 3,
          io_type=io_type)
    check((4, 6, 5, 3) if layout == "NCX" else (4, 5, 3, 6), channel_axis=1 if layout == "NCX" else 3,
          io_type=io_type, offset=1e4, symbolic=True, tol=2e-5 if io_type == F32 else None)


@pytest.mark.parametrize("io_type,internal", [(F16, False), (BF16, False), (F32, True), (F32, False)],
                         ids=["f16", "bf16", "f32-read-by-nodes", "f32-graph-output"])
@pytest.mark.parametrize("shape", [(2, 3, 196), (3, 4, 14, 14), (2, 3, 2, 10, 10)], ids=["rank3", "rank4", "rank5"])
@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_depthwise_conv_form(io_type, internal, shape, offset):
    """NCX with >= CONV_MIN_SPATIAL elements per (sample, channel): diff_src's affine part is a depthwise Conv
    with bias, added to a*dy where the sum is no graph output (f16/bf16, or f32 diff_src that other nodes
    read), or to dy and then scaled by a where f32 diff_src is a graph output; no BatchNormalization.
    diff_src stays within 2e-6 of its scale (f32) or one unit in the last place of the float64 result
    rounded (f16/bf16), |mean|/std 1e4 too."""
    from lowering.numerics import compare
    from lowering.rules.batch_norm_backward.emit import CONV_MIN_SPATIAL

    assert int(np.prod(shape[2:])) >= CONV_MIN_SPATIAL
    model, got, want = check(shape, channel_axis=1, io_type=io_type, offset=offset, internal=internal,
                             tol=2e-6 if io_type == F32 else None)
    convs = [n for n in model.graph.node if n.op_type == "Conv" and n.attribute[0].i == shape[1]]
    assert len(convs) == 1
    assert not any(n.op_type == "BatchNormalization" for n in model.graph.node)
    conv_out = convs[0].output[0]
    add = next(n for n in model.graph.node if n.op_type == "Add" and conv_out in n.input)
    graph_output = io_type == F32 and not internal
    assert ("diff_dst" in add.input) == graph_output  # dy itself, or a*dy
    if graph_output:  # then the Mul by a writes the output
        assert any(n.op_type == "Mul" and add.output[0] in n.input and "dx" in n.output for n in model.graph.node)
    result = compare("diff_src", want["diff_src"], got["dx"], io_type)
    assert result.ok, result.describe()


@pytest.mark.parametrize("io_type,shape,channel_axis", [
    (BF16, (3, 4, 7, 7), 1),  # 49 < CONV_MIN_SPATIAL: BatchNormalization measured faster
    (BF16, (3, 14, 14, 4), 3),  # NXC
    (BF16, (2, 3, 2, 2, 2, 5, 5), 1),  # rank 7: Conv has at most 3 spatial axes in onnxruntime
])
def test_depthwise_conv_form_only_where_it_wins(io_type, shape, channel_axis):
    model, _, _ = check(shape, channel_axis=channel_axis, io_type=io_type)
    assert not any(n.op_type == "Conv" and n.attribute[0].i == shape[channel_axis] for n in model.graph.node)


def test_depthwise_conv_form_needs_static_channels_and_spatial_dims():
    model, _, _ = check((3, 4, 14, 14), channel_axis=1, io_type=BF16, symbolic=True)
    assert not any(n.op_type == "Conv" for n in model.graph.node)
    # a symbolic batch is fine (the Conv's group is C); the sum of products needs N too (its group is N*C)
    model, got, want = check((3, 4, 14, 14), channel_axis=1, io_type=BF16, symbolic_batch=True)
    assert [n.attribute[0].i for n in model.graph.node if n.op_type == "Conv"] == [4]


@pytest.mark.parametrize("io_type", [F32, BF16])
@pytest.mark.parametrize("shape,pieces", [((2, 3, 196), 1), ((3, 4, 14, 14), 1), ((2, 3, 2, 10, 10), 1),
                                          ((2, 3, 48, 48), 2), ((2, 2, 8, 100, 25), 10)])
@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_sum_of_products_as_a_conv(io_type, shape, pieces, offset):
    """NCX, static dims, >= 196 elements per (sample, channel): sum(dy*xc) is a Conv whose kernels are xc's
    rows (one group per row of at most DOT_ROW_MAX elements), exact like the Mul + ReduceSum it replaces."""
    from lowering.numerics import compare

    model, got, want = check(shape, channel_axis=1, io_type=io_type, offset=offset,
                             tol=2e-6 if io_type == F32 else None)
    rows = shape[0] * shape[1] * pieces
    dots = [n for n in model.graph.node if n.op_type == "Conv" and n.attribute[0].i == rows]
    assert len(dots) == 1
    for role, name, elem in (("diff_gamma", "dg", F32), ("diff_src", "dx", io_type)):
        result = compare(role, want[role], got[name], elem)
        assert result.ok, result.describe()


@pytest.mark.parametrize("shape,channel_axis,symbolic", [((3, 4, 7, 7), 1, False), ((3, 14, 14, 4), 3, False),
                                                         ((3, 4, 14, 14), 1, True)],
                         ids=["49-per-sample", "NXC", "symbolic"])
def test_sum_of_products_as_a_conv_only_where_it_pays(shape, channel_axis, symbolic):
    model, _, _ = check(shape, channel_axis=channel_axis, symbolic=symbolic)
    assert not any(n.op_type == "Conv" for n in model.graph.node)



def _f32_model(shape, channel_axis: int, symbolic: str) -> onnx.ModelProto:
    """All three outputs of an f32 batch-statistics node; dims "static", "batch" (the batch symbolic) or
    "all" symbolic."""
    plan = BatchNormBackwardPlan(
        "src", "diff_dst", "mean", "stat", "gamma", "dx", "dg", "db", rank=len(shape), channel_axis=channel_axis,
        reduce_axes=None, stats_keep_rank=False, statistics="batch", stat_input="variance", epsilon=1e-5,
        io_type=F32, stat_type=F32,
        src_shape={"static": shape, "batch": ("n", *shape[1:]), "all": None}[symbolic])
    dims = {"static": list(shape), "batch": ["n", *shape[1:]], "all": [f"d{i}" for i in range(len(shape))]}[symbolic]
    return build(plan, 17, dims, [shape[channel_axis]])


@pytest.mark.parametrize("layout,shape,symbolic", [
    *[(layout, shape, symbolic) for layout, shape in [("NCX", (16, 3, 160, 160)), ("NXC", (16, 160, 160, 3)),
                                                      ("NXC", (4, 8, 80, 80, 3)), ("NCX", (16, 3, 25600))]
      for symbolic in ("static", "batch")],
    ("NCX", (16, 3, 160, 160), "all"), ("NXC", (16, 160, 160, 3), "all"),
    ("NCX", (1, 3, 409600), "static"), ("NXC", (1, 409600, 3), "static"), ("NXC", (409600, 3), "static")])
def test_long_sums_stay_within_f32_tolerance(layout, shape, symbolic):
    """409,600 elements per channel, sums about 1/80 of the sum of magnitudes: a single MatMul over every
    NXC row drifted to 2.4x the 2e-6 tolerance (torch's own kernel is off by 1.1e-6 to 2e-6 in diff_gamma
    here); the sums in stages along the axes stay near 2e-7. Dims static, the batch symbolic (as exported
    models have it), or all symbolic (where a long run along one axis cannot be cut: rank 4 only); one axis
    of 409,600 (cut into rows of 2,048)."""
    from lowering.numerics import compare

    channel_axis = 1 if layout == "NCX" else len(shape) - 1
    axes = tuple(a for a in range(len(shape)) if a != channel_axis)
    rng = np.random.default_rng(3)
    x = (2 * rng.standard_normal(shape) + 0.5).astype(np.float32)
    dy = (rng.standard_normal(shape) + 0.01).astype(np.float32)
    mean = x.astype(np.float64).mean(axis=axes).astype(np.float32)
    var = x.astype(np.float64).var(axis=axes).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, shape[channel_axis]).astype(np.float32)
    got = run_model(_f32_model(shape, channel_axis, symbolic), {"src": x, "diff_dst": dy, "mean": mean,
                                                                "stat": var, "gamma": gamma})
    want = reference(x, dy, mean, var, gamma, epsilon=1e-5, reduce_axes=axes, statistics="batch",
                     stat_input="variance", outputs=OUTPUTS)
    for role, name in zip(OUTPUTS, ("dx", "dg", "db"), strict=True):
        result = compare(role, want[role], got[name], F32)
        assert result.ok, result.describe()


@pytest.mark.parametrize("internal", [False, True])
def test_f64_never_uses_conv(internal):
    """onnxruntime has no double Conv kernel: f64 keeps Mul + ReduceSum and BatchNormalization."""
    model, _, _ = check((2, 3, 48, 48), channel_axis=1, io_type=F64, stat_type=F64, internal=internal)
    assert not any(n.op_type == "Conv" for n in model.graph.node)


@pytest.mark.parametrize("opset", [12, 13, 18])
@pytest.mark.parametrize("layout", ["NCX", "NXC"])
def test_staged_sums_and_convs_at_every_opset(opset, layout):
    """32,768 elements per channel (staged sums) and 16,384 per sample (Conv forms): ReduceSum's axes as an
    attribute (opset 12) and as an input (13+)."""
    shape = (2, 3, 128, 128) if layout == "NCX" else (2, 128, 128, 3)
    model, _, _ = check(shape, channel_axis=1 if layout == "NCX" else 3, opset=opset, tol=2e-6)
    ops = {n.op_type for n in model.graph.node}
    assert ("Conv" in ops) == (layout == "NCX") and ("MatMul" in ops) == (layout == "NXC")
    if opset >= 13:  # bf16 Cast and Reshape came with opset 13
        check(shape, channel_axis=1 if layout == "NCX" else 3, opset=opset, io_type=BF16)


@pytest.mark.parametrize("layout,shape,symbolic", [
    ("NXC", (2, 14, 14, 0), "static"), ("NXC", (2, 14, 14, 0), "batch"), ("NXC", (2, 0, 0), "static"),
    ("NCX", (2, 0, 14, 14), "static"), ("NCX", (2, 0, 14, 14), "all")])
def test_no_channels(layout, shape, symbolic):
    """Zero channels: a model onnxruntime loads and runs, with empty outputs (the tuned forms' views would
    need a literal 0 in a Reshape target, and the count per channel is 0 / 0)."""
    channel_axis = 1 if layout == "NCX" else len(shape) - 1
    x = np.zeros(shape, np.float32)
    empty = np.zeros(0, np.float32)
    got = run_model(_f32_model(shape, channel_axis, symbolic), {"src": x, "diff_dst": x, "mean": empty,
                                                                "stat": empty, "gamma": empty})
    assert got["dx"].shape == shape and got["dg"].shape == (0,) and got["db"].shape == (0,)


@st.composite
def _small_cases(draw):
    layout = draw(st.sampled_from(["NCX", "NXC"]))
    rank = draw(st.integers(3 if layout == "NCX" else 2, 5))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(rank))
    return layout, shape, draw(st.sampled_from(["static", "batch", "all"])), draw(st.sampled_from([F32, BF16])), \
        draw(st.booleans())


@settings(derandomize=True)  # the same shapes every run: a tiny sum that cancels must not make CI flaky
@given(case=_small_cases())
def test_every_stage_and_conv_form_on_small_shapes(case):
    """With the thresholds shrunk (rows of 4, stages from 8 elements, Conv forms from 4 per sample), small
    random shapes take every branch of the staged sums, the axis cutting and both Conv forms; each result
    against the float64 formula (the tight f32 bound on long sums is test_long_sums_stay_within_f32_tolerance)."""
    from unittest import mock

    import lowering.rules.batch_norm_backward.emit as bn_emit

    layout, shape, symbolic, io_type, internal = case
    channel_axis = 1 if layout == "NCX" else len(shape) - 1
    # with a handful of elements per channel diff_src is ~0 (x's centred values and dy's nearly span the same
    # line) and an error relative to its own size says nothing
    assume(math.prod(shape) // shape[channel_axis] >= 8)
    with mock.patch.multiple(bn_emit, DOT_ROW_MAX=4, STAGED_SUMS_FROM=8, CONV_MIN_SPATIAL=4):
        check(shape, channel_axis=channel_axis, io_type=io_type, symbolic=symbolic == "all",
              symbolic_batch=symbolic == "batch", internal=internal)


@pytest.mark.parametrize("target", ["onnxruntime", "portable"])
@pytest.mark.parametrize("layout,shape", [("NCX", (32, 16, 7, 7)), ("NXC", (32, 7, 7, 16)), ("NCX", (32, 8, 14, 14)),
                                          ("NXC", (32, 14, 14, 8)), ("NCX", (32, 4, 28, 28)), ("NXC", (32, 28, 28, 4))])
def test_short_sums_stay_near_one_rounding(layout, shape, target):
    """The small ResNet-50 layers (batch 32, 7x7 to 28x28; fewer channels): against float64, diff_src within
    2e-7 of its scale and diff_gamma / diff_beta within 3e-7 in both targets (measured at most 1.4e-7 and
    2.8e-7). One f32 MatMul over all 1,568 / 6,272 NXC rows was off by 4e-7 / 8.8e-7 in diff_gamma and
    diff_beta, about 4x torch's own error; now only the first stage of a sum runs in f32 and the partials go
    on in f64 (emit.py, _Fast.channel_sum)."""
    from lowering import lower_model
    from lowering.bench import onednn_model

    channel_axis = 1 if layout == "NCX" else 3
    axes = tuple(a for a in range(4) if a != channel_axis)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, dtype=np.float32) * 2 + np.float32(0.5)
    dy = rng.standard_normal(shape, dtype=np.float32) + np.float32(0.01)
    mean = x.astype(np.float64).mean(axis=axes).astype(np.float32)
    var = x.astype(np.float64).var(axis=axes).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, shape[channel_axis]).astype(np.float32)
    model = lower_model(onednn_model(shape, layout, F32), target=target)
    got = run_model(model, {"src": x, "diff_dst": dy, "mean": mean, "variance": var, "gamma": gamma})
    want = reference(x, dy, mean, var, gamma, epsilon=1e-5, reduce_axes=axes, statistics="batch",
                     stat_input="variance", outputs=OUTPUTS)
    for role, bound in zip(OUTPUTS, (2e-7, 3e-7, 3e-7), strict=True):
        error = np.max(np.abs(got[f"{role}_0"].astype(np.float64) - want[role])) / np.max(np.abs(want[role]))
        assert error <= bound, f"{role}: {error:.3g} of the scale > {bound}"
