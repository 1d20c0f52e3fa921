"""Lowering of onnxruntime-training's recurrent ops ``LSTMTraining``, ``LSTMGrad``, ``GRUTraining`` and
``GRUGrad`` (``specs/com.microsoft/``).

Per direction, a ``Scan`` over the steps carries the state; everything that does not depend on the state is
done on the whole sequence outside it, as batched MatMuls and ReduceSums:

- forward: ``X W^T + W_b + R_b`` for all steps at once; the Scan body adds ``h R^T`` and applies the gates.
  The reverse direction runs the same Scan on the sequence reversed (a Slice of step -1) and reverses its
  outputs back into step order. The Scan's scan outputs are only the requested ones of HAll, CAll, iofc.
- backward (backpropagation through time): a Scan opposite to the forward carries dh, dc and emits the gate
  pre-activation gradients dz per step; then dX = dz W, dW = sum dz^T x, dR = sum dz^T h_prev (h_prev: HAll
  shifted by one step, initial_h first), dB and dP by ReduceSum, all outside the loop.
- ``sequence_lengths``: a step mask ``t < L`` (Range, Less); where it is false the state is carried unchanged
  (Where) and the step's outputs are 0, in the forward and the backward Scan alike.
- GRU: the same shape; the backward Scan emits [a_z, a_r, a_h] and, for ``linear_before_reset`` 1, reads the
  reset gate's operand ``h_prev R_h^T + R_bh``, computed for all steps before it.

Scan rather than Loop: measured faster for the backward, equal for the forward (onnxruntime CPU, S=50, N=32,
H=128); unrolling a short static sequence measured the same as the Scan on the S=5 artifacts. Three runtime
quirks shape the Scan (:func:`_scan`): the weights ride it as pass-through states (OpenVINO refuses a body that
reads outer values), backwards runs reverse with Slices (``onnx.reference`` has scan direction 0 only), and a
new state computed from scan inputs alone is reshaped like the carried one (tract, :meth:`_Emit.like`).

One form for both targets: MatMul, Gather, Reshape, Transpose, Concat, Slice, Where, Less, Range, Expand,
Sigmoid, Tanh, elementwise arithmetic and Scan with runtime inputs (lowering.rules.PORTABLE_OPS).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from lowering.builder import NodeBuilder
from lowering.emit_common import Emitter, compute_type
from lowering.rules import TARGETS, LoweringRequest, register_rule
from lowering.rules.elementwise_grad import input_elem

AXES_INPUT_SINCE = 13  # Unsqueeze/Squeeze take axes as an input from here on
_BACKWARDS = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}


class _Emit(Emitter):
    """The helpers the recurrent rules use; ``b`` may be the main graph's builder or a Scan body's."""

    state_zeros: str | None = None  # zeros [N, H] for a missing initial state or final-state gradient, made once

    def unsqueeze(self, x: str, axes: list[int], output: str | None = None) -> str:
        if self.b.opset < AXES_INPUT_SINCE:
            return self.b.op1("Unsqueeze", [x], output, axes=axes)
        return self.b.op1("Unsqueeze", [x, self.ints(axes, "axes")], output)

    def pick(self, x: str, index: int, axis: int) -> str:
        """``x`` at ``index`` along ``axis``, that axis dropped."""
        return self.b.op1("Gather", [x, self.b.const(np.array(index, np.int64), hint="index")], axis=axis)

    def slice(self, x: str, start: int, end: int, axis: int) -> str:
        return self.b.op1("Slice", [x, self.ints([start], "starts"), self.ints([end], "ends"),
                                    self.ints([axis], "axes")])

    def add(self, *terms: str) -> str:
        total = terms[0]
        for t in terms[1:]:
            total = self.b.op1("Add", [total, t])
        return total

    def mul(self, *factors: str) -> str:
        total = factors[0]
        for f in factors[1:]:
            total = self.b.op1("Mul", [total, f])
        return total

    def one_minus(self, x: str) -> str:
        return self.b.op1("Sub", [self.scalar(1.0, "one"), x])

    def gates(self, x: str, count: int = 4) -> list[str]:
        """The ``count`` H-wide blocks of the last axis of ``x`` ([N, count*H] -> count x [N, H])."""
        blocks = self.b.op1("Reshape", [x, self.ints([0, count, -1], "gate_blocks")])
        return [self.pick(blocks, k, 1) for k in range(count)]

    def like(self, x: str, reference: str) -> str:
        """``x`` reshaped to ``reference``'s shape: a Scan body's new state shaped like the carried one (tract
        0.23's Scan analysis sees a state with the scan axis kept, [1, N, H], and refuses a new state computed
        from the scan inputs alone, [N, H])."""
        return self.b.op1("Reshape", [x, self.b.op1("Shape", [reference])])

    def emit(self, op_type: str, inputs: list[str], output: str, out_type: int, **attrs) -> None:
        """The last op of a result writes the requested name (through one Cast when the types differ)."""
        if out_type == self.ct:
            self.b.op1(op_type, inputs, output, **attrs)
        else:
            self.b.op1("Cast", [self.b.op1(op_type, inputs, **attrs)], output, to=out_type)

    def stack(self, parts: list[str], axis: int, output: str, out_type: int) -> None:
        """One [.., 1, ..] slice per direction on ``axis``, concatenated into ``output``."""
        parts = [self.unsqueeze(p, [axis]) for p in parts]
        if len(parts) == 1:
            self.emit("Identity", parts, output, out_type)
        else:
            self.emit("Concat", parts, output, out_type, axis=axis)


def _state_zeros(e: _Emit, x: str, r: str) -> str:
    """Zeros of shape [N, H]: N from X [S, N, I], H from R [D, 4H, H]."""
    b = e.b
    shape = b.op1("Concat", [e.slice(b.op1("Shape", [x]), 1, 2, 0), e.slice(b.op1("Shape", [r]), 2, 3, 0)], axis=0)
    return b.op1("Expand", [e.scalar(0.0, "zero"), shape], hint="zero_state")


def _steps(e: _Emit, x: str) -> str:
    """The step indices [S, 1, 1] as int32 (the type of sequence_lengths)."""
    b = e.b
    count = b.op1("Cast", [e.pick(b.op1("Shape", [x]), 0, 0)], to=TensorProto.INT32)
    steps = b.op1("Range", [b.const(np.array(0, np.int32), hint="zero_i32"), count,
                            b.const(np.array(1, np.int32), hint="one_i32")])
    return b.op1("Reshape", [steps, e.ints([-1, 1, 1], "step_view")])


def _step_mask(e: _Emit, steps: str, lengths: str, offset: int = 0) -> str:
    """Bool [S, N, 1]: ``t + offset < sequence_lengths[n]``."""
    b = e.b
    if offset:
        steps = b.op1("Add", [steps, b.const(np.array(offset, np.int32), hint="offset")])
    return b.op1("Less", [steps, b.op1("Reshape", [lengths, e.ints([1, -1, 1], "length_view")])])


def _direction_input(e: _Emit, request: LoweringRequest, role: str, d: int, io: int) -> str | None:
    name = request.input(role)
    return None if name is None else e.pick(e.up(name, io), d, 0)


def _states(e: _Emit, request: LoweringRequest, roles: tuple[str, ...], d: int, io: int, x: str, r: str) -> list[str]:
    """Direction d of each optional [D, N, H] input in ``roles``; a missing one is the rule's one zeros [N, H]."""
    values = []
    for role in roles:
        value = _direction_input(e, request, role, d, io)
        if value is None:
            e.state_zeros = e.state_zeros or _state_zeros(e, x, r)
            value = e.state_zeros
        values.append(value)
    return values


