"""The ``ngraph`` dialect: nGraph's op pages (``doc/sphinx/source/ops/*.rst``).

Grammar: an RST title (the op name), an optional ``.. code-block:: cpp`` one-liner, a Description
section, grid tables under "Inputs" / "Outputs" (Name, Element Type, Shape [, Notes]) and "Attributes"
(Name, Type, Notes), a Mathematical Definition and a "C++ Interface" with ``.. doxygenclass::``.

How the tables become a schema:

- Every listed input and output is required (nGraph has no optional arguments). A later table in the
  Inputs/Outputs section without a Name column (examples: "``arg`` Shape | ``input_order`` Value") is
  skipped with a warning; an output named like an input is kept, with a warning.
- Element types become type variables: each cell that names types ("real", "any", "Any floating point
  type", ``element::f32`` ``element::f64``, ``ngraph::element::boolean``) starts a variable, and
  "same as ``x``" shares ``x``'s variable (forward references and references to outputs are allowed).
  A cell naming an attribute (``element_type``: the type is chosen by that attribute) and a cell that
  refers to its own row (upstream random_uniform says "Same as ``max_value``" for ``max_value``) start
  an unconstrained variable (any type). Type classes come from :data:`opdef.types.TYPE_CLASSES`;
  variables are named ``T`` when there is one, else ``T1``, ``T2`` ... in order of first appearance.
- Shapes are kept as the document writes them, whitespace folded (``:math:`(C)```, "Same as ``input``").
- An Inputs table with a "Type" column of ``Nodes`` (Concat) is one variadic input.
- Attribute types are normalized: ``double`` -> f64, ``float`` -> f32, ``Shape``/``Strides``/``AxisSet``/
  ``Coordinate*`` (with or without ``[n]``) -> s64[], ``size_t``/``int64_t`` -> s64, ``uint64_t`` -> u64,
  ``bool``/``Boolean`` -> bool, ``std::string`` -> string, ``element::Type`` -> dtype; a table without
  a Type column gives "undefined". Attributes are required unless their notes say "optional" or give a
  default ("default: 1", "defaults to ``true``").
- The version comes from the ``doxygenclass`` namespace (``ngraph::op::v1::Add`` -> 1); ``v0`` and
  unversioned classes are version 1, the first ONNX version.

Stub pages (a title, maybe a code block and a C++ Interface, no tables; e.g. arg_max.rst) yield an
**empty but valid schema**: the name from the title, no inputs, outputs or attributes, and
``("stub", True)`` in ``extra``. A document without a title is a SpecError.

Quirks repaired before docutils sees the text (upstream tables docutils would otherwise misread):
a header separator (``+===+``) whose column joints disagree with the table's top border, and body
rows whose ``|`` separators are shifted off the column joints (cells are re-padded when their
text fits). Anything else malformed (an unparsable table, a missing Name column, a "same as" naming
no argument, an element type that is not one) raises :class:`~opdef.errors.SpecError` with the line.
"""

from __future__ import annotations

import re

import docutils.nodes as dn

from opdef.errors import SpecError
from opdef.rst import parse_rst, table_rows
from opdef.schema import Argument, Attribute, OpSchema, SpecWarning
from opdef.types import ONNX_ELEM_TYPE, TYPE_CLASSES, normalize_type

DOMAIN = "ngraph"
DIALECT = "ngraph"

_NGRAPH_TYPES = {"i8": "s8", "i16": "s16", "i32": "s32", "i64": "s64", "char": "s8"}
_TYPE_PHRASES = (  # (phrase in an element-type cell, types), checked in order
    ("floating", TYPE_CLASSES["real"]),
    ("real", TYPE_CLASSES["real"]),
    ("quantized", ("s8", "u8")),
    ("integ", ("s8", "s16", "s32", "s64", "u8", "u16", "u32", "u64")),
    ("numeric", tuple(t for t in TYPE_CLASSES["any"] if t != "boolean")),
    ("any", TYPE_CLASSES["any"]),
)
_ATTR_TYPES = {
    "double": "f64", "float": "f32", "bool": "bool", "boolean": "bool", "string": "string",
    "std::string": "string", "size_t": "s64", "int64_t": "s64", "int": "s64", "int32_t": "s32",
    "uint64_t": "u64", "uint32_t": "u32", "int64": "s64",
    "shape": "s64[]", "strides": "s64[]", "axisset": "s64[]", "axisvector": "s64[]", "coordinate": "s64[]",
    "coordinatediff": "s64[]", "partialshape": "s64[]",
    "element::type": "dtype", "ngraph::element::type": "dtype", "element_type": "dtype",
}
_IDENT = re.compile(r"[A-Za-z_]\w*")
_QUALIFIED = re.compile(r"(inputs?|outputs?|attributes?)\s*\(([^()]*\S[^()]*)\)\s*:?")

