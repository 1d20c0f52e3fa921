"""The ``opset_v0`` dialect: the 2022 oneDNN Graph opset specification (``graph/ops/<category>/<Op>_1.rst``).

Grammar (RST, bullet lists under bold labels)::

    **Versioned name**: *Op-1*            name "Op", version 1 (mandatory)
    **Short description**: ...            the schema's description
    **Attributes**:                       then "* *attr*" items with nested "* **Key**: value" properties
                                          (Description, Range of values, Type, Default value, Required)
    **Inputs** / **Outputs**              "* **N**: ``name`` - text **Required.**|**Optional.**" with a
                                          nested "* **Type**: T1"; "* **1..N**:" is a variadic argument
    **Types**                             "* *T1*: f32, f16, bf16." and
                                          "* Constraints: *T2* can be bf16 only when *T1* is bf16."

Quirks handled here:

- The layout may have lost its line breaks (the seed copy is one line). :func:`restore_layout` detects
  that (the ``**Versioned name**`` label is not at the start of a line) and rebuilds the bullet
  structure from the grammar's markers before the document is parsed normally; error lines are mapped
  back onto the collapsed text.
- Labels with or without a colon, inside or outside the bold (``**Inputs**``, ``**Inputs**:``,
  ``**Detailed description:**``); type variables as ``*T*`` or ``**T**``.
- "**Attributes**: *ReLU* operation has no attributes." (prose, no list) means no attributes, and so does
  an indented sentence under the label ("No attributes available."; a warning unless it negates).
- "**Attributes**: * *epsilon*" (the first item on the label's line, one lost line break; also without the
  space, "**Attributes**:* *epsilon*") is split before parsing, with a warning; line numbers stay those of
  the source.
- Constraints: each sentence is read clause by clause (``;``) as "*V* can be X only when *W* is Y",
  "when *W* is Y, *V* should/must/can be X" or "*V* should be X when *W* is Y"; an implication becomes the
  equivalent :class:`TypeRule` (V outside X only when W outside Y). A sentence with any other clause is
  kept verbatim as a Constraint C1, C2 ... with a warning, never a SpecError.
- Two names for one argument (``result_forward`` / ``input_forward``) are joined as
  ``result_forward/input_forward``, the way oneDNN's own op definitions name such arguments.
- ``**Required**.`` / ``**Optional**.`` / ``**Optional.**.`` markers; an argument without one is required.
- An argument whose ``**Type**`` is an element type rather than a type variable (``s32``) gets
  ``Argument.types``.
- "Range of values" becomes ``allowed_values`` only when it is an enumeration (``*NXC* or *NCX* (...)``,
  ``one of ``a``, ``b````, a nested list of ``*value* - meaning`` items); prose such as "arbitrary
  positive f32 value" is not. Boolean attributes keep no allowed values.
- Defaults are converted to the attribute's type (``*NXC*`` -> "NXC", ``True`` -> True, ``1e-5`` ->
  1e-05, "empty list" -> []); a default that is prose for a non-string type ("all zeros", "list of 1")
  or "none" gives ``default=None`` and the text is kept in the attribute's description.

A stub (a Versioned name but none of Attributes, Inputs, Outputs, Types) yields an empty but valid
schema with ``("stub", True)`` in ``extra``, as the other dialects do with pages that have no tables.
Malformed documents raise :class:`~opdef.errors.SpecError` naming the line and what was expected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import docutils.nodes as dn

from opdef.errors import SpecError
from opdef.rst import parse_rst
from opdef.schema import Argument, Attribute, Constraint, OpSchema, SpecWarning, TypeRule
from opdef.types import ONNX_ELEM_TYPE, normalize_type

DOMAIN = "onednn"
DIALECT = "opset_v0"

_VERSIONED = re.compile(r"\*\*Versioned name\*\*\s*:?\s*\*[^*\s][^*]*-\d+\*")
_ATTR_TYPES = {"boolean": "bool", "str": "string"}

# ----------------------------------------------------------------------------------------------
# dialect detection


def looks_like(text: str) -> float:
    """High when the ``**Versioned name**: *Op-N*`` bullet grammar is present (collapsed or not)."""
    if not _VERSIONED.search(text):
        return 0.0
    score = 0.8
    for marker in ("**Inputs**", "**Outputs**", "**Types**", "**Attributes**"):
        if marker in text:
            score += 0.05
    return min(score, 1.0)


# ----------------------------------------------------------------------------------------------
# the collapsed layout

_LABEL_WORDS = re.compile(r"[A-Z][A-Za-z ]*:?")
_NOT_LABELS = {"required", "optional"}
_PROPERTY = re.compile(r"\*\*[A-Za-z][A-Za-z ]*\*\*\s*:")
_ARG_INDEX = re.compile(r"\*\*\s*(?:\d+|\d+\s*\.\.\s*\w+|N)\s*\*\*\s*:")
_PURE_NAME = re.compile(r"\*[^*\s][^*]*\*")
_DIRECTIVE = re.compile(r"\.\. [A-Za-z][\w:-]*::")
_ADORNED_TITLE = re.compile(r"(?P<adorn>([-=#~^+\"'`:.*])\2{2,})\s+(?P<title>\S.*?)\s+(?P=adorn)(?=\s|$)")
_UNDERLINED_TITLE = re.compile(r"(?P<title>\S+)\s+(?P<adorn>([-=#~^+\"])\3{2,})\s*$")


_OTHER_LABELS = re.compile(r"\*\*(?:Category|Short description|Attributes|Inputs|Outputs|Types)\*\*|\s\* \*")


def is_collapsed(text: str) -> bool:
    """True when the label lines have been run together (``**Versioned name**`` not at a line start)."""
    for line in text.splitlines():
        if "**Versioned name**" in line:
            return not line.lstrip().startswith("**Versioned name**") or bool(_OTHER_LABELS.search(line))
    return False


@dataclass
class _Piece:
    kind: str  # "label" | "bullet" | "directive"
    start: int  # offset in the collapsed text
    end: int


def _split_points(text: str) -> list[_Piece]:
    """Offsets where a top-level label paragraph or a bullet item starts in a collapsed document."""
    pieces: list[_Piece] = []
    i, n = 0, len(text)
    while i < n:
        if text.startswith("``", i):  # literals never hold markers
            j = text.find("``", i + 2)
            i = n if j < 0 else j + 2
            continue
        if text.startswith("* ", i) and (i == 0 or text[i - 1].isspace()) and i + 2 < n and not text[i + 2].isspace():
            pieces.append(_Piece("bullet", i, n))
            i += 2
            continue
        if text.startswith(".. ", i) and (i == 0 or text[i - 1].isspace()) and _DIRECTIVE.match(text, i):
            pieces.append(_Piece("directive", i, n))
            i += 3
            continue
        if text.startswith("**", i):
            j = text.find("**", i + 2)
            if j < 0:
                break
            label = text[i + 2: j]
            after_bullet = re.search(r"(?:^|\s)\*\s+$", text[max(0, i - 4): i]) is not None
            if (_LABEL_WORDS.fullmatch(label) and label.rstrip(":").strip().lower() not in _NOT_LABELS
                    and not after_bullet):
                pieces.append(_Piece("label", i, n))
            i = j + 2
            continue
        i += 1
    for a, b in zip(pieces, pieces[1:], strict=False):
        a.end = b.start
    return pieces


def _restore_header(prefix: str, offset: int, out: list[tuple[str, int]]) -> None:
    m = _ADORNED_TITLE.search(prefix) or _UNDERLINED_TITLE.search(prefix)
    before = prefix[: m.start()].strip() if m else prefix.strip()
    if before:
        out.append((before, offset))
    if m:
        title = m.group("title").strip()
        char = m.group("adorn")[0]
        rule = char * max(len(title), 3)
        out.append((f"{rule}\n{title}\n{rule}", offset + m.start()))


def restore_layout(text: str) -> tuple[str, list[int]]:
    """Rebuild line breaks and bullet indentation of a collapsed document.

    Returns the restored text and, for each of its lines, the line number in ``text``.
    """
    pieces = _split_points(text)
    out: list[tuple[str, int]] = []
    _restore_header(text[: pieces[0].start] if pieces else text, 0, out)
    section = ""
    attribute_open = False  # inside "* *attr*" whose properties are being listed
    expects_children = False  # the last level-1 property ended with ':' (an enumeration follows)
    last_level: int | None = None  # indentation level of the last bullet since the last label
    for k, piece in enumerate(pieces):
        body = " ".join(text[piece.start: piece.end].split())
        if piece.kind == "label":
            section = body[2:].split("**", 1)[0].rstrip(":").strip().lower()
            attribute_open = expects_children = False
            last_level = None
            out.append((body, piece.start))
            continue
        if piece.kind == "directive":  # its content stays inside the enclosing item, if any
            indent = "" if last_level is None else "  " * (last_level + 1)
            out.append((indent + body, piece.start))
            continue
        item = body[2:]
        level = 0
        if section == "attributes":
            nxt = " ".join(text[pieces[k + 1].start + 2: pieces[k + 1].end].split()) if k + 1 < len(pieces) else ""
            if _PROPERTY.match(item):
                level, expects_children = 1, item.endswith(":")
            elif (_PURE_NAME.fullmatch(item) and _PROPERTY.match(nxt)
                  and (not attribute_open or not expects_children or nxt.startswith("**Description**"))):
                level, attribute_open, expects_children = 0, True, False
            else:
                level = 2 if attribute_open else 0
        elif section in ("inputs", "outputs"):
            if _ARG_INDEX.match(item):
                level = 0
            elif _PROPERTY.match(item):
                level = 1
            else:
                level = 2
        last_level = level
        out.append(("  " * level + "* " + item, piece.start))
    restored_lines: list[str] = []
    line_map: list[int] = []
    for chunk, offset in out:
        orig_line = text.count("\n", 0, offset) + 1
        for line in (chunk + "\n").splitlines() + [""]:
            restored_lines.append(line)
            line_map.append(orig_line)
    return "\n".join(restored_lines), line_map


# ----------------------------------------------------------------------------------------------
# parsing


class _Doc:
    """The parsed document plus the mapping from its lines to the source's lines."""

    def __init__(self, source: str, line_map: list[int] | None) -> None:
        self.source = source
        self.line_map = line_map
        self.warnings: list[SpecWarning] = []

    def warn(self, node: dn.Node | None, message: str) -> None:
        self.warnings.append(SpecWarning(self.source, self.line(node), message))

    def line(self, node: dn.Node | None) -> int | None:
        line = None
        while node is not None and line is None:
            line = getattr(node, "line", None)
            if line is None:
                for sub in node.findall(include_self=False):
                    if getattr(sub, "line", None):
                        line = sub.line
                        break
            node = node.parent if line is None else node
        if line is None or self.line_map is None:
            return line
        return self.line_map[min(max(line - 1, 0), len(self.line_map) - 1)]

    def error(self, node: dn.Node | None, message: str) -> SpecError:
        return SpecError(self.source, self.line(node), message)


