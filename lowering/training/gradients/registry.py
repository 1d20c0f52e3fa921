"""The gradient-rule registry: one rule per forward op, kept per op family like ``lowering/rules``.

A rule names the op (domain, op_type), the input positions a gradient can flow through, and an ``emit``
function that reads the forward node and the gradients of its outputs from a :class:`GradientContext` and
emits the nodes that compute the gradients of the inputs that need one. ``prepare`` (optional) rewrites the
forward node before differentiation (a training-mode BatchNormalization becomes BatchNormInternal, a
LayerNormalization gains its Mean and InvStdDev outputs, a Dropout its mask), the way onnxruntime-training's
gradient builder changes the forward graph. ``eval_form`` (optional) rewrites the node for the eval model
(inference-mode BatchNormalization and Dropout).

Ops that never carry a gradient (Shape, Constant, comparisons...) are listed in ``NO_GRADIENT``: a value
they produce does not depend on any parameter, whatever feeds them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx

    from lowering.training.gradients.context import ForwardContext, GradientContext


@dataclass(frozen=True)
class GradientRule:
    domain: str                         # "" for the default domain
    op_type: str
    differentiable: tuple[int, ...]     # input positions a gradient flows through
    emit: Callable[[GradientContext], None]
    prepare: Callable[[onnx.NodeProto, ForwardContext], list[onnx.NodeProto] | None] | None = None
    eval_form: Callable[[onnx.NodeProto, ForwardContext], list[onnx.NodeProto] | None] | None = None


_RULES: dict[tuple[str, str], GradientRule] = {}

# ops whose outputs never depend differentiably on their inputs (integer, boolean or shape-only results,
# or random values): gradients stop there
NO_GRADIENT: frozenset[str] = frozenset({
    "Shape", "Size", "Constant", "ConstantOfShape", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual",
    "Not", "And", "Or", "Xor", "IsNaN", "IsInf", "ArgMax", "ArgMin", "NonZero", "Mod", "Range", "EyeLike",
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial",
    "Floor", "Ceil", "Round", "Sign", "BitShift", "OneHot", "TopK_indices", "NonMaxSuppression", "Trilu_mask",
})


def gradient_rule(op_type: str, *, domain: str = "", differentiable: tuple[int, ...] = (0,),
                  prepare=None, eval_form=None):
    """Register ``emit`` as the gradient rule of (domain, op_type)."""
    def register(emit: Callable[[GradientContext], None]) -> Callable[[GradientContext], None]:
        key = (domain, op_type)
        if key in _RULES:
            raise ValueError(f"a gradient rule for {domain or 'ai.onnx'}::{op_type} is already registered")
        _RULES[key] = GradientRule(domain, op_type, tuple(differentiable), emit, prepare, eval_form)
        return emit
    return register


def rule_for(domain: str, op_type: str) -> GradientRule | None:
    return _RULES.get(("" if domain in ("", "ai.onnx") else domain, op_type))


def registered_rules() -> dict[tuple[str, str], GradientRule]:
    return dict(_RULES)
