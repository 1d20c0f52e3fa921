"""The recurrent lowering's forms outside the Scan loops (issue 31, fewer kernels per small training step; the
bodies are pinned by tests/test_recurrent_forms.py): with one direction W and R lose their direction axis by a
Squeeze (a view the train-step model's flat state cuts from the parameter's buffer without a kernel), LSTMGrad
reads R as the forward does ([4H, H]), GRUTraining's biases with linear_before_reset 1 (H static, onnxruntime)
are one MatMul of B's row with a constant 0/1 packing and one Split, shared with GRUGrad, with 0 the sum of B's
[2, 3H] rows, and GRUGrad's dB one ReduceSum. Each gives the values of the form it replaced: sums of at most two
nonzero terms, the same column sums."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from test_portable import _run as _run_any
from test_recurrent import (
    GRAD_IN,
    GRAD_OUT,
    GRU_GRAD_IN,
    GRU_GRAD_OUT,
    GRU_IN,
    GRU_OUT,
    LSTM_IN,
    LSTM_OUT,
    _close,
    _grad_feeds,
    _gru_grad_feeds,
    _gru_inputs,
    _lowered,
    _lstm_inputs,
    _model,
)

from lowering.rules import recurrent
from lowering.rules.recurrent import PACKED_BIAS_LIMIT
from runtime import reference_recurrent as ref
from runtime.session import run_model


def _outside(model: onnx.ModelProto) -> collections.Counter:
    """The op types of the lowered graph's nodes outside the Scans (Constants are no kernels)."""
    return collections.Counter(n.op_type for n in model.graph.node if n.op_type != "Constant")


def _readers(model: onnx.ModelProto, name: str) -> list[str]:
    return [n.op_type for n in model.graph.node if name in n.input]


# GRUTraining with sequence lengths: the Scan form these bias tests pin, whatever recurrent.STOCK_STEPS says (a
# short, small sequence without them runs onnxruntime's own GRU kernel, tests/test_recurrent_forms.py; its ZRH reads
# the same packed biases)
SCAN_LENGTHS = [4, 2, 3]


def _case(op: str, direction: str, lbr: int = 1, hidden: int = 3, state: bool = True, lengths=None):
    rng = np.random.default_rng(50)
    d = 2 if direction == "bidirectional" else 1
    attrs = {"direction": direction, "hidden_size": hidden}
    if op.startswith("LSTM"):
        fwd = _lstm_inputs(rng, directions=d, hidden=hidden, state=state)
        if op == "LSTMTraining":
            return _model(op, fwd, LSTM_IN, LSTM_OUT, attrs), fwd
        feeds = _grad_feeds(rng, fwd, direction)
        return _model(op, feeds, GRAD_IN, GRAD_OUT, attrs), feeds
    fwd = _gru_inputs(rng, directions=d, hidden=hidden, state=state, lengths=lengths)
    attrs["linear_before_reset"] = lbr
    if op == "GRUTraining":
        return _model(op, fwd, GRU_IN, GRU_OUT, attrs), fwd
    feeds = _gru_grad_feeds(rng, fwd, direction, lbr)
    return _model(op, feeds, GRU_GRAD_IN, GRU_GRAD_OUT, attrs), feeds


def _run(model: onnx.ModelProto, feeds: dict, target: str = "onnxruntime") -> dict:
    return run_model(_lowered(model, target), {k: v for k, v in feeds.items() if v is not None})


@pytest.mark.parametrize("op", ["LSTMTraining", "LSTMGrad", "GRUTraining", "GRUGrad"])
@pytest.mark.parametrize("target", ["onnxruntime", "portable"])
def test_one_direction_weights_are_squeezed(op, target):
    model, _ = _case(op, "forward")
    lowered = _lowered(model, target)
    for name in ("W", "R"):
        readers = _readers(lowered, name)
        if readers:  # LSTMGrad reads W for dX only
            assert "Gather" not in readers and "Squeeze" in readers, (name, readers)
    both, _ = _case(op, "bidirectional")
    assert "Gather" in _readers(_lowered(both, target), "R")