def _blocks(node: dn.Element):
    """Body elements in document order, sections flattened (their titles skipped)."""
    for child in node.children:
        if isinstance(child, dn.section):
            yield from _blocks(child)
        elif not isinstance(child, (dn.title, dn.comment, dn.system_message, dn.substitution_definition)):
            yield child


def _text(node: dn.Node) -> str:
    return " ".join(node.astext().split())


def _label_of(block: dn.Node) -> tuple[str, str] | None:
    """``**Label**: value`` paragraph -> (label lower-cased, value text); None for other blocks."""
    if not isinstance(block, dn.paragraph) or not block.children or not isinstance(block[0], dn.strong):
        return None
    label = _text(block[0]).rstrip(":").strip()
    if not label or label.lower() in _NOT_LABELS or not _LABEL_WORDS.fullmatch(label):
        return None
    value = _after_key(block)
    return label.lower(), value


def _after_key(para: dn.paragraph) -> str:
    """The text after a paragraph's leading ``**Key**``, without the colon."""
    value = " ".join("".join(c.astext() for c in para.children[1:]).split())
    return value[1:].strip() if value.startswith(":") else value


def _first_paragraph(item: dn.list_item) -> dn.paragraph | None:
    return next((c for c in item.children if isinstance(c, dn.paragraph)), None)