# ----------------------------------------------------------------------------------------------
# dialect detection


def looks_like(text: str) -> float:
    """Score the nGraph page grammar: Name/Element Type grid tables, ``ngraph::`` doxygen classes."""
    if "**Versioned name**" in text:
        return 0.0
    score = 0.0
    if re.search(r"^\s*\.\. doxygenclass::\s*ngraph::", text, re.M):
        score += 0.5
    if re.search(r"^\|\s*Name\s*\|\s*Element [Tt]ype\s*\|", text, re.M):
        score += 0.4
    for section in ("Inputs", "Outputs", "Attributes"):
        if re.search(rf"^{section}\n-{{3,}}\s*$", text, re.M):
            score += 0.03
    return min(score, 1.0)


# ----------------------------------------------------------------------------------------------
# grid-table repair

_BORDER = re.compile(r"^(\s*)\+([-=+]+)\+\s*$")
_ROW = re.compile(r"^(\s*)\|.*\|\s*$")


def repair_grid_tables(text: str) -> str:
    """Align header separators and shifted ``|`` rows with the table's top border (see module doc)."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        if not _BORDER.match(lines[i].rstrip()):
            i += 1
            continue
        end = i + 1
        while end < len(lines) and (_BORDER.match(lines[end].rstrip()) or _ROW.match(lines[end].rstrip())):
            end += 1
        _repair_table(lines, i, end)
        i = end
    return "\n".join(lines)


def _repair_table(lines: list[str], first: int, end: int) -> None:
    top = lines[first].rstrip().replace("=", "-")
    joints = _joints(top, "+")
    for k in range(first + 1, end):
        line = lines[k].rstrip()
        if _ROW.match(line):
            if not _joints(line, "|") <= joints or len(line) != len(top):
                lines[k] = _realign(line, sorted(joints)) or lines[k]
            continue
        fill = "=" if "=" in line else "-"
        if not _joints(line, "+") <= joints or len(line) != len(top):
            lines[k] = top.replace("-", fill)
            continue
        # a joint missing from a border although the rows on both sides are split there
        near = [lines[j].rstrip() for j in (k - 1, k + 1) if first < j < end and _ROW.match(lines[j].rstrip())]
        missing = [j for j in joints if line[j] != "+" and near and all(r[j:j + 1] == "|" for r in near)]
        if missing:
            lines[k] = "".join("+" if j in missing else c for j, c in enumerate(line))


def _joints(line: str, char: str) -> set[int]:
    return {k for k, c in enumerate(line) if c == char}


def _realign(row: str, joints: list[int]) -> str | None:
    """Re-pad a row's cells onto the column joints; None when the cells cannot fit."""
    start = row.index("|")
    cells = row[start + 1:].rstrip()[:-1].split("|")
    if len(cells) != len(joints) - 1 or joints[0] != start:
        return None
    out = row[:start] + "|"
    for cell, (a, b) in zip(cells, zip(joints, joints[1:], strict=False), strict=True):
        width = b - a - 1
        content = cell.rstrip()
        if len(content) > width:
            return None
        out += content.ljust(width) + "|"
    return out


# ----------------------------------------------------------------------------------------------
# parsing


