"""Gradient rules: recurrent family (LSTM, GRU).

As onnxruntime-training's generator does it (its LSTMReplacement / GRUReplacement rewrites and its
``GetLSTMGradient`` / ``GetGRUGradient`` builders): ``prepare`` turns an ONNX ``LSTM`` into
``com.microsoft::LSTMTraining`` with the outputs its gradient reads (every step's hidden state ``HAll``, every
step's cell state ``CAll``, the gate activations ``iofc``) and a ``GRU`` into ``GRUTraining`` (``HAll``,
``ZRH``); the gradient is one ``LSTMGrad`` / ``GRUGrad`` node (backpropagation through time), fed with the
gradients of HAll, HFinal (and CFinal) that flow back, an empty input where none does. The eval model keeps the
standard LSTM / GRU (no ``eval_form``).

An LSTM or GRU that the training ops cannot express (``layout`` 1, ``clip``, ``input_forget``, other
activations, peephole weights, a type other than float32/float64) stays a standard node: it still runs in the
training model, and differentiating through it is a one-line error saying why.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from lowering.training.gradients.context import ForwardContext, GradientContext, node_attributes
from lowering.training.gradients.registry import gradient_rule

MS = "com.microsoft"
_DIRECTIONS = {"forward": 1, "reverse": 1, "bidirectional": 2}
_ACTIVATIONS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh")}
_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)
_LSTM_P = 7  # the peephole weights' input position


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _input(node: onnx.NodeProto, i: int) -> str:
    return node.input[i] if i < len(node.input) else ""


def _zero_constant(f: ForwardContext, name: str) -> bool:
    value = f.constant(name)
    return value is not None and not np.any(value)


def _unsupported(node: onnx.NodeProto, f: ForwardContext, kind: str) -> str | None:
    """Why onnxruntime-training's ``<kind>Training`` / ``<kind>Grad`` cannot stand for this node (None: they can)."""
    op = f"{kind}Training"
    attrs = node_attributes(node)
    direction = _text(attrs.get("direction", "forward"))
    if direction not in _DIRECTIONS:
        return f"direction {direction!r} is none of forward, reverse, bidirectional"
    if int(attrs.get("layout", 0)) != 0:
        return (f"layout {attrs['layout']} (batch-major X and Y) is not supported by {op}; use layout 0 "
                "(sequence-major, as torch exports it)")
    if attrs.get("clip") is not None:
        return f"clip {attrs['clip']} (cell clipping) is not supported by {op}"
    if kind == "LSTM" and int(attrs.get("input_forget", 0)) != 0:
        return f"input_forget {attrs['input_forget']} (coupled input and forget gates) is not supported by {op}"
    activations = attrs.get("activations")
    default = _ACTIVATIONS[kind] * _DIRECTIONS[direction]
    if activations is not None and tuple(_text(a) for a in activations) != default:
        return (f"activations {[_text(a) for a in activations]} are not supported by {op} (only the defaults "
                f"{list(default)})")
    if kind == "LSTM" and _input(node, _LSTM_P) and not _zero_constant(f, _input(node, _LSTM_P)):
        return ("peephole weights (input P) are not supported: LSTMGrad differentiates an LSTM without peepholes, "
                "as onnxruntime-training's kernel does")
    elem = f.elem_type(node.input[0])
    if elem is not None and elem not in _TYPES:
        name = helper.tensor_dtype_to_np_dtype(elem).name if elem != onnx.TensorProto.BFLOAT16 else "bfloat16"
        return f"{op} runs in float32 or float64 only, not {name}"
    return None


def _sizes(node: onnx.NodeProto, f: ForwardContext) -> tuple:
    """(S, D, N, H) as far as shape inference knows them (None where not)."""
    x = f.shape(node.input[0]) or (None, None, None)
    r = f.shape(_input(node, 2)) or (None, None, None)
    hidden = node_attributes(node).get("hidden_size", r[2] if len(r) == 3 else None)
    direction = _text(node_attributes(node).get("direction", "forward"))
    return x[0], _DIRECTIONS.get(direction), x[1], hidden