def test_lstm_grad_reads_r_like_the_forward():
    """One direction: the forward and the backward read the same [4H, H] view of R, one Squeeze each (onnxruntime
    merges the two; the flat state makes it a view of its buffer)."""
    model, feeds = _case("LSTMGrad", "forward")
    lowered = _lowered(model)
    assert _readers(lowered, "R") == ["Squeeze"]
    scan = next(n for n in lowered.graph.node if n.op_type == "Scan")
    squeezed = next(n.output[0] for n in lowered.graph.node if n.op_type == "Squeeze" and n.input[0] == "R")
    body = next(a.g for a in scan.attribute if a.name == "body")
    assert any(squeezed in n.input for n in body.node if n.op_type == "MatMul")  # read by name, [4H, H]


@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_gru_biases_packed(direction, monkeypatch):
    """linear_before_reset 1, H static: one MatMul of B's row with the constant packing and one Split make the x
    bias and R_bh (no Slice/Add/Concat/Reshape chain), and GRUGrad emits the same nodes for R_bh; the
    outputs are the portable form's (which adds the blocks) on biases with exact zeros of both signs, ties and
    magnitudes far apart."""
    model, feeds = _case("GRUTraining", direction, lengths=SCAN_LENGTHS)
    rng = np.random.default_rng(51)
    d = feeds["B"].shape[0]
    tricky = np.array([0.0, -0.0, 1e-30, 3.0, 2.0 ** -24, 1.0, 1e4, 0.1], np.float32)
    signs = rng.choice(np.array([1, -1], np.float32), feeds["B"].shape)
    feeds["B"] = rng.choice(tricky, size=feeds["B"].shape) * signs
    lowered = _lowered(model)
    ops = _outside(lowered)
    # per direction x W^T and the packing, one Add (the x bias); Concats only where two directions' outputs join
    assert ops["MatMul"] == 2 * d and ops["Add"] == d and ops["Concat"] == (0 if d == 1 else 2)
    packing = [n for n in lowered.graph.node if n.op_type == "MatMul" and _readers(lowered, n.output[0]) == ["Split"]]
    assert len(packing) == d
    got, want = _run(model, feeds), _run(model, feeds, "portable")
    assert all(np.array_equal(got[k], v) for k, v in want.items())
    # without sequence lengths (onnxruntime's GRU kernel, taken here at any length; its ZRH from the same
    # packing): its rounding, the values
    monkeypatch.setattr(recurrent, "STOCK_STEPS", {**recurrent.STOCK_STEPS, "GRUTraining": 1})
    stock, stock_feeds = _case("GRUTraining", direction)
    assert "GRU" in {n.op_type for n in _lowered(stock).graph.node}
    stock_feeds["B"] = np.ascontiguousarray(feeds["B"])
    got, want = _run(stock, stock_feeds), _run(stock, stock_feeds, "portable")
    assert all(np.allclose(got[k], v, rtol=0, atol=1e-6) for k, v in want.items())
    grad, grad_feeds = _case("GRUGrad", direction)
    grad_feeds["B"] = feeds["B"]
    got, want = _run(grad, grad_feeds), _run(grad, grad_feeds, "portable")
    assert all(np.array_equal(got[k], v) for k, v in want.items())


