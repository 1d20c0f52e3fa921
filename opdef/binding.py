"""Binding data: how one dialect's op maps onto a canonical lowering rule.

Read from ``specs/bindings.json``. The spec document says what the op's arguments *are*; the binding
says which canonical role each plays (DESIGN.md section 4), where the channel axis is and which
statistics mode applies. It is data, validated here, never Python literals elsewhere.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from opdef.errors import SpecError

LAYOUTS = ("data_format", "channel_first", "stats_broadcast")
STATISTICS = ("batch", "frozen")
STAT_INPUTS = ("variance", "inv_std")


@dataclass(frozen=True)
class Binding:
    spec: str  # path of the spec document, relative to the specs directory
    domain: str
    op_type: str
    rule: str  # lowering/verification rule key, e.g. "batch_norm_backward"
    dialect: str | None = None  # None: detected from the document's content
    roles: tuple[tuple[str, str], ...] = ()  # (canonical role, the spec's argument/attribute name)
    layout: str = "channel_first"
    layout_attribute: str | None = None  # for layout == "data_format"
    statistics: str = "batch"
    stat_input: str = "variance"
    # Rank range used where the spec is silent (inclusive); None = no limit from the binding.
    min_rank: int | None = None
    max_rank: int | None = None
    options: tuple[tuple[str, Any], ...] = ()  # rule-specific extras
    # default-domain ops only (onnxruntime-training's MaxPoolGrad ...): the first default opset that has it
    since_opset: int | None = None
    # (output role, input role): the output is the in-place update of the input (DESIGN.md section 9); a
    # lowered main graph also returns it as the graph output "<input value name>.updated"
    in_place: tuple[tuple[str, str], ...] = ()
    # (attribute role, value): no in-place update when the node's attribute (or its spec default) has that
    # value, e.g. BatchNormInternal in inference mode leaves its running statistics alone
    in_place_unless: tuple[tuple[str, Any], ...] = ()

    @functools.cached_property
    def role_map(self) -> Mapping[str, str]:  # read for every node the pass lowers: built once, read-only
        return MappingProxyType(dict(self.roles))

    def arg(self, role: str) -> str | None:
        """The spec's name for a canonical role, or None when this dialect has no such argument."""
        return self.role_map.get(role)

    @property
    def key(self) -> tuple[str, str]:
        return (self.domain, self.op_type)

    @property
    def paired_param_grads(self) -> bool:
        """diff_gamma and diff_beta are requested both or neither, and with neither gamma is ignored.

        oneDNN Graph's note (C1 in its spec); declared in bindings.json as
        ``"options": {"param_grads": "both_or_neither"}`` so no code reads meaning out of prose.
        """
        return dict(self.options).get("param_grads") == "both_or_neither"


_FIELDS = {"spec", "domain", "op_type", "rule", "dialect", "roles", "layout", "layout_attribute",
           "statistics", "stat_input", "min_rank", "max_rank", "options", "since_opset", "in_place",
           "in_place_unless", "comment"}


def load_bindings(path: Path) -> list[Binding]:
    return read_binding_file(path)[0]


def read_binding_file(path: Path) -> tuple[list[Binding], frozenset[str]]:
    """The bindings, and the ``shared_domains``: domains the project does not own (onnxruntime's
    ``com.microsoft`` holds many ops besides the ones bound here), where unbound ops are left alone."""
    source = str(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(source, None, f"cannot read binding data: {exc}") from None
    except json.JSONDecodeError as exc:
        raise SpecError(source, exc.lineno, f"invalid JSON: {exc.msg}") from None
    shared = raw.get("shared_domains", []) if isinstance(raw, dict) else []
    if not isinstance(shared, list) or not all(isinstance(d, str) for d in shared):
        raise SpecError(source, None, '"shared_domains" must be a list of domain names')
    return _bindings(raw, source), frozenset(shared)


def _bindings(raw: Any, source: str) -> list[Binding]:
    if not isinstance(raw, dict) or not isinstance(raw.get("ops"), list):
        raise SpecError(source, None, 'expected an object with an "ops" list')
    out = []
    for i, entry in enumerate(raw["ops"]):
        where = f"ops[{i}]"
        if not isinstance(entry, dict):
            raise SpecError(source, None, f"{where}: expected an object")
        unknown = set(entry) - _FIELDS
        if unknown:
            raise SpecError(source, None, f"{where}: unknown field(s) {sorted(unknown)}")
        for field in ("spec", "domain", "op_type", "rule"):
            if not isinstance(entry.get(field), str) or (not entry[field] and field != "domain"):
                raise SpecError(source, None, f"{where}: field {field!r} must be a non-empty string")
        if entry["domain"] in ("", "ai.onnx") and not isinstance(entry.get("since_opset"), int):
            # a default-domain op is recognised by name and opset: without one it could shadow standard ops
            raise SpecError(source, None, f"{where}: a default-domain op needs 'since_opset'")
        layout = entry.get("layout", "channel_first")
        if layout not in LAYOUTS:
            raise SpecError(source, None, f"{where}: layout {layout!r} not one of {list(LAYOUTS)}")
        if layout == "data_format" and not entry.get("layout_attribute"):
            raise SpecError(source, None, f"{where}: layout 'data_format' needs 'layout_attribute'")
        statistics = entry.get("statistics", "batch")
        if statistics not in STATISTICS:
            raise SpecError(source, None,
                            f"{where}: statistics {statistics!r} not one of {list(STATISTICS)}")
        stat_input = entry.get("stat_input", "variance")
        if stat_input not in STAT_INPUTS:
            raise SpecError(source, None, f"{where}: stat_input {stat_input!r} not one of {list(STAT_INPUTS)}")
        roles = entry.get("roles", {})
        if not isinstance(roles, dict) or not all(isinstance(v, str) for v in roles.values()):
            raise SpecError(source, None, f"{where}: roles must map role names to argument names")
        for field in ("min_rank", "max_rank", "since_opset"):
            value = entry.get(field)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise SpecError(source, None, f"{where}: {field} must be a non-negative integer, not {value!r}")
        options = entry.get("options", {})
        if not isinstance(options, dict):
            raise SpecError(source, None, f"{where}: options must be an object")
        in_place = entry.get("in_place", {})
        if not isinstance(in_place, dict) or not all(
                isinstance(o, str) and isinstance(i, str) and o in roles and i in roles for o, i in in_place.items()):
            raise SpecError(source, None, f"{where}: in_place must map output roles to input roles, both in roles")
        in_place_unless = entry.get("in_place_unless", {})
        if not isinstance(in_place_unless, dict) or not all(r in roles for r in in_place_unless):
            raise SpecError(source, None, f"{where}: in_place_unless must map attribute roles to values")
        out.append(Binding(
            spec=entry["spec"], domain=entry["domain"], op_type=entry["op_type"], rule=entry["rule"],
            dialect=entry.get("dialect"), roles=tuple(roles.items()), layout=layout,
            layout_attribute=entry.get("layout_attribute"), statistics=statistics, stat_input=stat_input,
            min_rank=entry.get("min_rank"), max_rank=entry.get("max_rank"),
            options=tuple(sorted(options.items())), since_opset=entry.get("since_opset"),
            in_place=tuple(in_place.items()), in_place_unless=tuple(in_place_unless.items()),
        ))
    return out
