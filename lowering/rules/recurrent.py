"""Lowering of onnxruntime-training's recurrent ops ``LSTMTraining``, ``LSTMGrad``, ``GRUTraining`` and
``GRUGrad`` (``specs/com.microsoft/``).

The forward ops on the onnxruntime target (f32, H static, no sequence_lengths, peepholes or input_forget) run the
recurrence on onnxruntime's own ``LSTM`` / ``GRU`` kernel, one kernel for the sequence, and compute what the
gradient reads from its hidden states for all steps at once (:func:`_stock_recurrence`): GRUTraining with the
native kernel's bits (its gates in its order and with its activations, the rational tanh of onnxruntime's
rnn_helpers among them), LSTMTraining as accurate, its cell states by a second LSTM kernel with identity
activations (a small N H) or a Scan of two kernels a step. Otherwise, per
direction, a ``Scan`` over the steps carries the state; everything that does not depend on the state is done on
the whole sequence outside it, as batched MatMuls, elementwise ops and ReduceSums:

- forward: ``X W^T + W_b + R_b`` for all steps at once; the Scan body adds ``h R^T`` and applies the gates, one
  Sigmoid over the i, o, f blocks (GRU: z, r) and one Tanh over the c block. With H static on onnxruntime and no
  peepholes, the LSTM step runs two Gemms, ``h R_iof^T + x_iof`` and ``h R_c^T + x_c`` (the step's x blocks as
  their C), which onnxruntime fuses with the Sigmoid and the Tanh (FusedGemm): 11 -> 9 kernels a step. The
  requested HAll, CAll, iofc (GRU: HAll, ZRH) leave the body as one packed scan output (a Concat per step rather
  than an Identity for each new state that is also a scan output), split into the outputs once after the loop.
- backward (backpropagation through time): a Scan opposite to the forward carries dh, dc and emits the gate
  pre-activation gradients dz per step; the gate factors (tanh c, 1 - o, 1 - g^2, ...) are computed for all steps
  before the loop and stacked so that one Mul per factor makes the four gates' dz with the same products in the
  same order as per gate (the same bits); then dX = dz W, dW = sum dz^T x, dR = sum dz^T h_prev (h_prev: HAll
  shifted by one step, initial_h first), dB and dP by ReduceSum, all outside the loop.
- ``sequence_lengths``: a step mask ``t < L`` (Range, Less); where it is false the state is carried unchanged
  (Where) and the step's outputs are 0, in the forward and the backward Scan alike.
- GRU: the same shape; the backward Scan emits [a_z, a_r] and a_h and, for ``linear_before_reset`` 1, reads the
  reset gate's operand ``h_prev R_h^T + R_bh``, computed for all steps before it (with a small static batch and H
  its step multiplies four blocks [a_z, a_r, a_h r, dh z] at once and runs two Gemms of them:
  :func:`_gru_grad_blocks`, 10 -> 8 kernels a step). With H static on onnxruntime the
  biases come from one product of B's row with a constant 0/1 packing (:func:`_packed_biases`, shared by the
  forward and the backward), and a linear_before_reset 1 forward step runs two Gemms, ``h R_zr^T + x_zr`` (the
  step's x_zr as the Gemm's C; onnxruntime fuses the Sigmoid into it) and ``h R_h^T + R_bh``, where one Gemm of
  h R^T, a Split and an Add were; dB is one ReduceSum of the joined per-step gradients.

LSTMGrad keeps the direction axis throughout ([S, 1, N, ..] scan inputs, [1, N, H] states): with one direction
its inputs and outputs (but dX) are the tensors themselves, no Gather or Unsqueeze each; R it reads as [4H, H]
like the forward (one view of R for both). GRUGrad does not keep it: its body's MatMul + Add pairs, which
onnxruntime fuses into Gemms when 2-D, would stay two kernels each per step. With one direction W and R (and
GRU's B) lose their direction axis by a Squeeze rather than a Gather: a view, which the train-step model's flat
state cuts from the parameter's buffer with no kernel of its own (torch's W and R arrive as such views).

Kernels per step of the committed lstm artifact (S = 5): LSTMTraining 92 + 20 of its Gathers' Squeezes -> 69,
LSTMGrad 174 + 20 -> 72 (the bodies 19 -> 12 and 34 -> 10 kernels per step). Sigmoid and Tanh over the stacked
blocks (and Tanh c before the loop) give the per-block bits in f32 (MLAS); in f64 (Eigen) an element may land 1 ulp
apart. The bodies are pinned node by node (tests/test_recurrent_forms.py), the forward ones with their
pass-through weights (an Identity per step): what is left to take is outside the loops.

Scan rather than Loop: measured faster for the backward, equal for the forward (onnxruntime CPU, S=50, N=32,
H=128); unrolling a short static sequence measured the same as the Scan on the S=5 artifacts. Three runtime
quirks shape the portable Scan (:func:`_scan`): the weights ride it as pass-through states (OpenVINO refuses a
body that reads outer values), backwards runs reverse with Slices (``onnx.reference`` has scan direction 0 only),
and a new state computed from scan inputs alone is reshaped like the carried one (tract, :meth:`_Emit.like`). On
the onnxruntime target a backwards Scan runs with ``scan_input_directions``, every body reads the weights by name
(no Identity per time step passing them through: lstm_tagger 179 -> 174 kernels a step, gru 243 -> 233) and, with
H static, gate blocks are cut by Split.

The portable form uses MatMul, Gather, Reshape, Squeeze, Transpose, Concat, Slice, Where, Less, Range, Expand, Sigmoid,
Tanh, elementwise arithmetic and Scan with runtime inputs (lowering.rules.PORTABLE_OPS).
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
SPLIT_INPUT_SINCE = 13  # Split's split as an input
# at most this many elements in GRU's constant [6H, 4H] bias packing (H <= 26: a 1 x 6H x 4H product of a few
# microseconds at most, against the kernels it saves)
PACKED_BIAS_LIMIT = 16384
# GRUGrad's four-block step (linear_before_reset 1) up to this many elements of a [N, H] state: 10 -> 8 kernels a step,
# but [N, 4H] x [4H, H] products and [N, 4H] factors where the two-product form multiplies [N, 2H] and [N, H]. The
# GRUGrad node alone, 1 thread, four blocks / two products: S 12 N 4 H 8 0.96-0.98, S 50 N 4 H 8 0.94, S 5 N 3 H 6
# 1.01, S 12 N 16 H 8 1.00, S 12 N 4 H 16 1.02, S 12 N 32 H 16 1.16, S 50 N 32 H 16 1.07
FOUR_BLOCKS_LIMIT = 32
# LSTMTraining's cell states by onnxruntime's LSTM kernel with identity activations (:func:`_cells_by_kernel`) up to
# this many elements of a [N, H] state, else by a Scan of the cell (2 kernels a step): the kernel's time grows with
# N H (its per-row work and a [4H, 4H] product) where the Scan's is per step. Cell states alone, kernel / Scan, 1
# thread (2 threads): S 10 N 4 H 8 0.67 (0.65), S 20 N 4 H 8 0.56 (0.93), S 5 N 3 H 6 0.58 (0.67), S 32 N 2 H 16 0.53
# (0.90), S 64 N 1 H 32 0.67 (1.12), S 10 N 4 H 16 0.90 (1.49), S 10 N 8 H 8 0.86 (1.44), S 10 N 16 H 8 1.35
CELL_KERNEL_LIMIT = 32
_BACKWARDS = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}


class _Emit(Emitter):
    """The helpers the recurrent rules use; ``b`` may be the main graph's builder or a Scan body's."""

    def __init__(self, b: NodeBuilder, ct: int, onnxruntime: bool, hidden: int | None) -> None:
        super().__init__(b, ct)
        self.onnxruntime = onnxruntime  # the onnxruntime target (else the portable one)
        # H where the onnxruntime target knows it statically: gate blocks are cut by one Split kernel
        self.hidden = hidden if onnxruntime else None
        self.state_zeros: str | None = None  # zeros [N, H] for a missing initial state or final-state gradient

    def body(self, b: NodeBuilder) -> _Emit:
        """An emitter for a Scan body built by ``b``, with this one's target."""
        return _Emit(b, self.ct, self.onnxruntime, self.hidden)

    def unsqueeze(self, x: str, axes: list[int], output: str | None = None) -> str:
        if self.b.opset < AXES_INPUT_SINCE:
            return self.b.op1("Unsqueeze", [x], output, axes=axes)
        return self.b.op1("Unsqueeze", [x, self.ints(axes, "axes")], output)

    def squeeze(self, x: str, axes: list[int], output: str | None = None) -> str:
        if self.b.opset < AXES_INPUT_SINCE:
            return self.b.op1("Squeeze", [x], output, axes=axes)
        return self.b.op1("Squeeze", [x, self.ints(axes, "axes")], output)

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

    def split_node(self, x: str, sizes: list[int], axis: int, outputs: list[str] | None = None) -> list[str]:
        """One Split of ``x`` along ``axis`` into parts of ``sizes``."""
        outputs = outputs or [self.b.fresh("part") for _ in sizes]
        if self.b.opset < SPLIT_INPUT_SINCE:
            self.b.op("Split", [x], outputs, axis=axis, split=sizes)
        else:
            self.b.op("Split", [x, self.ints(sizes, "splits")], outputs, axis=axis)
        return outputs

    def split(self, x: str, blocks: list[int], axis: int, outputs: list[str] | None = None) -> list[str]:
        """``x`` cut along ``axis``, its last, into parts of ``blocks[k]`` H-wide gate blocks each (written to
        ``outputs`` when given): one Split where H is static on the onnxruntime target, else a [.., blocks, H]
        view and a Gather (one block) or a Slice and a Reshape (several) per part."""
        outputs = outputs or [self.b.fresh("gate") for _ in blocks]
        if self.hidden:
            return self.split_node(x, [k * self.hidden for k in blocks], axis, outputs)
        view = self.b.op1("Reshape", [x, self.ints([0] * axis + [sum(blocks), -1], "gate_blocks")])
        start = 0
        for k, output in zip(blocks, outputs, strict=True):
            if k == 1:
                self.b.op1("Gather", [view, self.b.const(np.array(start, np.int64), hint="index")], output,
                           axis=axis)
            else:
                self.b.op1("Reshape", [self.slice(view, start, start + k, axis), self.ints([0] * axis + [-1], "flat")],
                           output)
            start += k
        return outputs

    def weight(self, w: str) -> str:
        """A [rows, k] weight for :meth:`affine`: as it is on the onnxruntime target (its Gemm reads it transposed,
        no Transpose kernel), transposed on the portable one."""
        return w if self.onnxruntime else self.b.op1("Transpose", [w], perm=[1, 0], hint="w_t")

    def affine(self, a: str, weight: str, c: str | None = None) -> str:
        """``a W^T + c`` with ``weight`` from :meth:`weight`: one Gemm on the onnxruntime target (the sum of
        MatMul and Add that onnxruntime fuses into a Gemm), MatMul and Add on the portable one."""
        if self.onnxruntime:
            return self.b.op1("Gemm", [a, weight] + ([c] if c else []), transB=1)
        product = self.b.op1("MatMul", [a, weight])
        return product if c is None else self.b.op1("Add", [c, product])

    def like(self, x: str, reference: str) -> str:
        """``x`` reshaped to ``reference``'s shape on the portable target: a Scan body's new state shaped like
        the carried one (tract 0.23's Scan analysis sees a state with the scan axis kept, [1, N, H], and refuses
        a new state computed from the scan inputs alone, [N, H]); onnxruntime needs no Reshape."""
        return x if self.onnxruntime else self.b.op1("Reshape", [x, self.b.op1("Shape", [reference])])

    def emit(self, op_type: str, inputs: list[str], output: str, out_type: int, **attrs) -> None:
        """The last op of a result writes the requested name (through one Cast when the types differ)."""
        if out_type == self.ct:
            self.b.op1(op_type, inputs, output, **attrs)
        else:
            self.b.op1("Cast", [self.b.op1(op_type, inputs, **attrs)], output, to=out_type)

    def stack(self, parts: list[str], axis: int, output: str, out_type: int, kept: bool = False) -> None:
        """One [.., 1, ..] slice per direction on ``axis`` (``kept``: the parts have that axis already, e.g. a
        ReduceSum's kept one), concatenated into ``output``."""
        parts = parts if kept else [self.unsqueeze(p, [axis]) for p in parts]
        if len(parts) == 1:
            self.emit("Identity", parts, output, out_type)
        else:
            self.emit("Concat", parts, output, out_type, axis=axis)

    def unpack(self, packed: list[str], outputs: list[str], blocks: list[int], out_type: int) -> None:
        """The Scan's one packed output per direction, [S, N, sum(blocks) H], stacked on a direction axis
        ([S, D, N, ..]) and split into ``outputs`` of ``blocks[k]`` H-wide blocks each."""
        if len(outputs) == 1:
            self.stack(packed, 1, outputs[0], out_type)
            return
        parts = [self.unsqueeze(p, [1]) for p in packed]
        whole = parts[0] if len(parts) == 1 else self.b.op1("Concat", parts, axis=1)
        if out_type != self.ct:
            whole = self.b.op1("Cast", [whole], to=out_type)
        self.split(whole, blocks, 3, outputs)


