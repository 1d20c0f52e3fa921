"""Gradient rule: RNN (torch's nn.RNN, tanh or relu; forward, reverse, bidirectional).

onnxruntime-training has neither a gradient nor a training op for it ("The gradient builder has not been
registered: RNN"), so the rule is standard ops: backpropagation through time unrolled over the static sequence
length. Per direction, with H_t = f(A_t), A_t = X_t W^T + H_prev R^T + Wb + Rb:

    dH_t = dY_t + dA_next R,  dA_t = dH_t * f'(A_t)  (from H_t: 1 - H^2, H > 0, H (1 - H))

walking against the direction's time order (the final state's gradient dY_h enters at the last step); then, over
all steps at once, dX = dA W, dW = dA^T X, dR = dA^T H_prev, dWb = dRb = sum(dA), d initial_h = the carry left.
``prepare`` gives the forward node its Y output (every H_t) where the model did not read it.

Not differentiated (a one-line error): ``clip``, ``sequence_lens``, ``layout`` 1, activations other than
Tanh/Relu/Sigmoid, a sequence length only the run knows.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from lowering.training.gradients.context import ForwardContext, GradientContext
from lowering.training.gradients.registry import gradient_rule

_ACTIVATIONS = ("Tanh", "Relu", "Sigmoid")


def _with_y(node: onnx.NodeProto, f: ForwardContext) -> list[onnx.NodeProto] | None:
    if node.output and node.output[0]:
        return None
    new = onnx.NodeProto()
    new.CopyFrom(node)
    if not new.output:
        new.output.append("")
    new.output[0] = f.fresh(f"{node.name or 'rnn'}_Y")
    if f.shape(node.input[0]) is not None and f.elem_type(node.input[0]) is not None:
        s0, s1, _ = f.shape(node.input[0])
        hidden = next((a.i for a in node.attribute if a.name == "hidden_size"), None)
        direction = next((a.s for a in node.attribute if a.name == "direction"), b"forward")
        dirs = 2 if direction == b"bidirectional" else 1
        f.set_type(new.output[0], f.elem_type(node.input[0]), [s0, dirs, s1, hidden])
    return [new]


def _str_list(ctx: GradientContext, name: str, default: list[str]) -> list[str]:
    value = ctx.attr(name)
    if value is None:
        return default
    return [v.decode() if isinstance(v, bytes) else v for v in value]


@gradient_rule("RNN", differentiable=(0, 1, 2, 3, 5), prepare=_with_y)
def rnn(ctx: GradientContext) -> None:
    f = ctx.f
    direction = ctx.attr("direction", b"forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    directions = 2 if direction == "bidirectional" else 1
    activations = _str_list(ctx, "activations", ["Tanh"] * directions)
    if any(a not in _ACTIVATIONS for a in activations):
        raise ctx.fail(f"activations {activations}: only {', '.join(_ACTIVATIONS)} are differentiated")
    if ctx.attr("clip") is not None:
        raise ctx.fail("clip is not differentiated")
    if len(ctx.node.input) > 4 and ctx.x(4):
        raise ctx.fail("sequence_lens is not differentiated (pack_padded_sequence): pad and mask instead")
    layout = int(ctx.attr("layout", 0))
    if layout:
        raise ctx.fail("layout 1 is not differentiated (onnxruntime has no batch-major RNN kernel to check it "
                       "against; torch exports layout 0 with Transposes)")
    x, w, r = ctx.x(0), ctx.x(1), ctx.x(2)
    b = ctx.x(3) if len(ctx.node.input) > 3 else ""
    h0 = ctx.x(5) if len(ctx.node.input) > 5 else ""
    x_shape = f.shape(x)
    if x_shape is None or len(x_shape) != 3:
        raise ctx.fail("the input's shape is unknown")
    steps = x_shape[0]
    if not isinstance(steps, int):
        raise ctx.fail(f"the sequence length ({steps}) must be static (the gradient is unrolled over it)")
    if f.opset < 13:
        raise ctx.fail("RNN is differentiated from opset 13 (Unsqueeze/Squeeze axes as inputs); re-export at 13+")
    hidden = int(ctx.attr("hidden_size"))
    dtype = f.np_dtype(x)

    # time-major views: X [T, B, I], Y [T, D, B, H], dY likewise
    xt = x
    y, dy, dy_h = ctx.y(0), ctx.dy(0), ctx.dy(1)
    yt = y
    dyt = dy or None
    dy_ht = dy_h or None

    h0t = h0

    def pick(value: str, index: int, axis: int) -> str:
        return f.node1("Gather", [value, f.const(np.asarray(index, np.int64), hint="index")], axis=axis)

    flat_shape = f.const(np.array([-1, hidden], np.int64), hint="rows")
    x_rows = f.node1("Reshape", [xt, f.const(np.array([-1, x_shape[2]], np.int64), hint="rows")]) \
        if isinstance(x_shape[2], int) else f.node1("Flatten", [xt], axis=2)
    d_x, d_w, d_r, d_b, d_h0 = [], [], [], [], []
    for d in range(directions):
        reverse = direction == "reverse" or d == 1
        act = activations[d] if d < len(activations) else activations[0]
        y_d = pick(yt, d, 1)                                   # [T, B, H]
        dy_d = pick(dyt, d, 1) if dyt else None
        w_d, r_d = pick(w, d, 0), pick(r, d, 0)                # [H, I], [H, H]
        h0_d = pick(h0t, d, 0) if h0 else None
        order = range(steps - 1, -1, -1) if not reverse else range(steps)
        carry = pick(dy_ht, d, 0) if dy_ht else None
        d_a: dict[int, str] = {}
        for t in order:
            parts = [p for p in (pick(dy_d, t, 0) if dy_d else None, carry) if p]
            if not parts:
                d_a[t] = None
                continue
            dh = parts[0] if len(parts) == 1 else f.node1("Add", parts)
            h_t = pick(y_d, t, 0)
            d_a[t] = f.node1("Mul", [dh, _derivative(f, act, h_t, dtype)], hint="rnn_dA")
            carry = f.node1("MatMul", [d_a[t], r_d], hint="rnn_dH")
        zeros = None  # steps no gradient reaches (a direction only Y_h of the other is read from)
        for t in range(steps):
            if d_a[t] is None:
                zeros = zeros or f.node1("Mul", [pick(y_d, 0, 0), f.const(np.asarray(0, dtype), hint="zero")])
                d_a[t] = zeros
        stacked = f.node1("Concat", [f.node1("Unsqueeze", [d_a[t], f.axes([0])]) for t in range(steps)], axis=0)
        rows = f.node1("Reshape", [stacked, flat_shape])        # [T*B, H]
        if ctx.requires(0):
            d_x.append(f.node1("MatMul", [stacked, w_d]))
        if ctx.requires(1):
            d_w.append(f.node1("Gemm", [rows, x_rows], transA=1))
        if ctx.requires(2):
            first = h0_d or f.node1("Mul", [pick(y_d, 0, 0), f.const(np.asarray(0, dtype), hint="zero")])
            first = f.node1("Unsqueeze", [first, f.axes([0])])
            if steps == 1:
                prev = first
            elif not reverse:
                prev = f.node1("Concat", [first, f.node1("Slice", [y_d, f.axes([0]), f.axes([steps - 1]),
                                                                    f.axes([0])])], axis=0)
            else:
                prev = f.node1("Concat", [f.node1("Slice", [y_d, f.axes([1]), f.axes([steps]), f.axes([0])]),
                                          first], axis=0)
            d_r.append(f.node1("Gemm", [rows, f.node1("Reshape", [prev, flat_shape])], transA=1))
        if ctx.requires(3) and b:
            bias = f.reduce("ReduceSum", rows, [0], keepdims=0)
            d_b.append(f.node1("Concat", [bias, bias], axis=0))
        if ctx.requires(5) and h0:
            d_h0.append(carry)
    def per_direction(parts: list[str]) -> str:
        return f.node1("Concat", [f.node1("Unsqueeze", [p, f.axes([0])]) for p in parts], axis=0)

    if d_x:
        total = d_x[0] if len(d_x) == 1 else f.node1("Sum", d_x)
        ctx.set_dx(0, total)
    if d_w:
        ctx.set_dx(1, per_direction(d_w))
    if d_r:
        ctx.set_dx(2, per_direction(d_r))
    if d_b:
        ctx.set_dx(3, per_direction(d_b))
    if d_h0:
        stacked = per_direction(d_h0)
        ctx.set_dx(5, stacked)


def _derivative(f: ForwardContext, act: str, h: str, dtype) -> str:
    """f'(A) from H = f(A)."""
    one = f.const(np.asarray(1, dtype), hint="one")
    if act == "Tanh":
        return f.node1("Sub", [one, f.node1("Mul", [h, h])])
    if act == "Sigmoid":
        return f.node1("Mul", [h, f.node1("Sub", [one, h])])
    return f.node1("Cast", [f.node1("Greater", [h, f.const(np.asarray(0, dtype), hint="zero")])],
                   to=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