def _sublists(item: dn.Element) -> list[dn.bullet_list]:
    found = []
    for child in item.children:
        if isinstance(child, dn.bullet_list):
            found.append(child)
        elif isinstance(child, dn.block_quote):
            found.extend(_sublists(child))
    return found


def _properties(item: dn.list_item) -> dict[str, tuple[str, dn.paragraph, dn.list_item]]:
    """Nested ``* **Key**: value`` items -> {key lower-cased: (value text, paragraph, item)}."""
    props = {}
    for sub in _sublists(item):
        for prop in sub.children:
            para = _first_paragraph(prop)
            if para is None or not para.children or not isinstance(para[0], dn.strong):
                continue
            key = _text(para[0]).rstrip(":").strip().lower()
            props[key] = (_after_key(para), para, prop)
    return props


def _marked(node: dn.Node) -> list[str]:
    """Texts of the emphasis / literal / strong tokens in a node, in order."""
    return [_text(n) for n in node.findall(lambda n: isinstance(n, (dn.emphasis, dn.literal, dn.strong)))]


_LABEL_THEN_BULLET = re.compile(r"(\*\*[A-Z][A-Za-z ]*:?\*\*:?)[ \t]*(\* \S.*)")  # "**Attributes**:* *a*" too


def split_label_lines(text: str) -> tuple[str, list[int], list[tuple[int, str]]]:
    """``**Attributes**: * *epsilon*`` (one lost line break) -> the label, a blank line, the bullet.

    Returns the text, for each of its lines the line number in ``text``, and (line, label) per split.
    """
    out: list[str] = []
    line_map: list[int] = []
    splits: list[tuple[int, str]] = []
    for number, line in enumerate(text.split("\n"), start=1):
        m = _LABEL_THEN_BULLET.fullmatch(line.rstrip())
        if m is None:
            out.append(line)
            line_map.append(number)
            continue
        out += [m.group(1), "", m.group(2)]
        line_map += [number] * 3
        splits.append((number, m.group(1)))
    return "\n".join(out), line_map, splits