def _input_product(e: _Emit, request: LoweringRequest, x: str, w: str, r: str, d: int) -> tuple[str, str]:
    """Direction d's X W^T for all steps ([S, N, gates * H], no bias; onnxruntime fuses the Transpose into the
    MatMul) and its R ([gates * H, H])."""
    w_d, r_d = (_drop_direction(e, request, v, d) for v in (w, r))
    return e.b.op1("MatMul", [x, e.b.op1("Transpose", [w_d], perm=[1, 0])], hint="x_w"), r_d


def _state_zeros(e: _Emit, x: str, r: str, kept: bool = False) -> str:
    """Zeros of shape [N, H] ([1, N, H] ``kept``): N from X [S, N, I], H from R [D, 4H, H]."""
    b = e.b
    dims = [e.slice(b.op1("Shape", [x]), 1, 2, 0), e.slice(b.op1("Shape", [r]), 2, 3, 0)]
    shape = b.op1("Concat", ([e.ints([1], "one_dim")] if kept else []) + dims, axis=0)
    return b.op1("Expand", [e.scalar(0.0, "zero"), shape], hint="zero_state")


def _steps(e: _Emit, x: str, kept: bool = False) -> str:
    """The step indices [S, 1, 1] ([S, 1, 1, 1] ``kept``) as int32 (the type of sequence_lengths)."""
    b = e.b
    count = b.op1("Cast", [e.pick(b.op1("Shape", [x]), 0, 0)], to=TensorProto.INT32)
    steps = b.op1("Range", [b.const(np.array(0, np.int32), hint="zero_i32"), count,
                            b.const(np.array(1, np.int32), hint="one_i32")])
    return b.op1("Reshape", [steps, e.ints([-1, 1, 1, 1] if kept else [-1, 1, 1], "step_view")])


def _step_mask(e: _Emit, steps: str, lengths: str, offset: int = 0, kept: bool = False) -> str:
    """Bool [S, N, 1] ([S, 1, N, 1] ``kept``): ``t + offset < sequence_lengths[n]``."""
    b = e.b
    if offset:
        steps = b.op1("Add", [steps, b.const(np.array(offset, np.int32), hint="offset")])
    view = e.ints([1, 1, -1, 1] if kept else [1, -1, 1], "length_view")
    return b.op1("Less", [steps, b.op1("Reshape", [lengths, view])])


def _direction(e: _Emit, x: str, d: int, axis: int, count: int) -> str:
    """Direction d of ``x`` with its direction ``axis`` kept ([.., 1, ..]): ``x`` itself when there is one."""
    return x if count == 1 else e.slice(x, d, d + 1, axis)


def _drop_direction(e: _Emit, request: LoweringRequest, x: str, d: int) -> str:
    """Direction d of a [D, ..] input, that axis dropped: with one direction a Squeeze, a view, which the train-step
    model's flat state cuts from a parameter's buffer with no kernel (torch's W, R, B), else a Gather."""
    if len(_BACKWARDS[request.inference.attributes.get("direction", "forward")]) == 1:
        return e.squeeze(x, [0])
    return e.pick(x, d, 0)


def _direction_input(e: _Emit, request: LoweringRequest, role: str, d: int, io: int, count: int = 0) -> str | None:
    """Direction d of the optional [D, ..] input ``role``: that axis dropped, or kept when given the ``count`` D."""
    name = request.input(role)
    if name is None:
        return None
    return _direction(e, e.up(name, io), d, 0, count) if count else _drop_direction(e, request, e.up(name, io), d)


def _bias_rows(e: _Emit, request: LoweringRequest, d: int, io: int, rows: int) -> str | None:
    """Direction d of B [D, rows * H] as [rows, H] (one Reshape of B itself when there is one direction)."""
    name = request.input("B")
    if name is None:
        return None
    bias = e.up(name, io)
    if len(_BACKWARDS[request.inference.attributes.get("direction", "forward")]) > 1:
        bias = e.pick(bias, d, 0)
    return e.b.op1("Reshape", [bias, e.ints([rows, -1], "bias_rows")])


def _states(e: _Emit, request: LoweringRequest, roles: tuple[str, ...], d: int, io: int, x: str, r: str,
            count: int = 0) -> list[str]:
    """Direction d of each optional [D, N, H] input in ``roles`` ([1, N, H] given the ``count`` D); a missing one
    is the rule's one zeros of that shape."""
    values = []
    for role in roles:
        value = _direction_input(e, request, role, d, io, count)
        if value is None:
            e.state_zeros = e.state_zeros or _state_zeros(e, x, r, bool(count))
            value = e.state_zeros
        values.append(value)
    return values


def _reversed(e: _Emit, x: str) -> str:
    """``x`` with axis 0 reversed (a Slice of step -1)."""
    big = np.iinfo(np.int64)
    return e.b.op1("Slice", [x, e.ints([-1], "starts"), e.ints([big.min], "ends"), e.ints([0], "axes"),
                             e.ints([-1], "steps")], hint="reversed")


