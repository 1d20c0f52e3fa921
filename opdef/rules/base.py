"""What every verification rule gets: the node context, shape helpers and the rule registry.

A rule is one plain function ``rule(ctx: NodeContext) -> RuleResult`` registered under the binding's
``rule`` key (``specs/bindings.json``). It runs after the generic, schema-driven checks of
:mod:`opdef.verify` (arity, attributes, element types, ranks) and adds the op's semantics: shapes,
the channel axis, output shapes. It raises ``ctx.error(...)``; it never walks the graph.
"""

from __future__ import annotations

import functools
import importlib
import math
import pkgutil
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opdef.binding import Binding
from opdef.errors import VerificationError
from opdef.node import Dim, TensorType
from opdef.schema import Argument, Constraint, OpSchema
from opdef.types import type_name

# -- formatting ------------------------------------------------------------------------------------


def format_dim(dim: Dim) -> str:
    return "?" if dim is None else str(dim)


def format_shape(shape: Sequence[Dim] | None) -> str:
    """``[8,64,7,7]``, ``[N,64,?,?]``; an unknown rank reads ``[...]``."""
    if shape is None:
        return "[...]"
    return "[" + ",".join(format_dim(d) for d in shape) + "]"


def format_elem(elem_type: int | None) -> str:
    return "?" if elem_type is None else type_name(elem_type)


def format_type(t: TensorType | None) -> str:
    """``f32 [N,64,7,7]``; a sequence or optional of tensors as the specs spell it, ``seq(f32)``."""
    if t is None:
        return "? [...]"
    if t.container in SEQUENCE_OR_OPTIONAL:
        return f"{t.container}({format_elem(t.elem_type)})"
    if t.container is not None:
        return t.container
    return f"{format_elem(t.elem_type)} {format_shape(t.shape)}"


SEQUENCE_OR_OPTIONAL = ("seq", "optional")


def format_kind(t: TensorType) -> str:
    """A value's kind as ONNX spells types, element types as the specs do: ``tensor(f32)``,
    ``seq(tensor(f32))``, ``optional(tensor(boolean))``."""
    if t.container is None:
        return f"tensor({format_elem(t.elem_type)})"
    if t.container in SEQUENCE_OR_OPTIONAL:
        return f"{t.container}(tensor({format_elem(t.elem_type)}))"
    return t.container


# -- shapes ----------------------------------------------------------------------------------------


class Conflict(Exception):
    """Two dims or shapes that cannot describe the same tensor (internal; rules turn it into an error)."""


def merge_dim(a: Dim, b: Dim) -> Dim:
    """The more specific of two dims that may be equal. Known sizes must agree; a size beats a symbol.

    Two different symbols are not a conflict: nothing says ``N`` and ``B`` differ at run time.
    """
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, int) and isinstance(b, int):
        if a != b:
            raise Conflict
        return a
    if isinstance(b, int):
        return b
    return a


def merge_shape(a: Sequence[Dim] | None, b: Sequence[Dim] | None) -> tuple[Dim, ...] | None:
    if a is None:
        return None if b is None else tuple(b)
    if b is None:
        return tuple(a)
    a = tuple(a)
    if a == tuple(b):  # the usual case: nothing to merge
        return a
    if len(a) != len(b):
        raise Conflict
    return tuple(merge_dim(x, y) for x, y in zip(a, b, strict=True))


# -- the node context ------------------------------------------------------------------------------


@dataclass
class NodeContext:
    """One node bound to its schema: positions resolved, attributes with defaults, element types checked.

    Inputs and outputs are indexed by the spec's argument names (``src``, ``InputTensor`` ...).
    ``output_types`` starts with what the type variables say; the rule completes it.
    """

    schema: OpSchema
    binding: Binding | None
    node_name: str
    inputs: list[str | None]  # ONNX value name per schema position; None = omitted
    outputs: list[str | None]
    attributes: dict[str, Any]
    input_types: list[TensorType | None]
    output_types: list[TensorType | None]
    type_vars: dict[str, int] = field(default_factory=dict)
    input_args: list[Argument] = field(default_factory=list)  # the formal argument of each position
    output_args: list[Argument] = field(default_factory=list)
    _input_index: dict[str, int] | None = field(default=None, init=False, repr=False, compare=False)
    _output_index: dict[str, int] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def domain(self) -> str:
        return self.binding.domain if self.binding else self.schema.domain

    @property
    def op_type(self) -> str:
        return self.binding.op_type if self.binding else self.schema.name

    def error(self, message: str, constraint: str | None = None) -> VerificationError:
        return VerificationError(self.domain, self.op_type, self.node_name, message, constraint)

    # lookups by spec argument name (the first position of that argument); a name the schema lacks is absent
    def _in(self, name: str | None) -> int | None:
        index = self._input_index
        if index is None:
            index = self._input_index = _first_positions(self.input_args)
        return index.get(name)

    def _out(self, name: str | None) -> int | None:
        index = self._output_index
        if index is None:
            index = self._output_index = _first_positions(self.output_args)
        return index.get(name)

    def has_input(self, name: str | None) -> bool:
        i = self._in(name)
        return i is not None and self.inputs[i] is not None

    def has_output(self, name: str | None) -> bool:
        i = self._out(name)
        return i is not None and self.outputs[i] is not None

    def input_value(self, name: str | None) -> str | None:
        i = self._in(name)
        return None if i is None else self.inputs[i]

    def output_value(self, name: str | None) -> str | None:
        i = self._out(name)
        return None if i is None else self.outputs[i]

    def input_type(self, name: str | None) -> TensorType | None:
        i = self._in(name)
        return None if i is None else self.input_types[i]

    def output_type(self, name: str | None) -> TensorType | None:
        i = self._out(name)
        return None if i is None else self.output_types[i]

    def set_output_type(self, name: str, t: TensorType) -> None:
        i = self._out(name)
        if i is not None and self.outputs[i] is not None:
            self.output_types[i] = t

    def constraint_label(self, names: Sequence[str], keywords: Sequence[str] = ()) -> str | None:
        return constraint_label(self.schema, names, keywords)


