"""onnxruntime-training's softmax and normalization ops (issue 19): SoftmaxGrad, SoftmaxGrad_13, LogSoftmaxGrad,
LogSoftmaxGrad_13, LayerNormalizationGrad, SimplifiedLayerNormalizationGrad and the forward SimplifiedLayerNormalization
(default domain) that generate_artifacts writes for a hand-written RMSNorm.

Per op: the parsed schema's facts; one failing node per spec constraint (a one-line VerificationError naming node,
problem and C-number); the lowering, for both targets, against runtime.reference_normalization (onnx.checker
full_check, onnxruntime; f32, f16, bf16, f64; opsets 12, 17, 18; optional outputs; flat and kept statistics; a
symbolic batch); the portable forms in OpenVINO, tract and onnx.reference; the references against finite
differences of their forward ops; the evaluator (runtime.reference_eval); the recorded onnxruntime-training cases
(tools/ort_training/cases_normalization.py) within 1e-5 of their largest entry (f16 1e-3).
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from _one_node import close, numeric_gradient, one_node_model, verify
from _one_node import verification_error as _error
from _recorded import recorded_cases
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from test_portable import _run as run_in
from test_training_grads_recorded import assert_matches_recorded, load_case

from lowering.cli import main
from lowering.passes import lower_model
from lowering.rules import PORTABLE_OPS, TARGETS, rule_targets
from opdef.errors import LoweringError
from opdef.node import TensorType
from opdef.parse import parse_spec
from runtime import reference_eval
from runtime import reference_normalization as ref
from runtime.session import run_model

SPECS = Path(__file__).resolve().parent.parent / "specs"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "ort_training"
MS = "com.microsoft"
F32, F16, BF16, F64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE
NP = {F32: np.float32, F16: np.float16, BF16: ml_dtypes.bfloat16, F64: np.float64}
SOFTMAX_OPS = {  # op: (second input, log-softmax, pre-13 trailing sum, default axis)
    "SoftmaxGrad": ("Y", False, True, 1), "SoftmaxGrad_13": ("Y", False, False, -1),
    "LogSoftmaxGrad": ("X", True, True, 1), "LogSoftmaxGrad_13": ("X", True, False, -1)}
NORM_OPS = ("LayerNormalizationGrad", "SimplifiedLayerNormalizationGrad", "SimplifiedLayerNormalization")
RECORDED = recorded_cases(*SOFTMAX_OPS, *NORM_OPS)
vi = helper.make_tensor_value_info


def lowered(model, target="onnxruntime"):
    out = lower_model(model, target=target)
    onnx.checker.check_model(out, full_check=True)
    ops = {n.op_type for n in out.graph.node}
    assert all(n.domain in ("", "ai.onnx") for n in out.graph.node)
    assert not ops & {*SOFTMAX_OPS, *NORM_OPS}
    if target == "portable":
        assert ops <= PORTABLE_OPS, sorted(ops - PORTABLE_OPS)
    return out


# -- schemas ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", list(SOFTMAX_OPS))
def test_softmax_grad_schemas(op):
    second, log, _, default = SOFTMAX_OPS[op]
    s = parse_spec(SPECS / "com.microsoft" / f"{op}.rst")
    assert [(a.name, a.optional) for a in s.inputs] == [("dY", False), (second, False)]
    assert [(a.name, a.optional) for a in s.outputs] == [("dX", False)]
    (axis,) = s.attributes
    assert (axis.name, axis.type, axis.required, axis.default) == ("axis", "s64", False, default)
    assert len({a.type_var for a in (*s.inputs, *s.outputs)}) == 1
    types = {dict(c)["T"] for c in s.type_combinations}
    assert types == ({"f32", "f16", "f64"} if log else {"f32", "f16", "f64", "bf16"})
    assert [c.label for c in s.constraints] == ["C1", "C2"]


def test_layer_norm_grad_schemas():
    s = parse_spec(SPECS / "com.microsoft" / "LayerNormalizationGrad.rst")
    assert [(a.name, a.optional) for a in s.inputs] == [("Y_grad", False), ("X", False), ("scale", False),
                                                        ("mean", False), ("inv_std_var", False)]
    assert [(a.name, a.optional) for a in s.outputs] == [("X_grad", True), ("scale_grad", True), ("bias_grad", True)]
    assert {a.name: a.default for a in s.attributes} == {"axis": -1, "epsilon": 1e-5, "stash_type": 1}
    t = {a.name: a.type_var for a in (*s.inputs, *s.outputs)}
    assert t["Y_grad"] == t["X"] == t["scale"] == t["X_grad"] == t["bias_grad"] != t["mean"] == t["inv_std_var"]
    combos = {(dict(c)[t["X"]], dict(c)[t["mean"]]) for c in s.type_combinations}
    assert combos == {("f32", "f32"), ("f16", "f32"), ("bf16", "f32"), ("bf16", "bf16"), ("f64", "f32")}
    assert [c.label for c in s.constraints] == ["C1", "C2", "C3", "C4"]
    s = parse_spec(SPECS / "com.microsoft" / "SimplifiedLayerNormalizationGrad.rst")
    assert [a.name for a in s.inputs] == ["Y_grad", "X", "scale", "inv_std_var"]
    assert [(a.name, a.optional) for a in s.outputs] == [("X_grad", True), ("scale_grad", True)]
    assert {dict(c)["T2"] for c in s.type_combinations} == {"f32"}


def test_simplified_layer_norm_schema():
    s = parse_spec(SPECS / "onnx.training" / "SimplifiedLayerNormalization.rst")
    assert [(a.name, a.optional) for a in s.inputs] == [("X", False), ("scale", False)]
    assert [(a.name, a.optional) for a in s.outputs] == [("Y", False), ("inv_std_var", True)]
    assert {a.name: a.default for a in s.attributes} == {"axis": -1, "epsilon": 1e-5, "stash_type": 1}
    assert {(dict(c)["T1"], dict(c)["T2"]) for c in s.type_combinations} == {
        ("f32", "f32"), ("f16", "f32"), ("bf16", "f32"), ("f64", "f32")}
    assert [c.label for c in s.constraints] == ["C1", "C2", "C3", "C4", "C5"]


def test_every_rule_emits_for_both_targets():
    for key in ("softmax_grad", "layer_norm_grad", "simplified_layer_norm"):
        assert rule_targets(key) == TARGETS


# -- constraints: one failing node each ----------------------------------------------------------------------

@pytest.mark.parametrize("op", list(SOFTMAX_OPS))
def test_error_softmax_grad_c1_shapes_differ(op):
    node = helper.make_node(op, ["dy", "y"], ["dx"], domain=MS, name="sg")
    message = _error(node, {"dy": (F32, (2, 3, 4)), "y": (F32, (2, 4, 3))})
    assert f"{SOFTMAX_OPS[op][0]} has shape [2,4,3]; expected [2,3,4]" in message and "[C1]" in message


@pytest.mark.parametrize("op, axis", [("SoftmaxGrad", 3), ("SoftmaxGrad_13", -4), ("LogSoftmaxGrad", -4),
                                      ("LogSoftmaxGrad_13", 3)])
def test_error_softmax_grad_c2_axis_out_of_range(op, axis):
    node = helper.make_node(op, ["dy", "y"], ["dx"], domain=MS, name="sg", axis=axis)
    message = _error(node, {"dy": (F32, (2, 3, 4)), "y": (F32, (2, 3, 4))})
    assert f"axis is {axis}; expected a value in [-3, 2] for rank 3" in message and "[C2]" in message


def test_error_log_softmax_grad_has_no_bf16():
    node = helper.make_node("LogSoftmaxGrad_13", ["dy", "x"], ["dx"], domain=MS, name="lsg")
    message = _error(node, {"dy": (BF16, (2, 3)), "x": (BF16, (2, 3))})
    assert "bf16" in message


def _ln(name="lg", outputs=("dx", "dw", "db"), **attrs):
    return helper.make_node("LayerNormalizationGrad", ["dy", "x", "w", "m", "r"], list(outputs), domain=MS, name=name,
                            **attrs)


def _ln_types(x=(2, 3, 8), dy=None, w=(8,), m=(2, 3, 1), r=None, elem=F32, stats=F32):
    return {"dy": (elem, dy or x), "x": (elem, x), "w": (elem, w), "m": (stats, m), "r": (stats, r or m)}


def test_error_layer_norm_grad_c1_shapes_differ():
    message = _error(_ln(), _ln_types(dy=(2, 3, 7)))
    assert "Y_grad has shape [2,3,7]; expected [2,3,8]" in message and "[C1]" in message


def test_error_layer_norm_grad_c2_axis():
    message = _error(_ln(axis=3), _ln_types())
    assert "axis is 3; expected a value in [-3, 2] for rank 3" in message and "[C2]" in message


def test_error_layer_norm_grad_c3_scale_shape():
    message = _error(_ln(axis=1), _ln_types(w=(8,), m=(2, 1, 1)))
    assert "scale has shape [8]; expected [3,8] (the dims of X [2,3,8] from axis 1 on)" in message
    assert "[C3]" in message


@pytest.mark.parametrize("m, r, bad", [((2, 3, 8), (2, 3, 1), "mean has shape [2,3,8]"),
                                       ((2, 3, 1), (3, 2), "inv_std_var has shape [3,2]"),
                                       ((2, 3, 1), (2,), "inv_std_var has shape [2]")])
def test_error_layer_norm_grad_c4_statistics_shape(m, r, bad):
    message = _error(_ln(), _ln_types(m=m, r=r))
    assert bad in message and "expected [2,3] or [2,3,1]" in message and "[C4]" in message


def test_error_layer_norm_grad_statistics_in_f64():
    message = _error(_ln(), _ln_types(elem=F64, stats=F64))
    assert "f64" in message


def test_layer_norm_grad_infers_output_shapes():
    inference = verify(_ln(axis=1), _ln_types(w=(3, 8), m=(2,)))
    assert [t.shape for t in inference.output_types] == [(2, 3, 8), (3, 8), (3, 8)]
    inference = verify(_ln(outputs=("", "dw")), _ln_types(x=("N", 3, 8), m=("N", 3, 1)))
    assert inference.output_types[1].shape == (8,)


def test_error_simplified_layer_norm_grad_c4_statistics_shape():
    node = helper.make_node("SimplifiedLayerNormalizationGrad", ["dy", "x", "w", "r"], ["dx", "dw"], domain=MS,
                            name="rg")
    message = _error(node, {"dy": (F32, (2, 3, 8)), "x": (F32, (2, 3, 8)), "w": (F32, (8,)), "r": (F32, (2, 1, 1))})
    assert "inv_std_var has shape [2,1,1]; expected [2,3] or [2,3,1]" in message and "[C4]" in message


def _rms(name="rms", outputs=("y", "r"), **attrs):
    return helper.make_node("SimplifiedLayerNormalization", ["x", "w"], list(outputs), name=name, **attrs)


def test_simplified_layer_norm_infers_statistics_shape():
    inference = verify(_rms(axis=1), {"x": (F16, ("N", 3, 8)), "w": (F16, (3, 8))})
    assert inference.output_types == (TensorType(F16, ("N", 3, 8)), TensorType(F32, ("N", 1, 1)))


def test_error_simplified_layer_norm_c2_axis():
    message = _error(_rms(axis=-4), {"x": (F32, (2, 3, 8)), "w": (F32, (8,))})
    assert "axis is -4" in message and "[C2]" in message


def test_error_simplified_layer_norm_c3_scale_shape():
    message = _error(_rms(), {"x": (F32, (2, 3, 8)), "w": (F32, (3, 8))})
    assert "scale has shape [3,8]; expected [8]" in message and "[C3]" in message


@pytest.mark.parametrize("epsilon", [0.0, -1e-5, float("inf")])
def test_error_simplified_layer_norm_c5_epsilon(epsilon):
    message = _error(_rms(epsilon=epsilon), {"x": (F32, (2, 8)), "w": (F32, (8,))})
    assert "epsilon is" in message and "[C5]" in message


# -- lowering against the float64 reference -------------------------------------------------------------------

def softmax_case(op, shape=(2, 3, 4), axis=None, elem=F32, opset=17, seed=0):
    """(model, feeds, {output: float64 expected}, elem): Y a real forward output for the op's semantics."""
    second, log, trailing, default = SOFTMAX_OPS[op]
    rng = np.random.default_rng(seed)
    forward = ref.log_softmax if log else ref.softmax
    y = forward(rng.standard_normal(shape) * 2, default if axis is None else axis, trailing).astype(NP[elem])
    dy = rng.standard_normal(shape).astype(NP[elem])
    grad = ref.log_softmax_grad if log else ref.softmax_grad
    attrs = {} if axis is None else {"axis": axis}
    node = helper.make_node(op, ["dy", "y"], ["dx"], domain=MS, name="sg", **attrs)
    model = one_node_model(node, [("dy", elem, list(shape)), ("y", elem, list(shape))],
                           [("dx", elem, list(shape))], opset)
    return model, {"dy": dy, "y": y}, {"dx": grad(dy, y, default if axis is None else axis, trailing)}, elem