def _reversed(e: _Emit, x: str) -> str:
    """``x`` with axis 0 reversed (a Slice of step -1)."""
    big = np.iinfo(np.int64)
    return e.b.op1("Slice", [x, e.ints([-1], "starts"), e.ints([big.min], "ends"), e.ints([0], "axes"),
                             e.ints([-1], "steps")], hint="reversed")


def _scan(e: _Emit, hint: str, states: list[str], scans: list[str], build, n_scan_outputs: int,
          backwards: bool, constants: list[str] = ()) -> tuple[list[str], list[str]]:
    """A Scan over axis 0 of ``scans`` carrying ``states``; ``build(sub_emitter, state_names, scan_names,
    constant_names)`` returns (new states, scan outputs); returns (final states, stacked scan outputs).

    ``constants`` (the weights the body multiplies by) ride along as extra states passed through unchanged:
    OpenVINO's Scan refuses a body that reads outer values by name. A backwards Scan reverses its scan inputs
    and outputs with Slices rather than ``scan_input_directions`` (onnx.reference's Scan has only 0)."""
    b = e.b
    body = onnx.GraphProto(name=b.fresh(hint))
    sub = _Emit(NodeBuilder(b.opset, b.fresh("body"), b.is_taken, into=body.node), e.ct)
    state_in = [sub.b.fresh("state") for _ in states]
    const_in = [sub.b.fresh("weight") for _ in constants]
    scan_in = [sub.b.fresh("step") for _ in scans]
    body.input.extend([helper.make_tensor_value_info(n, e.ct, None) for n in state_in + const_in] +
                      [helper.make_tensor_value_info(n, TensorProto.BOOL if s.startswith("mask:") else e.ct, None)
                       for n, s in zip(scan_in, scans, strict=True)])
    new_states, outs = build(sub, state_in, scan_in, const_in)
    # body outputs must be distinct names of the body's own (a body input passed through, or a value that is
    # both the new state and a scan output, goes through an Identity)
    body_out: list[str] = []
    taken = set(state_in + const_in + scan_in)
    for v in new_states + const_in + outs:
        body_out.append(sub.b.op1("Identity", [v]) if v in taken or v in body_out else v)
    body.output.extend([helper.make_tensor_value_info(n, e.ct, None) for n in body_out])
    finals = [b.fresh(hint + "_final") for _ in states]
    passed = [b.fresh(hint + "_weight") for _ in constants]
    stacked = [b.fresh(hint + "_all") for _ in range(n_scan_outputs)]
    inputs = [s.removeprefix("mask:") for s in scans]
    if backwards:
        inputs = [_reversed(e, s) for s in inputs]
    b.op("Scan", list(states) + list(constants) + inputs, finals + passed + stacked, hint=hint, body=body,
         num_scan_inputs=len(scans))
    if backwards:
        stacked = [_reversed(e, s) for s in stacked]
    return finals, stacked


