"""onnxruntime-training's recurrent ops, LSTMTraining, LSTMGrad, GRUTraining and GRUGrad (issue 20): the parsed
schemas, one failing
check per spec constraint, the lowering (a Scan per direction) against the float64 reference of
runtime.reference_recurrent across directions, sequence lengths, given/absent initial states and biases,
peepholes, hidden size != input size and dtypes, only the requested outputs computed, finite differences of the
reference, the recorded onnxruntime-training cases (forward direction only: its kernels refuse the rest), and
the portable form in onnxruntime, OpenVINO, tract and onnx.reference."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from _one_node import one_node_model
from _recorded import FIXTURES, recorded_cases
from onnx import TensorProto, helper
from test_portable import _run as _run_any

from lowering.passes import lower_model
from lowering.rules import PORTABLE_OPS, TARGETS, rule_targets
from lowering.rules.recurrent import STOCK_STEPS
from opdef.errors import VerificationError
from opdef.model_verify import verify_model
from opdef.registry import load_schemas
from runtime import reference_eval
from runtime import reference_recurrent as ref
from runtime.session import run_model

MS = "com.microsoft"
F32, F64, I32 = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT32
NP = {F32: np.float32, F64: np.float64}
TOL = {F32: 2e-6, F64: 1e-12}  # of each output's largest magnitude
LSTM_IN = ("X", "W", "R", "B", "sequence_lengths", "initial_h", "initial_c", "P")
LSTM_OUT = ("HAll", "HFinal", "CFinal", "CAll", "iofc")
GRAD_IN = ("X", "W", "R", "sequence_lengths", "initial_h", "initial_c", "HAll", "CAll", "iofc", "dHAll", "dHFinal",
           "dCFinal")
GRAD_OUT = ("dX", "dW", "dR", "dB", "dH0", "dC0", "dP")
RANK = {"HAll": 4, "CAll": 4, "iofc": 4, "HFinal": 3, "CFinal": 3, "dX": 3, "dW": 3, "dR": 3, "dB": 2, "dH0": 3,
        "dC0": 3, "dP": 2, "ZRH": 4}
GRU_IN = ("X", "W", "R", "B", "sequence_lengths", "initial_h")
GRU_OUT = ("HAll", "HFinal", "ZRH")
GRU_GRAD_IN = ("X", "W", "R", "B", "sequence_lengths", "initial_h", "HAll", "ZRH", "dHAll", "dHFinal")
GRU_GRAD_OUT = ("dX", "dW", "dR", "dB", "dH0")


def _model(op: str, feeds: dict, in_order, outputs, attrs: dict, elem=F32, opset=17) -> onnx.ModelProto:
    names = [n if feeds.get(n) is not None else "" for n in in_order]
    while names and not names[-1]:
        names.pop()
    node = helper.make_node(op, names, list(outputs), domain=MS, name=op.lower(), **attrs)
    inputs = [(n, I32 if n == "sequence_lengths" else elem, list(feeds[n].shape)) for n in names if n]
    return one_node_model(node, inputs, [(o, elem, [None] * RANK[o]) for o in outputs if o], opset)


def _lstm_inputs(rng, steps=4, batch=3, inputs=5, hidden=3, directions=1, bias=True, state=True, peep=False,
                 lengths=None, elem=F32) -> dict:
    dt = NP[elem]

    def rand(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(dt)

    return {"X": rand(steps, batch, inputs), "W": rand(directions, 4 * hidden, inputs, scale=0.5),
            "R": rand(directions, 4 * hidden, hidden, scale=0.5),
            "B": rand(directions, 8 * hidden, scale=0.5) if bias else None,
            "sequence_lengths": None if lengths is None else np.array(lengths, np.int32),
            "initial_h": rand(directions, batch, hidden) if state else None,
            "initial_c": rand(directions, batch, hidden) if state else None,
            "P": rand(directions, 3 * hidden, scale=0.5) if peep else None}


def _close(got: np.ndarray, want: np.ndarray, tol: float, label: str) -> None:
    assert got.shape == want.shape, f"{label}: shape {got.shape} != {want.shape}"
    scale = max(float(np.abs(want).max()), 1e-30)
    err = float(np.abs(got.astype(np.float64) - want).max()) / scale
    assert err <= tol, f"{label}: error {err:.3g} of the largest entry"


def _lowered(model: onnx.ModelProto, target: str = "onnxruntime") -> onnx.ModelProto:
    lowered = lower_model(model, target=target)
    onnx.checker.check_model(lowered, full_check=True)
    assert {n.domain for n in lowered.graph.node} <= {"", "ai.onnx"}
    return lowered


# -- schemas ---------------------------------------------------------------------------------------------------

def test_schemas_parsed_from_the_specs():
    registry = load_schemas()
    fwd = registry.get(MS, "LSTMTraining").schema
    assert [(a.name, a.optional) for a in fwd.inputs] == [
        ("X", False), ("W", False), ("R", False), ("B", True), ("sequence_lengths", True), ("initial_h", True),
        ("initial_c", True), ("P", True)]
    assert [a.name for a in fwd.outputs] == list(LSTM_OUT) and all(a.optional for a in fwd.outputs)
    attrs = {a.name: a for a in fwd.attributes}
    assert attrs["direction"].default == "forward"
    assert attrs["direction"].allowed_values == ("forward", "reverse", "bidirectional")
    assert attrs["input_forget"].default == 0 and attrs["hidden_size"].type == "s64"
    assert fwd.type_constraint_map[fwd.input("sequence_lengths").type_var] == ("s32",)
    assert set(fwd.type_constraint_map[fwd.input("X").type_var]) == {"f32", "f64"}
    grad = registry.get(MS, "LSTMGrad").schema
    assert [(a.name, a.optional) for a in grad.inputs] == [
        ("X", False), ("W", False), ("R", False), ("sequence_lengths", True), ("initial_h", True),
        ("initial_c", True), ("HAll", False), ("CAll", False), ("iofc", False), ("dHAll", True), ("dHFinal", True),
        ("dCFinal", True)]
    assert [a.name for a in grad.outputs] == list(GRAD_OUT)
    assert [c.label for c in fwd.constraints] == [f"C{i}" for i in range(1, 7)]
    assert rule_targets("lstm_training") == TARGETS and rule_targets("lstm_grad") == TARGETS


# -- one failing check per constraint ---------------------------------------------------------------------------

def _verify(model: onnx.ModelProto) -> None:
    verify_model(model)


def _bad_forward(edit, attrs=None):
    feeds = _lstm_inputs(np.random.default_rng(0))
    edit(feeds)
    return _model("LSTMTraining", feeds, LSTM_IN, LSTM_OUT, {"hidden_size": 3, **(attrs or {})})


@pytest.mark.parametrize("constraint, edit, attrs, message", [
    ("C1", lambda f: f.update(W=f["W"][:, :8]), None, "W has shape [1,8,5]; expected [1,12,5]"),
    ("C1", lambda f: f.update(R=f["R"][:, :, :2]), None, "R has shape [1,12,2]"),
    ("C1", lambda f: f.update(X=f["X"][0]), None, "X has rank 2"),
    ("C1", lambda f: None, {"direction": "bidirectional"}, "direction 'bidirectional' needs 2 direction(s)"),
    ("C2", lambda f: f.update(B=f["B"][:, :12]), None, "B has shape [1,12]; expected [1,24]"),
    ("C2", lambda f: f.update(P=np.zeros((1, 6), np.float32)), None, "P has shape [1,6]; expected [1,9]"),
    ("C3", lambda f: f.update(initial_h=f["initial_h"][:, :2]), None, "initial_h has shape [1,2,3]"),
    ("C3", lambda f: f.update(sequence_lengths=np.array([1, 2], np.int32)), None, "sequence_lengths has shape [2]"),
    ("C4", lambda f: None, {"hidden_size": 4}, "W has shape [1,12,5]; expected [1,16,5]"),
    ("C5", lambda f: None, {"clip": 1.0}, "clip is 1.0; cell clipping is not supported"),
    ("C5", lambda f: None, {"activations": ["Relu", "Tanh", "Tanh"]},
     "activations are ['Relu', 'Tanh', 'Tanh']; only ['Sigmoid', 'Tanh', 'Tanh'] (the defaults) are supported"),
    ("C5", lambda f: None, {"input_forget": 1}, "attribute 'input_forget' is 1; allowed: 0"),
    ("C5", lambda f: None, {"direction": "sideways"}, "attribute 'direction' is 'sideways'"),
])
def test_lstm_training_constraint(constraint, edit, attrs, message):
    with pytest.raises(VerificationError) as info:
        _verify(_bad_forward(edit, attrs))
    text = str(info.value)
    assert message in text and "LSTMTraining 'lstmtraining'" in text and "\n" not in text


@pytest.mark.parametrize("name, shape, message", [
    ("iofc", (4, 1, 3, 6), "iofc has shape [4,1,3,6]; expected [4,1,3,12]"),
    ("HAll", (3, 1, 3, 3), "HAll has shape [3,1,3,3]"),
    ("dHFinal", (2, 3, 3), "dHFinal has shape [2,3,3]"),
    ("dCFinal", (1, 3, 4), "dCFinal has shape [1,3,4]"),
])
def test_lstm_grad_constraint(name, shape, message):
    rng = np.random.default_rng(1)
    feeds = _grad_feeds(rng, _lstm_inputs(rng), "forward")
    feeds[name] = np.zeros(shape, np.float32)
    model = _model("LSTMGrad", feeds, GRAD_IN, GRAD_OUT, {"hidden_size": 3})
    with pytest.raises(VerificationError) as info:
        _verify(model)
    assert message in str(info.value) and "LSTMGrad 'lstmgrad'" in str(info.value)


def test_inferred_output_shapes():
    feeds = _lstm_inputs(np.random.default_rng(2), directions=2, bias=False, state=False)
    model = _model("LSTMTraining", feeds, LSTM_IN, LSTM_OUT, {"direction": "bidirectional"})
    inferred = {o: t.shape for o, t in zip(LSTM_OUT, _output_types(model), strict=True)}
    assert inferred == {"HAll": (4, 2, 3, 3), "HFinal": (2, 3, 3), "CFinal": (2, 3, 3), "CAll": (4, 2, 3, 3),
                        "iofc": (4, 2, 3, 12)}


def _output_types(model):
    return verify_model(model)[0].output_types


# -- the lowering against the float64 reference -----------------------------------------------------------------

def _grad_feeds(rng, fwd_feeds: dict, direction: str, d_all=True, d_h=True, d_c=True) -> dict:
    """LSTMGrad's inputs from the reference forward (rounded to the feeds' type) and random output gradients."""
    dt = fwd_feeds["X"].dtype
    fwd = ref.lstm_training(*(fwd_feeds[n] for n in LSTM_IN), direction=direction)
    # LSTMGrad has no P input: its gradient is that of the forward without peepholes
    feeds = {n: fwd_feeds[n] for n in ("X", "W", "R", "sequence_lengths", "initial_h", "initial_c")}
    feeds.update({n: fwd[n].astype(dt) for n in ("HAll", "CAll", "iofc")})
    feeds["dHAll"] = rng.standard_normal(fwd["HAll"].shape).astype(dt) if d_all else None
    feeds["dHFinal"] = rng.standard_normal(fwd["HFinal"].shape).astype(dt) if d_h else None
    feeds["dCFinal"] = rng.standard_normal(fwd["CFinal"].shape).astype(dt) if d_c else None
    return feeds


CASES = [  # direction, lengths, bias, initial states, peepholes, elem
    ("forward", None, True, True, False, F32),
    ("forward", None, False, False, False, F64),
    ("forward", [4, 2, 1], True, True, True, F32),
    ("reverse", None, True, False, False, F32),
    ("reverse", [2, 4, 3], True, True, False, F64),
    ("bidirectional", None, True, True, True, F32),
    ("bidirectional", [3, 1, 4], False, True, False, F32),
    ("bidirectional", [1, 4, 2], True, False, False, F64),
]


def _case_id(case):
    direction, lengths, bias, state, peep, elem = case
    return "-".join([direction, "lengths" if lengths else "full", "bias" if bias else "nobias",
                     "state" if state else "nostate", "peep" if peep else "nopeep", "f64" if elem == F64 else "f32"])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_lstm_training_lowering_matches_reference(case):
    direction, lengths, bias, state, peep, elem = case
    rng = np.random.default_rng(3)
    feeds = _lstm_inputs(rng, directions=2 if direction == "bidirectional" else 1, bias=bias, state=state, peep=peep,
                         lengths=lengths, elem=elem)
    model = _model("LSTMTraining", feeds, LSTM_IN, LSTM_OUT, {"hidden_size": 3, "direction": direction}, elem)
    got = run_model(_lowered(model), {k: v for k, v in feeds.items() if v is not None})
    want = ref.lstm_training(*(feeds[n] for n in LSTM_IN), direction=direction)
    for name in LSTM_OUT:
        _close(got[name], want[name], TOL[elem], f"{_case_id(case)} {name}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_lstm_grad_lowering_matches_reference(case):
    direction, lengths, bias, state, peep, elem = case
    rng = np.random.default_rng(4)
    fwd = _lstm_inputs(rng, directions=2 if direction == "bidirectional" else 1, bias=bias, state=state, peep=False,
                       lengths=lengths, elem=elem)
    # the case's peephole flag picks which output gradients are absent
    feeds = _grad_feeds(rng, fwd, direction, d_all=True, d_h=not peep, d_c=state)
    model = _model("LSTMGrad", feeds, GRAD_IN, GRAD_OUT, {"hidden_size": 3, "direction": direction}, elem)
    got = run_model(_lowered(model), {k: v for k, v in feeds.items() if v is not None})
    want = ref.lstm_grad(*(feeds[n] for n in GRAD_IN), direction=direction)
    for name in GRAD_OUT:
        _close(got[name], want[name], TOL[elem] * 5, f"{_case_id(case)} {name}")


def test_opset_12_lowering_matches_reference():
    """Unsqueeze and ReduceSum take axes as attributes there."""
    rng = np.random.default_rng(5)
    feeds = _lstm_inputs(rng, lengths=[2, 4, 3])
    model = _model("LSTMTraining", feeds, LSTM_IN, LSTM_OUT, {}, opset=12)
    got = run_model(_lowered(model), {k: v for k, v in feeds.items() if v is not None})
    want = ref.lstm_training(*(feeds[n] for n in LSTM_IN))
    _close(got["HAll"], want["HAll"], TOL[F32], "HAll")
    grads = _grad_feeds(rng, feeds, "forward")
    model = _model("LSTMGrad", grads, GRAD_IN, GRAD_OUT, {}, opset=12)
    got = run_model(_lowered(model), {k: v for k, v in grads.items() if v is not None})
    want = ref.lstm_grad(*(grads[n] for n in GRAD_IN))
    for name in GRAD_OUT:
        _close(got[name], want[name], 1e-5, name)


def _op_counts(model: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def test_absent_outputs_are_not_computed():
    rng = np.random.default_rng(6)
    feeds = _lstm_inputs(rng)
    long = _lstm_inputs(rng, steps=STOCK_STEPS["LSTMTraining"])  # long enough for onnxruntime's LSTM kernel
    only_final = _lowered(_model("LSTMTraining", long, LSTM_IN, ["", "HFinal"], {}))
    # onnxruntime's LSTM kernel writes the final h alone: no HAll, CAll or iofc, no Scan for the cells
    (lstm,) = [n for n in only_final.graph.node if n.op_type == "LSTM"]
    assert list(lstm.output) == ["", "HFinal"] and "Scan" not in _op_counts(only_final)
    with_lengths = _model("LSTMTraining", _lstm_inputs(rng, lengths=[2, 1, 2]), LSTM_IN, ["", "HFinal"], {})
    scan = next(n for n in _lowered(with_lengths).graph.node if n.op_type == "Scan")  # the Scan form
    assert len(scan.output) == 2  # the final h and c (R^T read by name); no stacked HAll, CAll or iofc
    body = next(a.g for a in scan.attribute if a.name == "body")
    assert "Concat" not in {n.op_type for n in body.node}  # iofc not assembled
    grads = _grad_feeds(rng, feeds, "forward")
    only_dh0 = _lowered(_model("LSTMGrad", grads, GRAD_IN, ["", "", "", "", "dH0"], {}))
    all_grads = _lowered(_model("LSTMGrad", grads, GRAD_IN, GRAD_OUT, {}))
    # dX, dW, dR: one MatMul each outside the Scan; dB, dP: ReduceSums
    assert _op_counts(all_grads)["MatMul"] - _op_counts(only_dh0).get("MatMul", 0) == 3
    assert "ReduceSum" not in _op_counts(only_dh0)
    got = run_model(only_dh0, {k: v for k, v in grads.items() if v is not None})
    _close(got["dH0"], ref.lstm_grad(*(grads[n] for n in GRAD_IN))["dH0"], TOL[F32], "dH0")
    nothing = _lowered(_model("LSTMGrad", grads, GRAD_IN, [""], {}))
    assert "Scan" not in _op_counts(nothing)


# -- finite differences of the float64 references ----------------------------------------------------------------

@pytest.mark.parametrize("direction, lengths", [("forward", None), ("bidirectional", [3, 1, 2])])
def test_reference_gradient_matches_finite_differences(direction, lengths):
    """Every gradient of LSTMGrad's reference against central differences of the scalar
    sum(HAll*gH) + sum(HFinal*gh) + sum(CFinal*gc) of LSTMTraining's reference."""
    rng = np.random.default_rng(7)
    d = 2 if direction == "bidirectional" else 1
    feeds = {k: (None if v is None else v.astype(np.float64) if v.dtype != np.int32 else v) for k, v in
             _lstm_inputs(rng, steps=3, batch=3, inputs=2, hidden=2, directions=d, lengths=lengths).items()}
    fwd = ref.lstm_training(*(feeds[n] for n in LSTM_IN), direction=direction)
    g_all, g_h, g_c = (rng.standard_normal(fwd[n].shape) for n in ("HAll", "HFinal", "CFinal"))

    def loss():
        out = ref.lstm_training(*(feeds[n] for n in LSTM_IN), direction=direction)
        return float((out["HAll"] * g_all).sum() + (out["HFinal"] * g_h).sum() + (out["CFinal"] * g_c).sum())

    grads = ref.lstm_grad(feeds["X"], feeds["W"], feeds["R"], feeds["sequence_lengths"], feeds["initial_h"],
                          feeds["initial_c"], fwd["HAll"], fwd["CAll"], fwd["iofc"], g_all, g_h, g_c,
                          direction=direction)
    for grad, name in (("dX", "X"), ("dW", "W"), ("dR", "R"), ("dB", "B"), ("dH0", "initial_h"),
                       ("dC0", "initial_c")):
        value, numeric = feeds[name], np.zeros_like(feeds[name])
        for index in itertools.product(*map(range, value.shape)):
            keep = value[index]
            value[index] = keep + 1e-6
            up = loss()
            value[index] = keep - 1e-6
            numeric[index] = (up - loss()) / 2e-6
            value[index] = keep
        np.testing.assert_allclose(grads[grad], numeric, atol=1e-7, err_msg=grad)
    # dP: the gradient with respect to the peepholes at P = 0
    feeds["P"] = np.zeros((d, 6))
    numeric = np.zeros_like(feeds["P"])
    for index in itertools.product(*map(range, feeds["P"].shape)):
        feeds["P"][index] = 1e-6
        up = loss()
        feeds["P"][index] = -1e-6
        numeric[index] = (up - loss()) / 2e-6
        feeds["P"][index] = 0.0
    np.testing.assert_allclose(grads["dP"], numeric, atol=1e-7, err_msg="dP")


