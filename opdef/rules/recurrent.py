"""onnxruntime-training's recurrent ops: ``LSTMTraining``, ``LSTMGrad``, ``GRUTraining``, ``GRUGrad``
(``specs/com.microsoft/``, notes
C1..C6). Every argument's shape is a pattern over the sizes S (steps), D (directions), N (batch), I (input),
H (hidden); the rule binds the sizes from whichever argument knows them and names the first that disagrees."""

from __future__ import annotations

from opdef.node import Dim, TensorType
from opdef.rules.base import Conflict, NodeContext, RuleResult, bound_roles, format_shape, merge_dim, register_rule

# argument -> its shape as (size, multiple) pairs
_X = (("S", 1), ("N", 1), ("I", 1))
_STATE = (("D", 1), ("N", 1), ("H", 1))
_ALL = (("S", 1), ("D", 1), ("N", 1), ("H", 1))
LSTM_SHAPES = {
    "X": _X, "W": (("D", 1), ("H", 4), ("I", 1)), "R": (("D", 1), ("H", 4), ("H", 1)), "B": (("D", 1), ("H", 8)),
    "P": (("D", 1), ("H", 3)), "sequence_lengths": (("N", 1),), "initial_h": _STATE, "initial_c": _STATE,
    "HAll": _ALL, "CAll": _ALL, "iofc": (("S", 1), ("D", 1), ("N", 1), ("H", 4)), "HFinal": _STATE,
    "CFinal": _STATE, "dHAll": _ALL, "dHFinal": _STATE, "dCFinal": _STATE,
    "dX": _X, "dW": (("D", 1), ("H", 4), ("I", 1)), "dR": (("D", 1), ("H", 4), ("H", 1)),
    "dB": (("D", 1), ("H", 8)), "dH0": _STATE, "dC0": _STATE, "dP": (("D", 1), ("H", 3)),
}
GRU_SHAPES = {
    "X": _X, "W": (("D", 1), ("H", 3), ("I", 1)), "R": (("D", 1), ("H", 3), ("H", 1)), "B": (("D", 1), ("H", 6)),
    "sequence_lengths": (("N", 1),), "initial_h": _STATE, "HAll": _ALL, "HFinal": _STATE,
    "ZRH": (("S", 1), ("D", 1), ("N", 1), ("H", 3)), "dHAll": _ALL, "dHFinal": _STATE,
    "dX": _X, "dW": (("D", 1), ("H", 3), ("I", 1)), "dR": (("D", 1), ("H", 3), ("H", 1)), "dB": (("D", 1), ("H", 6)),
    "dH0": _STATE,
}
LSTM_ACTIVATIONS = ("Sigmoid", "Tanh", "Tanh")
GRU_ACTIVATIONS = ("Sigmoid", "Tanh")
DIRECTIONS = {"forward": 1, "reverse": 1, "bidirectional": 2}


def _label(ctx: NodeContext, name: str) -> str | None:
    for c in ctx.schema.constraints:
        if f"``{name}``" in c.text or name in c.arguments:
            if "shape" in c.text:
                return c.label
    return ctx.constraint_label([name])


def _describe(pattern, sizes: dict[str, Dim]) -> str:
    dims = []
    for size, multiple in pattern:
        value = sizes.get(size)
        if isinstance(value, int):
            dims.append(str(value * multiple))
        else:
            dims.append(f"{multiple}{size}" if multiple != 1 else size)
    return "[" + ",".join(dims) + "]"


def _bind(ctx: NodeContext, name: str, shape, pattern, sizes: dict[str, Dim]) -> None:
    if shape is None:
        return
    if len(shape) != len(pattern):
        raise ctx.error(f"{name} has rank {len(shape)} {format_shape(shape)}; expected {_describe(pattern, sizes)}",
                        _label(ctx, name))
    for dim, (size, multiple) in zip(shape, pattern, strict=True):
        if isinstance(dim, int):
            if dim % multiple:
                raise ctx.error(f"{name} has shape {format_shape(shape)}; expected {_describe(pattern, sizes)} "
                                f"({dim} is no multiple of {multiple})", _label(ctx, name))
            dim //= multiple
        elif multiple != 1:
            continue  # a symbol for 4H says nothing about H
        try:
            sizes[size] = merge_dim(sizes.get(size), dim)
        except Conflict:
            raise ctx.error(f"{name} has shape {format_shape(shape)}; expected {_describe(pattern, sizes)} "
                            f"({size} = {sizes[size]} from the arguments before it)", _label(ctx, name)) from None


def _output_shape(pattern, sizes: dict[str, Dim]) -> tuple[Dim, ...]:
    out = []
    for size, multiple in pattern:
        value = sizes.get(size)
        out.append(value * multiple if isinstance(value, int) else (value if multiple == 1 else None))
    return tuple(out)


def _recurrent(ctx: NodeContext, activations: tuple[str, ...], shapes=LSTM_SHAPES) -> RuleResult:
    direction = ctx.attributes.get("direction", "forward")
    directions = DIRECTIONS[direction]
    sizes: dict[str, Dim] = {"D": directions}
    hidden = ctx.attributes.get("hidden_size")
    if hidden is not None:
        if hidden <= 0:
            raise ctx.error(f"hidden_size is {hidden}; it must be positive", ctx.constraint_label(["hidden_size"]))
        sizes["H"] = hidden
    given = ctx.attributes.get("activations")
    if given is not None and tuple(given) != activations * directions:
        raise ctx.error(f"activations are {list(given)}; only {list(activations * directions)} (the defaults) are "
                        f"supported", ctx.constraint_label(["activations"]))
    if ctx.attributes.get("clip") is not None:
        raise ctx.error(f"clip is {ctx.attributes['clip']}; cell clipping is not supported (onnxruntime-training's "
                        f"kernel has none)", ctx.constraint_label(["clip"]))
    for arg in ctx.input_args:
        name = arg.name
        if name in shapes and ctx.has_input(name):
            t = ctx.input_type(name)
            if name == "W" and t is not None and t.shape is not None and len(t.shape) == 3 \
                    and isinstance(t.shape[0], int) and t.shape[0] != directions:
                raise ctx.error(f"W has shape {format_shape(t.shape)}; direction {direction!r} needs "
                                f"{directions} direction(s) on axis 0", _label(ctx, "W"))
            _bind(ctx, name, None if t is None else t.shape, shapes[name], sizes)
    for arg in ctx.output_args:
        if ctx.has_output(arg.name):
            current = ctx.output_type(arg.name)
            ctx.set_output_type(arg.name, TensorType(None if current is None else current.elem_type,
                                                     _output_shape(shapes[arg.name], sizes)))
    return RuleResult(roles=bound_roles(ctx), rank=3)


@register_rule("lstm_training")
def lstm_training(ctx: NodeContext) -> RuleResult:
    return _recurrent(ctx, LSTM_ACTIVATIONS)


@register_rule("lstm_grad")
def lstm_grad(ctx: NodeContext) -> RuleResult:
    return _recurrent(ctx, LSTM_ACTIVATIONS)


@register_rule("gru_training")
def gru_training(ctx: NodeContext) -> RuleResult:
    return _recurrent(ctx, GRU_ACTIVATIONS, GRU_SHAPES)


@register_rule("gru_grad")
def gru_grad(ctx: NodeContext) -> RuleResult:
    return _recurrent(ctx, GRU_ACTIVATIONS, GRU_SHAPES)