def _start(b: NodeBuilder, request: LoweringRequest, roles: tuple[str, ...]):
    """What every recurrent rule starts from: its requested outputs by role (None when none is: nothing to emit),
    the input element type, the emitter, and X, W, R in the computation type."""
    outputs = {role: request.output(role) for role in roles}
    if not any(outputs.values()):
        return None
    io = input_elem(request, "X")
    e = _Emit(b, compute_type(io))
    x, w, r = (e.up(request.input(n), io) for n in ("X", "W", "R"))
    return outputs, io, e, x, w, r


# -- LSTMTraining ---------------------------------------------------------------------------------------------------

@register_rule("lstm_training", targets=TARGETS)
def lower_lstm_training(b: NodeBuilder, request: LoweringRequest) -> None:
    roles = ("HAll", "HFinal", "CFinal", "CAll", "iofc")
    started = _start(b, request, roles)
    if started is None:
        return
    outputs, io, e, x, w, r = started
    lengths = request.input("sequence_lengths")
    mask = _step_mask(e, _steps(e, x), lengths) if lengths else None
    scan_outputs = [r for r in ("HAll", "CAll", "iofc") if outputs[r]]
    per_direction: dict[str, list[str]] = {r: [] for r in roles}
    for d, backwards in enumerate(_BACKWARDS[request.inference.attributes.get("direction", "forward")]):
        w_d, r_d = e.pick(w, d, 0), e.pick(r, d, 0)
        projected = b.op1("MatMul", [x, b.op1("Transpose", [w_d], perm=[1, 0])], hint="x_w")
        bias = _direction_input(e, request, "B", d, io)
        if bias is not None:  # W_b + R_b, [8H] -> [2, 4H] -> [4H]
            pair = b.op1("Reshape", [bias, e.ints([2, -1], "bias_pair")])
            projected = b.op1("Add", [projected, e.reduce("ReduceSum", pair, (0,), keepdims=0)])
        r_t = b.op1("Transpose", [r_d], perm=[1, 0], hint="r_t")
        start = _states(e, request, ("initial_h", "initial_c"), d, io, x, r)
        peep = _direction_input(e, request, "P", d, io)
        peepholes = None
        if peep is not None:
            blocks = b.op1("Reshape", [peep, e.ints([3, -1], "peephole_blocks")])
            peepholes = [e.pick(blocks, k, 0) for k in range(3)]  # p_i, p_o, p_f

        def step(s: _Emit, state: list[str], scanned: list[str], weights: list[str]):
            h, c = state
            r_t = weights[0]
            peepholes = weights[1:] or None
            z_i, z_o, z_f, z_c = s.gates(s.b.op1("Add", [scanned[0], s.b.op1("MatMul", [h, r_t])]))
            if peepholes is not None:
                z_i = s.add(z_i, s.mul(peepholes[0], c))
                z_f = s.add(z_f, s.mul(peepholes[2], c))
            i, f, g = s.b.op1("Sigmoid", [z_i]), s.b.op1("Sigmoid", [z_f]), s.b.op1("Tanh", [z_c])
            c_new = s.add(s.mul(f, c), s.mul(i, g))
            if peepholes is not None:
                z_o = s.add(z_o, s.mul(peepholes[1], c_new))
            o = s.b.op1("Sigmoid", [z_o])
            h_new = s.mul(o, s.b.op1("Tanh", [c_new]))
            values = {"HAll": h_new, "CAll": c_new}
            if "iofc" in scan_outputs:
                values["iofc"] = s.b.op1("Concat", [i, o, f, g], axis=1)
            outs = [values[role] for role in scan_outputs]
            if mask is None:
                return [h_new, c_new], outs
            keep = scanned[1]
            zero = s.scalar(0.0, "zero")
            return ([s.b.op1("Where", [keep, h_new, h]), s.b.op1("Where", [keep, c_new, c])],
                    [s.b.op1("Where", [keep, v, zero]) for v in outs])

        scans = [projected] + ([f"mask:{mask}"] if mask else [])
        finals, stacked = _scan(e, "lstm_forward", start, scans, step, len(scan_outputs), backwards,
                                [r_t] + (peepholes or []))
        per_direction["HFinal"].append(finals[0])
        per_direction["CFinal"].append(finals[1])
        for role, value in zip(scan_outputs, stacked, strict=True):
            per_direction[role].append(value)
    for role in roles:
        if outputs[role]:
            e.stack(per_direction[role], 1 if role in ("HAll", "CAll", "iofc") else 0, outputs[role], io)