SOFTMAX_CASES = [  # (op, shape, axis, elem, opset)
    *[(op, (2, 3, 4), None, F32, 17) for op in SOFTMAX_OPS],
    *[(op, (2, 3, 4), 0, F32, 12) for op in SOFTMAX_OPS],
    *[(op, (2, 3, 4), -2, F16, 17) for op in SOFTMAX_OPS],
    *[(op, (3, 5), None, F64, 13) for op in SOFTMAX_OPS],
    ("SoftmaxGrad", (2, 2, 3, 3), 2, BF16, 17), ("SoftmaxGrad_13", (2, 2, 3, 3), 1, BF16, 17),
    ("SoftmaxGrad_13", (7,), None, F32, 12), ("LogSoftmaxGrad", (7,), 0, F32, 18),
]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("op, shape, axis, elem, opset", SOFTMAX_CASES)
def test_softmax_grad_lowering(op, shape, axis, elem, opset, target):
    model, feeds, want, elem = softmax_case(op, shape, axis, elem, opset)
    close(run_model(lowered(model, target), feeds)["dx"], want["dx"], elem, op)


def test_pre13_and_13_differ_on_the_same_inputs_and_axis():
    """The pre-13 ops sum over every axis from ``axis`` on; the _13 ops over ``axis`` alone."""
    for log in (False, True):
        old, new = ("LogSoftmaxGrad", "LogSoftmaxGrad_13") if log else ("SoftmaxGrad", "SoftmaxGrad_13")
        model_old, feeds, _, _ = softmax_case(old, axis=1)
        model_new = softmax_case(new, axis=1)[0]
        got_old = run_model(lowered(model_old), feeds)["dx"]
        got_new = run_model(lowered(model_new), feeds)["dx"]
        grad = ref.log_softmax_grad if log else ref.softmax_grad
        close(got_old, grad(feeds["dy"], feeds["y"], 1, trailing=True), F32, old)
        close(got_new, grad(feeds["dy"], feeds["y"], 1, trailing=False), F32, new)
        assert np.max(np.abs(got_old - got_new)) > 0.1