def _training_node(node: onnx.NodeProto, f: ForwardContext, kind: str) -> list[onnx.NodeProto] | None:
    """``LSTM`` -> ``LSTMTraining`` (HAll, HFinal, CFinal, CAll, iofc); ``GRU`` -> ``GRUTraining`` (HAll, HFinal,
    ZRH). The original outputs keep their names; HAll gets one if the node had none (the gradient reads it)."""
    if _unsupported(node, f, kind):
        return None  # stays a standard node; its gradient rule says why it cannot be differentiated
    direction = _text(node_attributes(node).get("direction", "forward"))
    if direction != "forward" and not _input(node, 4):
        return _forward_only(node, f, kind, direction)
    visible = 3 if kind == "LSTM" else 2
    inputs = list(node.input[:_LSTM_P] if kind == "LSTM" else node.input)  # P, if any, is a constant zero
    while inputs and not inputs[-1]:
        inputs.pop()
    outputs = (list(node.output) + [""] * visible)[:visible]
    elem = f.elem_type(node.input[0]) or onnx.TensorProto.FLOAT
    s, d, n, h = _sizes(node, f)
    if not outputs[0]:
        outputs[0] = f.fresh("all_hidden_states")
        f.set_type(outputs[0], elem, [s, d, n, h])
    extra = ([("all_cell_states", 1), ("iofc", 4)] if kind == "LSTM" else [("zrh", 3)])
    for hint, gates in extra:
        name = f.fresh(hint)
        f.set_type(name, elem, [s, d, n, h * gates if isinstance(h, int) else None])
        outputs.append(name)
    new = helper.make_node(f"{kind}Training", inputs, outputs, domain=MS,
                           name=f.fresh(f"{node.name}_training" if node.name else f"{kind}_training"))
    new.attribute.extend(a for a in node.attribute if a.name != "layout")
    return [new]


def _forward_only(node: onnx.NodeProto, f: ForwardContext, kind: str, direction: str) -> list[onnx.NodeProto]:
    """A reverse or bidirectional LSTM/GRU (without sequence_lens) as forward-direction ``<kind>Training`` nodes:
    onnxruntime-training's LSTMTraining/LSTMGrad and GRUTraining/GRUGrad kernels run the forward direction only
    ("only supports the forward direction for now"; its own generator writes the reverse and bidirectional
    nodes its runtime then refuses). The reverse direction reads X reversed in time (a Slice with step -1) and
    its HAll is reversed back; a bidirectional node's W, R, B, initial_h/c are sliced per direction and the
    outputs concatenated (Y on the direction axis, Y_h and Y_c on the first). The original outputs keep their
    names; the gradient flows back through the Slices and Concats by their own rules."""
    elem = f.elem_type(node.input[0]) or onnx.TensorProto.FLOAT
    s, _, n, h = _sizes(node, f)
    directions = 2 if direction == "bidirectional" else 1
    visible = 3 if kind == "LSTM" else 2
    wanted = (list(node.output) + [""] * visible)[:visible]
    nodes: list[onnx.NodeProto] = []
    base = node.name or kind

    def add(op: str, inputs: list[str], hint: str, shape, **attrs) -> str:
        out = f.fresh(f"{base}_{hint}")
        nodes.append(helper.make_node(op, inputs, [out], name=f.fresh(f"{base}_{hint}_{op}"), **attrs))
        f.set_type(out, elem, shape)
        return out

    def slice_direction(name: str, d: int) -> str:
        if not name or directions == 1:
            return name
        shape = f.shape(name)
        return add("Slice", [name, f.const(np.array([d], np.int64), hint="starts"),
                             f.const(np.array([d + 1], np.int64), hint="ends"), f.axes([0])],
                   f"{name}_dir{d}", None if shape is None else [1, *shape[1:]])

    def reversed_in_time(name: str, shape) -> str:
        return add("Slice", [name, f.const(np.array([-1], np.int64), hint="starts"),
                             f.const(np.array([-(2**63) + 1], np.int64), hint="ends"), f.axes([0]),
                             f.const(np.array([-1], np.int64), hint="steps")], f"{name}_reversed", shape)

    extra = [("all_cell_states", 1), ("iofc", 4)] if kind == "LSTM" else [("zrh", 3)]
    finals: list[list[str]] = [[] for _ in range(visible)]
    x = node.input[0]
    for d in range(directions):
        backwards = direction == "reverse" or d == 1
        x_d = reversed_in_time(x, f.shape(x)) if backwards else x
        inputs = [x_d] + [slice_direction(_input(node, i), d) for i in (1, 2, 3)] + [""] + \
            [slice_direction(_input(node, i), d) for i in ((5, 6) if kind == "LSTM" else (5,))]
        while inputs and not inputs[-1]:
            inputs.pop()
        outputs = [f.fresh(f"{base}_dir{d}_{hint}") for hint in ("all_hidden_states", "hidden", "cell")[:visible]]
        f.set_type(outputs[0], elem, [s, 1, n, h])
        for name in outputs[1:]:
            f.set_type(name, elem, [1, n, h])
        for hint, gates in extra:
            name = f.fresh(f"{base}_dir{d}_{hint}")
            f.set_type(name, elem, [s, 1, n, h * gates if isinstance(h, int) else None])
            outputs.append(name)
        training = helper.make_node(f"{kind}Training", inputs, outputs, domain=MS,
                                    name=f.fresh(f"{base}_dir{d}_training"))
        training.attribute.extend(a for a in node.attribute if a.name not in ("layout", "direction", "activations"))
        training.attribute.append(helper.make_attribute("direction", "forward"))
        nodes.append(training)
        finals[0].append(reversed_in_time(outputs[0], [s, 1, n, h]) if backwards else outputs[0])
        for k in range(1, visible):
            finals[k].append(outputs[k])
    for k, name in enumerate(wanted):
        if not name:
            continue
        parts = finals[k]
        if len(parts) == 1:
            nodes.append(helper.make_node("Identity", parts, [name], name=f.fresh(f"{base}_output{k}")))
        else:
            nodes.append(helper.make_node("Concat", parts, [name], name=f.fresh(f"{base}_output{k}"),
                                          axis=1 if k == 0 else 0))
    return nodes