# -- LSTMGrad -------------------------------------------------------------------------------------------------------

def _previous(e: _Emit, values: str, initial: str, backwards: bool, keep: str | None) -> str:
    """The state before each step in step order: ``values`` shifted by one step towards where the direction
    starts, ``initial`` at the first step; ``keep`` (reverse direction with sequence_lengths) picks ``initial``
    where the next step was not run (each sequence's first reverse step)."""
    b = e.b
    first = e.unsqueeze(initial, [0])
    big = np.iinfo(np.int64).max
    if backwards:
        shifted = b.op1("Concat", [e.slice(values, 1, big, 0), first], axis=0)
    else:
        shifted = b.op1("Concat", [first, e.slice(values, 0, -1, 0)], axis=0)
    return shifted if keep is None else b.op1("Where", [keep, shifted, first])


@register_rule("lstm_grad", targets=TARGETS)
def lower_lstm_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    roles = ("dX", "dW", "dR", "dB", "dH0", "dC0", "dP")
    started = _start(b, request, roles)
    if started is None:
        return
    outputs, io, e, x, w, r = started
    h_all, c_all, gates = (e.up(request.input(n), io) for n in ("HAll", "CAll", "iofc"))
    d_h_all = request.input("dHAll")
    d_h_all = None if d_h_all is None else e.up(d_h_all, io)
    lengths = request.input("sequence_lengths")
    steps = _steps(e, x) if lengths else None
    mask = _step_mask(e, steps, lengths) if lengths else None
    results: dict[str, list[str]] = {r: [] for r in roles}
    for d, backwards in enumerate(_BACKWARDS[request.inference.attributes.get("direction", "forward")]):
        w_d, r_d = e.pick(w, d, 0), e.pick(r, d, 0)
        dh_final, h0, dc_final, c0 = _states(e, request, ("dHFinal", "initial_h", "dCFinal", "initial_c"), d, io, x, r)
        start, initial = [dh_final, dc_final], [h0, c0]
        h_d, c_d, gates_d = (e.pick(v, d, 1) for v in (h_all, c_all, gates))
        keep_prev = _step_mask(e, steps, lengths, 1) if lengths and backwards else None
        c_prev = _previous(e, c_d, initial[1], backwards, keep_prev)

        def step(s: _Emit, state: list[str], scanned: list[str], weights: list[str]):
            dh, dc = state
            r_d = weights[0]
            gates_t, c_t, c_prev_t = scanned[:3]
            dh_t = dh if d_h_all is None else s.add(dh, scanned[3])
            dh_s, dc_s = dh_t, dc
            if mask is not None:
                keep, zero = scanned[-1], s.scalar(0.0, "zero")
                dh_s, dc_s = s.b.op1("Where", [keep, dh_t, zero]), s.b.op1("Where", [keep, dc, zero])
            i, o, f, g = s.gates(gates_t)
            tanh_c = s.b.op1("Tanh", [c_t])
            dz_o = s.mul(dh_s, tanh_c, o, s.one_minus(o))
            dc_t = s.add(dc_s, s.mul(dh_s, o, s.one_minus(s.mul(tanh_c, tanh_c))))
            dz_i = s.mul(dc_t, g, i, s.one_minus(i))
            dz_f = s.mul(dc_t, c_prev_t, f, s.one_minus(f))
            dz_c = s.mul(dc_t, i, s.one_minus(s.mul(g, g)))
            dz = s.b.op1("Concat", [dz_i, dz_o, dz_f, dz_c], axis=1)
            dh_new = s.like(s.b.op1("MatMul", [dz, r_d]), dh)
            dc_new = s.mul(dc_t, f)
            if mask is not None:
                dh_new, dc_new = s.b.op1("Where", [keep, dh_new, dh]), s.b.op1("Where", [keep, dc_new, dc])
            return [dh_new, dc_new], [dz]

        scans = [gates_d, c_d, c_prev]
        if d_h_all is not None:
            scans.append(e.pick(d_h_all, d, 1))
        if mask is not None:
            scans.append(f"mask:{mask}")
        # backpropagation runs opposite to the forward
        finals, (dz,) = _scan(e, "lstm_backward", start, scans, step, 1, not backwards, [r_d])
        results["dH0"].append(finals[0])
        results["dC0"].append(finals[1])
        if outputs["dX"]:
            results["dX"].append(b.op1("MatMul", [dz, w_d], hint="dx"))
        dz_t = b.op1("Transpose", [dz], perm=[0, 2, 1], hint="dz_t") if outputs["dW"] or outputs["dR"] else None
        if outputs["dW"]:
            results["dW"].append(e.reduce("ReduceSum", b.op1("MatMul", [dz_t, x]), (0,), keepdims=0))
        if outputs["dR"]:
            h_prev = _previous(e, h_d, initial[0], backwards, keep_prev)
            results["dR"].append(e.reduce("ReduceSum", b.op1("MatMul", [dz_t, h_prev]), (0,), keepdims=0))
        if outputs["dB"]:
            db = e.reduce("ReduceSum", dz, (0, 1), keepdims=0)
            results["dB"].append(b.op1("Concat", [db, db], axis=0))
        if outputs["dP"]:
            blocks = b.op1("Reshape", [dz, e.ints([0, 0, 4, -1], "gate_blocks_all")])
            dz_i, dz_o, dz_f = (e.pick(blocks, k, 2) for k in range(3))
            parts = [e.reduce("ReduceSum", e.mul(g, c), (0, 1), keepdims=0)
                     for g, c in ((dz_i, c_prev), (dz_o, c_d), (dz_f, c_prev))]
            results["dP"].append(b.op1("Concat", parts, axis=0))
    if outputs["dX"]:
        e.emit("Identity", [e.add(*results["dX"])], outputs["dX"], io)
    for role in ("dW", "dR", "dB", "dH0", "dC0", "dP"):
        if outputs[role]:
            e.stack(results[role], 0, outputs[role], io)