# -- onnxruntime-training's recorded cases -------------------------------------------------------------------------

RECORDED = recorded_cases("LSTMTraining", "LSTMGrad", "GRUTraining", "GRUGrad")


def _recorded(case):
    model = onnx.load(FIXTURES / case["model"])
    arrays = np.load(FIXTURES / case["arrays"])
    feeds = {k[3:]: arrays[k] for k in arrays.files if k.startswith("in.")}
    wanted = {k[4:]: arrays[k] for k in arrays.files if k.startswith("out.")}
    return model, feeds, wanted


def test_recorded_cases_cover_both_ops():
    assert {c["op_type"] for c in RECORDED} == {"LSTMTraining", "LSTMGrad", "GRUTraining", "GRUGrad"}
    assert len(RECORDED) >= 17


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", RECORDED, ids=lambda c: f"{c['op_type']}-{c['variant']}")
def test_recorded_case_matches_onnxruntime_training(case, target):
    model, feeds, wanted = _recorded(case)
    got = run_model(_lowered(model, target), feeds)
    assert set(got) == set(wanted)
    for name, value in wanted.items():
        _close(got[name], value.astype(np.float64), 1e-5, f"{case['variant']} {name}")


@pytest.mark.parametrize("case", RECORDED, ids=lambda c: f"{c['op_type']}-{c['variant']}")
def test_reference_evaluator_matches_onnxruntime_training(case):
    """runtime.reference_eval (the oracle of `lower --verify`) on the un-lowered one-node model."""
    model, feeds, wanted = _recorded(case)
    got = reference_eval.evaluate(model, feeds)
    for name, value in wanted.items():
        _close(np.asarray(got[name]), value.astype(np.float64), 1e-5, f"{case['variant']} {name}")


