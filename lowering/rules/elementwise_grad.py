"""Lowering of onnxruntime-training's ``ReluGrad``, ``SigmoidGrad``, ``DivGrad`` and ``Scale``
(``specs/com.microsoft/``).

ReluGrad: ``dY * Cast(X > 0)`` (a Where with a broadcast scalar ran 20x slower in onnxruntime's CPU provider:
4.0-6.4 against 0.20-0.22 ms on [32,16,32,32], 2 threads; the two differ only where X <= 0 and dY is not
finite, which gives NaN instead of 0); SigmoidGrad: ``dY * (Y * (1 - Y))``; DivGrad: ``dY / B`` and
``dY * (A / -(B * B))``, each ReduceSum'd over its input's broadcast axes (static: decided from the shapes) and
reshaped where the input has fewer axes -- onnxruntime-training's CPU function body in the same rounding order
(it negates A instead of B * B, which is the same number), so f32/f64 results are bit-identical with the same
ReduceSum; Scale: one Mul or Div by the scale viewed as a scalar. f16/bf16 are cast up to f32 once and rounded
once. One form for both targets: every op here is elementwise, a reduction or a Reshape
(lowering.rules.PORTABLE_OPS).
"""

from __future__ import annotations

import math

from lowering.builder import NodeBuilder
from lowering.emit_common import Emitter, compute_type
from lowering.rules import TARGETS, LoweringRequest, register_rule
from opdef.errors import LoweringError


def input_elem(request: LoweringRequest, name: str) -> int:
    """The element type of the schema input ``name`` (or of its type variable, decided by another argument);
    lowering needs it known."""
    inference = request.inference
    t = inference.input_types[inference.schema.input_index(name)]
    if t is not None and t.elem_type is not None:
        return t.elem_type
    var = inference.schema.input(name).type_var
    if var in inference.type_vars:
        return inference.type_vars[var]
    raise LoweringError(f"{inference.domain} {inference.op_type} '{inference.node_name}': the element type of "
                        f"{name} must be known to lower it")


@register_rule("relu_grad", targets=TARGETS)
def lower_relu_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    out = request.output("dX")
    if out is None:
        return
    io = input_elem(request, "dY")
    e = Emitter(b, compute_type(io))
    positive = b.op1("Greater", [e.up(request.input("X"), io), e.scalar(0.0, "zero")])
    e.finish("Mul", [e.up(request.input("dY"), io), b.op1("Cast", [positive], to=e.ct, hint="positive")], out, io)


@register_rule("sigmoid_grad", targets=TARGETS)
def lower_sigmoid_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    out = request.output("dX")
    if out is None:
        return
    io = input_elem(request, "dY")
    e = Emitter(b, compute_type(io))
    y = e.up(request.input("Y"), io)
    slope = b.op1("Mul", [y, b.op1("Sub", [e.scalar(1.0, "one"), y])])
    e.finish("Mul", [e.up(request.input("dY"), io), slope], out, io)


def _shape(request: LoweringRequest, name: str) -> tuple | None:
    t = request.inference.input_types[request.inference.schema.input_index(name)]
    return None if t is None else t.shape


def _broadcast_dim(x, y):
    if x == 1 or y == 1:
        return y if x == 1 else x
    return x if isinstance(x, int) else y  # a size beats a symbol (verification checked they agree)


def broadcast_axes(request: LoweringRequest, source: str) -> tuple[int, tuple[int, ...]]:
    """(leading axes ``source`` lacks, the axes of dY its gradient is summed over), decided from the shapes."""
    a, b, dy = _shape(request, "A"), _shape(request, "B"), _shape(request, "dY")
    if a is None or b is None:
        raise request.error("the shapes of A and B must be known to lower it (which axes each is broadcast along)")
    rank = max(len(a), len(b))
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in (a, b)]
    target = [_broadcast_dim(x, y) for x, y in zip(*padded, strict=True)]
    if dy is not None and len(dy) == rank:  # dY's declared sizes refine symbols
        target = [d if isinstance(d, int) else t for t, d in zip(target, dy, strict=True)]
    shape = _shape(request, source)
    lead = rank - len(shape)
    axes = list(range(lead))
    for i, d in enumerate(shape):
        t = target[lead + i]
        if d == 1 and t != 1:
            axes.append(lead + i)
        elif d != t and t != 1 and not isinstance(d, int):
            raise request.error(f"cannot tell whether {source}'s axis {i} (size {d if d is not None else '?'}) is "
                                f"broadcast to {t}; lowering needs it known")
    return lead, tuple(axes)


def _sum_to(e: Emitter, request: LoweringRequest, source: str, op_type: str, inputs: list[str], output: str,
            io: int) -> None:
    """The elementwise ``op_type(inputs)`` (the broadcast shape, in the computation type) summed back to input
    ``source``'s shape into ``output`` (of type ``io``): ReduceSum over the broadcast axes, Reshape where leading
    axes go."""
    b = e.b
    lead, axes = broadcast_axes(request, source)
    if not lead and not axes:
        e.finish(op_type, inputs, output, io)
        return
    grad = b.op1(op_type, inputs)
    if lead:
        shape = _shape(request, source)
        target = (e.ints(list(shape), "shape") if all(isinstance(d, int) for d in shape)
                  else b.op1("Shape", [request.input(source)]))
        reduced = e.reduce("ReduceSum", grad, axes, keepdims=1)
        e.finish("Reshape", [reduced, target], output, io)
    elif io == e.ct:
        e.reduce("ReduceSum", grad, axes, keepdims=1, output=output)
    else:
        e.cast(e.reduce("ReduceSum", grad, axes, keepdims=1), e.ct, io, output)


def _elements(shape: tuple | None) -> int | None:
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return math.prod(shape)


@register_rule("div_grad", targets=TARGETS)
def lower_div_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    da_out, db_out = request.output("dA"), request.output("dB")
    if da_out is None and db_out is None:
        return
    io = input_elem(request, "dY")
    e = Emitter(b, compute_type(io))
    dy, a, divisor = (e.up(request.input(name), io) for name in ("dY", "A", "B"))
    if da_out is not None:
        _sum_to(e, request, "A", "Div", [dy, divisor], da_out, io)
    if db_out is not None:
        square = b.op1("Mul", [divisor, divisor])
        # -A / B^2 as upstream computes it; negating the smaller operand gives the same number
        a_size, b_size = _elements(_shape(request, "A")), _elements(_shape(request, "B"))
        if a_size is not None and b_size is not None and a_size < b_size:
            quotient = b.op1("Div", [b.op1("Neg", [a]), square])
        else:
            quotient = b.op1("Div", [a, b.op1("Neg", [square])])
        _sum_to(e, request, "B", "Mul", [dy, quotient], db_out, io)


@register_rule("scale", targets=TARGETS)
def lower_scale(b: NodeBuilder, request: LoweringRequest) -> None:
    out = request.output("output")
    if out is None:
        return
    io, factor_type = input_elem(request, "input"), input_elem(request, "scale")
    e = Emitter(b, compute_type(io))
    factor = b.op1("Reshape", [e.cast(request.input("scale"), factor_type, e.ct), e.ints([], "scalar_shape")])
    scale_down = request.inference.attributes.get("scale_down") or 0
    e.finish("Div" if scale_down else "Mul", [e.up(request.input("input"), io), factor], out, io)