def layer_norm_case(shape=(2, 3, 8), axis=-1, elem=F32, stats=F32, flat_stats=False, outputs=None,
                    opset=17, simplified=False, offset=0.0, batch=None, seed=1):
    outputs = outputs or (("dx", "dw") if simplified else ("dx", "dw", "db"))
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) + offset).astype(NP[elem])
    a = axis % len(shape)
    scale = (rng.standard_normal(shape[a:]) + 1).astype(NP[elem])
    dy = rng.standard_normal(shape).astype(NP[elem])
    if simplified:
        _, inv = ref.simplified_layer_norm(x, scale, axis)
        mean = None
    else:
        _, mean, inv = ref.layer_norm(x, scale, None, axis)
    row_shape = shape[:a] if flat_stats else shape[:a] + (1,) * (len(shape) - a)
    inv = inv.reshape(row_shape).astype(NP[stats])
    feeds = {"dy": dy, "x": x, "w": scale, "r": inv}
    if mean is not None:
        feeds["m"] = mean.reshape(row_shape).astype(NP[stats])
    lead = [batch or shape[0], *shape[1:]]
    stat_dims = [batch or row_shape[0], *row_shape[1:]] if a > 0 else list(row_shape)
    names = ["dy", "x", "w", "r"] if simplified else ["dy", "x", "w", "m", "r"]
    op = "SimplifiedLayerNormalizationGrad" if simplified else "LayerNormalizationGrad"
    node = helper.make_node(op, names, list(outputs), domain=MS, name="lg", axis=axis)
    types = {"dy": (elem, lead), "x": (elem, lead), "w": (elem, list(shape[a:])), "m": (stats, stat_dims),
             "r": (stats, stat_dims)}
    out_types = {"dx": (elem, lead), "dw": (elem, list(shape[a:])), "db": (elem, list(shape[a:]))}
    model = one_node_model(node, [(n, *types[n]) for n in names], [(n, *out_types[n]) for n in outputs if n], opset)
    if simplified:
        dx, dw = ref.simplified_layer_norm_grad(dy, x, scale, inv, axis)
        want = {"dx": dx, "dw": dw}
    else:
        dx, dw, db = ref.layer_norm_grad(dy, x, scale, feeds["m"], inv, axis)
        want = {"dx": dx, "dw": dw, "db": db}
    return model, feeds, {k: v for k, v in want.items() if k in outputs}