def _lstm_training(node: onnx.NodeProto, f: ForwardContext) -> list[onnx.NodeProto] | None:
    return _training_node(node, f, "LSTM")


def _gru_training(node: onnx.NodeProto, f: ForwardContext) -> list[onnx.NodeProto] | None:
    return _training_node(node, f, "GRU")


def _standard(ctx: GradientContext, kind: str) -> None:
    """A standard LSTM/GRU on the gradient path: ``prepare`` left it alone because the training op cannot
    express it."""
    reason = _unsupported(ctx.node, ctx.f, kind) or f"it was kept as a standard {kind} (not rewritten to " \
                                                     f"{kind}Training)"
    raise ctx.fail(f"cannot differentiate this {kind}: {reason}")


def _grad_node(ctx: GradientContext, kind: str, inputs: list[str], positions: tuple[int, ...],
               saved: tuple[int, ...]) -> None:
    """The ``<kind>Grad`` node: ``inputs`` then one output per input position in ``positions`` (empty where no
    gradient is required). ``saved``: the outputs only the gradient reads (no gradient may flow into them)."""
    f = ctx.f
    for i in saved:
        if ctx.dy(i) is not None:
            raise ctx.fail(f"output {i} ({ctx.y(i)!r}) is read by another node: {kind}Grad cannot take its gradient")
    if not all(ctx.y(i) for i in (0, *saved)):
        names = ", ".join(str(i) for i in (0, *saved))
        raise ctx.fail(f"{kind}Grad needs outputs {names} of the {kind}Training node (states and gates)")
    outputs = [f.fresh(f"{ctx.x(i)}_grad") if ctx.requires(i) else "" for i in positions]
    while inputs and not inputs[-1]:
        inputs.pop()
    while outputs and not outputs[-1]:
        outputs.pop()
    f.node(f"{kind}Grad", inputs, outputs, domain=MS, **node_attributes(ctx.node))
    for i, name in zip(positions, outputs, strict=False):
        if name:
            ctx.set_dx(i, name)


@gradient_rule("LSTMTraining", domain=MS, differentiable=(0, 1, 2, 3, 5, 6, _LSTM_P))
def lstm_training(ctx: GradientContext) -> None:
    """LSTMGrad(X, W, R, sequence_lengths, initial_h, initial_c, HAll, CAll, iofc, dHAll, dHFinal, dCFinal) ->
    dX, dW, dR, dB, dH0, dC0, dP. No B input (the gates in iofc hold it) and no P input: the gradient is that of
    an LSTM without peepholes."""
    p = ctx.x(_LSTM_P)
    if p and (ctx.requires(_LSTM_P) or not _zero_constant(ctx.f, p)):
        raise ctx.fail("peephole weights (input P) are not supported: LSTMGrad differentiates an LSTM without "
                       "peepholes")
    inputs = [ctx.x(i) for i in (0, 1, 2, 4, 5, 6)] + [ctx.y(0), ctx.y(3), ctx.y(4)] + \
        [ctx.dy(i) or "" for i in range(3)]
    _grad_node(ctx, "LSTM", inputs, (0, 1, 2, 3, 5, 6, _LSTM_P), (3, 4))


@gradient_rule("GRUTraining", domain=MS, differentiable=(0, 1, 2, 3, 5))
def gru_training(ctx: GradientContext) -> None:
    """GRUGrad(X, W, R, B, sequence_lengths, initial_h, HAll, ZRH, dHAll, dHFinal) -> dX, dW, dR, dB, dH0."""
    inputs = [ctx.x(i) for i in range(6)] + [ctx.y(0), ctx.y(2)] + [ctx.dy(i) or "" for i in range(2)]
    _grad_node(ctx, "GRU", inputs, (0, 1, 2, 3, 5), (2,))


@gradient_rule("LSTM", differentiable=(0, 1, 2, 3, 5, 6, _LSTM_P), prepare=_lstm_training)
def lstm(ctx: GradientContext) -> None:
    _standard(ctx, "LSTM")


@gradient_rule("GRU", differentiable=(0, 1, 2, 3, 5), prepare=_gru_training)
def gru(ctx: GradientContext) -> None:
    _standard(ctx, "GRU")