def _scan(e: _Emit, hint: str, states: list[str], scans: list[str], build, n_scan_outputs: int,
          backwards: bool, constants: list[str] = (), outer: bool = False) -> tuple[list[str], list[str]]:
    """A Scan over axis 0 of ``scans`` carrying ``states``; ``build(sub_emitter, state_names, scan_names,
    constant_names)`` returns (new states, scan outputs); returns (final states, stacked scan outputs).

    ``constants`` (the weights the body multiplies by) ride along as extra states passed through unchanged
    (OpenVINO's Scan refuses a body that reads outer values by name), or with ``outer`` the body reads them by
    name (no Identity per step). A backwards Scan reverses its scan inputs and outputs with Slices on the portable
    target (onnx.reference's Scan has direction 0 only), with ``scan_input_directions`` on onnxruntime."""
    b = e.b
    body = onnx.GraphProto(name=b.fresh(hint))
    sub = e.body(NodeBuilder(b.opset, b.fresh("body"), b.is_taken, into=body.node))
    state_in = [sub.b.fresh("state") for _ in states]
    const_in = list(constants) if outer else [sub.b.fresh("weight") for _ in constants]
    passed_in = [] if outer else const_in
    scan_in = [sub.b.fresh("step") for _ in scans]
    body.input.extend([helper.make_tensor_value_info(n, e.ct, None) for n in state_in + passed_in] +
                      [helper.make_tensor_value_info(n, TensorProto.BOOL if s.startswith("mask:") else e.ct, None)
                       for n, s in zip(scan_in, scans, strict=True)])
    new_states, outs = build(sub, state_in, scan_in, const_in)
    # body outputs must be distinct names of the body's own (a body input passed through, or a value that is
    # both the new state and a scan output, goes through an Identity)
    body_out: list[str] = []
    taken = set(state_in + passed_in + scan_in)
    for v in new_states + passed_in + outs:
        body_out.append(sub.b.op1("Identity", [v]) if v in taken or v in body_out else v)
    body.output.extend([helper.make_tensor_value_info(n, e.ct, None) for n in body_out])
    finals = [b.fresh(hint + "_final") for _ in states]
    passed = [b.fresh(hint + "_weight") for _ in passed_in]
    stacked = [b.fresh(hint + "_all") for _ in range(n_scan_outputs)]
    inputs = [s.removeprefix("mask:") for s in scans]
    directions = {}
    if backwards and e.onnxruntime:
        directions = {"scan_input_directions": [1] * len(inputs), "scan_output_directions": [1] * n_scan_outputs}
    elif backwards:
        inputs = [_reversed(e, s) for s in inputs]
    b.op("Scan", list(states) + ([] if outer else list(constants)) + inputs, finals + passed + stacked, hint=hint,
         body=body, num_scan_inputs=len(scans), **directions)
    if backwards and not e.onnxruntime:
        stacked = [_reversed(e, s) for s in stacked]
    return finals, stacked


def _hidden(request: LoweringRequest) -> int | None:
    """H when static: the ``hidden_size`` attribute, else R's last dimension."""
    if "hidden_size" in request.inference.attributes:
        return int(request.inference.attributes["hidden_size"])
    r = request.inference.input_types[request.inference.schema.input_index("R")]
    dim = None if r is None or r.shape is None else r.shape[-1]
    return dim if isinstance(dim, int) and dim > 0 else None


def _batch(request: LoweringRequest) -> int | None:
    """N when static: X's second dimension."""
    x = request.inference.input_types[request.inference.schema.input_index("X")]
    dim = None if x is None or x.shape is None else x.shape[1]
    return dim if isinstance(dim, int) and dim > 0 else None


def _start(b: NodeBuilder, request: LoweringRequest, roles: tuple[str, ...]):
    """What every recurrent rule starts from: its requested outputs by role (None when none is: nothing to emit),
    the input element type, the emitter, and X, W, R in the computation type."""
    outputs = {role: request.output(role) for role in roles}
    if not any(outputs.values()):
        return None
    io = input_elem(request, "X")
    e = _Emit(b, compute_type(io), request.options.target == "onnxruntime", _hidden(request))
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
    if _stock_recurrence(e, request):
        _lstm_training_stock(b, request, e, outputs, io, x, w, r)
        return
    lengths = request.input("sequence_lengths")
    mask = _step_mask(e, _steps(e, x), lengths) if lengths else None
    scan_outputs = [r for r in ("HAll", "CAll", "iofc") if outputs[r]]
    # without peepholes, H static (onnxruntime): two Gemms a step, h R_iof^T + x_iof and h R_c^T + x_c (the step's
    # x blocks as the Gemms' C), which onnxruntime fuses with the Sigmoid and the Tanh (FusedGemm), instead of one
    # Gemm, a Split, a Sigmoid and a Tanh
    two_gemms = request.input("P") is None and bool(e.hidden)
    per_direction: dict[str, list[str]] = {r: [] for r in ("HFinal", "CFinal", "packed")}
    for d, backwards in enumerate(_BACKWARDS[request.inference.attributes.get("direction", "forward")]):
        projected, r_d = _input_product(e, request, x, w, r, d)
        pair = _bias_rows(e, request, d, io, 2)
        if pair is not None:  # W_b + R_b, [2, 4H] -> [4H]
            projected = b.op1("Add", [projected, e.reduce("ReduceSum", pair, (0,), keepdims=0)])
        start = _states(e, request, ("initial_h", "initial_c"), d, io, x, r)
        peep = _direction_input(e, request, "P", d, io)
        peepholes = None
        if peep is not None:
            blocks = b.op1("Reshape", [peep, e.ints([3, -1], "peephole_blocks")])
            peepholes = [e.pick(blocks, k, 0) for k in range(3)]  # p_i, p_o, p_f
        if two_gemms:
            weights = e.split_node(r_d, [3 * e.hidden, e.hidden], 0)
            scans = e.split(projected, [3, 1], 2)
        else:
            weights, scans = [e.weight(r_d)] + (peepholes or []), [projected]

        def step(s: _Emit, state: list[str], scanned: list[str], weights: list[str]):
            h, c = state
            if two_gemms:
                iof = s.b.op1("Sigmoid", [s.affine(h, weights[0], scanned[0])])
                g = s.b.op1("Tanh", [s.affine(h, weights[1], scanned[1])])
                i, o, f = s.split(iof, [1, 1, 1], 1)
                activated = [iof, g]
                c_new = s.add(s.mul(f, c), s.mul(i, g))
                h_new = s.mul(o, s.b.op1("Tanh", [c_new]))
                return _lstm_outputs(s, h, c, h_new, c_new, activated, scanned[2] if mask else None)
            r_t = weights[0]
            peepholes = weights[1:] or None
            z = s.affine(h, r_t, scanned[0])
            if peepholes is None:  # one Sigmoid over the i, o, f blocks (elementwise: the per-block bits)
                z_iof, z_c = s.split(z, [3, 1], 1)
                iof, g = s.b.op1("Sigmoid", [z_iof]), s.b.op1("Tanh", [z_c])
                i, o, f = s.split(iof, [1, 1, 1], 1)
                activated = [iof, g]
                c_new = s.add(s.mul(f, c), s.mul(i, g))
            else:  # o's pre-activation reads the new c
                z_i, z_o, z_f, z_c = s.split(z, [1, 1, 1, 1], 1)
                z_i = s.add(z_i, s.mul(peepholes[0], c))
                z_f = s.add(z_f, s.mul(peepholes[2], c))
                i, f, g = s.b.op1("Sigmoid", [z_i]), s.b.op1("Sigmoid", [z_f]), s.b.op1("Tanh", [z_c])
                c_new = s.add(s.mul(f, c), s.mul(i, g))
                o = s.b.op1("Sigmoid", [s.add(z_o, s.mul(peepholes[1], c_new))])
                activated = [i, o, f, g]
            h_new = s.mul(o, s.b.op1("Tanh", [c_new]))
            return _lstm_outputs(s, h, c, h_new, c_new, activated, scanned[1] if mask else None)

        def _lstm_outputs(s: _Emit, h: str, c: str, h_new: str, c_new: str, activated: list[str], keep: str | None):
            # the requested HAll, CAll, iofc as one packed scan output (one Concat per step, not an Identity each
            # for the new states); split once after the loop
            parts = {"HAll": [h_new], "CAll": [c_new], "iofc": activated}
            pieces = [p for role in scan_outputs for p in parts[role]]
            outs = [s.b.op1("Concat", pieces, axis=1) if len(pieces) > 1 else pieces[0]] if pieces else []
            if keep is None:
                return [h_new, c_new], outs
            zero = s.scalar(0.0, "zero")
            return ([s.b.op1("Where", [keep, h_new, h]), s.b.op1("Where", [keep, c_new, c])],
                    [s.b.op1("Where", [keep, v, zero]) for v in outs])

        scans = scans + ([f"mask:{mask}"] if mask else [])
        finals, packed = _scan(e, "lstm_forward", start, scans, step, 1 if scan_outputs else 0, backwards,
                               weights, outer=e.onnxruntime)
        per_direction["HFinal"].append(finals[0])
        per_direction["CFinal"].append(finals[1])
        per_direction["packed"] += packed
    for role in ("HFinal", "CFinal"):
        if outputs[role]:
            e.stack(per_direction[role], 0, outputs[role], io)
    if scan_outputs:
        e.unpack(per_direction["packed"], [outputs[r] for r in scan_outputs],
                 [4 if r == "iofc" else 1 for r in scan_outputs], io)


