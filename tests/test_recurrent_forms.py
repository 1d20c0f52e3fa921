"""The recurrent lowering's per-step forms (issue 31: fewer kernels per small training step). On the onnxruntime
target the Scan bodies are as few nodes as asserted here (each one a kernel per time step): gate blocks cut by
Split, one Sigmoid over the stacked gates, the weights read transposed by a Gemm, the requested sequence outputs
packed into one scan output, the backward's gate factors computed before the loop, backwards Scans run with
scan_input_directions and the backward bodies reading the weights by name. That form gives, in f32, the portable
form's bits (Gather views, MatMul with transposed weights, reversing Slices, weights as Scan states), which
tests/test_recurrent.py checks against the float64 reference: every direction, sequence lengths, peepholes, GRU's
linear_before_reset, opsets 12 and 17, and H known only at run time. A short, small forward without
sequence_lengths (and LSTM without peepholes; recurrent.STOCK_STEPS, STOCK_GATES) runs onnxruntime's own LSTM / GRU
kernel instead, its gates for all steps at once (GRUTraining: the native kernel's bits; LSTMTraining: its
accuracy)."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import onnx
import pytest
from _recorded import recorded_cases
from test_accuracy_vs_native import HALF_ULP, measure
from test_accuracy_vs_native import load as load_recorded
from test_recurrent import (
    GRAD_IN,
    GRAD_OUT,
    GRU_GRAD_IN,
    GRU_GRAD_OUT,
    GRU_IN,
    GRU_OUT,
    LSTM_IN,
    LSTM_OUT,
    _grad_feeds,
    _gru_grad_feeds,
    _gru_inputs,
    _lowered,
    _lstm_inputs,
    _model,
)

from lowering.rules import recurrent
from runtime.session import run_model


def _bodies(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, collections.Counter]]:
    """Each Scan node with its body's op types (Constants are no kernels)."""
    found = []
    for node in model.graph.node:
        if node.op_type == "Scan":
            body = next(a.g for a in node.attribute if a.name == "body")
            found.append((node, collections.Counter(n.op_type for n in body.node if n.op_type != "Constant")))
    return found


def _lstm(op: str, rng, direction="forward", lengths=None, peep=False, hidden_attr=True, opset=17):
    d = 2 if direction == "bidirectional" else 1
    fwd = _lstm_inputs(rng, directions=d, peep=peep, lengths=lengths)
    attrs = {"direction": direction} | ({"hidden_size": 3} if hidden_attr else {})
    if op == "LSTMTraining":
        return _model(op, fwd, LSTM_IN, LSTM_OUT, attrs, opset=opset), fwd
    feeds = _grad_feeds(rng, fwd, direction)
    return _model(op, feeds, GRAD_IN, GRAD_OUT, attrs, opset=opset), feeds


def _gru(op: str, rng, direction="forward", lengths=None, lbr=1, bias=True, opset=17):
    d = 2 if direction == "bidirectional" else 1
    fwd = _gru_inputs(rng, directions=d, bias=bias, lengths=lengths)
    attrs = {"direction": direction, "linear_before_reset": lbr, "hidden_size": 3}
    if op == "GRUTraining":
        return _model(op, fwd, GRU_IN, GRU_OUT, attrs, opset=opset), fwd
    feeds = _gru_grad_feeds(rng, fwd, direction, lbr)
    return _model(op, feeds, GRU_GRAD_IN, GRU_GRAD_OUT, attrs, opset=opset), feeds


# the bodies of a forward-direction node with every output requested, no sequence_lengths nor peepholes (None: no
# Scan at all)
BODIES = {
    # onnxruntime's LSTM kernel runs the cell; CAll by a second LSTM kernel with identity activations (a small
    # N H; a Scan of the cell alone otherwise: CELL_SCAN_BODY)
    "LSTMTraining": None,
    # dh + dHAll; dc + (dh o)(1 - tanh^2 c); dz = ([dc, dh, dc, dc] a1) a2 a3; dz R; dc f
    "LSTMGrad": {"Add": 2, "Mul": 6, "Concat": 1, "MatMul": 1},
    # onnxruntime's GRU kernel runs the loop; ZRH is computed for all steps at once from its hidden states
    "GRUTraining": None,
    # dh + dHAll; a_h = (dh (1 - z))(1 - h~^2); [a_z, a_r, a_h r, dh z] = ([dh, a_h, a_h, dh] f1) f2 f3; two Gemms
    # of it: dh z + [a_z, a_r] R_zr, + (a_h r) R_h (a small static batch and H: tests/test_gru_grad_blocks.py)
    "GRUGrad": {"Add": 1, "Mul": 5, "Concat": 1, "Gemm": 2},
}


