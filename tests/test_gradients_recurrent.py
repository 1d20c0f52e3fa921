"""The recurrent gradient rules (lowering/training/gradients/recurrent.py): LSTM -> LSTMTraining + LSTMGrad,
GRU -> GRUTraining + GRUGrad, as onnxruntime-training's generator rewrites and differentiates them.

Each case is a tiny forward model: X = xin + xoff (``xoff`` a parameter, so dX is checked too), one LSTM or GRU
whose W, R and (when given) B, initial_h, initial_c are parameters, the loss a weighted sum of the outputs the
case uses (the others get no gradient: Y only, Y_h only, ...). ``build_artifacts`` makes the training model
(its custom nodes verified against the project's specs, as ``oplower check`` does), which is lowered and run in
onnxruntime; its gradients are compared with central finite differences of a float64 NumPy model of the ONNX
LSTM/GRU (sequence_lens included), itself checked against onnxruntime's own LSTM/GRU. Unsupported attributes
are one-line errors.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from _artifacts import gradients_exposed
from onnx import helper, numpy_helper

from lowering.passes import lower_model
from lowering.training.artifacts import build_artifacts
from opdef.errors import OplowerError
from opdef.model_verify import verify_model
from opdef.registry import load_schemas
from runtime.session import run_model

S, N, IN, H = 4, 3, 2, 3  # steps, batch, input size, hidden size
ACCUMULATOR = ("com.microsoft", "InPlaceAccumulatorV2")
_GATES = {"LSTM": 4, "GRU": 3}


# -- the float64 truth: ONNX LSTM / GRU semantics in NumPy ---------------------------------------------------

def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _run_direction(kind, x, w, r, b, h, c, lengths, backwards, linear_before_reset):
    """One direction over the whole batch; steps at t >= lengths[n] are skipped (state carried, output 0)."""
    y = np.zeros((x.shape[0], x.shape[1], w.shape[0] // _GATES[kind]))
    order = range(x.shape[0] - 1, -1, -1) if backwards else range(x.shape[0])
    for t in order:
        active = (t < lengths)[:, None]
        if kind == "LSTM":
            wb, rb = np.split(b, 2)
            zi, zo, zf, zc = np.split(x[t] @ w.T + h @ r.T + wb + rb, 4, axis=-1)
            i, o, f, g = _sigmoid(zi), _sigmoid(zo), _sigmoid(zf), np.tanh(zc)
            c_new = f * c + i * g
            h_new = o * np.tanh(c_new)
            c = np.where(active, c_new, c)
        else:
            wz, wr, wh = np.split(w, 3)
            rz, rr, rh = np.split(r, 3)
            wbz, wbr, wbh, rbz, rbr, rbh = np.split(b, 6)
            z = _sigmoid(x[t] @ wz.T + h @ rz.T + wbz + rbz)
            rg = _sigmoid(x[t] @ wr.T + h @ rr.T + wbr + rbr)
            if linear_before_reset:
                hh = np.tanh(x[t] @ wh.T + wbh + rg * (h @ rh.T + rbh))
            else:
                hh = np.tanh(x[t] @ wh.T + (rg * h) @ rh.T + rbh + wbh)
            h_new = (1 - z) * hh + z * h
        y[t] = np.where(active, h_new, 0.0)
        h = np.where(active, h_new, h)
    return y, h, c


def reference(kind, params, direction, lengths=None, linear_before_reset=0):
    """Y [S, D, N, H], Y_h [D, N, H], Y_c [D, N, H] (None for a GRU) in float64."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = p["xin"] + p["xoff"]
    dirs = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}[direction]
    g = _GATES[kind]
    lengths = np.full(N, S) if lengths is None else np.asarray(lengths)
    ys, hs, cs = [], [], []
    for d, backwards in enumerate(dirs):
        b = p["B"][d] if "B" in p else np.zeros(2 * g * H)
        h0 = p["initial_h"][d] if "initial_h" in p else np.zeros((N, H))
        c0 = p["initial_c"][d] if "initial_c" in p else np.zeros((N, H))
        y, h, c = _run_direction(kind, x, p["W"][d], p["R"][d], b, h0, c0, lengths, backwards, linear_before_reset)
        ys.append(y)
        hs.append(h)
        cs.append(c)
    return np.stack(ys, 1), np.stack(hs), (np.stack(cs) if kind == "LSTM" else None)


def reference_loss(case, params) -> float:
    outs = reference(case.kind, params, case.direction, case.lengths, case.linear_before_reset)
    return float(sum(np.sum(outs[k] * params[f"c{k}"]) for k in case.used))


# -- the cases ----------------------------------------------------------------------------------------------