def _lstm_training_stock(b: NodeBuilder, request: LoweringRequest, e: _Emit, outputs: dict, io: int, x: str, w: str,
                         r: str) -> None:
    """LSTMTraining by onnxruntime's ``LSTM`` kernel (:func:`_stock_recurrence`): HAll, HFinal and CFinal are its Y,
    Y_h and Y_c. iofc needs no loop: with every step's previous state known (HAll shifted by one step, initial_h
    first), the gates of all steps are computed on [S * N] rows at once in onnxruntime-training's kernel's order (X
    W^T, plus h R^T by a Gemm with it as C, plus W_b + R_b, then MLAS's Sigmoid and Tanh, as onnxruntime's ops run
    them). CAll is the cell recurrence alone, c f + i g: by a second LSTM kernel (:func:`_cells_by_kernel`, N H up
    to CELL_KERNEL_LIMIT), else a Scan of two kernels a step (i g for all steps before it) where the Scan of the
    whole cell ran nine; the same bits either way. Not the native kernel's bits (onnxruntime's LSTM kernel rounds
    a third of the recorded hidden states otherwise, and splits the batch across intra-op threads, whose smaller
    GEMMs round otherwise again, as the native kernel does too); as accurate against float64 on every recorded
    case (tests/test_accuracy_vs_native.py)."""
    direction = request.inference.attributes.get("direction", "forward")
    backwards_list = _BACKWARDS[direction]
    count = len(backwards_list)
    gates_wanted = bool(outputs["CAll"] or outputs["iofc"])  # they read every step's hidden state
    results = _stock_results(b, e, outputs, io, ("HAll", "HFinal", "CFinal"), {"HAll": gates_wanted})
    b.op("LSTM", _stock_inputs(e, request, io, x, w, r, ("initial_h", "initial_c")),
         _trimmed([results["HAll"], results["HFinal"], results["CFinal"]]), hidden_size=e.hidden, direction=direction)
    _cast_results(b, outputs, results, io)
    if not gates_wanted:
        return
    h = e.hidden
    gates, cells = [], []
    for d, backwards in enumerate(backwards_list):
        x_rows, rows, r_d = _stock_direction(e, request, results["HAll"], x, w, r, io, d, count, backwards, 4)
        pre = e.affine(rows, r_d, x_rows)
        pair = _bias_rows(e, request, d, io, 2)
        if pair is not None:  # W_b + R_b, [2, 4H] -> [4H]
            pre = b.op1("Add", [pre, e.reduce("ReduceSum", pair, (0,), keepdims=0)])
        pre_iof, pre_g = e.split(pre, [3, 1], 1)
        iof, g = b.op1("Sigmoid", [pre_iof]), b.op1("Tanh", [pre_g])
        gates.append(b.op1("Concat", [iof, g], axis=1))
        if not outputs["CAll"]:
            continue
        start = _direction_input(e, request, "initial_c", d, io, count=count)  # [1, N, H]
        if _batch(request) * h <= CELL_KERNEL_LIMIT:
            cells.append(_cells_by_kernel(e, request, gates[-1], start, backwards))
            continue
        i, _, f = e.split(iof, [1, 1, 1], 1)
        f_steps, ig_steps = (_steps_back(e, request, x, t, h) for t in (f, e.mul(i, g)))  # [S, 1, N, H]
        if start is None:
            start = _state_zeros(e, x, r, kept=True)  # [1, N, H]

        def cell(s: _Emit, state: list[str], scanned: list[str], _weights: list[str]):
            # c f + i g; the step emits c f (not the new c, which as the state too would need an Identity a step):
            # the same Add of every step's c f and i g after the loop makes every c
            kept = s.mul(state[0], scanned[0])
            return [s.add(kept, scanned[1])], [kept]

        _, (kept,) = _scan(e, "lstm_cells", [start], [f_steps, ig_steps], cell, 1, backwards, outer=e.onnxruntime)
        cells.append(b.op1("Add", [kept, ig_steps]))  # [S, 1, N, H]
    if outputs["iofc"]:
        _stack_steps(e, request, x, gates, 4 * h, outputs["iofc"], io)
    if outputs["CAll"]:
        e.stack(cells, 1, outputs["CAll"], io, kept=True)


def _cells_by_kernel(e: _Emit, request: LoweringRequest, gates: str, start: str | None, backwards: bool) -> str:
    """One direction's cell states [S, 1, N, H] from its gate values ``gates`` [S * N, 4H] (iofc, activated) by
    onnxruntime's own LSTM kernel with every activation Affine(1, 0), the identity: X = the gates, W the identity
    with the o rows zero and Wb_o = 1, R = 0, so the kernel's gates are the given i, f, c exactly (each the one
    product by 1 plus exact zeros), o = 1, its cell c f + i g in the same f32 operations as the cell Scan, and its
    Y = o c = every c: one kernel where the Scan ran two a step (0.5-0.7x at N H <= 32, :data:`CELL_KERNEL_LIMIT`).
    A NaN gate spreads to its row's other gates (0 NaN in the product), where the stock recurrence's R product
    spreads it a step later anyway."""
    b, h = e.b, e.hidden
    select = np.eye(4 * h, dtype=e.np_ct)
    select[h:2 * h] = 0  # o from its bias alone
    bias = np.zeros((1, 8 * h), e.np_ct)
    bias[0, h:2 * h] = 1
    steps = b.op1("Reshape", [gates, e.ints([-1, _batch(request), 4 * h], "gate_steps")])
    inputs = _trimmed([steps, b.const(select[None], hint="gate_select"),
                       b.const(np.zeros((1, 4 * h, h), e.np_ct), hint="no_recurrence"),
                       b.const(bias, hint="open_output"), "", "", start or ""])
    return b.op1("LSTM", inputs, hint="cells", hidden_size=h, direction="reverse" if backwards else "forward",
                 activations=["Affine"] * 3, activation_alpha=[1.0] * 3, activation_beta=[0.0] * 3)


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
    # the direction axis kept throughout ([S, 1, N, ..], states [1, N, H]): with one direction the inputs and the
    # outputs but dX are the tensors themselves, no Gather or Unsqueeze each
    directions = _BACKWARDS[request.inference.attributes.get("direction", "forward")]
    count = len(directions)
    steps = _steps(e, x, kept=True) if lengths else None
    mask = _step_mask(e, steps, lengths, kept=True) if lengths else None
    x_kept = e.unsqueeze(x, [1]) if outputs["dW"] else None
    results: dict[str, list[str]] = {r: [] for r in roles}
    for d, backwards in enumerate(directions):
        r_d = _drop_direction(e, request, r, d)  # [4H, H]: the forward's view of R (one kernel for both, or none)
        dh_final, h0, dc_final, c0 = _states(e, request, ("dHFinal", "initial_h", "dCFinal", "initial_c"), d, io, x, r,
                                             count)
        start, initial = [dh_final, dc_final], [h0, c0]
        h_d, c_d, gates_d = (_direction(e, v, d, 1, count) for v in (h_all, c_all, gates))
        keep_prev = _step_mask(e, steps, lengths, 1, kept=True) if lengths and backwards else None
        c_prev = _previous(e, c_d, initial[1], backwards, keep_prev)
        # Every factor that does not depend on the carried dh, dc, for all steps at once before the loop, stacked
        # so that one Mul per factor makes all four gates' dz in the per-gate products' order:
        # dz_i = ((dc g) i)(1 - i), dz_o = ((dh tanh c) o)(1 - o), dz_f = ((dc c_prev) f)(1 - f),
        # dz_c = ((dc 1) i)(1 - g^2) = (dc i)(1 - g^2) (times 1: exact); the same bits as the products per step.
        i, o, f, g = e.split(gates_d, [1, 1, 1, 1], 3)
        tanh_c = b.op1("Tanh", [c_d])
        ones = b.op1("Expand", [e.scalar(1.0, "one"), b.op1("Shape", [c_d])])
        first = b.op1("Concat", [g, tanh_c, c_prev, ones], axis=3)
        second = b.op1("Concat", [i, o, f, i], axis=3)
        third = e.one_minus(b.op1("Concat", [i, o, f, e.mul(g, g)], axis=3))
        through_c = e.one_minus(e.mul(tanh_c, tanh_c))  # dc += (dh o)(1 - tanh^2 c)

        def step(s: _Emit, state: list[str], scanned: list[str], weights: list[str]):
            dh, dc = state
            r_d = weights[0]
            first_t, second_t, third_t, o_t, through_c_t, f_t = scanned[:6]
            dh_t = dh if d_h_all is None else s.add(dh, scanned[6])
            dh_s, dc_s = dh_t, dc
            if mask is not None:
                keep, zero = scanned[-1], s.scalar(0.0, "zero")
                dh_s, dc_s = s.b.op1("Where", [keep, dh_t, zero]), s.b.op1("Where", [keep, dc, zero])
            dc_t = s.add(dc_s, s.mul(dh_s, o_t, through_c_t))
            dz = s.mul(s.b.op1("Concat", [dc_t, dh_s, dc_t, dc_t], axis=2), first_t, second_t, third_t)
            dh_new = s.like(s.b.op1("MatMul", [dz, r_d]), dh)
            dc_new = s.mul(dc_t, f_t)
            if mask is not None:
                dh_new, dc_new = s.b.op1("Where", [keep, dh_new, dh]), s.b.op1("Where", [keep, dc_new, dc])
            return [dh_new, dc_new], [dz]

        scans = [first, second, third, o, through_c, f]
        if d_h_all is not None:
            scans.append(_direction(e, d_h_all, d, 1, count))
        if mask is not None:
            scans.append(f"mask:{mask}")
        # backpropagation runs opposite to the forward; onnxruntime reads R by name (no Identity per step)
        finals, (dz,) = _scan(e, "lstm_backward", start, scans, step, 1, not backwards, [r_d], outer=e.onnxruntime)
        results["dH0"].append(finals[0])
        results["dC0"].append(finals[1])
        if outputs["dX"]:
            results["dX"].append(b.op1("MatMul", [dz, _drop_direction(e, request, w, d)], hint="dx"))
        dz_t = b.op1("Transpose", [dz], perm=[0, 1, 3, 2], hint="dz_t") if outputs["dW"] or outputs["dR"] else None
        if outputs["dW"]:
            results["dW"].append(e.reduce("ReduceSum", b.op1("MatMul", [dz_t, x_kept]), (0,), keepdims=0))
        if outputs["dR"]:
            h_prev = _previous(e, h_d, initial[0], backwards, keep_prev)
            results["dR"].append(e.reduce("ReduceSum", b.op1("MatMul", [dz_t, h_prev]), (0,), keepdims=0))
        if outputs["dB"]:
            db = e.reduce("ReduceSum", dz, (0, 1, 2), keepdims=0)
            results["dB"].append(b.op1("Concat", [db, db], axis=0))
        if outputs["dP"]:
            blocks = b.op1("Reshape", [dz, e.ints([0, 0, 0, 4, -1], "gate_blocks_all")])
            dz_i, dz_o, dz_f = (e.pick(blocks, k, 3) for k in range(3))
            parts = [e.reduce("ReduceSum", e.mul(g, c), (0, 1, 2), keepdims=0)
                     for g, c in ((dz_i, c_prev), (dz_o, c_d), (dz_f, c_prev))]
            results["dP"].append(b.op1("Concat", parts, axis=0))
    if outputs["dX"]:  # [S, 1, N, I] per direction
        e.emit("Identity", [e.squeeze(e.add(*results["dX"]), [1])], outputs["dX"], io)
    for role in ("dW", "dR", "dB", "dH0", "dC0", "dP"):
        if outputs[role]:  # dB, dP summed to [4H], [3H]; the others [1, ..] per direction
            e.stack(results[role], 0, outputs[role], io, kept=role not in ("dB", "dP"))