def parse(text: str, source: str, *, include_dirs=()) -> OpSchema:
    line_map = None
    splits: list[tuple[int, str]] = []
    collapsed = is_collapsed(text)
    if collapsed:
        text, line_map = restore_layout(text)
    else:
        text, line_map, splits = split_label_lines(text)
    doc = _Doc(source, line_map)
    for number, label in splits:
        doc.warnings.append(SpecWarning(source, number, f"{label} and its first item share a line (a lost line "
                                                        "break); read as a label and a list"))
    tree = parse_rst(text, source)
    sections: dict[str, tuple[str, dn.paragraph, list[dn.Node]]] = {}
    current: list[dn.Node] | None = None
    for block in _blocks(tree):
        label = _label_of(block)
        if label is not None:
            current = []
            sections.setdefault(label[0], (label[1], block, current))
        elif current is not None:
            current.append(block)

    if "versioned name" not in sections:
        raise SpecError(source, 1, "expected a '**Versioned name**: *Op-N*' line")
    value, para, _ = sections["versioned name"]
    m = re.fullmatch(r"\*?\s*([A-Za-z_][\w.]*)-(\d+)\s*\*?\.?", value.strip())
    if not m:
        raise doc.error(para, f"expected '**Versioned name**: *Op-N*', got {value!r}")
    name, version = m.group(1), int(m.group(2))
    stub = not any(key in sections for key in ("inputs", "outputs", "attributes", "types"))
    if not stub and "inputs" not in sections and "outputs" not in sections:
        raise doc.error(para, "expected '**Inputs**' and '**Outputs**' sections")

    type_vars, rules, constraints = _types(sections.get("types"), doc)
    inputs = _arguments(sections.get("inputs"), "input", type_vars, doc)
    outputs = _arguments(sections.get("outputs"), "output", type_vars, doc)
    attributes = _attributes(sections.get("attributes"), doc)
    for arg in inputs + outputs:
        if arg.type_var and arg.type_var not in type_vars:
            raise SpecError(source, None, f"{arg.name} has type {arg.type_var}, which '**Types**' does not define")
    extra: list[tuple[str, object]] = [("stub", True)] if stub else []
    if "category" in sections:
        extra.append(("category", sections["category"][0].strip("* ")))
    return OpSchema(
        name=name, domain=DOMAIN, version=version, dialect=DIALECT,
        description=sections.get("short description", ("",))[0],
        inputs=tuple(inputs), outputs=tuple(outputs), attributes=tuple(attributes),
        type_constraints=tuple(type_vars.items()), type_rules=tuple(rules), constraints=tuple(constraints),
        source=source, extra=tuple(extra), warnings=tuple(doc.warnings),
    )