LAYER_NORM_CASES = [  # keyword arguments of layer_norm_case
    {}, {"axis": 1}, {"axis": 0, "shape": (4, 6)}, {"flat_stats": True}, {"axis": 1, "flat_stats": True},
    {"elem": F16}, {"elem": BF16}, {"elem": BF16, "stats": BF16}, {"elem": F64}, {"opset": 12}, {"opset": 18},
    {"outputs": ("dx",)}, {"outputs": ("", "dw", "db")}, {"outputs": ("dx", "", "db")}, {"shape": (5, 8)},
    {"simplified": True}, {"simplified": True, "axis": 1}, {"simplified": True, "elem": F16, "opset": 12},
    {"simplified": True, "elem": F64, "flat_stats": True}, {"simplified": True, "outputs": ("", "dw")},
]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kwargs", LAYER_NORM_CASES, ids=lambda k: "-".join(f"{a}={v}" for a, v in k.items()) or "base")
def test_layer_norm_grad_lowering(kwargs, target):
    model, feeds, want = layer_norm_case(**kwargs)
    elem = kwargs.get("elem", F32)
    got = run_model(lowered(model, target), feeds)
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == NP[elem]
        close(got[name], value, elem, name)


def test_layer_norm_grad_rows_far_from_zero_lose_no_digits():
    """Rows whose mean is 1e4 times their spread: the centred form stays at f32 rounding (DESIGN.md section 5)."""
    model, feeds, want = layer_norm_case(shape=(4, 64), offset=1e4)
    got = run_model(lowered(model), feeds)
    for name in want:
        close(got[name], want[name], F32, name)