def parse(text: str, source: str, *, include_dirs=()) -> OpSchema:
    tree = parse_rst(repair_grid_tables(text), source)
    top = next(iter(tree.findall(dn.section)), None)
    if top is None or not top.children or not isinstance(top[0], dn.title):
        raise SpecError(source, 1, "expected a title with the op name (e.g. '###\\nAbs\\n###')")
    name = _text(top[0])
    if not _IDENT.fullmatch(name):
        raise SpecError(source, top[0].line or top.line, f"expected an op name as the title, got {name!r}")

    warnings: list[SpecWarning] = []
    sections: dict[str, dn.section] = {}
    for section in tree.findall(dn.section):
        title = _text(section[0])
        key = title.lower().rstrip(":").strip()
        qualified = _QUALIFIED.fullmatch(key)
        key = qualified.group(1) if qualified else key
        key = {"input": "inputs", "output": "outputs", "attribute": "attributes"}.get(key, key)
        if qualified:  # "Outputs (in place)": the section, and the qualifier a user should see
            warnings.append(SpecWarning(source, _title_line(text, section[0].line, title),
                                        f"section heading {title!r} has the qualifier {qualified.group(2).strip()!r}; "
                                        f"read as the section '{key.capitalize()}'"))
        sections.setdefault(key, section)
    tables = {key: _tables(sections[key], source) for key in ("inputs", "outputs", "attributes") if key in sections}

    attributes = _attributes(tables.get("attributes", []), source)
    attr_names = {a.name for a in attributes}
    rows_in = _argument_rows(tables.get("inputs", []), "input", source, warnings)
    rows_out = _argument_rows(tables.get("outputs", []), "output", source, warnings)
    input_names = {r["name"] for r in rows_in}
    for row in rows_out:  # legal (upstream ops that pass a tensor through do it), but easy to misread
        if row["name"] in input_names:
            warnings.append(SpecWarning(source, row["line"], f"output {row['name']!r} has the name of an input; "
                                                             "kept as two arguments"))
    inputs, outputs, constraints = _assign_types(rows_in, rows_out, attr_names, source)

    classes = [m.group(1) for m in re.finditer(r"^\s*\.\. doxygenclass::\s*(\S+)", text, re.M)]
    versions = [int(m.group(1)) for c in classes for m in [re.search(r"::v(\d+)::", c)] if m]
    extra: list[tuple[str, object]] = [("doxygen_classes", tuple(classes))]
    if not any(tables.values()):
        extra.append(("stub", True))
    return OpSchema(
        name=name, domain=DOMAIN, version=max([1, *versions]), dialect=DIALECT,
        description=_description(tree, sections.get("description")),
        inputs=inputs, outputs=outputs, attributes=tuple(attributes), type_constraints=constraints,
        source=source, extra=tuple(extra), warnings=tuple(warnings),
    )


def _title_line(text: str, line: int | None, title: str) -> int | None:
    """The line of a section title's text (docutils gives its underline's)."""
    lines = text.split("\n")
    for k in range(min(line or 0, len(lines)), 0, -1):
        if " ".join(lines[k - 1].split()) == title:
            return k
    return line


def _text(node: dn.Node) -> str:
    return " ".join(node.astext().split())


def _own_children(section: dn.section):
    """Body nodes of a section, not those of its subsections."""
    stack = list(reversed(section.children[1:]))
    while stack:
        node = stack.pop()
        if isinstance(node, dn.section):
            continue
        yield node
        if isinstance(node, dn.Element):
            stack.extend(reversed(node.children))


def _tables(section: dn.section, source: str) -> list[dn.table]:
    found = []
    for node in _own_children(section):
        if isinstance(node, dn.table):
            found.append(node)
        elif isinstance(node, dn.system_message) and node["level"] >= 3 and "table" in node.astext().lower():
            message = node[0].astext() if node.children else node.astext()
            raise SpecError(source, node.get("line"), f"in '{_text(section[0])}': {' '.join(message.split())}")
    return found


def _description(tree: dn.document, section: dn.section | None) -> str:
    if section is not None:
        paragraphs = [_text(p) for p in _own_children(section) if isinstance(p, dn.paragraph)]
        if paragraphs:
            return " ".join(paragraphs)
    for block in tree.findall(dn.literal_block):
        comment = block.astext().partition("//")[2]
        if comment.strip():
            return " ".join(re.sub(r"\n\s*//", " ", comment).split())
    return ""


class _Cell:
    def __init__(self, entry: dn.entry | None) -> None:
        self.text = _text(entry) if entry is not None else ""
        self.raw = " ".join(_raw(entry).split()) if entry is not None else ""
        self.literals = [_text(n) for n in entry.findall(dn.literal)] if entry is not None else []


def _raw(node: dn.Element) -> str:
    """A cell's source text: paragraphs as written (roles kept), lists given back their markers.

    A cell reading "(C)" is an enumerated list to docutils; it is turned back into "(C)".
    """
    parts = []
    for child in node.children:
        if isinstance(child, dn.system_message):
            continue
        if isinstance(child, dn.paragraph):
            parts.append(child.rawsource)
        elif isinstance(child, dn.enumerated_list):
            start = int(child.get("start", 1))
            for k, item in enumerate(child.children):
                label = _ordinal(start + k, child.get("enumtype", "arabic"))
                parts.append(f"{child.get('prefix', '')}{label}{child.get('suffix', '')} {_raw(item)}".strip())
        elif isinstance(child, dn.bullet_list):
            parts.extend(f"{child.get('bullet', '-')} {_raw(item)}".strip() for item in child.children)
        elif isinstance(child, dn.Element) and not isinstance(child, dn.TextElement):
            parts.append(_raw(child))
        else:
            parts.append(child.astext())
    return " ".join(parts)