def _first_positions(args: Sequence[Argument]) -> dict[str, int]:
    index: dict[str, int] = {}
    for i, a in enumerate(args):
        index.setdefault(a.name, i)
    return index


def constraint_label(schema: OpSchema, names: Sequence[str], keywords: Sequence[str] = ()) -> str | None:
    """The label of the spec constraint that mentions every one of ``names`` (e.g. "C1"), if any.

    With ``keywords``, only a constraint whose text also contains one of them counts (DirectML states
    "same DataType" and "same Sizes" as separate constraints over the same tensors).
    """
    return _constraint_label(schema.constraints, tuple(names), tuple(keywords))


@functools.lru_cache(maxsize=4096)  # asked on every check of a node (the label goes into an error), answered alike
def _constraint_label(constraints: tuple[Constraint, ...], names: tuple[str, ...],
                      keywords: tuple[str, ...]) -> str | None:
    def mentions(c, name):
        return name in c.arguments or re.search(rf"(?<!\w){re.escape(name)}(?!\w)", c.text) is not None

    matches = [c for c in constraints if all(mentions(c, n) for n in names)]
    if keywords:
        matches = [c for c in matches if any(k.lower() in c.text.lower() for k in keywords)]
    return matches[0].label if matches else None


# -- rule registry ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RuleResult:
    roles: Mapping[str, str]
    rank: int | None = None
    channel_axis: int | None = None
    reduce_axes: tuple[int, ...] | None = None
    epsilon: float | None = None


Rule = Callable[[NodeContext], RuleResult]
RULES: dict[str, Rule] = {}


def register_rule(key: str) -> Callable[[Rule], Rule]:
    """Register a verification rule under a binding's ``rule`` key; registering a key twice is an error."""
    def decorate(fn: Rule) -> Rule:
        if key in RULES:
            raise ValueError(f"verification rule {key!r} is already registered ({RULES[key].__module__})")
        RULES[key] = fn
        return fn
    return decorate


def number_attribute(ctx: NodeContext, name: str) -> float:
    """A numeric attribute (the schema's default already applied); missing or non-numeric is an error."""
    value = ctx.attributes.get(name)
    if value is None:
        raise ctx.error(f"attribute '{name}' is missing and the spec gives no default")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ctx.error(f"{name} is {value!r}; expected a number")
    return float(value)


def per_axis_attribute(attributes: Mapping[str, Any], name: str, default: int | None, spatial: int, *,
                       per_axis: int = 1, minimum: int = 0,
                       error: type[ValueError] = ValueError) -> tuple[int, ...] | None:
    """A windowed op's list attribute with ``per_axis`` entries per spatial axis (pads: 2): the node's
    value, else ``default`` repeated (None when ``default`` is None); ``error`` names the attribute when its
    length or an entry does not fit."""
    length = per_axis * spatial
    value = attributes.get(name)
    if value is None:
        return None if default is None else (default,) * length
    value = tuple(int(v) for v in value)
    if len(value) != length:
        raise error(f"{name} has {len(value)} entries {list(value)}; expected {length} "
                    f"({'two' if per_axis == 2 else 'one'} per spatial axis)")
    if any(v < minimum for v in value):
        raise error(f"{name} is {list(value)}; every entry must be >= {minimum}")
    return value


def epsilon_attribute(ctx: NodeContext, name: str) -> float:
    """epsilon: finite and > 0 (labelled with the spec's constraint that says so, where it has one)."""
    value = number_attribute(ctx, name)
    if not math.isfinite(value) or value <= 0:
        raise ctx.error(f"{name} is {value!r}; it must be finite and > 0",
                        ctx.constraint_label([name], ("positive", "finite")))
    return value


def rule_for(key: str) -> Rule | None:
    """The verification rule for a binding's ``rule`` key, or None when there is none.

    A rule ``key`` lives in ``opdef.rules.<key>`` and is imported, which registers it, on first use: the
    same convention as the lowering rules (``lowering.<key>``), so a new op adds files, not imports.
    """
    if key not in RULES:
        import_rule_module("opdef.rules", key)
    return RULES.get(key)


def import_rule_module(package: str, key: str) -> None:
    """Import the module that registers rule ``key`` of ``package`` (``opdef.rules``, ``lowering.rules``).

    A rule lives in ``<package>.<key>`` (a module or a subpackage), or, for an op family whose module
    registers several rules, in any module of the package: when ``<package>.<key>`` does not exist, every
    module of the package is imported (importing registers; Python imports a module once). A key that is no
    module name, or that no module registers, is simply no rule.
    """
    if key.isidentifier():
        try:
            importlib.import_module(f"{package}.{key}")
            return
        except ModuleNotFoundError as exc:
            if exc.name != f"{package}.{key}":
                raise
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        importlib.import_module(f"{package}.{module.name}")


def bound_roles(ctx: NodeContext) -> dict[str, str]:
    """Canonical role -> ONNX value name, for the present inputs and requested outputs the binding names."""
    roles: dict[str, str] = {}
    if ctx.binding is None:
        return roles
    for role, spec_name in ctx.binding.roles:
        value = ctx.input_value(spec_name) or ctx.output_value(spec_name)
        if value:
            roles[role] = value
    return roles