@pytest.mark.parametrize("op", list(BODIES))
def test_onnxruntime_bodies_per_step(op, stock_from_one_step):
    rng = np.random.default_rng(40)
    model, _ = (_lstm if op.startswith("LSTM") else _gru)(op, rng)
    lowered = _lowered(model)
    if op.endswith("Training"):  # onnxruntime's own kernel runs the recurrence (LSTM: and the cell states)
        kernels = collections.Counter(n.op_type for n in lowered.graph.node)[op[:-len("Training")]]
        assert kernels == (2 if op == "LSTMTraining" else 1)
    if BODIES[op] is None:
        assert _bodies(lowered) == []
        return
    ((scan, body),) = _bodies(lowered)
    assert body == BODIES[op]
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in scan.attribute}
    if op.endswith("Grad"):  # backpropagation runs backwards: by the Scan's directions, no reversing Slices
        assert attributes["scan_input_directions"] == [1] * attributes["num_scan_inputs"]
        assert all(d == 1 for d in attributes["scan_output_directions"])
        assert not [n for n in lowered.graph.node if n.op_type == "Slice" and len(n.input) == 5]
    portable = _lowered(model, "portable")
    ((_, portable_body),) = _bodies(portable)
    assert "Split" not in portable_body and "Gemm" not in portable_body  # not in lowering.rules.PORTABLE_OPS


# LSTMTraining's cell states past recurrent.CELL_KERNEL_LIMIT: a Scan of the cell alone, c f (the step's output) and
# c f + i g (the new state; every step's c is the same Add of its c f and i g after the loop)
CELL_SCAN_BODY = {"Mul": 1, "Add": 1}


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("state", [True, False])
def test_lstm_cell_states_by_the_kernel_are_the_cell_scans_bits(direction, state, stock_from_one_step, monkeypatch):
    """CAll by onnxruntime's LSTM kernel with identity activations (the gates fed as X through an identity W, o = 1
    by its bias, R = 0) is the cell Scan's c f + i g bit for bit, and so is every other output; with N H past
    CELL_KERNEL_LIMIT the Scan of the cell alone runs, two kernels a step."""
    rng = np.random.default_rng(44)
    directions = 2 if direction == "bidirectional" else 1
    inputs = _lstm_inputs(rng, steps=6, batch=3, directions=directions, state=state)
    model = _model("LSTMTraining", inputs, LSTM_IN, LSTM_OUT, {"hidden_size": 3, "direction": direction})
    feeds = {k: v for k, v in inputs.items() if v is not None}
    by_kernel = _lowered(model)
    # the recurrence's one kernel (every direction), one for each direction's cell states
    assert collections.Counter(n.op_type for n in by_kernel.graph.node)["LSTM"] == 1 + directions
    assert _bodies(by_kernel) == []
    monkeypatch.setattr(recurrent, "CELL_KERNEL_LIMIT", 3 * 3 - 1)
    by_scan = _lowered(model)
    assert [body for _, body in _bodies(by_scan)] == [CELL_SCAN_BODY] * directions
    want, got = run_model(by_scan, feeds), run_model(by_kernel, feeds)
    assert set(got) == set(LSTM_OUT)
    for name, value in want.items():
        assert np.array_equal(got[name], value), name