@pytest.mark.parametrize("flat_stats", [False, True])
def test_layer_norm_grad_symbolic_batch(flat_stats):
    model, feeds, want = layer_norm_case(shape=(3, 4, 8), batch="N", flat_stats=flat_stats)
    got = run_model(lowered(model), feeds)
    for name in want:
        close(got[name], want[name], F32, name)


@pytest.mark.parametrize("target", TARGETS)
def test_simplified_layer_norm_symbolic_row_length(target):
    """Symbolic normalized dims: the mean square's row length is a run-time value."""
    model = one_node_model(_rms(axis=1, epsilon=1e-6), [("x", F32, ("N", "S", "H")), ("w", F32, ("S", "H"))],
                           [("y", F32, ("N", "S", "H")), ("r", F32, ("N", 1, 1))])
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((2, 3, 8)).astype(np.float32), rng.standard_normal((3, 8)).astype(np.float32)
    got = run_model(lowered(model, target), {"x": x, "w": w})
    y, r = ref.simplified_layer_norm(x, w, 1, float(np.float32(1e-6)))
    close(got["y"], y, F32, "y")
    close(got["r"], r, F32, "r")


def test_unknown_rank_is_a_lowering_error_naming_the_node():
    for op in ("SoftmaxGrad", "LayerNormalizationGrad"):
        names = ["dy", "y"] if op == "SoftmaxGrad" else ["dy", "x", "w", "m", "r"]
        node = helper.make_node(op, names, ["dx"], domain=MS, name="unranked")
        model = one_node_model(node, [(n, F32, None) for n in names], [("dx", F32, None)])
        with pytest.raises(LoweringError, match=f"{op} 'unranked': the rank of X must be known"):
            lower_model(model)