def test_gru_biases_past_the_packing_limit():
    """Past PACKED_BIAS_LIMIT the blocks are added as before: same outputs."""
    hidden = 27  # the packing is [6H, 4H]
    assert 24 * hidden * hidden > PACKED_BIAS_LIMIT >= 24 * 26 * 26
    model, feeds = _case("GRUTraining", "forward", hidden=hidden, lengths=SCAN_LENGTHS)
    lowered = _lowered(model)
    assert _outside(lowered)["Concat"] == 1  # [Wb_zr + Rb_zr, Wb_h]
    got, want = _run(model, feeds), _run(model, feeds, "portable")
    assert all(np.array_equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("op", ["GRUTraining", "GRUGrad"])
def test_gru_linear_after_reset_bias_is_one_row_sum(op):
    """linear_before_reset 0: the x bias is one ReduceSum of B's [2, 3H] rows (GRUGrad reads no B)."""
    model, feeds = _case(op, "forward", lbr=0, lengths=SCAN_LENGTHS if op == "GRUTraining" else None)
    lowered = _lowered(model)
    readers = _readers(lowered, "B")
    if op == "GRUTraining":
        assert readers == ["Reshape"] and "Add" not in _readers(lowered, next(
            n.output[0] for n in lowered.graph.node if n.op_type == "Reshape" and n.input[0] == "B"))
    else:
        assert readers == []
    got, want = _run(model, feeds), _run(model, feeds, "portable")
    assert all(np.array_equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("lbr", [0, 1])
def test_gru_grad_bias_and_recurrent_weights(lbr):
    """GRUGrad's dB: one ReduceSum of [a_zr, a_h, a_zr, a_h r] joined (dW and dR one each); dR with
    linear_before_reset 1 one product of [a_zr, a_h r]^T and h_prev (with 0 the R_h rows read r h_prev: two)."""
    model, _ = _case("GRUGrad", "forward", lbr=lbr)
    ops = _outside(_lowered(model))
    # dX, dW and dR's products; with linear_before_reset 1 also the bias packing, and q = h_prev R_h^T + R_bh as the
    # forward's stock form computes it (one Gemm on [S N, H] rows, which onnxruntime then runs once for both)
    assert ops["ReduceSum"] == 3 and ops["MatMul"] == 4 and ops["Gemm"] == lbr


@pytest.mark.parametrize("shape", [(5, 3, 6), (4, 3, 3), (50, 32, 128), (7, 1, 5)])
def test_reduce_sum_of_joined_parts_is_each_parts_sum(shape):
    """The premise of GRUGrad's one dB ReduceSum: onnxruntime sums each column of [S, N, k] over (0, 1) in the same
    order whatever the columns beside it, so the sum of [a, b, a, c] joined is [sum a, sum b, sum a, sum c] bit for
    bit."""
    s, n, h = shape
    rng = np.random.default_rng(52)
    parts = {"a": rng.standard_normal((s, n, 2 * h)), "b": rng.standard_normal((s, n, h)) * 1e3,
             "c": rng.standard_normal((s, n, h)) * 1e-3}
    parts = {k: v.astype(np.float32) for k, v in parts.items()}
    axes = helper.make_tensor("axes", TensorProto.INT64, [2], [0, 1])
    nodes = [helper.make_node("Concat", ["a", "b", "a", "c"], ["joined"], axis=2),
             helper.make_node("ReduceSum", ["joined", "axes"], ["sum"], keepdims=0)]
    nodes += [helper.make_node("ReduceSum", [k, "axes"], [f"sum_{k}"], keepdims=0) for k in parts]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape) for k, v in parts.items()],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("sum", "sum_a", "sum_b", "sum_c")],
        [axes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    joined, a, b, c = ort.InferenceSession(model.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"]).run(None, parts)
    assert np.array_equal(joined, np.concatenate([a, b, a, c]))


@pytest.mark.parametrize("runtime", ["openvino", "tract", "reference"])
@pytest.mark.parametrize("op, lbr", [("LSTMTraining", 1), ("LSTMGrad", 1), ("GRUTraining", 0), ("GRUTraining", 1),
                                     ("GRUGrad", 0), ("GRUGrad", 1)])
def test_one_direction_portable_forms_in_every_runtime(op, lbr, runtime, tmp_path):
    """The portable target's one-direction forms (W, R, initial states squeezed; GRU's x bias the sum of B's rows
    with linear_before_reset 0) in the other runtimes, against the float64 reference. OpenVINO runs GRUGrad
    without initial_h: it folds h_prev's Unsqueeze of the squeezed (or, before, gathered) initial_h into the input,
    whose port test_portable's runner then finds under the Unsqueeze's name."""
    model, feeds = _case(op, "forward", lbr=lbr, state=not (runtime == "openvino" and op == "GRUGrad"))
    names = {"LSTMTraining": LSTM_IN, "LSTMGrad": GRAD_IN, "GRUTraining": GRU_IN, "GRUGrad": GRU_GRAD_IN}[op]
    attrs = {} if op.startswith("LSTM") else {"linear_before_reset": lbr}
    want = getattr(ref, {"LSTMTraining": "lstm_training", "LSTMGrad": "lstm_grad", "GRUTraining": "gru_training",
                         "GRUGrad": "gru_grad"}[op])(*(feeds[n] for n in names), **attrs)
    got = _run_any(runtime, _lowered(model, "portable"), {k: v for k, v in feeds.items() if v is not None}, tmp_path)
    for name in (o for o in model.graph.output):
        _close(np.asarray(got[name.name]), want[name.name], 1e-5, f"{runtime} {name.name}")