def _only_list(section, what: str, doc: _Doc, *, prose_ok: bool) -> list[dn.list_item]:
    value, para, blocks = section
    lists = [b for b in blocks if isinstance(b, dn.bullet_list)]
    if not lists:
        for b in blocks:
            if isinstance(b, dn.block_quote) and _sublists(b):
                lists = _sublists(b)
                break
    if not lists:
        if prose_ok and value:
            return []
        prose = " ".join(_text(b) for b in blocks if isinstance(b, (dn.paragraph, dn.block_quote)))
        if prose_ok and prose:  # "**Attributes**:" over an indented "No attributes available."
            if not _NEGATION.search(prose):
                doc.warn(para, f"no list after this label, only prose; read as no {what}: {prose[:60]!r}")
            return []
        raise doc.error(para, f"expected a bullet list of {what} after this label")
    return [item for lst in lists for item in lst.children if isinstance(item, dn.list_item)]


# -- Types ------------------------------------------------------------------------------------

_RULE = re.compile(r"\*?(\w+)\*?\s+can\s+be\s+(.+?)\s+only\s+(?:when|if)\s+\*?(\w+)\*?\s+is\s+(.+?)\s*$", re.I)
# "When T1 is f32, T2 should be f16 or bf16" and "T2 should be f32 when T1 is f16": an implication.
_MODAL = r"(?:should|must|shall|can|may|will|has\s+to)\s+be"
_WHEN_THEN = re.compile(rf"(?:when|if)\s+\*?(\w+)\*?\s+is\s+(.+?),\s*(?:then\s+)?\*?(\w+)\*?\s+{_MODAL}\s+(.+?)\s*$",
                        re.I)
_THEN_WHEN = re.compile(rf"\*?(\w+)\*?\s+{_MODAL}\s+(.+?)\s+(?:when|if)\s+\*?(\w+)\*?\s+is\s+(.+?)\s*$", re.I)
_NEGATION = re.compile(r"\b(?:no|not|none|without)\b|n't\b", re.I)


def _type_list(text: str) -> tuple[str, ...]:
    words = re.split(r"\s*(?:,|\bor\b|\band\b|/)\s*", text.strip().rstrip(".").strip())
    return tuple(normalize_type(w) for w in words if w.strip("*` "))


