"""The op schema model: frozen data parsed from a specification document.

Parsers produce these objects; nothing here knows about ONNX. Element types are spelled the oneDNN
way (``f32``, ``bf16``, ``f16``, ``f64``, ``s32``, ``s8``, ``u8``, ``boolean`` ...) whatever the dialect
wrote (``FLOAT32`` in DirectML, ``real`` in nGraph is a type *class* kept verbatim).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DIALECTS = ("onednn", "opset_v0", "ngraph", "directml")


@dataclass(frozen=True)
class Argument:
    """One input or output of an op, in document order."""

    name: str
    optional: bool = False
    variadic: bool = False
    type_var: str | None = None  # e.g. "T1"; None when the document gives none
    description: str = ""
    # Element types allowed for this argument when the document lists them per argument
    # (DirectML's tensor-support table); empty means "see type_var / type_constraints".
    types: tuple[str, ...] = ()
    # Shape as the document writes it, verbatim (nGraph ":math:`(C)`", DirectML "{ MeanDimensions[] }").
    shape: str | None = None
    # Supported ranks (inclusive) when the document states them; None = not stated.
    min_rank: int | None = None
    max_rank: int | None = None


@dataclass(frozen=True)
class Attribute:
    name: str
    type: str  # normalized: "f32", "f64", "s64", "s64[]", "f32[]", "string", "bool", ...
    required: bool
    default: Any = None  # Python value (str, int, float, bool, list) or None when there is none
    allowed_values: tuple[Any, ...] = ()
    description: str = ""


@dataclass(frozen=True)
class TypeRule:
    """A cross-variable rule: ``var`` may take one of ``types`` only when ``when_var`` is in ``when_types``.

    From "*T2* can be bf16 only when *T1* is bf16": TypeRule("T2", ("bf16",), "T1", ("bf16",), text).
    """

    var: str
    types: tuple[str, ...]
    when_var: str
    when_types: tuple[str, ...]
    text: str = ""


@dataclass(frozen=True)
class Constraint:
    """A numbered constraint from the document's notes (label "C1", "C2", ...), kept as text."""

    label: str
    text: str
    # Argument names the constraint mentions, in order of mention.
    arguments: tuple[str, ...] = ()


@dataclass(frozen=True)
class SpecWarning:
    """Something unusual a parser read past: the document is well formed, but a reader should look.

    Parsers attach these to the schema (``OpSchema.warnings``); ``oplower schema`` prints them and
    ``--strict`` turns them into errors. A document that cannot be read raises ``SpecError`` instead.
    """

    source: str
    line: int | None
    message: str

    def __str__(self) -> str:
        where = f"{self.source}:{self.line}" if self.line else self.source
        return f"{where}: warning: {self.message}"


@dataclass(frozen=True)
class OpSchema:
    name: str
    domain: str
    version: int
    dialect: str
    description: str = ""
    inputs: tuple[Argument, ...] = ()
    outputs: tuple[Argument, ...] = ()
    attributes: tuple[Attribute, ...] = ()
    # {type var: allowed types}
    type_constraints: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # oneDNN's supported-data-type table: each row is one legal assignment {type var: type}.
    type_combinations: tuple[tuple[tuple[str, str], ...], ...] = ()
    type_rules: tuple[TypeRule, ...] = ()
    constraints: tuple[Constraint, ...] = ()
    source: str = ""  # file the schema was parsed from
    extra: tuple[tuple[str, Any], ...] = field(default=(), compare=False)
    # What the parser read past (not part of the op's definition, so not compared).
    warnings: tuple[SpecWarning, ...] = field(default=(), compare=False)

    # -- lookups ---------------------------------------------------------------------------------
    def input(self, name: str) -> Argument:
        return _find(self.inputs, name, self, "input")

    def output(self, name: str) -> Argument:
        return _find(self.outputs, name, self, "output")

    def attribute(self, name: str) -> Attribute:
        return _find(self.attributes, name, self, "attribute")

    def input_index(self, name: str) -> int:
        return [a.name for a in self.inputs].index(name)

    def output_index(self, name: str) -> int:
        return [a.name for a in self.outputs].index(name)

    @property
    def type_constraint_map(self) -> dict[str, tuple[str, ...]]:
        return dict(self.type_constraints)

    @property
    def key(self) -> tuple[str, str]:
        return (self.domain, self.name)

    def to_json(self) -> dict[str, Any]:
        """The fields of DESIGN.md section 6 (plus a few more), JSON-ready."""

        def arg(a: Argument) -> dict[str, Any]:
            d: dict[str, Any] = {"name": a.name, "optional": a.optional, "variadic": a.variadic,
                                 "type_var": a.type_var}
            if a.types:
                d["types"] = list(a.types)
            if a.shape is not None:
                d["shape"] = a.shape
            if a.min_rank is not None or a.max_rank is not None:
                d["ranks"] = [a.min_rank, a.max_rank]
            return d

        data = {
            "name": self.name,
            "domain": self.domain,
            "dialect": self.dialect,
            "version": self.version,
            "description": self.description,
            "inputs": [arg(a) for a in self.inputs],
            "outputs": [arg(a) for a in self.outputs],
            "attributes": [
                {"name": a.name, "type": a.type, "required": a.required, "default": a.default,
                 "allowed_values": list(a.allowed_values)}
                for a in self.attributes
            ],
            "type_constraints": {v: list(t) for v, t in self.type_constraints},
            "type_combinations": [dict(c) for c in self.type_combinations],
            "type_rules": [
                {"var": r.var, "types": list(r.types), "when_var": r.when_var,
                 "when_types": list(r.when_types), "text": r.text}
                for r in self.type_rules
            ],
            "constraints": [{"label": c.label, "text": c.text} for c in self.constraints],
            "source": self.source,
        }
        if self.warnings:  # only when there are any, so a clean schema's JSON is unchanged
            data["warnings"] = [{"line": w.line, "message": w.message} for w in self.warnings]
        return data


def _find(items, name, schema, what):
    for item in items:
        if item.name == name:
            return item
    raise KeyError(f"{schema.domain} {schema.name} has no {what} {name!r}")
