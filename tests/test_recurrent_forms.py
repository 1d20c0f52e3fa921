"""The recurrent lowering's per-step forms (issue 31: fewer kernels per small training step). On the onnxruntime
target the Scan bodies are as few nodes as asserted here (each one a kernel per time step): gate blocks cut by
Split, one Sigmoid over the stacked gates, the weights read transposed by a Gemm, the requested sequence outputs
packed into one scan output, the backward's gate factors computed before the loop, backwards Scans run with
scan_input_directions and the backward bodies reading the weights by name. That form gives, in f32, the portable
form's bits (Gather views, MatMul with transposed weights, reversing Slices, weights as Scan states), which
tests/test_recurrent.py checks against the float64 reference: every direction, sequence lengths, peepholes, GRU's
linear_before_reset, opsets 12 and 17, and H known only at run time."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import onnx
import pytest
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


# the bodies of a forward-direction node with every output requested, no sequence_lengths nor peepholes
BODIES = {
    # h R_iof^T + x_iof and h R_c^T + x_c as two Gemms (onnxruntime fuses the Sigmoid and the Tanh into them); one
    # Sigmoid; Split into i, o, f; c' = f c + i g; h' = o tanh c'; [h', c', iofc] as one Concat; R_iof, R_c read by
    # name (no Identity passing them through)
    "LSTMTraining": {"Gemm": 2, "Split": 1, "Sigmoid": 1, "Tanh": 2, "Mul": 3, "Add": 1, "Concat": 1},
    # dh + dHAll; dc + (dh o)(1 - tanh^2 c); dz = ([dc, dh, dc, dc] a1) a2 a3; dz R; dc f
    "LSTMGrad": {"Add": 2, "Mul": 6, "Concat": 1, "MatMul": 1},
    # h R_zr^T + x_zr and h R_h^T + Rb_h as two Gemms (onnxruntime fuses the Sigmoid into the first); one Sigmoid;
    # Split z, r; x_h + r (h R_h^T + Rb_h); Tanh; (1 - z) h~ + z h; [h', zrh] as one Concat; R_zr, R_h and Rb_h
    # read by name
    "GRUTraining": {"Gemm": 2, "Split": 1, "Add": 2, "Sigmoid": 1, "Mul": 3, "Sub": 1, "Tanh": 1, "Concat": 1},
    # dh + dHAll; a_h = (dh (1 - z))(1 - h~^2); [a_z, a_r, a_h r, dh z] = ([dh, a_h, a_h, dh] f1) f2 f3; two Gemms
    # of it: dh z + [a_z, a_r] R_zr, + (a_h r) R_h (a small static batch and H: tests/test_gru_grad_blocks.py)
    "GRUGrad": {"Add": 1, "Mul": 5, "Concat": 1, "Gemm": 2},
}


@pytest.mark.parametrize("op", list(BODIES))
def test_onnxruntime_bodies_per_step(op):
    rng = np.random.default_rng(40)
    model, _ = (_lstm if op.startswith("LSTM") else _gru)(op, rng)
    lowered = _lowered(model)
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


CASES = [("LSTMTraining", d, lengths, peep) for d, lengths, peep in
         itertools.product(["forward", "reverse", "bidirectional"], [None, [2, 4, 3]], [False, True])] + \
        [("LSTMGrad", d, lengths, False) for d, lengths in
         itertools.product(["forward", "reverse", "bidirectional"], [None, [2, 4, 3]])] + \
        [(op, d, lengths, lbr) for op, d, lengths, lbr in
         itertools.product(["GRUTraining", "GRUGrad"], ["forward", "bidirectional"], [None, [2, 4, 3]], [0, 1])]


@pytest.mark.parametrize("op, direction, lengths, flag", CASES, ids=lambda v: str(v))
def test_onnxruntime_form_gives_the_portable_forms_bits(op, direction, lengths, flag):
    """flag: peepholes (LSTM) or linear_before_reset (GRU)."""
    rng = np.random.default_rng(41)
    if op.startswith("LSTM"):
        model, feeds = _lstm(op, rng, direction, lengths, peep=flag)
    else:
        model, feeds = _gru(op, rng, direction, lengths, lbr=flag)
    feeds = {k: v for k, v in feeds.items() if v is not None}
    ours, portable = (run_model(_lowered(model, target), feeds) for target in ("onnxruntime", "portable"))
    for name, value in portable.items():
        assert ours[name].dtype == value.dtype == np.float32
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