# -- the portable form in other runtimes ---------------------------------------------------------------------------

@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino", "tract", "reference"])
@pytest.mark.parametrize("op", ["LSTMTraining", "LSTMGrad", "GRUTraining", "GRUGrad"])
def test_portable_form_runs_in_every_runtime(op, runtime, tmp_path):
    rng = np.random.default_rng(8)
    attrs = {"direction": "bidirectional"}
    if op.startswith("LSTM"):
        fwd = _lstm_inputs(rng, directions=2, lengths=[3, 1, 4])
    else:
        fwd = _gru_inputs(rng, directions=2, lengths=[3, 1, 4])
        attrs["linear_before_reset"] = 1
    if op == "LSTMTraining":
        feeds, in_order, outputs = fwd, LSTM_IN, LSTM_OUT
        want = ref.lstm_training(*(fwd[n] for n in LSTM_IN), direction="bidirectional")
    elif op == "LSTMGrad":
        feeds, in_order, outputs = _grad_feeds(rng, fwd, "bidirectional"), GRAD_IN, GRAD_OUT
        want = ref.lstm_grad(*(feeds[n] for n in GRAD_IN), direction="bidirectional")
    elif op == "GRUTraining":
        feeds, in_order, outputs = fwd, GRU_IN, GRU_OUT
        want = ref.gru_training(*(fwd[n] for n in GRU_IN), direction="bidirectional", linear_before_reset=1)
    else:
        feeds, in_order, outputs = _gru_grad_feeds(rng, fwd, "bidirectional", 1), GRU_GRAD_IN, GRU_GRAD_OUT
        want = ref.gru_grad(*(feeds[n] for n in GRU_GRAD_IN), direction="bidirectional", linear_before_reset=1)
    model = _lowered(_model(op, feeds, in_order, outputs, attrs), "portable")
    used = {n.op_type for n in model.graph.node} | {
        m.op_type for n in model.graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH
        for m in a.g.node}
    assert used <= PORTABLE_OPS, used - PORTABLE_OPS
    got = _run_any(runtime, model, {k: v for k, v in feeds.items() if v is not None}, tmp_path)
    for name in outputs:
        _close(np.asarray(got[name]), want[name], 1e-5, f"{runtime} {name}")


