"""``oplower schema``: show parsed op schemas."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from opdef.errors import SpecError
from opdef.parse import parse_spec
from opdef.registry import load_schemas
from opdef.schema import DIALECTS, OpSchema

HELP = "show the op schema parsed from a spec document, or from the bundled specs/ by op type"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", nargs="?", metavar="OP_TYPE|SPEC_FILE",
                   help="an op type from the bundled specs (all of them when omitted), or a spec file")
    p.add_argument("--dialect", choices=DIALECTS, help="the spec file's dialect (default: detected)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--strict", action="store_true",
                   help="treat the parser's warnings (unusual but readable documents) as errors: exit 1")


def run(args: argparse.Namespace) -> int:
    schemas = _select(args.target, args.dialect)
    warnings = [w for s in schemas for w in s.warnings]
    for w in warnings:  # one line each, before any output, so they are seen even when piped
        print(w, file=sys.stderr)
    if args.strict and warnings:
        first = warnings[0]
        more = f" (and {len(warnings) - 1} more)" if len(warnings) > 1 else ""
        raise SpecError(first.source, first.line, f"{first.message}{more}; --strict makes warnings errors")
    if args.json:
        data = [s.to_json() for s in schemas]
        print(json.dumps(data[0] if len(data) == 1 else data, indent=2))
    else:
        print("\n\n".join(format_schema(s) for s in schemas))
    return 0


def _select(target: str | None, dialect: str | None) -> list[OpSchema]:
    if target is not None and (Path(target).exists() or any(c in target for c in "/\\.")):
        return [parse_spec(Path(target), dialect)]
    registry = load_schemas()
    entries = list(registry) if target is None else registry.find(target)
    if dialect:
        entries = [e for e in entries if e.schema.dialect == dialect]
    if not entries:
        known = ", ".join(sorted({e.binding.op_type for e in registry}))
        raise SpecError(target or "specs/", None, f"no bundled schema named {target!r} (known: {known})")
    return [e.schema for e in entries]


def format_schema(s: OpSchema) -> str:
    domain = s.domain or "ai.onnx"  # the default domain has no name of its own
    lines = [f"{domain}::{s.name} (version {s.version}, dialect {s.dialect})", f"  source: {s.source}"]
    tc = s.type_constraint_map

    def arg_line(i, a):
        flags = [f for f, on in (("optional", a.optional), ("variadic", a.variadic)) if on]
        types = a.types or tc.get(a.type_var or "", ())
        t = f"{a.type_var}" if a.type_var else "-"
        if types:
            t += " {" + ", ".join(types) + "}"
        extra = f"  shape {a.shape}" if a.shape else ""
        return f"    {i}: {a.name:<24} {t}{'  (' + ', '.join(flags) + ')' if flags else ''}{extra}"

    lines.append("  inputs:")
    lines += [arg_line(i, a) for i, a in enumerate(s.inputs)] or ["    (none)"]
    lines.append("  outputs:")
    lines += [arg_line(i, a) for i, a in enumerate(s.outputs)] or ["    (none)"]
    lines.append("  attributes:")
    for a in s.attributes:
        req = "required" if a.required else f"optional, default {a.default!r}"
        allowed = f", one of {list(a.allowed_values)}" if a.allowed_values else ""
        lines.append(f"    {a.name:<24} {a.type} ({req}{allowed})")
    if not s.attributes:
        lines.append("    (none)")
    if s.type_combinations:
        lines.append("  supported type combinations:")
        lines += ["    " + ", ".join(f"{v}={t}" for v, t in combo) for combo in s.type_combinations]
    for r in s.type_rules:
        default = f"{r.var} in {list(r.types)} only when {r.when_var} in {list(r.when_types)}"
        lines.append(f"  rule: {r.text or default}")
    for c in s.constraints:
        lines.append(f"  {c.label}: {c.text}")
    return "\n".join(lines)