def _types(section, doc: _Doc) -> tuple[dict[str, tuple[str, ...]], list[TypeRule], list[Constraint]]:
    """Type variables, the constraints read as type rules, and constraint sentences kept as text."""
    if section is None:
        return {}, [], []
    type_vars: dict[str, tuple[str, ...]] = {}
    rules: list[TypeRule] = []
    # (then var, then types, when var, when types, text): "when <when> is A, <then> should be B"
    implications: list[tuple[str, tuple[str, ...], str, tuple[str, ...], str]] = []
    constraints: list[Constraint] = []
    for item in _only_list(section, "type variables", doc, prose_ok=False):
        para = _first_paragraph(item)
        if para is None:
            continue
        text = _text(para)
        head, sep, rest = text.partition(":")
        key = head.strip().strip("*").strip()
        if key.lower() in ("constraints", "constraint"):
            for sentence in re.split(r"(?<=\.)\s+", rest.strip()):
                if not sentence.strip():
                    continue
                read = _constraint_clauses(sentence.strip().rstrip("."))
                if read is None:  # a sentence this grammar has no form for: documented, not checked
                    label = f"C{len(constraints) + 1}"
                    constraints.append(Constraint(label, sentence.strip()))
                    doc.warn(para, f"type constraint not in a form read as a rule; kept as constraint {label}: "
                                   f"{sentence.strip()!r}")
                    continue
                for kind, m, clause in read:
                    clause = sentence.strip() if len(read) == 1 else clause  # a whole sentence keeps its period
                    if kind == "only":
                        rules.append(TypeRule(m.group(1), _type_list(m.group(2)), m.group(3),
                                              _type_list(m.group(4)), clause))
                    elif kind == "when":
                        implications.append((m.group(3), _type_list(m.group(4)), m.group(1),
                                             _type_list(m.group(2)), clause))
                    else:
                        implications.append((m.group(1), _type_list(m.group(2)), m.group(3),
                                             _type_list(m.group(4)), clause))
        elif key.lower() == "note" or not sep:
            continue
        elif re.fullmatch(r"[A-Za-z_]\w*", key):
            types = _type_list(rest)
            unknown = [t for t in types if t not in ONNX_ELEM_TYPE]
            if not types or unknown:
                raise doc.error(para, f"expected element types for {key} (f32, f16, bf16, ...), got {rest.strip()!r}")
            type_vars[key] = types
    for var, types, when_var, when_types, text in implications:
        for v in (var, when_var):
            if v not in type_vars:
                raise SpecError(doc.source, None, f"type constraint names {v}, which '**Types**' does not define")
        # "when W in A, V in B" is, read backwards, "V outside B only when W outside A": a TypeRule.
        outside = tuple(t for t in type_vars[var] if t not in types)
        if outside:
            rules.append(TypeRule(var, outside, when_var, tuple(t for t in type_vars[when_var] if t not in when_types),
                                  text))
    for rule in rules:
        for var in (rule.var, rule.when_var):
            if var not in type_vars:
                raise SpecError(doc.source, None, f"type constraint names {var}, which '**Types**' does not define")
    return type_vars, rules, constraints


def _constraint_clauses(sentence: str) -> list[tuple[str, re.Match, str]] | None:
    """Each ';'-separated clause as (form, match, clause text); None unless every clause has a known form."""
    read = []
    for clause in (c.strip() for c in sentence.split(";")):
        if not clause:
            continue
        for kind, pattern in (("only", _RULE), ("when", _WHEN_THEN), ("then", _THEN_WHEN)):
            m = pattern.match(clause)
            if m and all(t in ONNX_ELEM_TYPE for g in (2, 4) for t in _type_list(m.group(g))):
                read.append((kind, m, clause))
                break
        else:
            return None
    return read or None


