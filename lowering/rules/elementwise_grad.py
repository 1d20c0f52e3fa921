"""Lowering of onnxruntime-training's ``ReluGrad``, ``SigmoidGrad`` and ``Scale`` (``specs/com.microsoft/``).

ReluGrad: ``dY * Cast(X > 0)`` (a Where with a broadcast scalar ran 20x slower in onnxruntime's CPU provider:
4.0-6.4 against 0.20-0.22 ms on [32,16,32,32], 2 threads; the two differ only where X <= 0 and dY is not
finite, which gives NaN instead of 0); SigmoidGrad: ``dY * (Y * (1 - Y))``; Scale: one Mul or Div by the
scale viewed as a scalar. f16/bf16 are cast up to f32 once and rounded once. One form for both targets:
every op here is elementwise (lowering.rules.PORTABLE_OPS).
"""

from __future__ import annotations

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