def test_softmax_grad_13_needs_no_rank():
    node = helper.make_node("SoftmaxGrad_13", ["dy", "y"], ["dx"], domain=MS, name="s")
    model = one_node_model(node, [("dy", F32, None), ("y", F32, None)], [("dx", F32, None)])
    _, feeds, want, _ = softmax_case("SoftmaxGrad_13")
    # no onnx.checker here: its full check wants every graph input's shape, ranked
    close(run_model(lower_model(model), feeds)["dx"], want["dx"], F32)


def rms_case(shape=(2, 3, 8), axis=-1, elem=F32, outputs=("y", "r"), opset=17, epsilon=1e-6, seed=2):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(NP[elem])
    scale = (rng.standard_normal(shape[axis % len(shape):]) + 1).astype(NP[elem])
    a = axis % len(shape)
    node = _rms(outputs=outputs, axis=axis, epsilon=epsilon)
    model = one_node_model(node, [("x", elem, list(shape)), ("w", elem, list(shape[a:]))],
                           [("y", elem, list(shape)), ("r", F32, [*shape[:a], *[1] * (len(shape) - a)])][:len(outputs)],
                           opset)
    y, inv = ref.simplified_layer_norm(x, scale, axis, epsilon)
    return model, {"x": x, "w": scale}, {"y": y, "r": inv}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kwargs", [{}, {"axis": 1}, {"elem": F16}, {"elem": BF16, "opset": 18}, {"elem": F64},
                                    {"outputs": ("y",), "opset": 12}, {"shape": (6,), "axis": 0}],
                         ids=lambda k: "-".join(f"{a}={v}" for a, v in k.items()) or "base")
def test_simplified_layer_norm_lowering(kwargs, target):
    model, feeds, want = rms_case(**kwargs)
    elem = kwargs.get("elem", F32)
    got = run_model(lowered(model, target), feeds)
    close(got["y"], want["y"], elem, "Y")
    if "r" in got:
        assert got["r"].dtype == np.float32
        close(got["r"], want["r"], F32 if elem != F64 else F32, "inv_std_var")


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_lowerings_over_random_shapes_and_axes(data):
    rank = data.draw(st.integers(1, 4), label="rank")
    shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank), label="shape"))
    axis = data.draw(st.integers(-rank, rank - 1), label="axis")
    target = data.draw(st.sampled_from(TARGETS), label="target")
    op = data.draw(st.sampled_from(list(SOFTMAX_OPS)), label="op")
    model, feeds, want, _ = softmax_case(op, shape, axis)
    close(run_model(lowered(model, target), feeds)["dx"], want["dx"], F32, op)
    simplified, flat = data.draw(st.booleans(), label="simplified"), data.draw(st.booleans(), label="flat stats")
    model, feeds, want = layer_norm_case(shape=shape, axis=axis, simplified=simplified, flat_stats=flat)
    got = run_model(lowered(model, target), feeds)
    # with a row of 1 or 2 elements X_grad is a difference of terms of size r * |dY * scale| (M = 2: x_hat = +-1
    # up to epsilon, so X_grad is O(epsilon) of them)
    terms = float(np.max(np.abs(feeds["r"]))) * float(np.max(np.abs(feeds["dy"]))) * float(np.max(np.abs(feeds["w"])))
    for name, value in want.items():
        close(got[name], value, F32, name, terms if name == "dx" else 0.0)


# -- the portable forms in the other runtimes ------------------------------------------------------------------