# -- GRUTraining ----------------------------------------------------------------------------------------------------

def _gru_weights(e: _Emit, r_d: str) -> tuple[str, str]:
    """(R_zr^T [H, 2H], R_h^T [H, H]) from one direction's R [3H, H]."""
    b = e.b
    blocks = b.op1("Reshape", [b.op1("Transpose", [r_d], perm=[1, 0]), e.ints([0, 3, -1], "gate_blocks_t")])
    r_zr_t = b.op1("Reshape", [e.slice(blocks, 0, 2, 1), e.ints([0, -1], "rows_view")], hint="r_zr_t")
    return r_zr_t, e.pick(blocks, 2, 1)


def _gru_biases(e: _Emit, b_d: str, linear_before_reset: int) -> tuple[str, str | None]:
    """(the bias added to X W^T [3H], R_bh [H] where the reset gate multiplies it, else None)."""
    b = e.b
    rows = b.op1("Reshape", [b_d, e.ints([6, -1], "bias_rows")])  # Wb_z, Wb_r, Wb_h, Rb_z, Rb_r, Rb_h
    if not linear_before_reset:
        summed = b.op1("Add", [e.slice(rows, 0, 3, 0), e.slice(rows, 3, 6, 0)])
        return b.op1("Reshape", [summed, e.ints([-1], "flat")]), None
    zr = b.op1("Add", [e.slice(rows, 0, 2, 0), e.slice(rows, 3, 5, 0)])
    joined = b.op1("Concat", [zr, e.slice(rows, 2, 3, 0)], axis=0)
    return b.op1("Reshape", [joined, e.ints([-1], "flat")]), e.pick(rows, 5, 0)