# -- GRUTraining ----------------------------------------------------------------------------------------------------

def _gru_weights(e: _Emit, r_d: str) -> tuple[str, str]:
    """(R_zr [2H, H], R_h [H, H]) from one direction's R [3H, H] for :meth:`_Emit.affine` (transposed on the
    portable target): one Split on the onnxruntime target where H is static."""
    b = e.b
    if e.hidden:
        r_zr, r_h = e.split_node(r_d, [2 * e.hidden, e.hidden], 0)
        return r_zr, r_h
    blocks = b.op1("Reshape", [b.op1("Transpose", [r_d], perm=[1, 0]), e.ints([0, 3, -1], "gate_blocks_t")])
    r_zr_t = b.op1("Reshape", [e.slice(blocks, 0, 2, 1), e.ints([0, -1], "rows_view")], hint="r_zr_t")
    r_h_t = e.pick(blocks, 2, 1)
    if e.onnxruntime:  # H not static
        return b.op1("Transpose", [r_zr_t], perm=[1, 0]), b.op1("Transpose", [r_h_t], perm=[1, 0])
    return r_zr_t, r_h_t


def _gru_biases(e: _Emit, rows: str) -> tuple[str, str]:
    """(the bias added to X W^T [3H], R_bh [H]) for linear_before_reset 1 from one direction's B as rows [6, H]:
    Wb_z, Wb_r, Wb_h, Rb_z, Rb_r, Rb_h (the reset gate multiplies R_bh)."""
    b = e.b
    zr = b.op1("Add", [e.slice(rows, 0, 2, 0), e.slice(rows, 3, 5, 0)])
    joined = b.op1("Concat", [zr, e.slice(rows, 2, 3, 0)], axis=0)
    return b.op1("Reshape", [joined, e.ints([-1], "flat")]), e.pick(rows, 5, 0)


def _packs_biases(e: _Emit) -> bool:
    """Whether GRU's biases are packed by :func:`_packed_biases`: H static (the onnxruntime target) and the packing
    at most PACKED_BIAS_LIMIT elements."""
    return bool(e.hidden) and 24 * e.hidden * e.hidden <= PACKED_BIAS_LIMIT


def _packed_biases(e: _Emit, request: LoweringRequest, d: int, io: int) -> list[str]:
    """Direction d's [Wb_zr + Rb_zr, Wb_h] [3H] and Rb_h [H]: B's row times a constant 0/1 matrix (each entry one
    term or the sum of two, exact like the Adds: the same values) and one Split; GRUGrad emits the same nodes,
    which onnxruntime's common-subexpression elimination runs once for both."""
    h = e.hidden
    # rows Wb_z, Wb_r, Wb_h, Rb_z, Rb_r, Rb_h of B; columns the x bias z, r, h blocks and R_bh
    blocks = np.zeros((6, 4), e.np_ct)
    blocks[[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 3]] = 1
    packing = e.b.const(np.kron(blocks, np.eye(h, dtype=e.np_ct)), hint="bias_packing")
    both = e.b.op1("MatMul", [_drop_direction(e, request, e.up(request.input("B"), io), d), packing])
    return e.split_node(both, [3 * h, h], 0)


def _gru_training_biases(e: _Emit, request: LoweringRequest, d: int, io: int,
                         linear_before_reset: int) -> tuple[str | None, str | None]:
    """Direction d's (bias added to X W^T [3H], R_bh [H] for linear_before_reset 1), both None without B.
    linear_before_reset 0: the sum of B's [2, 3H] rows, one Reshape and one ReduceSum (no Slices, Add, Reshape).
    1 with a small static H: B's row times a constant 0/1 matrix makes [Wb_zr + Rb_zr, Wb_h, R_bh] at once (each
    entry one term or the sum of two, exact like the Adds: the same values), split in two: 3 kernels instead of 5
    (Reshape, Slices, Add, Concat, Reshape, Gather)."""
    if request.input("B") is None:
        return None, None
    if not linear_before_reset:
        return e.reduce("ReduceSum", _bias_rows(e, request, d, io, 2), (0,), keepdims=0), None
    if _packs_biases(e):
        x_bias, rb_h = _packed_biases(e, request, d, io)
        return x_bias, rb_h
    return _gru_biases(e, _bias_rows(e, request, d, io, 6))


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
    if _stock_recurrence(e, request):
        _gru_training_stock(b, request, e, outputs, io, x, w, r, linear_before_reset)
        return
    mask = _step_mask(e, _steps(e, x), lengths) if lengths else None
    scan_outputs = [role for role in ("HAll", "ZRH") if outputs[role]]
    # linear_before_reset 1 with H static (onnxruntime): two Gemms per step, h R_zr^T + x_zr (the step's x_zr as
    # the Gemm's C) and h R_h^T + R_bh, instead of one Gemm of h R^T + [0, 0, R_bh], a Split and an Add
    two_gemms = bool(linear_before_reset and e.hidden)
    per_direction: dict[str, list[str]] = {role: [] for role in ("HFinal", "packed")}
    for d, backwards in enumerate(_BACKWARDS[attributes.get("direction", "forward")]):
        projected, r_d = _input_product(e, request, x, w, r, d)
        x_bias, rb_h = _gru_training_biases(e, request, d, io, linear_before_reset)
        if x_bias is not None:
            projected = b.op1("Add", [projected, x_bias])
        x_zr, x_h = e.split(projected, [2, 1], 2)  # for all steps: the scan inputs
        start = _direction_input(e, request, "initial_h", d, io)
        if start is None:
            start = _state_zeros(e, x, r)
        if two_gemms:
            weights = list(_gru_weights(e, r_d)) + ([rb_h] if rb_h else [])
        elif linear_before_reset:
            weights = [e.weight(r_d)] + ([rb_h] if rb_h else [])
        else:
            weights = list(_gru_weights(e, r_d))

        def step(s: _Emit, state: list[str], scanned: list[str], weights: list[str]):
            (h,) = state
            x_zr_t, x_h_t = scanned[:2]
            if two_gemms:  # z and r at once (elementwise: the per-gate bits)
                zr = s.b.op1("Sigmoid", [s.affine(h, weights[0], x_zr_t)])
                h_h = s.affine(h, weights[1], weights[2] if len(weights) > 2 else None)
            elif linear_before_reset:
                h_zr, h_h = s.split(s.affine(h, weights[0]), [2, 1], 1)
                if len(weights) > 1:
                    h_h = s.add(h_h, weights[1])
                zr = s.b.op1("Sigmoid", [s.add(x_zr_t, h_zr)])
            else:
                zr = s.b.op1("Sigmoid", [s.affine(h, weights[0], x_zr_t)])
            z, reset = s.split(zr, [1, 1], 1)
            if linear_before_reset:
                candidate = s.b.op1("Tanh", [s.add(x_h_t, s.mul(reset, h_h))])
            else:
                candidate = s.b.op1("Tanh", [s.affine(s.mul(reset, h), weights[1], x_h_t)])
            h_new = s.add(s.mul(s.one_minus(z), candidate), s.mul(z, h))
            # the requested HAll, ZRH as one packed scan output, split once after the loop
            parts = {"HAll": [h_new], "ZRH": [zr, candidate]}
            pieces = [p for role in scan_outputs for p in parts[role]]
            outs = [s.b.op1("Concat", pieces, axis=1) if len(pieces) > 1 else pieces[0]] if pieces else []
            if mask is None:
                return [h_new], outs
            keep, zero = scanned[2], s.scalar(0.0, "zero")
            return [s.b.op1("Where", [keep, h_new, h])], [s.b.op1("Where", [keep, v, zero]) for v in outs]

        scans = [x_zr, x_h] + ([f"mask:{mask}"] if mask else [])
        finals, packed = _scan(e, "gru_forward", [start], scans, step, 1 if scan_outputs else 0, backwards, weights,
                               outer=e.onnxruntime)
        per_direction["HFinal"].append(finals[0])
        per_direction["packed"] += packed
    if outputs["HFinal"]:
        e.stack(per_direction["HFinal"], 0, outputs["HFinal"], io)
    if scan_outputs:
        e.unpack(per_direction["packed"], [outputs[r] for r in scan_outputs],
                 [3 if r == "ZRH" else 1 for r in scan_outputs], io)