# -- Inputs / Outputs -------------------------------------------------------------------------

_INDEX = re.compile(r"(\d+)(?:\s*\.\.\s*(\w+))?")


def _arguments(section, what: str, type_vars, doc: _Doc) -> list[Argument]:
    if section is None:
        return []
    args: list[Argument] = []
    for item in _only_list(section, f"{what}s", doc, prose_ok=True):
        para = _first_paragraph(item)
        if para is None or not para.children or not isinstance(para[0], dn.strong):
            raise doc.error(item, f"expected '* **N**: ``name`` - description' for an {what}")
        index = _INDEX.fullmatch(_text(para[0]).rstrip(":").strip())
        if not index:
            raise doc.error(para, f"expected an {what} number like **1** or **1..N**, got {_text(para[0])!r}")
        name, description = _argument_name(para)
        if not name:
            raise doc.error(para, f"expected the {what}'s name as ``name`` after **{_text(para[0])}**")
        if any(a.name == name for a in args):
            raise doc.error(para, f"{what} {name!r} is listed twice")
        markers = [_text(s).lower() for s in para.findall(dn.strong)][1:]
        optional = False
        for marker in markers:
            if marker.startswith("optional"):
                optional = True
                break
            if marker.startswith("required"):
                break
        props = _properties(item)
        type_var, types = None, ()
        if "type" in props:
            spelled = props["type"][0].strip().strip("*`").rstrip(".").strip()
            if spelled in type_vars or re.fullmatch(r"T\d*", spelled):
                type_var = spelled
            else:
                types = _type_list(spelled)
                if not types or any(t not in ONNX_ELEM_TYPE for t in types):
                    raise doc.error(props["type"][1], f"expected a type variable or element type, got {spelled!r}")
        args.append(Argument(name=name, optional=optional, variadic=bool(index.group(2)), type_var=type_var,
                             description=description, types=types))
    return args


def _argument_name(para: dn.paragraph) -> tuple[str, str]:
    """``**1**: ``a`` / ``b`` - text`` -> ("a/b", "text")."""
    names: list[str] = []
    rest: list[str] = []
    children = list(para.children[1:])
    k = 0
    while k < len(children):
        child = children[k]
        if isinstance(child, dn.literal) and not rest:
            names.append(_text(child))
        elif isinstance(child, dn.Text) and not rest:
            t = str(child).strip()
            t = t[1:].strip() if t.startswith(":") and not names else t
            if t in ("", "/") or (names and t.startswith("/") and t.strip("/ ") == ""):
                pass
            elif not names and re.match(r"[A-Za-z_]\w*", t):
                word = re.match(r"[A-Za-z_]\w*", t).group(0)
                names.append(word)
                rest.append(t[len(word):])
            else:
                rest.append(t)
        else:
            rest.append(child.astext())
        k += 1
    text = " ".join(" ".join(rest).split())
    text = re.sub(r"^[-–—:\s]+", "", text)
    text = re.sub(r"\s*(Required|Optional)\s*\.?\s*\.?$", "", text, flags=re.I).strip()
    return "/".join(names), text


# -- Attributes -------------------------------------------------------------------------------


