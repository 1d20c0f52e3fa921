"""Lowering of onnxruntime-training's activation family (``specs/com.microsoft/``): TanhGrad, LeakyReluGrad,
QuickGelu, QuickGeluGrad, GeluGrad, FastGeluGrad, Gelu, BiasGelu, BiasGeluGrad_dX, BiasFastGeluGrad_dX,
DropoutGrad.

Every form is elementwise arithmetic plus Erf, Tanh, Sigmoid, Where (lowering.rules.PORTABLE_OPS), so one form
serves both targets (but for GeluGrad's one BatchNormalization on the onnxruntime target). f16/bf16 are cast up
to f32 once and rounded once; f64 computes in f64. The f32 forms follow the order of operations of onnxruntime's
CPU kernels and their f32 constants, so that where the kernel uses the same primitives (Sigmoid, Tanh, Erf, Exp)
the results agree to the last bit or nearly so:

- TanhGrad: ``dY * (1 - Y*Y)``.
- LeakyReluGrad: ``dY * Where(Y > 0, 1, alpha)``. Where picks between two scalars; a Where picking between
  ``dY`` and ``alpha*dY`` reads two whole tensors and is 4-8x slower in onnxruntime (1M f32 elements, 2 threads,
  one-node models: about 5 ms against 20-38 ms; both bit-identical to the kernel).
- QuickGelu: ``X * Sigmoid(alpha*X)`` (onnxruntime re-fuses it into its own QuickGelu when it optimizes);
  QuickGeluGrad: ``(dY * s) * (1 + (alpha*X) * (1 - s))`` with ``s = Sigmoid(alpha*X)``.
- GeluGrad: ``dY * (0.5*(Erf(X*sqrt(1/2)) + 1) + (X*k) * Exp((-0.5*X)*X))``, ``k = 1/sqrt(2 pi)`` (the
  ``0.5*(e + 1)`` one BatchNormalization on the onnxruntime target where it can: :func:`_half_plus_half`);
  FastGeluGrad: the kernel's ``0.5*(t + (1 - t*t)*(a*X + b*X^3) + 1)`` with ``t = tanh(a*X + (a*g)*X^3)``,
  written with ``s = 1/(1 + Exp(-2u))`` as ``s*(1 + 2*(e*s)*p)``: onnxruntime's Tanh rounds worse than its
  Exp (the Tanh form's error was 2-4x the kernel's on the recorded cases; this one is below it).
- Gelu, BiasGelu: ``x * 0.5 * (1 + Erf(x / sqrt 2))`` of ``x = X``, ``x = A + B`` (the exported GELU pattern
  onnxruntime's optimizer fuses back into Gelu/BiasGelu); the biased gradients: their plain form at ``X + B``.
- DropoutGrad: ``dy / Where(keep, 1 - ratio, +inf)``: a dropped element divides to a signed zero exactly as
  the kernel's ``mask * dy / (1 - ratio)`` does (also NaN for an infinite dy), a kept one is the kernel's own
  quotient, and Where again picks between scalars; a dropped element's scalar is ``1 - ratio`` itself where
  ``ratio == 0`` (every element kept). ``1 - ratio`` is formed in f32 from the ratio read as f32, as the kernel
  does, whatever the computation type.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from lowering.builder import NodeBuilder
from lowering.emit_common import Emitter, compute_type
from lowering.rules import TARGETS, LoweringRequest, register_rule
from lowering.rules.elementwise_grad import input_elem

# the kernels' constants, as the C++ computes them (double math, cast to the computation type)
SQRT1_2 = math.sqrt(0.5)
GELU_PDF = 2 / math.sqrt(math.pi) * SQRT1_2 * 0.5  # 1/sqrt(2 pi), GeluGrad's kAlpha
FAST_A = 2 / math.sqrt(math.pi) * SQRT1_2  # sqrt(2/pi), FastGeluGrad's kAlpha
FAST_G = 0.044715


class _Form(Emitter):
    """An emitter with the node's io type and the small elementwise helpers the forms share."""

    def __init__(self, b: NodeBuilder, request: LoweringRequest, first_input: str) -> None:
        self.io = input_elem(request, first_input)
        super().__init__(b, compute_type(self.io))
        self.request = request

    def value(self, role: str) -> str:
        return self.up(self.request.input(role), self.io)

    def c(self, value: float) -> str:
        return self.scalar(value, "c")

    def mul(self, a: str, b: str) -> str:
        return self.b.op1("Mul", [a, b])

    def add(self, a: str, b: str) -> str:
        return self.b.op1("Add", [a, b])

    def sub(self, a: str, b: str) -> str:
        return self.b.op1("Sub", [a, b])

    def const_product(self, *factors: float) -> float:
        """A product of constants as the kernel forms it: in the computation type, left to right."""
        result = self.np_ct(factors[0])
        for f in factors[1:]:
            result = self.np_ct(result * self.np_ct(f))
        return float(result)

    def biased(self, x_role: str) -> str:
        """``X + B`` for the biased ops (B broadcasts along the last axis); ``X`` otherwise."""
        x = self.value(x_role)
        return self.add(x, self.value("B")) if self.request.input("B") else x