# The stock kernel's form computes the gates the gradient reads for all steps at once in a fixed number of kernels
# (GRU ~70 with the rational tanh, LSTM ~20 and two a step for the cells) where the Scan runs 9-11 a step: it pays
# from STOCK_STEPS static steps on (tools/ab_lowered.py --threads 1, CPU clock, stock / Scan form: GRU 5 steps 1.25,
# 12 steps 0.90; LSTM 5 steps 0.92-0.94, 10 steps 0.86) and up to STOCK_GATES gate values (S * N * gates * H) a
# direction: past that the passes over the gates outweigh the Scan's per-step cost (tools/bench_recurrent.py, 2
# threads, the forward op alone, stock / Scan ms: [S, N, I, H] [20, 8, 16, 32] LSTM 0.19 / 0.31, GRU 0.29 / 0.31;
# [30, 16, 32, 64] LSTM 0.75 / 0.72, GRU 0.86 / 0.48; [50, 32, 64, 128] LSTM 5.2-7.3 / 3.6-4.2, GRU 6.4-9.1 /
# 2.5-2.7)
STOCK_STEPS = {"LSTMTraining": 4, "GRUTraining": 9}
STOCK_GATES = {"LSTMTraining": 1 << 16, "GRUTraining": 1 << 14}
_GATES = {"LSTMTraining": 4, "GRUTraining": 3}


def _stock_recurrence(e: _Emit, request: LoweringRequest) -> bool:
    """Whether the hidden states come from onnxruntime's own ``LSTM`` / ``GRU`` kernel (one kernel for the whole
    sequence, every direction) rather than a Scan: the onnxruntime target with H and X's shape static, f32, no
    ``sequence_lengths``, no peepholes and no ``input_forget`` (the verifier already refused other activations and
    ``clip``), a sequence of STOCK_STEPS to STOCK_GATES (small steps). A Scan step costs 7-11 kernels (each ~0.4 us
    at a sensor LSTM's sizes) where onnxruntime-training's kernel runs the sequence in one: held-out gru_sensor's
    GRUTraining took 87 of its 197 us step, the native kernel 12 us, the stock GRU kernel 11 us. The gate values the
    gradient reads are then computed from its hidden states for all steps at once (see :func:`_gru_training_stock`,
    :func:`_lstm_training_stock`)."""
    op = request.inference.op_type
    x = request.inference.input_types[request.inference.schema.input_index("X")]
    steps, batch = (None, None) if x is None or x.shape is None or len(x.shape) != 3 else x.shape[:2]
    return e.onnxruntime and bool(e.hidden) and e.ct == TensorProto.FLOAT and \
        request.input("sequence_lengths") is None and request.input("P") is None and \
        not int(request.inference.attributes.get("input_forget", 0)) and \
        isinstance(steps, int) and isinstance(batch, int) and steps >= STOCK_STEPS[op] and \
        steps * batch * _GATES[op] * e.hidden <= STOCK_GATES[op]


def _stock_inputs(e: _Emit, request: LoweringRequest, io: int, x: str, w: str, r: str,
                  states: tuple[str, ...]) -> list[str]:
    """The stock LSTM / GRU kernel's inputs: X, W, R, B, no sequence_lens, the initial states (trailing absent
    ones dropped)."""
    return _trimmed([x, w, r] + [e.up(request.input(role), io) if role and request.input(role) else ""
                                 for role in ("B", None, *states)])


def _trimmed(names: list[str]) -> list[str]:
    """Names of a node's optional inputs or outputs without the trailing absent ones ("")."""
    while names and names[-1] == "":
        names = names[:-1]
    return names


def _stock_results(b: NodeBuilder, e: _Emit, outputs: dict, io: int, roles: tuple[str, ...],
                   needed: dict[str, bool]) -> dict[str, str]:
    """The stock kernel's output names per role: the requested output itself (f32), a fresh name (cast to it after,
    or read by the gates' rows though not requested: ``needed``), or "" (an optional output not written)."""
    return {role: (outputs[role] if outputs[role] and io == e.ct else
                   b.fresh(role.lower()) if outputs[role] or needed.get(role) else "") for role in roles}


def _cast_results(b: NodeBuilder, outputs: dict, results: dict[str, str], io: int) -> None:
    for role, value in results.items():
        if outputs[role] and value != outputs[role]:
            b.op1("Cast", [value], outputs[role], to=io)


def _stock_previous(e: _Emit, request: LoweringRequest, y: str, x: str, r: str, io: int, d: int, count: int,
                    backwards: bool) -> str:
    """Direction d's hidden state before each step as [S * N, H] rows: the stock kernel's Y [S, D, N, H] shifted by
    one step towards where the direction starts, initial_h (zeros without it) first. One direction: Y as it is, the
    state as [1, N, H] (no Squeeze of either)."""
    if count == 1:
        values = y
        start = _direction_input(e, request, "initial_h", d, io, count=1)
        if start is None:
            start = _state_zeros(e, x, r, kept=True)
    else:
        values = e.pick(y, d, 1)
        start = _direction_input(e, request, "initial_h", d, io)
        if start is None:
            start = _state_zeros(e, x, r)
    previous = _previous(e, values, start, backwards, None)
    return e.b.op1("Reshape", [previous, e.ints([-1, e.hidden], "state_rows")])


def _stock_direction(e: _Emit, request: LoweringRequest, y: str, x: str, w: str, r: str, io: int, d: int, count: int,
                     backwards: bool, gates: int) -> tuple[str, str, str]:
    """What the stock forms compute direction d's gates from, as [S * N, ..] rows: X W^T (no bias) [S * N, gates *
    H], the hidden state before each step (:func:`_stock_previous`) [S * N, H], and the direction's R."""
    projected, r_d = _input_product(e, request, x, w, r, d)
    x_rows = e.b.op1("Reshape", [projected, e.ints([-1, gates * e.hidden], "gate_rows")])
    return x_rows, _stock_previous(e, request, y, x, r, io, d, count, backwards), r_d


def _steps_back(e: _Emit, request: LoweringRequest, x: str, rows: str, width: int, output: str | None = None) -> str:
    """[S * N, width] rows as [S, 1, N, width] (one direction's slice of a [S, D, N, ..] output; written to
    ``output`` when given)."""
    n = _batch(request)
    if n is not None:
        shape = e.ints([-1, 1, n, width], "steps_back")
    else:
        dims = e.b.op1("Shape", [x])
        shape = e.b.op1("Concat", [e.slice(dims, 0, 1, 0), e.ints([1], "one_dim"), e.slice(dims, 1, 2, 0),
                                   e.ints([width], "width")], axis=0)
    return e.b.op1("Reshape", [rows, shape], output)