# with sequence_lengths the forward ops keep a Scan of the whole step (the stock kernels' output for a step past a
# sequence's end is not the Scan's): two Gemms (onnxruntime fuses the Sigmoid, and LSTM's Tanh, into them), one
# Sigmoid, gate blocks cut by Split, the requested sequence outputs packed by one Concat, the weights read by name,
# a Where per state and per packed output
SCAN_BODIES = {
    "LSTMTraining": {"Gemm": 2, "Split": 1, "Sigmoid": 1, "Tanh": 2, "Mul": 3, "Add": 1, "Concat": 1, "Where": 3},
    "GRUTraining": {"Gemm": 2, "Split": 1, "Add": 2, "Sigmoid": 1, "Mul": 3, "Sub": 1, "Tanh": 1, "Concat": 1,
                    "Where": 2},
}


@pytest.mark.parametrize("op", list(SCAN_BODIES))
def test_onnxruntime_scan_bodies_with_sequence_lengths(op):
    rng = np.random.default_rng(40)
    model, _ = (_lstm if op.startswith("LSTM") else _gru)(op, rng, lengths=[2, 4, 3])
    lowered = _lowered(model)
    assert op[:-len("Training")] not in {n.op_type for n in lowered.graph.node}
    ((_, body),) = _bodies(lowered)
    assert body == SCAN_BODIES[op]


@pytest.fixture
def stock_from_one_step(monkeypatch):
    """The stock kernels' form at any sequence length (recurrent.STOCK_STEPS keeps the Scan for short ones)."""
    monkeypatch.setattr(recurrent, "STOCK_STEPS", {"LSTMTraining": 1, "GRUTraining": 1})


@pytest.mark.parametrize("op, steps, batch", [("LSTMTraining", 3, 3), ("LSTMTraining", 4, 3), ("LSTMTraining", 4, 1366),
                                              ("GRUTraining", 8, 3), ("GRUTraining", 9, 3), ("GRUTraining", 9, 203)])
def test_the_stock_form_for_small_steps(op, steps, batch):
    """The stock kernel from recurrent.STOCK_STEPS static steps up to STOCK_GATES gate values (steps x batch x
    gates x H, H = 3 here: 4 x 1366 x 4 x 3 and 9 x 203 x 3 x 3 are just past it), the Scan otherwise and with the
    steps or the batch unknown."""
    rng = np.random.default_rng(43)
    inputs = (_lstm_inputs if op.startswith("LSTM") else _gru_inputs)(rng, steps=steps, batch=batch)
    names, outputs = (LSTM_IN, LSTM_OUT) if op.startswith("LSTM") else (GRU_IN, GRU_OUT)
    attrs = {"hidden_size": 3} | ({} if op.startswith("LSTM") else {"linear_before_reset": 1})
    model = _model(op, inputs, names, outputs, attrs)
    stock = op[:-len("Training")] in {n.op_type for n in _lowered(model).graph.node}
    gates = steps * batch * (4 if op.startswith("LSTM") else 3) * 3
    assert stock == (steps >= recurrent.STOCK_STEPS[op] and gates <= recurrent.STOCK_GATES[op])
    for axis in (0, 1):
        symbolic = onnx.ModelProto()
        symbolic.CopyFrom(model)
        x = next(v for v in symbolic.graph.input if v.name == "X")
        x.type.tensor_type.shape.dim[axis].dim_param = "S" if axis == 0 else "N"
        assert op[:-len("Training")] not in {n.op_type for n in _lowered(symbolic).graph.node}


RECORDED = [c for c in recorded_cases() if c["op_type"] in ("LSTMTraining", "GRUTraining")]


@pytest.mark.parametrize("case", RECORDED, ids=lambda c: f"{c['op_type']}-{c['variant']}")
def test_the_stock_form_is_as_accurate_as_the_native_kernel(case, stock_from_one_step):
    """The recorded cases are 3-4 steps (the Scan's lengths, tests/test_accuracy_vs_native.py measures that form):
    with the stock form taken, every output is at least as accurate as onnxruntime-training's, with no exception."""
    for row in measure(case, targets=("onnxruntime",)):
        if "native" in row:
            limit = row["native"] * (1 + 1e-9) + HALF_ULP[row["dtype"]]
            assert row["onnxruntime"] <= limit, row


