"""The explicit registry of lowering rules, keyed by ``Binding.rule`` (e.g. ``"batch_norm_backward"``), and
the rule modules themselves, one per op family (``lowering/rules/<family>.py`` or a subpackage).

A rule is one plain function ``rule(builder, request) -> None`` that emits standard ONNX nodes into a
:class:`~lowering.builder.NodeBuilder`. It never walks the graph: the pass matches the node, verifies it,
hands the rule a :class:`LoweringRequest` and splices what the rule emitted in place of the node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from lowering.builder import NodeBuilder
from opdef.errors import LoweringError
from opdef.node import NodeInference
from opdef.rules.base import import_rule_module

ONEDNN_SINGLE_OUTPUT = ("spec", "upstream")
# What the lowered graph is for: "onnxruntime" (tuned for its CPU provider: BatchNormalization with computed
# parameters, Conv with runtime-tensor weights) or "portable" (only ops whose every data input may be a runtime
# tensor in any conforming runtime: elementwise arithmetic, Reduce*, Reshape, Cast, MatMul ...).
TARGETS = ("onnxruntime", "portable")
# The op types a rule may emit for the portable target (the pass checks): every data input of each may be a
# runtime tensor in any conforming runtime. Not here on purpose: Conv/ConvTranspose (TensorRT and converters
# want constant weights), BatchNormalization (tract wants constant parameters).
PORTABLE_OPS = frozenset({
    "Abs", "Add", "Sub", "Mul", "Div", "Neg", "Reciprocal", "Sqrt", "Pow", "Exp", "Log", "Max", "Min", "Where",
    "Equal", "Less", "Greater", "Not", "And", "Or", "Identity", "Cast", "CastLike", "MatMul",
    "ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceProd", "ReduceMax", "ReduceMin",
    "Reshape", "Shape", "Size", "Slice", "Concat", "Gather", "Squeeze", "Unsqueeze", "Transpose", "Expand",
    "ConstantOfShape", "Constant",
    # For the training gradient ops (checked with runtime data inputs in onnxruntime, OpenVINO, tract and
    # onnx.reference by tests/test_portable_training.py): Pad whose pads are a constant (zero padding: the
    # windows of im2col/col2im, lowering/rules/im2col.py); Range over a runtime class count (the class ids of
    # SoftmaxCrossEntropyLossGrad's one-hot).
    "Pad", "Range",
    # For the activation family (lowering/rules/activation_grad.py; elementwise, checked in onnxruntime, OpenVINO,
    # tract and onnx.reference by tests/test_activation_grads.py): the transcendental functions its forms use.
    "Erf", "Tanh", "Sigmoid",
    # For the optimizers (their model's own inputs are tensor sequences, so a runtime without sequences cannot
    # take the model at all, lowered or not): the Loop over the sequence and its sequence ops. Every input
    # of these may be a runtime value by the standard.
    "Loop", "SequenceEmpty", "SequenceLength", "SequenceAt", "SequenceInsert",
    # For the recurrent ops (tests/test_recurrent.py runs them in onnxruntime, OpenVINO, tract and onnx.reference;
    # their gates use Sigmoid and Tanh above): the Scan over the steps, its weights passed in as states.
    "Scan",
})

# A rule ``key`` lives in ``lowering.rules.<key>`` (a module or subpackage), or in any module of this package
# for a family that registers several rules (opdef.rules.base.import_rule_module); it is imported on first
# lookup, which registers it (once: Python imports a module once).


@dataclass(frozen=True)
class LoweringOptions:
    """Choices where the specs leave room; see :func:`lowering.rules.batch_norm_backward.lower_batch_norm_backward`."""

    onednn_single_output: str = "spec"
    target: str = "onnxruntime"  # one of TARGETS; every rule reads it (or declares one form for all)

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {list(TARGETS)}, not {self.target!r}")
        if self.onednn_single_output not in ONEDNN_SINGLE_OUTPUT:
            raise ValueError(f"onednn_single_output must be one of {list(ONEDNN_SINGLE_OUTPUT)}, "
                             f"not {self.onednn_single_output!r}")


@dataclass(frozen=True)
class LoweringRequest:
    """What a rule gets: the verified node, which of its outputs someone consumes, and the options."""

    inference: NodeInference
    wanted: frozenset[str]  # output value names that a node, subgraph or graph output consumes
    options: LoweringOptions = field(default_factory=LoweringOptions)
    # the node's output names that are outputs of the graph (or function) being lowered: a caller-owned
    # buffer in onnxruntime, which an op cannot work in place on (see the Conv form in
    # lowering/rules/batch_norm_backward/emit.py)
    graph_outputs: frozenset[str] = frozenset()

    def input(self, role: str) -> str | None:
        """The value name bound to an input role, or None when the node omits it."""
        return self.inference.roles.get(role) or None

    def requested(self, role: str) -> bool:
        """Whether the node declares the output role at all (what the op's semantics depend on)."""
        return bool(self.inference.roles.get(role))

    def output(self, role: str) -> str | None:
        """The value name the rule must produce for an output role; None: not requested or unused."""
        name = self.inference.roles.get(role)
        return name if name and name in self.wanted else None

    def error(self, problem: str) -> LoweringError:
        """A LoweringError naming the node: ``<domain> <op_type> '<name>': <problem>``."""
        node = self.inference
        return LoweringError(f"{node.domain} {node.op_type} '{node.node_name}': {problem}")


Rule = Callable[[NodeBuilder, LoweringRequest], None]
"""A lowering rule: emits standard nodes into the builder for the request. What it emits must depend only
on the request (the inference: op, attributes, types, roles; which outputs are wanted and which are graph
outputs; the options) and the builder's opset, never on the node's name or anything else: the pass copies a
rule's nodes, renamed, for later nodes of a graph with the same lowering key (lowering/passes.py). Nodes with
subgraph attributes are never copied (a subgraph may read the outer values by name)."""

_RULES: dict[str, Rule] = {}
_TARGETS: dict[str, tuple[str, ...]] = {}


def register_rule(key: str, *, targets: tuple[str, ...] = ("onnxruntime",)) -> Callable[[Rule], Rule]:
    """Decorator: register ``rule`` under ``key``. Registering a key twice is an error.

    ``targets``: the :data:`TARGETS` the rule can emit for. A rule that reads ``request.options.target`` and
    emits a form per target, or whose one form uses only portable ops (then it is the same for both), says
    ``targets=TARGETS``. The default is onnxruntime only: a rule must claim portability explicitly, and the
    pass refuses a node of a rule that cannot emit for the requested target (:func:`check_target`).
    """
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise ValueError(f"targets of rule {key!r} must be a non-empty subset of {list(TARGETS)}, not {targets}")

    def decorate(rule: Rule) -> Rule:
        if key in _RULES:
            raise ValueError(f"a lowering rule for {key!r} is already registered ({_RULES[key].__module__}."
                             f"{_RULES[key].__qualname__})")
        _RULES[key] = rule
        _TARGETS[key] = tuple(targets)
        return rule

    return decorate


def unregister_rule(key: str) -> None:
    """For tests that register temporary rules."""
    _RULES.pop(key, None)
    _TARGETS.pop(key, None)


def rule_targets(key: str) -> tuple[str, ...]:
    """The targets the rule registered under ``key`` emits for."""
    rule_for(key)
    return _TARGETS[key]


def check_portable(request: LoweringRequest, op_types: Iterable[str]) -> None:
    """A LoweringError naming the node when a rule emitted, for the portable target, an op outside
    :data:`PORTABLE_OPS` (a rule that claims a portable form it does not have)."""
    if request.options.target != "portable":
        return
    other = sorted(set(op_types) - PORTABLE_OPS)
    if other:
        raise request.error(f"the portable lowering emitted {', '.join(other)}, which not every runtime runs with "
                            "computed inputs")


def check_target(key: str, request: LoweringRequest) -> None:
    """A LoweringError naming the node when the rule for ``key`` has no form for the requested target."""
    targets = rule_targets(key)
    if request.options.target not in targets:
        raise request.error(f"no {request.options.target} lowering: rule {key!r} emits only for "
                            f"{', '.join(targets)} (use --target {targets[0]})")


def rule_for(key: str) -> Rule:
    if key not in _RULES:
        import_rule_module("lowering.rules", key)
    try:
        return _RULES[key]
    except KeyError:
        raise LoweringError(f"no lowering rule registered for {key!r} (known: {sorted(_RULES)})") from None