@register_rule("gru_training", targets=TARGETS)
def lower_gru_training(b: NodeBuilder, request: LoweringRequest) -> None:
    roles = ("HAll", "HFinal", "ZRH")
    started = _start(b, request, roles)
    if started is None:
        return
    outputs, io, e, x, w, r = started
    attributes = request.inference.attributes
    linear_before_reset = int(attributes.get("linear_before_reset", 0))
    lengths = request.input("sequence_lengths")
    mask = _step_mask(e, _steps(e, x), lengths) if lengths else None
    scan_outputs = [role for role in ("HAll", "ZRH") if outputs[role]]
    per_direction: dict[str, list[str]] = {role: [] for role in roles}
    for d, backwards in enumerate(_BACKWARDS[attributes.get("direction", "forward")]):
        w_d, r_d = e.pick(w, d, 0), e.pick(r, d, 0)
        projected = b.op1("MatMul", [x, b.op1("Transpose", [w_d], perm=[1, 0])], hint="x_w")
        bias = _direction_input(e, request, "B", d, io)
        rb_h = None
        if bias is not None:
            x_bias, rb_h = _gru_biases(e, bias, linear_before_reset)
            projected = b.op1("Add", [projected, x_bias])
        start = _direction_input(e, request, "initial_h", d, io)
        if start is None:
            start = _state_zeros(e, x, r)
        if linear_before_reset:
            weights = [b.op1("Transpose", [r_d], perm=[1, 0], hint="r_t")] + ([rb_h] if rb_h else [])
        else:
            weights = list(_gru_weights(e, r_d))

        def step(s: _Emit, state: list[str], scanned: list[str], weights: list[str]):
            (h,) = state
            x_z, x_r, x_h = s.gates(scanned[0], 3)
            if linear_before_reset:
                h_z, h_r, h_h = s.gates(s.b.op1("MatMul", [h, weights[0]]), 3)
                if len(weights) > 1:
                    h_h = s.add(h_h, weights[1])
            else:
                h_z, h_r = s.gates(s.b.op1("MatMul", [h, weights[0]]), 2)
            z, reset = s.b.op1("Sigmoid", [s.add(x_z, h_z)]), s.b.op1("Sigmoid", [s.add(x_r, h_r)])
            if linear_before_reset:
                candidate = s.b.op1("Tanh", [s.add(x_h, s.mul(reset, h_h))])
            else:
                candidate = s.b.op1("Tanh", [s.add(x_h, s.b.op1("MatMul", [s.mul(reset, h), weights[1]]))])
            h_new = s.add(s.mul(s.one_minus(z), candidate), s.mul(z, h))
            values = {"HAll": h_new}
            if "ZRH" in scan_outputs:
                values["ZRH"] = s.b.op1("Concat", [z, reset, candidate], axis=1)
            outs = [values[role] for role in scan_outputs]
            if mask is None:
                return [h_new], outs
            keep, zero = scanned[1], s.scalar(0.0, "zero")
            return [s.b.op1("Where", [keep, h_new, h])], [s.b.op1("Where", [keep, v, zero]) for v in outs]

        scans = [projected] + ([f"mask:{mask}"] if mask else [])
        finals, stacked = _scan(e, "gru_forward", [start], scans, step, len(scan_outputs), backwards, weights)
        per_direction["HFinal"].append(finals[0])
        for role, value in zip(scan_outputs, stacked, strict=True):
            per_direction[role].append(value)
    for role in roles:
        if outputs[role]:
            e.stack(per_direction[role], 0 if role == "HFinal" else 1, outputs[role], io)