@pytest.mark.parametrize("case", [c for c in RECORDED if c["op_type"] == "GRUTraining"], ids=lambda c: c["variant"])
def test_onnxruntime_gru_form_gives_the_native_kernels_bits(case, stock_from_one_step):
    """Every recorded GRUTraining case: the onnxruntime form's outputs are onnxruntime-training's own, bit for bit
    (its kernel and onnxruntime's GRU share their loop; ZRH, computed for all steps at once from the stock kernel's
    hidden states, follows its order of operations and its activations: MLAS's logistic for z, the rational tanh of
    rnn_helpers for r and h~). LSTMTraining's stock form is not the native bits (onnxruntime's LSTM kernel rounds a
    third of the recorded hidden states otherwise), only as accurate (the test above)."""
    model, feeds, recorded = load_recorded(case)
    lowered = _lowered(model)
    assert "GRU" in {n.op_type for n in lowered.graph.node}
    got = run_model(lowered, {i.name: feeds[i.name] for i in model.graph.input if i.name in feeds})
    for name, value in recorded.items():
        assert np.array_equal(got[name], value), name


CASES = [("LSTMTraining", d, lengths, peep) for d, lengths, peep in
         itertools.product(["forward", "reverse", "bidirectional"], [None, [2, 4, 3]], [False, True])] + \
        [("LSTMGrad", d, lengths, False) for d, lengths in
         itertools.product(["forward", "reverse", "bidirectional"], [None, [2, 4, 3]])] + \
        [(op, d, lengths, lbr) for op, d, lengths, lbr in
         itertools.product(["GRUTraining", "GRUGrad"], ["forward", "bidirectional"], [None, [2, 4, 3]], [0, 1])]


@pytest.mark.parametrize("op, direction, lengths, flag", CASES, ids=lambda v: str(v))
def test_onnxruntime_form_gives_the_portable_forms_bits(op, direction, lengths, flag):
    """flag: peepholes (LSTM) or linear_before_reset (GRU). Where the onnxruntime target takes the stock kernel's
    form (here LSTMTraining's 4 steps without sequence_lengths or peepholes) it rounds otherwise than the portable
    Scan (test_the_stock_form_is_as_accurate_as_the_native_kernel; every direction against the float64 reference in
    tests/test_recurrent.py): the two forms agree to 1e-6 of the scale there, bit for bit everywhere else."""
    rng = np.random.default_rng(41)
    if op.startswith("LSTM"):
        model, feeds = _lstm(op, rng, direction, lengths, peep=flag)
    else:
        model, feeds = _gru(op, rng, direction, lengths, lbr=flag)
    feeds = {k: v for k, v in feeds.items() if v is not None}
    lowered = _lowered(model)
    ours, portable = run_model(lowered, feeds), run_model(_lowered(model, "portable"), feeds)
    stock = bool({"LSTM", "GRU"} & {n.op_type for n in lowered.graph.node})
    for name, value in portable.items():
        assert ours[name].dtype == value.dtype == np.float32
        if stock:
            np.testing.assert_allclose(ours[name], value, rtol=0, atol=1e-6 * max(1.0, np.abs(value).max()))
        else:
            assert np.array_equal(ours[name], value), name


@pytest.mark.parametrize("op", ["LSTMTraining", "LSTMGrad"])
def test_opset_12_and_a_run_time_hidden_size(op):
    """Split's sizes as an attribute (opset 12); without hidden_size and with R's dimensions symbolic the
    onnxruntime target cuts the gates with Gather views like the portable one: the same bits either way."""
    rng = np.random.default_rng(42)
    model, feeds = _lstm(op, rng, lengths=[2, 4, 3], opset=12)
    feeds = {k: v for k, v in feeds.items() if v is not None}
    want = run_model(_lowered(model, "portable"), feeds)
    got = run_model(_lowered(model), feeds)
    assert all(np.array_equal(got[k], v) for k, v in want.items())
    model, _ = _lstm(op, rng, lengths=[2, 4, 3], hidden_attr=False)
    for value in model.graph.input:
        if value.name == "R":
            for dim, symbol in zip(value.type.tensor_type.shape.dim, ("D", "G", "H"), strict=True):
                dim.dim_param = symbol
    lowered = _lowered(model)
    assert all("Split" not in body for _, body in _bodies(lowered))
    got = run_model(lowered, feeds)
    assert all(np.array_equal(got[k], v) for k, v in want.items())