@register_rule("tanh_grad", targets=TARGETS)
def lower_tanh_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    out = request.output("dX")
    if out is None:
        return
    f = _Form(b, request, "dY")
    y = f.value("Y")
    f.finish("Mul", [f.value("dY"), f.sub(f.c(1.0), f.mul(y, y))], out, f.io)


@register_rule("leaky_relu_grad", targets=TARGETS)
def lower_leaky_relu_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    out = request.output("dX")
    if out is None:
        return
    f = _Form(b, request, "dY")
    alpha = float(request.inference.attributes.get("alpha", 0.01))
    positive = b.op1("Greater", [f.value("Y"), f.c(0.0)])
    slope = b.op1("Where", [positive, f.c(1.0), f.c(alpha)])
    f.finish("Mul", [f.value("dY"), slope], out, f.io)


def _scaled(f: _Form, x: str, alpha: float) -> str:
    return x if alpha == 1.0 else f.mul(x, f.c(alpha))


@register_rule("quick_gelu", targets=TARGETS)
def lower_quick_gelu(b: NodeBuilder, request: LoweringRequest) -> None:
    out = request.output("Y")
    if out is None:
        return
    f = _Form(b, request, "X")
    alpha = float(request.inference.attributes.get("alpha", 1.702))
    x = f.value("X")
    f.finish("Mul", [x, b.op1("Sigmoid", [_scaled(f, x, alpha)])], out, f.io)


@register_rule("quick_gelu_grad", targets=TARGETS)
def lower_quick_gelu_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    out = request.output("dX")
    if out is None:
        return
    f = _Form(b, request, "dY")
    alpha = float(request.inference.attributes.get("alpha", 1.702))
    ax = _scaled(f, f.value("X"), alpha)
    s = b.op1("Sigmoid", [ax])
    factor = f.add(f.c(1.0), f.mul(ax, f.sub(f.c(1.0), s)))
    f.finish("Mul", [f.mul(f.value("dY"), s), factor], out, f.io)


def _half_plus_half(f: _Form, e: str) -> str:
    """``(e + 1) * 0.5``. On the onnxruntime target in f32 where X's axis 1 is static: one BatchNormalization with
    constant vectors (scale and bias 0.5, mean 0, variance 1, epsilon 0), which onnxruntime computes as ``e * 0.5 +
    0.5``: the same number (``0.5 e`` is exact, and halving commutes with rounding; byte-equal on 140 f32 cases
    with Erf's whole range, NaN, infinities and subnormals), one kernel instead of Add + Mul and faster at every
    size measured (1 thread: [4, 16, 128] 0.79, [2, 197, 64] 0.80, [32, 128, 1024] 0.33)."""
    shape = f.request.inference.input_types[f.request.inference.schema.input_index("X")]
    channels = shape.shape[1] if shape is not None and shape.shape is not None and len(shape.shape) > 1 else None
    if f.request.options.target == "portable" or f.ct != TensorProto.FLOAT or not isinstance(channels, int):
        return f.mul(f.add(e, f.c(1.0)), f.c(0.5))
    half, zero, one = (f.b.const(np.full(channels, v, np.float32), hint=h) for v, h in
                       ((0.5, "half"), (0.0, "zeros"), (1.0, "ones")))
    return f.b.op1("BatchNormalization", [e, half, half, zero, one], epsilon=0.0)


def _gelu_grad(f: _Form, out: str) -> None:
    x = f.biased("X")
    cdf = _half_plus_half(f, f.b.op1("Erf", [f.mul(x, f.c(SQRT1_2))]))
    pdf = f.mul(f.mul(x, f.c(GELU_PDF)), f.b.op1("Exp", [f.mul(f.mul(x, f.c(-0.5)), x)]))
    f.finish("Mul", [f.value("dY"), f.add(cdf, pdf)], out, f.io)