def _ordinal(n: int, enumtype: str) -> str:
    if enumtype.endswith("alpha"):
        label = chr(ord("a") + n - 1)
    elif enumtype.endswith("roman"):
        label = "".join(r * c for r, c in _roman(n))
    else:
        return str(n)
    return label.upper() if enumtype.startswith("upper") else label


def _roman(n: int):
    for value, numeral in ((1000, "m"), (900, "cm"), (500, "d"), (400, "cd"), (100, "c"), (90, "xc"), (50, "l"),
                           (40, "xl"), (10, "x"), (9, "ix"), (5, "v"), (4, "iv"), (1, "i")):
        count, n = divmod(n, value)
        yield numeral, count


def _table(table: dn.table, what: str, source: str) -> tuple[list[str], list[dict[str, _Cell]], int | None]:
    """Column keys (lower-cased header texts) and body rows as {key: cell}."""
    header, _, line = table_rows(table)
    if not header:
        raise SpecError(source, line, f"expected a header row (Name, ...) in the {what} table")
    keys = [h.lower() for h in header[-1]]
    if "name" not in keys:
        raise SpecError(source, line, f"expected a 'Name' column in the {what} table, got {header[-1]}")
    rows = []
    tbody = next(iter(table.findall(dn.tbody)), None)
    for row in tbody.findall(dn.row) if tbody is not None else []:
        cells: list[_Cell] = []
        for entry in row.findall(dn.entry):
            cells.extend([_Cell(entry)] * (1 + int(entry.get("morecols", 0))))
        cells += [_Cell(None)] * (len(keys) - len(cells))
        rows.append(dict(zip(keys, cells, strict=False)))
    return keys, rows, line


def _has_name_column(table: dn.table) -> bool:
    header, _, _ = table_rows(table)
    return bool(header) and "name" in [h.lower() for h in header[-1]]


def _name(cell: _Cell, what: str, source: str, line: int | None) -> str:
    candidate = (cell.literals[0] if cell.literals else cell.text).strip("`*,.:; ")
    if not _IDENT.fullmatch(candidate):
        raise SpecError(source, line, f"expected an {what} name like ``name`` in the Name column, got {cell.text!r}")
    return candidate


# -- Inputs / Outputs -------------------------------------------------------------------------


def _argument_rows(tables: list[dn.table], what: str, source: str, warnings: list[SpecWarning]) -> list[dict]:
    rows: list[dict] = []
    for k, table in enumerate(tables):
        if k > 0 and not _has_name_column(table):
            # a further table of examples ("``arg`` Shape | ``input_order`` Value | Output Shape"), not arguments
            header, _, line = table_rows(table)
            warnings.append(SpecWarning(source, line, f"table with columns {header[-1] if header else []} after the "
                                                      f"{what}s table has no Name column; read as examples, not "
                                                      f"{what}s"))
            continue
        keys, body, line = _table(table, f"{what}s", source)
        etype_key = next((k for k in keys if k.replace(" ", "") == "elementtype"), None)
        if etype_key is None and "type" not in keys:
            raise SpecError(source, line, f"expected an 'Element Type' column in the {what}s table, got {keys}")
        for row in body:
            row_line = line  # docutils keeps no line for table rows: the table's
            name = _name(row["name"], what, source, row_line)
            if any(r["name"] == name for r in rows):
                raise SpecError(source, row_line, f"{what} {name!r} is listed twice")
            variadic = False
            if etype_key is not None:
                etype = row[etype_key]
            else:  # "Type" column of node kinds (``Nodes``): element types only in the notes
                variadic = bool(re.fullmatch(r"(?:ngraph::)?(?:nodes|nodevector|outputvector|node list)",
                                             row["type"].text.lower().strip("`")))
                etype = None
            notes = row.get("notes") or row.get("description")
            rows.append({"name": name, "etype": etype, "variadic": variadic, "line": row_line,
                         "shape": row["shape"].raw if "shape" in row else None,
                         "description": notes.text if notes is not None else ""})
    return rows


def _element_types(cell: _Cell) -> tuple[str, ...] | None:
    """Concrete or class types named by an element-type cell; None when it names none."""
    words = cell.literals or cell.text.replace(",", " ").split()
    types = []
    for word in words:
        bare = re.sub(r"^(?:ngraph::)?element::", "", word.strip("`,. ")).lower()
        bare = _NGRAPH_TYPES.get(bare, normalize_type(bare))
        if bare not in ONNX_ELEM_TYPE:
            types = []
            break
        types.append(bare)
    if types:
        return tuple(dict.fromkeys(types))
    lowered = cell.text.lower()
    for phrase, classes in _TYPE_PHRASES:
        if re.search(rf"\b{phrase}", lowered):
            return classes
    return None