PORTABLE_CASES = {
    "softmax_grad": lambda: softmax_case("SoftmaxGrad", axis=1)[:3],
    "log_softmax_grad_13": lambda: softmax_case("LogSoftmaxGrad_13", axis=-2)[:3],
    "layer_norm_grad": lambda: layer_norm_case(axis=1),
    "layer_norm_grad_flat_stats_f16": lambda: layer_norm_case(elem=F16, flat_stats=True),
    "simplified_layer_norm_grad": lambda: layer_norm_case(simplified=True),
    "simplified_layer_norm": lambda: rms_case(),
}


@pytest.mark.parametrize("runtime", ["openvino", "tract", "reference"])
@pytest.mark.parametrize("name", list(PORTABLE_CASES))
def test_portable_forms_run_in_other_runtimes(name, runtime, tmp_path):
    model, feeds, want = PORTABLE_CASES[name]()
    elem = F16 if "f16" in name else F32
    got = run_in(runtime, lowered(model, "portable"), feeds, tmp_path)
    for output, value in want.items():
        close(got[output], value, elem, f"{runtime} {output}")


# -- the references against finite differences of their forward ops --------------------------------------------

@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("axis, trailing", [(1, True), (1, False), (-1, False), (0, True)])
def test_softmax_references_match_finite_differences(log, axis, trailing):
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    forward = ref.log_softmax if log else ref.softmax
    y = forward(x, axis, trailing)
    grad = (ref.log_softmax_grad if log else ref.softmax_grad)(dy, y, axis, trailing)
    for v, numeric in numeric_gradient(lambda z: np.sum(dy * forward(z, axis, trailing)), x, direction_count=4):
        assert abs(np.sum(grad * v) - numeric) <= 1e-7 * max(1.0, abs(numeric))


@pytest.mark.parametrize("simplified", [False, True])
@pytest.mark.parametrize("axis", [-1, 1])
def test_layer_norm_references_match_finite_differences(simplified, axis):
    rng = np.random.default_rng(4)
    x, dy = rng.standard_normal((2, 3, 5)) + 0.5, rng.standard_normal((2, 3, 5))
    scale, bias = rng.standard_normal(x.shape[axis % 3:]), rng.standard_normal(x.shape[axis % 3:])

    def loss(z, s, b):
        y = ref.simplified_layer_norm(z, s, axis)[0] if simplified else ref.layer_norm(z, s, b, axis)[0]
        return np.sum(dy * y)

    if simplified:
        inv = ref.simplified_layer_norm(x, scale, axis)[1]
        dx, dscale = ref.simplified_layer_norm_grad(dy, x, scale, inv, axis)
        grads = {"x": dx, "scale": dscale}
    else:
        _, mean, inv = ref.layer_norm(x, scale, bias, axis)
        dx, dscale, dbias = ref.layer_norm_grad(dy, x, scale, mean, inv, axis)
        grads = {"x": dx, "scale": dscale, "bias": dbias}
    point = {"x": x, "scale": scale, "bias": bias}
    for name, grad in grads.items():
        def along(value, name=name):
            return loss(**{"z": x, "s": scale, "b": bias, {"x": "z", "scale": "s", "bias": "b"}[name]: value})
        for v, numeric in numeric_gradient(along, point[name], direction_count=4):
            assert abs(np.sum(grad * v) - numeric) <= 1e-6 * max(1.0, abs(numeric)), name


# -- the evaluator (lower --verify's oracle) ---------------------------------------------------------------------