# -- GRU -----------------------------------------------------------------------------------------------------------

def _gru_inputs(rng, steps=4, batch=3, inputs=5, hidden=3, directions=1, bias=True, state=True, lengths=None,
                elem=F32) -> dict:
    dt = NP[elem]

    def rand(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(dt)

    return {"X": rand(steps, batch, inputs), "W": rand(directions, 3 * hidden, inputs, scale=0.5),
            "R": rand(directions, 3 * hidden, hidden, scale=0.5),
            "B": rand(directions, 6 * hidden, scale=0.5) if bias else None,
            "sequence_lengths": None if lengths is None else np.array(lengths, np.int32),
            "initial_h": rand(directions, batch, hidden) if state else None}


def _gru_grad_feeds(rng, fwd_feeds: dict, direction: str, linear_before_reset: int, d_all=True, d_h=True) -> dict:
    dt = fwd_feeds["X"].dtype
    fwd = ref.gru_training(*(fwd_feeds[n] for n in GRU_IN), direction=direction,
                           linear_before_reset=linear_before_reset)
    feeds = {n: fwd_feeds[n] for n in ("X", "W", "R", "B", "sequence_lengths", "initial_h")}
    feeds.update({n: fwd[n].astype(dt) for n in ("HAll", "ZRH")})
    feeds["dHAll"] = rng.standard_normal(fwd["HAll"].shape).astype(dt) if d_all else None
    feeds["dHFinal"] = rng.standard_normal(fwd["HFinal"].shape).astype(dt) if d_h else None
    return feeds


def test_gru_schemas_parsed_from_the_specs():
    registry = load_schemas()
    fwd = registry.get(MS, "GRUTraining").schema
    assert [(a.name, a.optional) for a in fwd.inputs] == [
        ("X", False), ("W", False), ("R", False), ("B", True), ("sequence_lengths", True), ("initial_h", True)]
    assert [a.name for a in fwd.outputs] == list(GRU_OUT)
    lbr = {a.name: a for a in fwd.attributes}["linear_before_reset"]
    assert lbr.default == 0 and lbr.allowed_values == (0, 1)
    grad = registry.get(MS, "GRUGrad").schema
    assert [(a.name, a.optional) for a in grad.inputs] == [
        ("X", False), ("W", False), ("R", False), ("B", True), ("sequence_lengths", True), ("initial_h", True),
        ("HAll", False), ("ZRH", False), ("dHAll", True), ("dHFinal", True)]
    assert [a.name for a in grad.outputs] == list(GRU_GRAD_OUT)
    assert [c.label for c in grad.constraints] == [f"C{i}" for i in range(1, 7)]
    assert rule_targets("gru_training") == TARGETS and rule_targets("gru_grad") == TARGETS


@pytest.mark.parametrize("op, edit, attrs, message", [
    ("GRUTraining", lambda f: f.update(W=f["W"][:, :6]), None, "W has shape [1,6,5]; expected [1,9,5]"),
    ("GRUTraining", lambda f: f.update(B=f["B"][:, :9]), None, "B has shape [1,9]; expected [1,18]"),
    ("GRUTraining", lambda f: f.update(initial_h=f["initial_h"][:, :2]), None, "initial_h has shape [1,2,3]"),
    ("GRUTraining", lambda f: None, {"hidden_size": 2}, "W has shape [1,9,5]; expected [1,6,5]"),
    ("GRUTraining", lambda f: None, {"linear_before_reset": 2}, "attribute 'linear_before_reset' is 2"),
    ("GRUTraining", lambda f: None, {"clip": 3.0}, "clip is 3.0; cell clipping is not supported"),
    ("GRUGrad", lambda f: f.update(ZRH=f["ZRH"][..., :6]), None, "ZRH has shape [4,1,3,6]; expected [4,1,3,9]"),
    ("GRUGrad", lambda f: f.update(dHFinal=f["dHFinal"][:, :1]), None, "dHFinal has shape [1,1,3]"),
])
def test_gru_constraint(op, edit, attrs, message):
    rng = np.random.default_rng(9)
    feeds = _gru_inputs(rng)
    if op == "GRUGrad":
        feeds = _gru_grad_feeds(rng, feeds, "forward", 0)
    edit(feeds)
    names = (GRU_IN, GRU_OUT) if op == "GRUTraining" else (GRU_GRAD_IN, GRU_GRAD_OUT)
    with pytest.raises(VerificationError) as info:
        verify_model(_model(op, feeds, *names, {"hidden_size": 3, **(attrs or {})}))
    assert message in str(info.value) and f"{op} '{op.lower()}'" in str(info.value)


GRU_CASES = [  # direction, lengths, bias, initial state, linear_before_reset, elem
    ("forward", None, True, True, 1, F32),
    ("forward", None, False, False, 0, F64),
    ("forward", [4, 2, 1], True, True, 0, F32),
    ("reverse", None, True, False, 1, F32),
    ("reverse", [2, 4, 3], True, True, 1, F64),
    ("bidirectional", None, True, True, 0, F32),
    ("bidirectional", [3, 1, 4], False, True, 1, F32),
    ("bidirectional", [1, 4, 2], True, False, 0, F64),
]


def _gru_id(case):
    direction, lengths, bias, state, lbr, elem = case
    return "-".join([direction, "lengths" if lengths else "full", "bias" if bias else "nobias",
                     "state" if state else "nostate", f"lbr{lbr}", "f64" if elem == F64 else "f32"])


@pytest.mark.parametrize("case", GRU_CASES, ids=_gru_id)
def test_gru_lowering_matches_reference(case):
    direction, lengths, bias, state, lbr, elem = case
    rng = np.random.default_rng(10)
    attrs = {"hidden_size": 3, "direction": direction, "linear_before_reset": lbr}
    feeds = _gru_inputs(rng, directions=2 if direction == "bidirectional" else 1, bias=bias, state=state,
                        lengths=lengths, elem=elem)
    got = run_model(_lowered(_model("GRUTraining", feeds, GRU_IN, GRU_OUT, attrs, elem)),
                    {k: v for k, v in feeds.items() if v is not None})
    want = ref.gru_training(*(feeds[n] for n in GRU_IN), direction=direction, linear_before_reset=lbr)
    for name in GRU_OUT:
        _close(got[name], want[name], TOL[elem], f"{_gru_id(case)} {name}")
    grads = _gru_grad_feeds(rng, feeds, direction, lbr, d_h=state)
    got = run_model(_lowered(_model("GRUGrad", grads, GRU_GRAD_IN, GRU_GRAD_OUT, attrs, elem)),
                    {k: v for k, v in grads.items() if v is not None})
    want = ref.gru_grad(*(grads[n] for n in GRU_GRAD_IN), direction=direction, linear_before_reset=lbr)
    for name in GRU_GRAD_OUT:
        _close(got[name], want[name], TOL[elem] * 5, f"{_gru_id(case)} {name}")


def test_gru_absent_outputs_are_not_computed():
    rng = np.random.default_rng(11)
    feeds = _gru_inputs(rng)
    long = _gru_inputs(rng, steps=STOCK_STEPS["GRUTraining"])  # long enough for onnxruntime's GRU kernel
    only_final = _lowered(_model("GRUTraining", long, GRU_IN, ["", "HFinal"], {"linear_before_reset": 1}))
    (gru,) = [n for n in only_final.graph.node if n.op_type == "GRU"]  # onnxruntime's GRU kernel: no HAll, ZRH
    assert list(gru.output) == ["", "HFinal"] and "Scan" not in _op_counts(only_final)
    with_lengths = _model("GRUTraining", _gru_inputs(rng, lengths=[2, 1, 2]), GRU_IN, ["", "HFinal"],
                          {"linear_before_reset": 1})
    scan = next(n for n in _lowered(with_lengths).graph.node if n.op_type == "Scan")  # the Scan form
    assert len(scan.output) == 1  # the final h (the weights read by name); no stacked HAll or ZRH
    grads = _gru_grad_feeds(rng, feeds, "forward", 1)
    only_dh0 = _lowered(_model("GRUGrad", grads, GRU_GRAD_IN, ["", "", "", "", "dH0"], {"linear_before_reset": 1}))
    assert "ReduceSum" not in _op_counts(only_dh0)
    got = run_model(only_dh0, {k: v for k, v in grads.items() if v is not None})
    _close(got["dH0"], ref.gru_grad(*(grads[n] for n in GRU_GRAD_IN), linear_before_reset=1)["dH0"], TOL[F32], "dH0")


@pytest.mark.parametrize("lbr", [0, 1])
def test_gru_reference_gradient_matches_finite_differences(lbr):
    """GRUGrad's reference against central differences of sum(HAll*gH) + sum(HFinal*gh) of GRUTraining's
    reference, bidirectional with sequence lengths."""
    rng = np.random.default_rng(12)
    feeds = {k: (None if v is None else v.astype(np.float64) if v.dtype != np.int32 else v) for k, v in
             _gru_inputs(rng, steps=3, batch=3, inputs=2, hidden=2, directions=2, lengths=[3, 1, 2]).items()}
    kw = {"direction": "bidirectional", "linear_before_reset": lbr}
    fwd = ref.gru_training(*(feeds[n] for n in GRU_IN), **kw)
    g_all, g_h = rng.standard_normal(fwd["HAll"].shape), rng.standard_normal(fwd["HFinal"].shape)

    def loss():
        out = ref.gru_training(*(feeds[n] for n in GRU_IN), **kw)
        return float((out["HAll"] * g_all).sum() + (out["HFinal"] * g_h).sum())

    grads = ref.gru_grad(*(feeds[n] for n in GRU_IN), fwd["HAll"], fwd["ZRH"], g_all, g_h, **kw)
    for grad, name in (("dX", "X"), ("dW", "W"), ("dR", "R"), ("dB", "B"), ("dH0", "initial_h")):
        value, numeric = feeds[name], np.zeros_like(feeds[name])
        for index in itertools.product(*map(range, value.shape)):
            keep = value[index]
            value[index] = keep + 1e-6
            up = loss()
            value[index] = keep - 1e-6
            numeric[index] = (up - loss()) / 2e-6
            value[index] = keep
        np.testing.assert_allclose(grads[grad], numeric, atol=1e-7, err_msg=grad)


def test_symbolic_steps_and_batch():
    """S and N as symbols: the lowering reads them at run time (Shape), one model serves two sequence lengths."""
    rng = np.random.default_rng(13)
    for op, in_order, outputs in (("LSTMTraining", LSTM_IN, LSTM_OUT), ("LSTMGrad", GRAD_IN, GRAD_OUT)):
        feeds = _lstm_inputs(rng, lengths=[3, 1, 4])
        if op == "LSTMGrad":
            feeds = _grad_feeds(rng, feeds, "forward")
        model = _model(op, feeds, in_order, outputs, {"hidden_size": 3})
        for value in model.graph.input:
            dims = value.type.tensor_type.shape.dim
            symbols = {"X": "SN", "sequence_lengths": "N", "HAll": "S?N", "CAll": "S?N", "iofc": "S?N",
                       "dHAll": "S?N", "initial_h": "?N", "initial_c": "?N", "dHFinal": "?N", "dCFinal": "?N"}
            for dim, symbol in zip(dims, symbols.get(value.name, ""), strict=False):
                if symbol != "?":
                    dim.dim_param = symbol
        lowered = _lowered(model)
        for steps, batch in ((4, 3), (2, 2)):
            sub = _lstm_inputs(np.random.default_rng(steps), steps=steps, batch=batch,
                               lengths=[steps, 1, 2][:batch])
            if op == "LSTMGrad":
                sub = _grad_feeds(rng, sub, "forward")
                want = ref.lstm_grad(*(sub[n] for n in GRAD_IN))
            else:
                want = ref.lstm_training(*(sub[n] for n in LSTM_IN))
            got = run_model(lowered, {k: v for k, v in sub.items() if v is not None})
            for name in outputs:
                _close(got[name], want[name], 1e-5, f"{op} S={steps} N={batch} {name}")


def test_default_activations_spelled_out_are_accepted():
    rng = np.random.default_rng(14)
    feeds = _lstm_inputs(rng, directions=2)
    attrs = {"direction": "bidirectional", "activations": ["Sigmoid", "Tanh", "Tanh"] * 2}
    got = run_model(_lowered(_model("LSTMTraining", feeds, LSTM_IN, LSTM_OUT, attrs)),
                    {k: v for k, v in feeds.items() if v is not None})
    _close(got["HAll"], ref.lstm_training(*(feeds[n] for n in LSTM_IN), direction="bidirectional")["HAll"],
           TOL[F32], "HAll")
    gru = _gru_inputs(rng)
    verify_model(_model("GRUTraining", gru, GRU_IN, GRU_OUT, {"activations": ["Sigmoid", "Tanh"]}))


@pytest.mark.parametrize("name", ["lstm", "gru", "lstm2"])
def test_recurrent_training_graph_passes_lower_verify(name, tmp_path, capsys):
    """The recurrent artifacts' training graphs (LSTMTraining/GRUTraining, their gradients, the exporter's
    ConcatTraining/SplitTraining, the accumulators) through `lower --verify`: every output within tolerance of
    runtime.reference_eval's float64 evaluation (this module's references for the recurrent nodes)."""
    from lowering.cli import main

    out = tmp_path / "lowered.onnx"
    code = main(["lower", str(FIXTURES / "artifacts" / name / "training_model.onnx"), "-o", str(out), "--verify"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert printed.count("PASS") == len(onnx.load(out).graph.output) and "FAIL" not in printed



# -- a graph onnxruntime-training writes but cannot run ----------------------------------------------------------------

BIDIRECTIONAL_GRU = FIXTURES / "graphs" / "gru_bidirectional"


@pytest.mark.parametrize("target", TARGETS)
def test_bidirectional_gru_training_graph_matches_torch(target):
    """generate_artifacts' training graph of a bidirectional nn.GRU classifier (GRUTraining/GRUGrad with direction
    bidirectional, which onnxruntime-training 1.19.2's kernel refuses): lowered, on plain onnxruntime, one step's
    loss and every gradient equal torch's autograd on the same model and batch
    (tools/ort_training/record_bidirectional_gru.py): loss 1e-5 relative, gradients 1e-4 of their largest entry."""
    model = _lowered(onnx.load(BIDIRECTIONAL_GRU / "training_model.onnx"), target)
    params = dict(np.load(BIDIRECTIONAL_GRU / "initial_params.npz"))
    data = np.load(BIDIRECTIONAL_GRU / "data.npz")
    torch_step = np.load(BIDIRECTIONAL_GRU / "torch_step1.npz")
    feeds = {"input": data["input"], "labels": data["labels"], "lazy_reset_grad": np.array([True]), **params,
             **{f"{p}_grad.accumulation.buffer": np.zeros_like(v) for p, v in params.items()}}
    got = run_model(model, feeds)
    assert float(got["onnx::loss::2"]) == pytest.approx(float(torch_step["loss"]), rel=1e-5)
    for p in params:
        _close(got[f"{p}_grad.accumulation.buffer.updated"], torch_step[f"grad.{p}"].astype(np.float64), 1e-4, p)


@pytest.mark.parametrize("runtime", ["openvino", "tract", "reference"])
def test_bidirectional_gru_portable_graph_in_other_runtimes(runtime, tmp_path):
    """The same graph lowered for the portable target in the other runtimes. tract stops at the forward's own
    SoftmaxCrossEntropyLoss (standard ONNX, left as it is; tract has no form with its second output): an asserted
    refusal."""
    model = _lowered(onnx.load(BIDIRECTIONAL_GRU / "training_model.onnx"), "portable")
    params = dict(np.load(BIDIRECTIONAL_GRU / "initial_params.npz"))
    data = np.load(BIDIRECTIONAL_GRU / "data.npz")
    torch_step = np.load(BIDIRECTIONAL_GRU / "torch_step1.npz")
    feeds = {"input": data["input"], "labels": data["labels"], "lazy_reset_grad": np.array([True]), **params,
             **{f"{p}_grad.accumulation.buffer": np.zeros_like(v) for p, v in params.items()}}
    if runtime == "tract":
        with pytest.raises(Exception, match=r"Unimplemented\(SoftmaxCrossEntropyLoss\)"):
            _run_any(runtime, model, feeds, tmp_path)
        return
    got = _run_any(runtime, model, feeds, tmp_path)
    assert float(np.asarray(got["onnx::loss::2"])) == pytest.approx(float(torch_step["loss"]), rel=1e-5)
    for p in params:
        _close(np.asarray(got[f"{p}_grad.accumulation.buffer.updated"]), torch_step[f"grad.{p}"].astype(np.float64),
               1e-4, f"{runtime} {p}")