# -- GRUGrad --------------------------------------------------------------------------------------------------------

@register_rule("gru_grad", targets=TARGETS)
def lower_gru_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    roles = ("dX", "dW", "dR", "dB", "dH0")
    started = _start(b, request, roles)
    if started is None:
        return
    outputs, io, e, x, w, r = started
    attributes = request.inference.attributes
    linear_before_reset = int(attributes.get("linear_before_reset", 0))
    h_all, gates = (e.up(request.input(n), io) for n in ("HAll", "ZRH"))
    d_h_all = request.input("dHAll")
    d_h_all = None if d_h_all is None else e.up(d_h_all, io)
    lengths = request.input("sequence_lengths")
    steps = _steps(e, x) if lengths else None
    mask = _step_mask(e, steps, lengths) if lengths else None
    results: dict[str, list[str]] = {role: [] for role in roles}
    for d, backwards in enumerate(_BACKWARDS[attributes.get("direction", "forward")]):
        w_d, r_d = e.pick(w, d, 0), e.pick(r, d, 0)
        start, initial = _states(e, request, ("dHFinal", "initial_h"), d, io, x, r)
        h_d, gates_d = e.pick(h_all, d, 1), e.pick(gates, d, 1)
        keep_prev = _step_mask(e, steps, lengths, 1) if lengths and backwards else None
        h_prev = _previous(e, h_d, initial, backwards, keep_prev)
        r_zr_t, r_h_t = _gru_weights(e, r_d)
        r_zr, r_h = (b.op1("Transpose", [v], perm=[1, 0]) for v in (r_zr_t, r_h_t))
        scans = [gates_d, h_prev]
        if linear_before_reset:  # q = h_prev R_h^T + Rb_h, for all steps at once
            q = b.op1("MatMul", [h_prev, r_h_t], hint="q")
            bias = _direction_input(e, request, "B", d, io)
            if bias is not None:
                q = b.op1("Add", [q, _gru_biases(e, bias, 1)[1]])
            scans.append(q)
        if d_h_all is not None:
            scans.append(e.pick(d_h_all, d, 1))
        if mask is not None:
            scans.append(f"mask:{mask}")

        def step(s: _Emit, state: list[str], scanned: list[str], weights: list[str]):
            (dh,) = state
            r_zr, r_h = weights
            gates_t, h_prev_t = scanned[:2]
            rest = scanned[2:]
            q_t = rest.pop(0) if linear_before_reset else None
            dh_t = dh if d_h_all is None else s.add(dh, rest.pop(0))
            if mask is not None:
                keep = rest.pop(0)
                dh_t = s.b.op1("Where", [keep, dh_t, s.scalar(0.0, "zero")])
            z, reset, candidate = s.gates(gates_t, 3)
            a_h = s.mul(dh_t, s.one_minus(z), s.one_minus(s.mul(candidate, candidate)))
            a_z = s.mul(dh_t, s.b.op1("Sub", [h_prev_t, candidate]), z, s.one_minus(z))
            if linear_before_reset:
                a_r = s.mul(a_h, q_t, reset, s.one_minus(reset))
                through_reset = s.b.op1("MatMul", [s.mul(a_h, reset), r_h])
            else:
                g = s.b.op1("MatMul", [a_h, r_h])
                a_r = s.mul(g, h_prev_t, reset, s.one_minus(reset))
                through_reset = s.mul(g, reset)
            a_zr = s.b.op1("Concat", [a_z, a_r], axis=1)
            dh_new = s.like(s.add(s.mul(dh_t, z), s.b.op1("MatMul", [a_zr, r_zr]), through_reset), dh)
            if mask is not None:
                dh_new = s.b.op1("Where", [keep, dh_new, dh])
            return [dh_new], [s.b.op1("Concat", [a_zr, a_h], axis=1)]

        # backpropagation runs opposite to the forward
        finals, (da,) = _scan(e, "gru_backward", [start], scans, step, 1, not backwards, [r_zr, r_h])
        results["dH0"].append(finals[0])
        if outputs["dX"]:
            results["dX"].append(b.op1("MatMul", [da, w_d], hint="dx"))
        if outputs["dW"]:
            da_t = b.op1("Transpose", [da], perm=[0, 2, 1], hint="da_t")
            results["dW"].append(e.reduce("ReduceSum", b.op1("MatMul", [da_t, x]), (0,), keepdims=0))
        if outputs["dR"] or outputs["dB"]:
            blocks = b.op1("Reshape", [da, e.ints([0, 0, 3, -1], "gate_blocks_all")])
            da_zr = b.op1("Reshape", [e.slice(blocks, 0, 2, 2), e.ints([0, 0, -1], "zr_view")])
            da_h = e.pick(blocks, 2, 2)
            reset = e.pick(b.op1("Reshape", [gates_d, e.ints([0, 0, 3, -1], "gate_blocks_all")]), 1, 2)
            if linear_before_reset:  # the h rows see a_h r against h_prev
                da_h = b.op1("Mul", [da_h, reset])
                h_rows_of = h_prev
            else:  # ... or a_h against r h_prev
                h_rows_of = b.op1("Mul", [reset, h_prev])
        if outputs["dR"]:
            zr_rows = b.op1("MatMul", [b.op1("Transpose", [da_zr], perm=[0, 2, 1]), h_prev])
            h_rows = b.op1("MatMul", [b.op1("Transpose", [da_h], perm=[0, 2, 1]), h_rows_of])
            results["dR"].append(e.reduce("ReduceSum", b.op1("Concat", [zr_rows, h_rows], axis=1), (0,), keepdims=0))
        if outputs["dB"]:
            results["dB"].append(b.op1("Concat", [e.reduce("ReduceSum", v, (0, 1), keepdims=0)
                                                  for v in (da, da_zr, da_h)], axis=0))
    if outputs["dX"]:
        e.emit("Identity", [e.add(*results["dX"])], outputs["dX"], io)
    for role in ("dW", "dR", "dB", "dH0"):
        if outputs[role]:
            e.stack(results[role], 0, outputs[role], io)