def test_reference_eval_runs_rmsnorm_forward_and_backward_like_the_lowering():
    """generate_artifacts' RMSNorm pair: the forward's inv_std_var feeds the gradient."""
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["y", "r"], name="rms", epsilon=1e-6),
             helper.make_node("SimplifiedLayerNormalizationGrad", ["dy", "x", "w", "r"], ["dx", "dw"], domain=MS,
                              name="rms_grad", epsilon=1e-6),
             helper.make_node("LayerNormalizationGrad", ["dy", "x", "w", "m", "r2"], ["dx2", "dw2", "db2"],
                              domain=MS, name="ln_grad"),
             helper.make_node("SoftmaxGrad", ["dy", "s"], ["ds"], domain=MS, name="sm_grad")]
    shape = [2, 3, 8]
    graph = helper.make_graph(nodes, "g", [vi("x", F32, shape), vi("w", F32, [8]), vi("dy", F32, shape),
                                           vi("m", F32, [2, 3, 1]), vi("r2", F32, [2, 3, 1]), vi("s", F32, shape)],
                              [vi("y", F32, shape), vi("r", F32, [2, 3, 1]), vi("dx", F32, shape), vi("dw", F32, [8]),
                               vi("dx2", F32, shape), vi("dw2", F32, [8]), vi("db2", F32, [8]), vi("ds", F32, shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    x, w, dy = (rng.standard_normal(s).astype(np.float32) for s in (shape, [8], shape))
    _, mean, inv = ref.layer_norm(x, w, None)
    feeds = {"x": x, "w": w, "dy": dy, "m": mean.astype(np.float32), "r2": inv.astype(np.float32),
             "s": ref.softmax(x, 1, trailing=True).astype(np.float32)}
    oracle = reference_eval.evaluate(model, feeds, exact=True)
    y, r = ref.simplified_layer_norm(x, w, -1, 1e-6)
    assert oracle["r"].dtype == np.float64 and oracle["r"].shape == (2, 3, 1)
    close(oracle["y"], y, F64)
    close(oracle["dx"], ref.simplified_layer_norm_grad(dy, x, w, oracle["r"])[0], F64)
    close(oracle["ds"], ref.softmax_grad(dy, feeds["s"], 1, trailing=True), F64)
    got = run_model(lowered(model), feeds)
    for name in ("y", "r", "dx", "dw", "dx2", "dw2", "db2", "ds"):
        close(got[name], oracle[name], F32, name)


# -- onnxruntime-training 1.19.2's own results ------------------------------------------------------------------

def test_every_op_of_the_family_has_recorded_cases():
    assert {c["op_type"] for c in RECORDED} == {*SOFTMAX_OPS, *NORM_OPS}
    assert {c["variant"] for c in RECORDED if c["op_type"] == "LayerNormalizationGrad"} >= {
        "3d_axis1", "3d_flat_stats", "2d_axis0", "rows_far_from_zero", "3d_axis_last_f16", "3d_axis_last_f64"}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", RECORDED, ids=lambda c: f"{c['op_type']}-{c['variant']}")
def test_lowering_matches_onnxruntime_training(case, target):
    model, feeds, recorded = load_case(case)
    assert_matches_recorded(run_model(lowered(model, target), feeds), recorded)


@pytest.mark.parametrize("op", list(SOFTMAX_OPS))
def test_recorded_softmax_cases_follow_the_axis_semantics(op):
    """onnxruntime-training's own outputs say which axes each op sums over (not the code under test)."""
    _, log, trailing, default = SOFTMAX_OPS[op]
    grad = ref.log_softmax_grad if log else ref.softmax_grad
    for case in recorded_cases(op):
        _, feeds, recorded = load_case(case)
        axis = case["attributes"].get("axis", default)
        dy, y = feeds["dY"], feeds["X" if log else "Y"]
        elem = F16 if dy.dtype == np.float16 else F32
        close(recorded["dX"], grad(dy, y, axis, trailing), elem, case["variant"])
        if axis % dy.ndim != dy.ndim - 1:  # the other semantics gives another result there
            assert np.max(np.abs(recorded["dX"] - grad(dy, y, axis, not trailing))) > 1e-2


@pytest.mark.parametrize("op", [*SOFTMAX_OPS, *NORM_OPS])
def test_lower_verify_passes_on_a_recorded_case(op, tmp_path, capsys):
    """``oplower lower --verify``: the lowering against the evaluator's float64 rule on random inputs."""
    case = recorded_cases(op)[0]
    out = tmp_path / "lowered.onnx"
    assert main(["lower", str(FIXTURES / case["model"]), "-o", str(out), "--verify"]) == 0
    report = capsys.readouterr().out
    assert "PASS" in report and "FAIL" not in report and out.is_file()