class Case:
    def __init__(self, kind, direction="forward", *, used=(0, 1, 2), bias=True, h0=True, c0=True, lengths=None,
                 linear_before_reset=0, dtype=np.float64, seed=0):
        self.kind, self.direction = kind, direction
        self.used = tuple(k for k in used if k < (3 if kind == "LSTM" else 2))
        self.bias, self.h0, self.c0 = bias, h0, c0 and kind == "LSTM"
        self.lengths = None if lengths is None else np.asarray(lengths, np.int32)
        self.linear_before_reset, self.dtype, self.seed = linear_before_reset, dtype, seed
        self.id = f"{kind}-{direction}-used{''.join(map(str, self.used))}" + ("-B" if bias else "") + \
            ("-h0" if h0 else "") + ("-c0" if self.c0 else "") + ("-lens" if lengths is not None else "") + \
            (f"-lbr{linear_before_reset}" if kind == "GRU" else "") + f"-{np.dtype(dtype).name}"

    def params(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        d = 2 if self.direction == "bidirectional" else 1
        g = _GATES[self.kind]
        p = {"xin": rng.standard_normal((S, N, IN)), "xoff": 0.3 * rng.standard_normal((S, N, IN)),
             "W": 0.6 * rng.standard_normal((d, g * H, IN)), "R": 0.6 * rng.standard_normal((d, g * H, H))}
        if self.bias:
            p["B"] = 0.5 * rng.standard_normal((d, 2 * g * H))
        if self.h0:
            p["initial_h"] = 0.5 * rng.standard_normal((d, N, H))
        if self.c0:
            p["initial_c"] = 0.5 * rng.standard_normal((d, N, H))
        for k, shape in ((0, (S, d, N, H)), (1, (d, N, H)), (2, (d, N, H))):
            p[f"c{k}"] = rng.standard_normal(shape)
        return {k: v.astype(self.dtype) for k, v in p.items()}

    def trainable(self) -> list[str]:
        return [k for k in ("xoff", "W", "R", "B", "initial_h", "initial_c") if k in self.params()]

    def model(self, **attrs) -> onnx.ModelProto:
        p = self.params()
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(self.dtype))
        count = 3 if self.kind == "LSTM" else 2
        outputs = [f"out{k}" if k in self.used else "" for k in range(count)]
        while not outputs[-1]:
            outputs.pop()
        inputs = ["X", "W", "R", "B" if self.bias else "", "lens" if self.lengths is not None else "",
                  "initial_h" if self.h0 else ""] + (["initial_c" if self.c0 else ""] if self.kind == "LSTM" else [])
        while not inputs[-1]:
            inputs.pop()
        if self.kind == "GRU":
            attrs.setdefault("linear_before_reset", self.linear_before_reset)
        nodes = [helper.make_node("Add", ["xin", "xoff"], ["X"]),
                 helper.make_node(self.kind, inputs, outputs, name="rnn", hidden_size=H, direction=self.direction,
                                  **attrs)]
        terms = []
        for k in self.used:
            nodes.append(helper.make_node("Mul", [f"out{k}", f"c{k}"], [f"m{k}"]))
            nodes.append(helper.make_node("ReduceSum", [f"m{k}"], [f"s{k}"], keepdims=0))
            terms.append(f"s{k}")
        total = terms[0]
        for k, term in enumerate(terms[1:]):
            nodes.append(helper.make_node("Add", [total, term], [f"t{k}"]))
            total = f"t{k}"
        nodes.append(helper.make_node("Identity", [total], ["loss"]))
        inits = [numpy_helper.from_array(v, k) for k, v in p.items() if k != "xin"]
        if self.lengths is not None:
            inits.append(numpy_helper.from_array(self.lengths, "lens"))
        graph = helper.make_graph(nodes, "rnn", [helper.make_tensor_value_info("xin", elem, [S, N, IN])],
                                  [helper.make_tensor_value_info("loss", elem, [])], initializer=inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


CASES = [
    Case("LSTM", "forward", dtype=np.float32),
    Case("LSTM", "forward", used=(0,), bias=False, h0=False, c0=False),
    Case("LSTM", "forward", used=(1,), seed=1),
    Case("LSTM", "forward", used=(2,), seed=2),
    Case("LSTM", "reverse", used=(0, 2), seed=3),
    Case("LSTM", "bidirectional", seed=4),
    Case("LSTM", "bidirectional", used=(0, 1), lengths=[4, 2, 3], seed=5),
    Case("GRU", "forward", linear_before_reset=1, dtype=np.float32),
    Case("GRU", "forward", used=(1,), bias=False, h0=False, seed=6),
    Case("GRU", "reverse", linear_before_reset=0, seed=7),
    Case("GRU", "bidirectional", linear_before_reset=1, seed=8),
    Case("GRU", "bidirectional", used=(0,), lengths=[1, 4, 3], linear_before_reset=0, seed=9),
]


def _finite_differences(case, params, names, eps=1e-6) -> dict[str, np.ndarray]:
    p64 = {k: v.astype(np.float64) for k, v in params.items()}
    grads = {}
    for name in names:
        g = np.zeros_like(p64[name])
        for idx in np.ndindex(g.shape):
            keep = p64[name][idx]
            p64[name][idx] = keep + eps
            up = reference_loss(case, p64)
            p64[name][idx] = keep - eps
            down = reference_loss(case, p64)
            p64[name][idx] = keep
            g[idx] = (up - down) / (2 * eps)
        grads[name] = g
    return grads




def _ops(model: onnx.ModelProto) -> list[tuple[str, str]]:
    return [(n.domain, n.op_type) for n in model.graph.node]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gradients_match_float64_finite_differences(case):
    params = case.params()
    art = build_artifacts(case.model(), case.trainable())
    kind = case.kind
    ops = _ops(art.training)
    # reverse / bidirectional without sequence_lens: forward-direction nodes (onnxruntime-training's kernels run
    # the forward direction only), one per direction
    nodes = 2 if case.direction == "bidirectional" and case.lengths is None else 1
    assert ops.count(("com.microsoft", f"{kind}Training")) == nodes
    assert ops.count(("com.microsoft", f"{kind}Grad")) == nodes
    if case.lengths is None:
        assert all(n.op_type != f"{kind}Training" or
                   {a.name: a.s for a in n.attribute}.get("direction", b"forward") == b"forward"
                   for n in art.training.graph.node)
    assert ("", kind) not in ops
    assert ("", kind) in _ops(art.eval) and not any(d == "com.microsoft" for d, _ in _ops(art.eval))

    # oplower check: every custom node verifies, and the gradients have their parameters' shapes
    results = verify_model(art.training, load_schemas())
    grad_node = next(r for r in results if r.op_type == f"{kind}Grad")
    shapes = {name: tuple(t.shape) for name, t in zip(grad_node.outputs, grad_node.output_types, strict=True)
              if name}
    for p in ("W", "R", "B", "initial_h", "initial_c"):
        if p in case.trainable() and nodes == 1 and case.direction == "forward":
            assert shapes[f"{p}_grad"] == params[p].shape, p

    model, exposed = gradients_exposed(art.training)
    lowered = lower_model(model)
    assert not [op for d, op in _ops(lowered) if d not in ("", "ai.onnx")]
    feeds = {k: v for k, v in params.items() if k in {i.name for i in lowered.graph.input}}
    got = run_model(lowered, feeds)
    want_loss = reference_loss(case, params)
    tight = case.dtype == np.float64
    assert abs(float(got[art.loss]) - want_loss) <= (1e-12 if tight else 1e-5) * max(1.0, abs(want_loss))
    truth = _finite_differences(case, params, exposed)
    scale = max(float(np.max(np.abs(g))) for g in truth.values())
    for p, g in truth.items():
        ours = got[exposed[p]]
        assert ours.dtype == case.dtype and ours.shape == g.shape, p
        err = float(np.max(np.abs(ours.astype(np.float64) - g))) / scale
        assert err <= (1e-8 if tight else 2e-6), f"{p}: {err:.3g} of the largest gradient entry"

    # the eval model (standard LSTM/GRU in onnxruntime) computes the same loss
    if case.dtype == np.float32:
        ev = run_model(art.eval, {"xin": params["xin"]} | {k: v for k, v in params.items()
                                                           if k in {i.name for i in art.eval.graph.input}})
        assert abs(float(ev[art.loss]) - want_loss) <= 1e-5 * max(1.0, abs(want_loss))


def test_the_truth_is_onnxruntimes_lstm_and_gru():
    """The NumPy model equals onnxruntime's own LSTM / GRU (float32), sequence_lens and both directions."""
    for case in (Case("LSTM", "bidirectional", lengths=[4, 2, 3], dtype=np.float32, seed=11),
                 Case("GRU", "bidirectional", lengths=[1, 4, 3], linear_before_reset=1, dtype=np.float32, seed=12),
                 Case("GRU", "reverse", linear_before_reset=0, dtype=np.float32, seed=13)):
        params = case.params()
        got = run_model(case.model(), {"xin": params["xin"]})
        assert abs(float(got["loss"]) - reference_loss(case, params)) <= 1e-5 * abs(reference_loss(case, params))


def test_lstm_grad_reads_what_onnxruntime_trainings_builder_passes():
    """LSTMGrad's inputs: X, W, R, sequence_lens, initial_h, initial_c, HAll, CAll, iofc, dHAll, dHFinal,
    dCFinal (no B, no P); an output that gets no gradient leaves its slot empty."""
    case = Case("LSTM", "forward", used=(1,), seed=1)
    art = build_artifacts(case.model(), ["W", "R", "B"])
    fwd = next(n for n in art.training.graph.node if n.op_type == "LSTMTraining")
    grad = next(n for n in art.training.graph.node if n.op_type == "LSTMGrad")
    # Y was not an output: HAll gets a name (the gradient reads it); CFinal stays absent
    assert fwd.name == "rnn_training" and fwd.output[0] and fwd.output[1] == "out1" and fwd.output[2] == ""
    assert fwd.output[3] and fwd.output[4]
    assert list(grad.input[:9]) == ["X", "W", "R", "", "initial_h", "initial_c", fwd.output[0], fwd.output[3],
                                    fwd.output[4]]
    assert grad.input[9] == "" and grad.input[10]  # dHAll absent (Y unused), dHFinal present
    assert list(grad.output) == ["", "W_grad", "R_grad", "B_grad"]
    assert {a.name for a in grad.attribute} == {a.name for a in fwd.attribute} == {"hidden_size", "direction"}


@pytest.mark.parametrize("kind, attrs, message", [
    ("LSTM", {"clip": 3.0}, "clip 3.0 (cell clipping) is not supported by LSTMTraining"),
    ("LSTM", {"input_forget": 1}, "input_forget 1"),
    ("LSTM", {"layout": 1}, "layout 1 (batch-major X and Y) is not supported by LSTMTraining"),
    ("LSTM", {"activations": ["Sigmoid", "Relu", "Tanh"]}, "activations ['Sigmoid', 'Relu', 'Tanh'] are not"),
    ("GRU", {"clip": 1.0}, "clip 1.0 (cell clipping) is not supported by GRUTraining"),
    ("GRU", {"activations": ["HardSigmoid", "Tanh"]}, "activations ['HardSigmoid', 'Tanh']"),
])
def test_unsupported_attributes_are_one_line_errors(kind, attrs, message):
    case = Case(kind, "forward", dtype=np.float32)
    with pytest.raises(OplowerError) as info:
        build_artifacts(case.model(**attrs), case.trainable())
    text = str(info.value)
    assert "\n" not in text and f"node 'rnn' ({kind}): cannot differentiate this {kind}: " in text
    assert message in text


def test_peephole_weights_are_refused_unless_zero():
    case = Case("LSTM", "forward", dtype=np.float32)
    model = case.model()
    node = next(n for n in model.graph.node if n.op_type == "LSTM")
    node.input.extend([""] * (7 - len(node.input)) + ["P"])
    model.graph.initializer.append(numpy_helper.from_array(np.full((1, 3 * H), 0.1, np.float32), "P"))
    with pytest.raises(OplowerError, match="peephole weights"):
        build_artifacts(model, case.trainable())
    model.graph.initializer[-1].CopyFrom(numpy_helper.from_array(np.zeros((1, 3 * H), np.float32), "P"))
    art = build_artifacts(model, case.trainable())
    fwd = next(n for n in art.training.graph.node if n.op_type == "LSTMTraining")
    assert len(fwd.input) == 7  # the zero P is dropped: LSTMGrad differentiates an LSTM without peepholes


def test_an_unsupported_lstm_off_the_gradient_path_stays_standard():
    """A frozen LSTM with clip (its input depends on no parameter) is kept as it is; the rest trains."""
    case = Case("LSTM", "forward", used=(1,), dtype=np.float32)
    model = case.model(clip=5.0)
    model.graph.node[0].input[1] = "xin"  # X = xin + xin: no parameter before the LSTM
    model.graph.node.append(helper.make_node("Mul", ["loss", "scale"], ["scaled"]))
    model.graph.initializer.append(numpy_helper.from_array(np.array(2.0, np.float32), "scale"))
    model.graph.output[0].name = "scaled"
    art = build_artifacts(model, ["scale"], frozen_params=["W", "R", "B", "initial_h", "initial_c"])
    assert ("", "LSTM") in _ops(art.training) and ("com.microsoft", "LSTMGrad") not in _ops(art.training)


def test_float16_is_refused():
    case = Case("GRU", "forward", dtype=np.float16)
    with pytest.raises(OplowerError, match="GRUTraining runs in float32 or float64 only, not float16"):
        build_artifacts(case.model(), case.trainable())