def _assign_types(rows_in, rows_out, attr_names, source):
    rows = rows_in + rows_out
    by_name: dict[str, int] = {}
    for k, row in enumerate(rows):
        by_name.setdefault(row["name"], k)
    parent = list(range(len(rows)))

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    allowed: dict[int, tuple[str, ...]] = {}
    for k, row in enumerate(rows):
        cell: _Cell | None = row["etype"]
        if cell is None:
            allowed[k] = TYPE_CLASSES["any"]
            continue
        same = re.match(r"same\s+as\s+(.*)", cell.text, re.I)
        if same:
            ref = (cell.literals[0] if cell.literals else (same.group(1).split() or [""])[0]).strip("`,.;:")
            if ref in by_name and by_name[ref] != k:
                parent[find(k)] = find(by_name[ref])
            elif ref == row["name"] or ref in attr_names:
                allowed[k] = TYPE_CLASSES["any"]
            else:
                raise SpecError(source, row["line"], f"{row['name']}: element type {cell.text!r} names no "
                                                     "input, output or attribute")
            continue
        types = _element_types(cell)
        if types is None:
            bare = cell.text.strip("` ")
            if bare in attr_names:
                types = TYPE_CLASSES["any"]
            else:
                raise SpecError(source, row["line"], f"{row['name']}: expected an element type (real, any, "
                                                     f"same as ``x``, element::f32 ...), got {cell.text!r}")
        allowed[k] = types

    group_types: dict[int, tuple[str, ...]] = {}
    order: list[int] = []
    for k in range(len(rows)):
        root = find(k)
        if root not in order:
            order.append(root)
        if k in allowed:  # "same as" rows carry no types, so a group has at most one row that does
            group_types[root] = allowed[k]
    names = {root: ("T" if len(order) == 1 else f"T{i + 1}") for i, root in enumerate(order)}
    args = [Argument(name=r["name"], variadic=r["variadic"], type_var=names[find(k)], description=r["description"],
                     shape=r["shape"]) for k, r in enumerate(rows)]
    constraints = tuple((names[root], group_types.get(root, TYPE_CLASSES["any"])) for root in order)
    return tuple(args[: len(rows_in)]), tuple(args[len(rows_in):]), constraints


# -- Attributes -------------------------------------------------------------------------------

_DEFAULT = re.compile(r"\bdefaults?\b(?:\s+(?:value|is|to|of))*\s*[:=]?\s*(?:``)?([^`\s,;)]+)", re.I)


def _attributes(tables: list[dn.table], source: str) -> list[Attribute]:
    attrs: list[Attribute] = []
    for table in tables:
        keys, body, line = _table(table, "attributes", source)
        for row in body:
            name = _name(row["name"], "attribute", source, line)
            if any(a.name == name for a in attrs):
                raise SpecError(source, line, f"attribute {name!r} is listed twice")
            attr_type = _attr_type(row["type"].text) if "type" in row else "undefined"
            notes_cell = row.get("notes") or row.get("description")
            notes = notes_cell.text if notes_cell is not None else ""
            default = None
            m = _DEFAULT.search(notes)
            if m:
                default = _value(m.group(1).rstrip("."), attr_type)
            required = m is None and not re.search(r"\boptional\b", notes, re.I)
            attrs.append(Attribute(name=name, type=attr_type, required=required, default=default, description=notes))
    return attrs


def _attr_type(spelled: str) -> str:
    bare = spelled.strip().strip("`").strip()
    dims = re.fullmatch(r"(.*?)\s*\[\s*\w*\s*\]", bare)
    base = (dims.group(1) if dims else bare).lower()
    base = re.sub(r"^(?:ngraph::|op::)+", "", base) if base not in _ATTR_TYPES else base
    normalized = _ATTR_TYPES.get(base) or _ATTR_TYPES.get(base.removeprefix("std::"))
    if normalized is None:
        normalized = normalize_type(base) if normalize_type(base) in ONNX_ELEM_TYPE else bare
    if dims and not normalized.endswith("[]"):
        normalized += "[]"
    return normalized


def _value(word: str, attr_type: str):
    if word.lower() in ("true", "false"):
        return word.lower() == "true"
    for convert in (int, float):
        try:
            return convert(word)
        except ValueError:
            pass
    return word