def _attributes(section, doc: _Doc) -> list[Attribute]:
    if section is None:
        return []
    attrs: list[Attribute] = []
    for item in _only_list(section, "attributes", doc, prose_ok=True):
        para = _first_paragraph(item)
        name = _text(para).strip("*: ") if para is not None else ""
        if not re.fullmatch(r"[A-Za-z_]\w*", name):
            raise doc.error(item, f"expected an attribute item '* *name*', got {name!r}")
        if any(a.name == name for a in attrs):
            raise doc.error(para, f"attribute {name!r} is listed twice")
        props = _properties(item)
        if "type" not in props:
            raise doc.error(para, f"attribute {name!r}: expected a '**Type**:' property")
        attr_type = _attr_type(props["type"][0])
        required = None
        if "required" in props:
            flag = props["required"][0].strip("*. ").lower()
            if flag not in ("yes", "no", "true", "false"):
                raise doc.error(props["required"][1], f"attribute {name!r}: expected '**Required**: *yes*' or "
                                                      f"'*no*', got {props['required'][0]!r}")
            required = flag in ("yes", "true")
        description = props.get("description", ("",))[0]
        default = None
        if "default value" in props:
            default, ok = _default(props["default value"][0], attr_type)
            if not ok:
                description = f"{description} (default: {props['default value'][0]})".strip()
        if required is None:
            required = "default value" not in props
        allowed = ()
        if "range of values" in props and attr_type != "bool":
            allowed = _enumeration(*props["range of values"], attr_type)
        attrs.append(Attribute(name=name, type=attr_type, required=required, default=default,
                               allowed_values=allowed, description=description))
    return attrs


def _attr_type(spelled: str) -> str:
    spelled = spelled.strip().strip("*`").rstrip(".").strip()
    base, brackets = (spelled[:-2], "[]") if spelled.endswith("[]") else (spelled, "")
    base = normalize_type(base)
    return _ATTR_TYPES.get(base, base) + brackets


def _scalar(word: str, attr_type: str):
    base = attr_type.rstrip("[]")
    word = word.strip().strip("*`\"'").strip()
    if base == "bool":
        if word.lower() in ("true", "false"):
            return word.lower() == "true", True
        return None, False
    if base[:1] in ("s", "u") and base[1:].isdigit():
        try:
            return int(word), True
        except ValueError:
            return None, False
    if base[:1] == "f" or base == "bf16":
        try:
            return float(word), True
        except ValueError:
            return None, False
    if base == "string":
        return word, bool(word)
    return word, bool(word)


def _default(text: str, attr_type: str):
    """The default value as a Python value of the attribute's type; (None, False) when it is prose."""
    value = text.strip().rstrip(".").strip()
    bare = value.strip("*`\"' ").lower()
    if attr_type.endswith("[]"):
        if bare in ("empty list", "empty", "[]"):
            return [], True
        if bare == "none":
            return None, True
        m = re.fullmatch(r"\[?([^\[\]]*)\]?", value.strip("*`"))
        items = [w for w in re.split(r"\s*,\s*", m.group(1).strip()) if w] if m else []
        converted = [_scalar(w, attr_type) for w in items]
        if items and all(ok for _, ok in converted):
            return [v for v, _ in converted], True
        return None, False
    if attr_type != "string" and bare == "none":
        return None, True
    value, ok = _scalar(value, attr_type)
    return (value, True) if ok else (None, False)


def _enumeration(text: str, para: dn.paragraph, item: dn.list_item, attr_type: str) -> tuple:
    """Allowed values when "Range of values" enumerates them; () for prose ranges."""
    values: list[str] = []
    nested = _sublists(item)
    if nested:
        for sub in nested:
            for entry in sub.children:
                p = _first_paragraph(entry)
                marked = _marked(p) if p is not None else []
                if not marked:
                    return ()
                values.append(marked[0].split()[0] if marked[0].split() else marked[0])
    else:
        body = re.sub(r"\([^()]*\)", "", text).strip().rstrip(".")
        body = re.sub(r"^(?:one of|either)\s+", "", body, flags=re.I)
        words = [w.strip() for w in re.split(r"\s*(?:,|\bor\b)\s*", body) if w.strip()]
        if len(words) < 2:
            return ()
        for w in words:
            bare = w.strip("*`\"'")
            if not re.fullmatch(r"[A-Za-z0-9_][\w.+-]*", bare):
                return ()
            values.append(bare)
    converted = [_scalar(v, attr_type) for v in values]
    if len(values) < 2 or not all(ok for _, ok in converted):
        return ()
    return tuple(v for v, _ in converted)