def _stack_steps(e: _Emit, request: LoweringRequest, x: str, parts: list[str], width: int, output: str,
                 io: int) -> None:
    """The directions' [S * N, width] rows as the [S, D, N, width] ``output``: one Reshape into it for one
    direction (no Identity after it), else Reshapes and a Concat."""
    if len(parts) == 1 and io == e.ct:
        _steps_back(e, request, x, parts[0], width, output)
        return
    e.stack([_steps_back(e, request, x, p, width) for p in parts], 1, output, io, kept=True)


# onnxruntime's recurrent kernels (rnn_helpers.cc, deepcpu) compute GRU's reset gate and candidate activation with a
# rational approximation of tanh: x clipped, then odd polynomial / even polynomial in x^2 by Horner's rule, in f32
# operations one at a time (no fused multiply-add); sigmoid(x) is 0.5 (1 + that at x / 2)
_TANH_NUMERATOR = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11, 5.12229709037114e-08,
                   1.48572235717979e-05, 6.37261928875436e-04, 4.89352455891786e-03)  # x^13 down to x^1
_TANH_DENOMINATOR = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03,
                     4.89352518554385e-03)  # x^6 down to x^0
_SIGMOID_BOUND, _TANH_BOUND = 20.0, 10.0


def _rational_ratio(e: _Emit, x: str) -> str:
    """The kernels' tanh approximation p(x) / q(x) of a clipped ``x``, in their order of f32 operations. Both
    polynomials run as one Horner chain on a stacked [2, ...] value (q's lane starts from zeros, 0 x^2 + 0 staying
    an exact 0 until its first coefficient): 17 kernels where the two chains ran 21, the same operations per lane."""
    b = e.b
    x2 = b.op1("Mul", [x, x])
    steps = len(_TANH_NUMERATOR) - 1
    q_lane = (0.0,) * (steps - len(_TANH_DENOMINATOR) + 1) + _TANH_DENOMINATOR
    chain = e.b.const(np.array([_TANH_NUMERATOR[0], q_lane[0]], e.np_ct).reshape(2, 1, 1), hint="tanh_start")
    for p_coefficient, q_coefficient in zip(_TANH_NUMERATOR[1:], q_lane[1:], strict=True):
        chain = b.op1("Add", [b.op1("Mul", [x2, chain]), e.b.const(
            np.array([p_coefficient, q_coefficient], e.np_ct).reshape(2, 1, 1), hint="tanh_coefficients")])
    p, q = e.split_node(chain, [1, 1], 0)  # [1, ...] each: x p / q broadcasts, one Squeeze at the end
    return e.squeeze(b.op1("Div", [b.op1("Mul", [x, p]), q]), [0])


def _clipped(e: _Emit, x: str, bound: float) -> str:
    return e.b.op1("Clip", [x, e.scalar(-bound, "clip_low"), e.scalar(bound, "clip_high")])


def _rational_tanh(e: _Emit, x: str) -> str:
    """tanh as onnxruntime's GRU kernel computes its candidate activation (gru_output_gate_tanh)."""
    return _rational_ratio(e, _clipped(e, x, _TANH_BOUND))


def _rational_sigmoid(e: _Emit, x: str) -> str:
    """sigmoid as onnxruntime's GRU kernel computes its reset gate (gru_reset_gate_sigmoid): 0.5 (1 + p/q) at x/2."""
    half = e.scalar(0.5, "half")
    ratio = _rational_ratio(e, e.b.op1("Mul", [half, _clipped(e, x, _SIGMOID_BOUND)]))
    return e.b.op1("Mul", [half, e.b.op1("Add", [e.scalar(1.0, "one"), ratio])])


def _gru_training_stock(b: NodeBuilder, request: LoweringRequest, e: _Emit, outputs: dict, io: int, x: str,
                        w: str, r: str, linear_before_reset: int) -> None:
    """GRUTraining by onnxruntime's ``GRU`` kernel (:func:`_stock_recurrence`): HAll and HFinal are its Y and Y_h
    (onnxruntime-training's kernel runs the same loop: the same bits on every recorded case). ZRH needs no loop:
    with every step's previous state known (HAll shifted by one step, initial_h first), z, r and h~ of all steps
    are computed on [S * N] rows at once in that kernel's order, so with its bits: X W^T, plus h R_zr^T (a Gemm
    with it as C), plus Wb_zr + Rb_zr, then the Sigmoid; h~ from X W_h^T plus r (h R_h^T + R_bh) (linear_before_reset
    1; 0: plus (r h) R_h^T), plus the h biases, then the Tanh."""
    direction = request.inference.attributes.get("direction", "forward")
    backwards_list = _BACKWARDS[direction]
    count = len(backwards_list)
    results = _stock_results(b, e, outputs, io, ("HAll", "HFinal"), {"HAll": bool(outputs["ZRH"])})
    hall = results["HAll"]
    b.op("GRU", _stock_inputs(e, request, io, x, w, r, ("initial_h",)), _trimmed([hall, results["HFinal"]]),
         hidden_size=e.hidden, direction=direction, linear_before_reset=linear_before_reset)
    _cast_results(b, outputs, results, io)
    if not outputs["ZRH"]:
        return
    h = e.hidden
    parts = []
    for d, backwards in enumerate(backwards_list):
        x_rows, rows, r_d = _stock_direction(e, request, hall, x, w, r, io, d, count, backwards, 3)
        x_zr, x_h = e.split(x_rows, [2, 1], 1)
        x_bias, rb_h = _gru_training_biases(e, request, d, io, linear_before_reset)
        bias_zr, bias_h = e.split(x_bias, [2, 1], 0) if x_bias is not None else (None, None)
        r_zr, r_h = _gru_weights(e, r_d)
        zr = e.affine(rows, r_zr, x_zr)
        z_pre, r_pre = e.split(zr if bias_zr is None else e.add(zr, bias_zr), [1, 1], 1)
        z = b.op1("Sigmoid", [z_pre])  # the kernel's update gate: MLAS's logistic, as onnxruntime's Sigmoid
        reset = _rational_sigmoid(e, r_pre)
        if linear_before_reset:
            pre = e.add(x_h, e.mul(e.affine(rows, r_h, rb_h), reset))
        else:
            pre = e.affine(e.mul(rows, reset), r_h, x_h)
        candidate = _rational_tanh(e, pre if bias_h is None else e.add(pre, bias_h))
        parts.append(b.op1("Concat", [z, reset, candidate], axis=1))
    _stack_steps(e, request, x, parts, 3 * h, outputs["ZRH"], io)


# -- GRUGrad --------------------------------------------------------------------------------------------------------