def _fast_gelu_grad(f: _Form, out: str) -> None:
    x = f.biased("X")
    x_cube = f.mul(f.mul(x, x), x)
    # 0.5*(1 + t) = s and 0.5*(1 - t*t)*p = s*(e*s)*(2p), with t = tanh(u), u = a*X + (a*g)*X^3,
    # p = a*X + (3*a*g)*X^3, e = exp(-2u), s = 1/(1 + e): onnxruntime's Exp rounds far better than its Tanh (the
    # kernel's half-tanh form was 2-4x the kernel's error; this one is below it). Scaling by 2 is exact: -2u and
    # 2p are formed from the doubled constants. -2u is capped at 80 so that e stays finite (there s < 2e-35).
    ax2 = f.mul(x, f.c(-2.0 * f.const_product(FAST_A)))
    minus_2u = f.add(ax2, f.mul(x_cube, f.c(-2.0 * f.const_product(FAST_A, FAST_G))))
    poly2 = f.sub(f.mul(x_cube, f.c(2.0 * f.const_product(FAST_G, FAST_A, 3.0))), ax2)
    e = f.b.op1("Exp", [f.b.op1("Min", [minus_2u, f.c(80.0)])])
    s = f.b.op1("Reciprocal", [f.add(e, f.c(1.0))])
    half = f.mul(s, f.add(f.mul(f.mul(e, s), poly2), f.c(1.0)))
    f.finish("Mul", [f.value("dY"), half], out, f.io)


@register_rule("gelu_grad", targets=TARGETS)
def lower_gelu_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    out = request.output("dX")
    if out is not None:
        _gelu_grad(_Form(b, request, "dY"), out)


@register_rule("bias_gelu_grad", targets=TARGETS)
def lower_bias_gelu_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    lower_gelu_grad(b, request)


@register_rule("fast_gelu_grad", targets=TARGETS)
def lower_fast_gelu_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    out = request.output("dX")
    if out is not None:
        _fast_gelu_grad(_Form(b, request, "dY"), out)


@register_rule("bias_fast_gelu_grad", targets=TARGETS)
def lower_bias_fast_gelu_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    lower_fast_gelu_grad(b, request)


def _gelu(f: _Form, x: str, out: str) -> None:
    cdf2 = f.add(f.b.op1("Erf", [f.b.op1("Div", [x, f.c(math.sqrt(2.0))])]), f.c(1.0))
    f.finish("Mul", [f.mul(x, f.c(0.5)), cdf2], out, f.io)


@register_rule("bias_gelu", targets=TARGETS)
def lower_bias_gelu(b: NodeBuilder, request: LoweringRequest) -> None:
    out = request.output("C")
    if out is not None:
        f = _Form(b, request, "A")
        _gelu(f, f.add(f.value("A"), f.value("B")), out)


@register_rule("gelu", targets=TARGETS)
def lower_gelu(b: NodeBuilder, request: LoweringRequest) -> None:
    out = request.output("Y")
    if out is not None:
        f = _Form(b, request, "X")
        _gelu(f, f.value("X"), out)


@register_rule("dropout_grad", targets=TARGETS)
def lower_dropout_grad(b: NodeBuilder, request: LoweringRequest) -> None:
    out = request.output("dx")
    if out is None:
        return
    f = _Form(b, request, "dy")
    ratio = request.input("ratio")
    if ratio is None:  # the default 0.5: 1 - 0.5 is exact in every type
        scale, dropped = f.c(0.5), f.c(math.inf)
    else:
        r = b.op1("Reshape", [f.cast(ratio, input_elem(request, "ratio"), TensorProto.FLOAT),
                              f.ints([], "scalar_shape")])
        scale = f.cast(b.op1("Sub", [b.const(np.float32(1.0), hint="one_f32"), r]), TensorProto.FLOAT, f.ct)
        # ratio 0 keeps every element: a dropped one divides by the scale too. A scalar Where of the ratio alone,
        # which onnxruntime folds where the ratio is a constant (every exported Dropout): no Or of the mask, one
        # kernel fewer a node (t5, vit_dyn, encoder_padmask: 8 a step), the same divisor element for element
        dropped = b.op1("Where", [b.op1("Equal", [r, b.const(np.float32(0.0), hint="zero_f32")]), scale,
                                  f.c(math.inf)])
    divisor = b.op1("Where", [request.input("mask"), scale, dropped])
    f.finish("Div", [f.value("dy"), divisor], out, f.io)