def _gru_grad_blocks(e: _Emit, z: str, reset: str, zr: str, candidate: str, h_prev: str, q: str, r_zr: str,
                     r_h: str) -> tuple[list[str], list[str]]:
    """GRUGrad's (linear_before_reset 1) scan inputs and weights for its four-block step: a_h = (dh (1 - z))
    (1 - h~^2), then [dh, a_h, a_h, dh] times [h_prev - h~, q, r, z], [z, r, 1, 1] and [1 - z, 1 - r, 1, 1] makes
    [a_z, a_r, a_h r, dh z] (each block the per-gate products in their order, times 1: exact) by one Mul per
    factor; Gemm(that, [R_zr; 0; I]) is [a_z, a_r] R_zr + dh z and Gemm(that, [0; R_h; 0], C = it) adds (a_h r) R_h
    -- where the two-product form ran Muls for a_h r and dh z and Gemm(a_zr, R_zr, C = dh z), Gemm(a_h r, R_h, C).
    The same bits at a batch and H of 2 and more (onnxruntime's rows sum the exact zero terms to nothing, dh z comes
    last into the first sum: P + dh z, the same single rounding as dh z + P; checked on 4,000 shapes; at a batch or
    H of 1 onnxruntime's one-row/one-column paths round otherwise); signed zeros and infinities aside: an exact
    -0 sum may come out +0, and an infinite a_h r or dh z turns the zero terms' products NaN. Returns (scan
    inputs: 1 - z, 1 - h~^2 and the three stacked factors; weights: the two [4H, H] row stacks)."""
    b, h = e.b, e.hidden
    ones = b.op1("Expand", [e.scalar(1.0, "one"), b.op1("Shape", [zr])])
    first = b.op1("Concat", [b.op1("Sub", [h_prev, candidate]), q, reset, z], axis=2)
    scans = [e.one_minus(z), e.one_minus(e.mul(candidate, candidate)), first,
             b.op1("Concat", [zr, ones], axis=2), b.op1("Concat", [e.one_minus(zr), ones], axis=2)]
    weights = [b.op1("Concat", [r_zr, b.const(np.eye(2 * h, h, -h, e.np_ct), hint="zero_eye")], axis=0),
               b.op1("Concat", [b.const(np.zeros((2 * h, h), e.np_ct), hint="zeros"), r_h,
                                b.const(np.zeros((h, h), e.np_ct), hint="zeros")], axis=0)]
    return scans, weights


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
    # linear_before_reset 1, H static (onnxruntime), N static, both at least 2 and N H <= FOUR_BLOCKS_LIMIT: one
    # Mul per factor over the 4 blocks [a_z, a_r, a_h r, dh z] and two Gemms of them (:func:`_gru_grad_blocks`)
    batch = _batch(request)
    four_blocks = bool(linear_before_reset and e.hidden and e.hidden >= 2 and batch and batch >= 2 and
                       batch * e.hidden <= FOUR_BLOCKS_LIMIT)
    results: dict[str, list[str]] = {role: [] for role in roles}
    directions = _BACKWARDS[attributes.get("direction", "forward")]
    # the forward's stock form's nodes for h_prev and q = h_prev R_h^T + Rb_h (one direction, static N and H, packed
    # biases): [S N, H] rows and one Gemm, which onnxruntime's common-subexpression elimination runs once for both
    # ops (the Gemm's C added after the product, as MatMul then Add: the same bits)
    shared = e.onnxruntime and len(directions) == 1 and not lengths and bool(linear_before_reset) and bool(batch) and \
        request.input("B") is not None and _packs_biases(e)
    for d, backwards in enumerate(directions):
        r_d = _drop_direction(e, request, r, d)
        (start,) = _states(e, request, ("dHFinal",), d, io, x, r)
        gates_d = e.pick(gates, d, 1)
        r_zr, r_h = _gru_weights(e, r_d)
        if shared:
            rows = _stock_previous(e, request, h_all, x, r, io, d, 1, backwards)
            steps_view = e.ints([-1, batch, e.hidden], "step_rows")
            h_prev = b.op1("Reshape", [rows, steps_view])
            q = b.op1("Reshape", [e.affine(rows, r_h, _packed_biases(e, request, d, io)[1]), steps_view], hint="q")
        else:
            (initial,) = _states(e, request, ("initial_h",), d, io, x, r)
            keep_prev = _step_mask(e, steps, lengths, 1) if lengths and backwards else None
            h_prev = _previous(e, e.pick(h_all, d, 1), initial, backwards, keep_prev)
        if e.onnxruntime:
            r_h_t = None if shared else b.op1("Transpose", [r_h], perm=[1, 0])
        else:
            r_zr, r_h, r_h_t = b.op1("Transpose", [r_zr], perm=[1, 0]), b.op1("Transpose", [r_h], perm=[1, 0]), r_h
        # Every factor that does not depend on the carried dh, for all steps at once before the loop; a_z and a_r
        # by one Mul per factor in the per-gate products' order: a_z = ((dh (h_prev - h~)) z)(1 - z) and
        # a_r = ((a_h q) r)(1 - r) (linear_before_reset), ((g h_prev) r)(1 - r) with g = a_h R_h (else)
        zr, candidate = e.split(gates_d, [2, 1], 2)
        z, reset = e.split(zr, [1, 1], 2)
        if linear_before_reset and not shared:  # q = h_prev R_h^T + Rb_h
            q = b.op1("MatMul", [h_prev, r_h_t], hint="q")
            if request.input("B") is not None and _packs_biases(e):  # R_bh from the forward's packing (shared)
                q = b.op1("Add", [q, _packed_biases(e, request, d, io)[1]])
            elif request.input("B") is not None:
                q = b.op1("Add", [q, _gru_biases(e, _bias_rows(e, request, d, io, 6))[1]])
        if four_blocks:
            scans, weights = _gru_grad_blocks(e, z, reset, zr, candidate, h_prev, q, r_zr, r_h)
        else:
            first = b.op1("Concat", [b.op1("Sub", [h_prev, candidate]), q if linear_before_reset else h_prev],
                          axis=2)
            scans = [z, reset, e.one_minus(z), e.one_minus(e.mul(candidate, candidate)), first, zr, e.one_minus(zr)]
            weights = [r_zr, r_h]
        if d_h_all is not None:
            scans.append(e.pick(d_h_all, d, 1))
        if mask is not None:
            scans.append(f"mask:{mask}")

        def step(s: _Emit, state: list[str], scanned: list[str], weights: list[str]):
            (dh,) = state
            count = 5 if four_blocks else 7
            dh_t = dh if d_h_all is None else s.add(dh, scanned[count])
            if mask is not None:
                keep = scanned[-1]
                dh_t = s.b.op1("Where", [keep, dh_t, s.scalar(0.0, "zero")])
            if four_blocks:
                one_minus_z, one_minus_c2, first_t, zr_t, one_minus_zr = scanned[:5]
                a_h = s.mul(dh_t, one_minus_z, one_minus_c2)
                a_zr = s.mul(s.b.op1("Concat", [dh_t, a_h, a_h, dh_t], axis=1), first_t, zr_t, one_minus_zr)
                dh_new = s.b.op1("Gemm", [a_zr, weights[1], s.b.op1("Gemm", [a_zr, weights[0]])])
                if mask is not None:
                    dh_new = s.b.op1("Where", [keep, dh_new, dh])
                return [dh_new], [a_zr, a_h]
            r_zr, r_h = weights
            z_t, reset_t, one_minus_z, one_minus_c2, first_t, zr_t, one_minus_zr = scanned[:7]
            a_h = s.mul(dh_t, one_minus_z, one_minus_c2)
            if linear_before_reset:
                a_zr = s.mul(s.b.op1("Concat", [dh_t, a_h], axis=1), first_t, zr_t, one_minus_zr)
                through_reset = s.b.op1("MatMul", [s.mul(a_h, reset_t), r_h])
            else:
                g = s.b.op1("MatMul", [a_h, r_h])
                a_zr = s.mul(s.b.op1("Concat", [dh_t, g], axis=1), first_t, zr_t, one_minus_zr)
                through_reset = s.mul(g, reset_t)
            dh_new = s.like(s.add(s.mul(dh_t, z_t), s.b.op1("MatMul", [a_zr, r_zr]), through_reset), dh)
            if mask is not None:
                dh_new = s.b.op1("Where", [keep, dh_new, dh])
            # onnxruntime: a_zr and a_h as two scan outputs, joined once after the loop; the portable target joins
            # them per step (tract 0.23 fails to analyse the Scan with a_h a scan output of its own)
            return [dh_new], [a_zr, a_h] if s.onnxruntime else [s.b.op1("Concat", [a_zr, a_h], axis=1)]

        # backpropagation runs opposite to the forward; onnxruntime reads the weights by name
        finals, stacked = _scan(e, "gru_backward", [start], scans, step, 2 if e.onnxruntime else 1, not backwards,
                                weights, outer=e.onnxruntime)
        results["dH0"].append(finals[0])
        if four_blocks:
            da_zr, a_h_r, _ = e.split(stacked[0], [2, 1, 1], 2)
            da_h = stacked[1]
            da = b.op1("Concat", [da_zr, da_h], axis=2) if outputs["dX"] or outputs["dW"] else None
        elif e.onnxruntime:
            da_zr, da_h = stacked
            da = b.op1("Concat", stacked, axis=2) if outputs["dX"] or outputs["dW"] else None
        else:
            (da,) = stacked
            da_zr, da_h = e.split(da, [2, 1], 2)
        if outputs["dX"]:
            results["dX"].append(b.op1("MatMul", [da, _drop_direction(e, request, w, d)], hint="dx"))
        if outputs["dW"]:
            da_t = b.op1("Transpose", [da], perm=[0, 2, 1], hint="da_t")
            results["dW"].append(e.reduce("ReduceSum", b.op1("MatMul", [da_t, x]), (0,)))
        # the R_h rows see a_h r against h_prev (linear_before_reset), else a_h against r h_prev
        if four_blocks:
            a_h_rows = a_h_r
        elif linear_before_reset and (outputs["dR"] or outputs["dB"]):
            a_h_rows = b.op1("Mul", [da_h, reset])
        else:
            a_h_rows = da_h
        if outputs["dR"] and linear_before_reset:  # every row against h_prev: one product of [a_zr, a_h r]^T
            rows = b.op1("Concat", [da_zr, a_h_rows], axis=2)  # (each entry the same dot product as per part)
            results["dR"].append(e.reduce("ReduceSum", b.op1("MatMul", [b.op1("Transpose", [rows], perm=[0, 2, 1]),
                                                                      h_prev]), (0,)))
        elif outputs["dR"]:
            zr_rows = b.op1("MatMul", [b.op1("Transpose", [da_zr], perm=[0, 2, 1]), h_prev])
            h_rows = b.op1("MatMul", [b.op1("Transpose", [a_h_rows], perm=[0, 2, 1]), b.op1("Mul", [reset, h_prev])])
            results["dR"].append(e.reduce("ReduceSum", b.op1("Concat", [zr_rows, h_rows], axis=1), (0,)))
        if outputs["dB"]:  # one ReduceSum of [a_zr, a_h, a_zr, a_h rows] (each column's sum as alone, bit for bit)
            joined = b.op1("Concat", [da_zr, da_h, da_zr, a_h_rows], axis=2)
            results["dB"].append(e.reduce("ReduceSum", joined, (0, 1), keepdims=0))
    if outputs["dX"]:
        e.emit("Identity", [e.add(*results["dX"])], outputs["dX"], io)
    for role in ("dW", "dR", "dB", "dH0"):
        if outputs[role]:  # dW, dR: [1, ..] per direction (the ReduceSum's kept axis)
            e.stack(results[role], 0, outputs[role], io, kept=role in ("dW", "dR"))
