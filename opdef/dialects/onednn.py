"""The ``onednn`` dialect: oneDNN Graph operation documents (current oneAPI spec RST).

Grammar (any op, not only batch norm), read through docutils (:func:`opdef.rst.parse_rst`):

- the document title is the op name; the paragraphs right under it are the description;
- ``Operation Attributes``: a grid table (Attribute Name / Description / Value Type / Supported Values /
  Required or Optional), or prose ("... does not support any attribute") meaning no attributes;
- ``Execution Arguments`` with ``Inputs`` and ``Outputs`` sections: simple tables (Index / Argument Name /
  Required or Optional); prose instead of a table must say there are none ("This operation has no outputs");
- ``Supported Data Types``: a table whose column headers name arguments (``Src / Diff_dst / Dst``) and
  whose rows are the legal type combinations (a cell ``f32, bf16`` allows either);
- ``@note`` paragraphs: constraints, labelled C1, C2, ... in document order;
- ``|attr_x|`` substitutions, defined by the file the document ``.. include::``-s.

Decisions a reader needs to know:

- Substitutions resolve through definitions in the document itself, then through its include file (the
  ``.. include::`` path relative to the document, else a file of the same name in ``include_dirs``);
  an undefined ``|attr_x|`` reads as the bare name ``x`` (any other undefined ``|y|`` reads as ``y``).
- Argument names: ``src`` (a ``(:math:...)`` suffix is dropped); ``src`` / ``dst`` alternatives become
  ``src/dst``. An argument is variadic when its name is an indexed family (``src_i``) or when a note says
  the op takes an arbitrary/any/variable number of inputs (outputs): then the last input (output) is.
- Attribute types: the Value Type cell normalized (``f32``, ``s64``, ``string``, ``bool`` ...), with
  ``[]`` appended when the type or the Supported Values cell calls the value a list (``A s64 list``).
- Attribute defaults come from the Supported Values cell, in whatever way it marks them: ``X (default)``,
  ``X, (default)`` (the marker after a comma belongs to the value before it), ``(X in default)``,
  ``X by default``, ``X is default``, ``Empty list(default)`` (``[]``), ``a list of X s (default)`` and
  ``all zeros by default`` (a per-axis fill: recorded as the scalar element value ``X``/``0`` on a list
  attribute, meaning "that value on every axis"), and ``none`` as the default of a non-string attribute
  (no default, ``None``). Defaults become Python values of the attribute's type (int, float, bool, str,
  list). Allowed values are the cell's items that are a single literal (``NCX``), or, in a cell of bare
  words only, those words (``True, False``). A required attribute has no default: a ``(default)`` marker
  on it is ignored (upstream StaticReshape carries one by copy-and-paste).
- Type variables: each data-type column is a variable; columns whose types are equal in every legal
  combination are one variable (``Src`` and ``Dst`` of an element-wise op are the same ``T``). One
  variable is named ``T``, several ``T1, T2, ...`` in column order. An argument named in a column header
  (case-insensitively; ``src/dst`` by either alternative) takes that column's variable; an unnamed
  ``diff_X`` takes ``X``'s variable (and ``X`` takes ``diff_X``'s); any other unnamed argument (e.g.
  ``dst`` when the header says ``Src``) takes the first column's variable. Without a data-type table (prose
  such as "arbitrary data type combinations") arguments have no type variable.
- ``## Heading`` lines (Markdown) in an RST page are read as section titles, with a warning; an
  Inputs/Outputs section of prose gives no arguments when a sentence negates and names them ("does not
  support output tensor"); attribute prose that denies nothing gives no attributes, with a warning; a table
  docutils cannot read (cut short, misaligned) is a :class:`SpecError`, never prose.
- Stub pages (a title and prose, no attribute/argument sections and no tables) give an empty but valid
  schema (name, description, no arguments) marked ``extra["stub"] = True``, so a documentation sweep can
  list them; a page that has argument sections but a malformed or missing table is a :class:`SpecError`.
- Anything malformed raises ``SpecError(source, line, what was expected)``: missing columns, a bad
  index sequence, duplicate names, unknown Required/Optional markers, unknown data types, unreadable
  defaults. No partial schema is ever returned.
"""

from __future__ import annotations

import functools
import itertools
import re
from pathlib import Path

import docutils.nodes as nodes

from opdef.errors import SpecError
from opdef.rst import parse_rst
from opdef.schema import Argument, Attribute, Constraint, OpSchema, SpecWarning
from opdef.types import ONNX_ELEM_TYPE, is_known_type, normalize_type

DIALECT = "onednn"
DOMAIN = "onednn"

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_REQUIRED = {"required": True, "mandatory": True, "optional": False}
_NO_ARGUMENTS = ("no input", "no output", "does not have", "does not take", "does not produce", "none")
# A sentence denies arguments when it negates and names them: "End operation does not support output tensor".
_NEGATION = re.compile(r"\b(?:no|not|none|zero|without|never)\b|n't\b", re.I)
_MD_HEADING = re.compile(r"(#{1,6})[ \t]+(\S.*?)[ \t#]*")
_UNDERLINE = re.compile(r"([!-/:-@\[-`{-~])\1{2,}\s*")
_VARIADIC_PHRASES = ("arbitrary number of", "any number of", "variable number of", "variadic")
_ATTR_TYPES = {"bool": "bool", "boolean": "bool", "string": "string", "str": "string", "enum": "string"}


# -- detection -----------------------------------------------------------------------------------------
def looks_like(text: str) -> float:
    """Score how much ``text`` reads like a oneDNN Graph op document (0 = not at all)."""
    if "**Versioned name**" in text:  # the 2022 opset bullet style (opset_v0)
        return 0.0
    if any(line.startswith(("# ", "## ", "### ")) for line in text.splitlines()) and not _rst_title(text):
        return 0.0  # Markdown (DirectML); an RST page may still use a few "## Heading" lines
    lines = [line.strip() for line in text.splitlines()]
    if any(line.startswith("|") and "Element Type" in line for line in lines):  # nGraph argument tables
        return 0.0
    signals = {"Operation Attributes": 0.3, "Execution Arguments": 0.3, "Supported Data Types": 0.2}
    score = sum(weight for title, weight in signals.items() if title in lines)
    if any("Argument Name" in line and "Index" in line for line in lines):
        score += 0.2
    if any("Required or" in line for line in lines):
        score += 0.1
    if any(line.startswith("@note") for line in lines):
        score += 0.05
    if "|attr_" in text:
        score += 0.05
    return min(score, 1.0)


def _rst_title(text: str) -> bool:
    """True when some line is underlined RST-style (``Pow`` over ``###``), as Markdown never does."""
    lines = text.splitlines()
    return any(line.strip() and not line.startswith(" ") and _UNDERLINE.fullmatch(under)
               and len(under.rstrip()) >= len(line.rstrip())
               for line, under in zip(lines, lines[1:], strict=False))


def _markdown_headings(text: str, source: str, warnings: list[SpecWarning]) -> str:
    """Read ``## Operation attributes`` lines (Markdown in an RST page) as RST section titles.

    The heading becomes a title underlined with the adornment the page itself uses at that depth
    (``##`` = the second style in order of first use, ...), written over the blank line that follows
    it so every later line keeps its number; a heading with no blank line after it stays text.
    """
    lines = text.split("\n")
    styles: list[str] = []
    for line, under in zip(lines, lines[1:], strict=False):
        m = _UNDERLINE.fullmatch(under)
        if line.strip() and not line.startswith(" ") and m and m.group(1) not in styles \
                and len(under.rstrip()) >= len(line.rstrip()):
            styles.append(m.group(1))
    spare = [c for c in "*=-~^+'" if c not in styles]
    for i, line in enumerate(lines):
        m = _MD_HEADING.fullmatch(line)
        if m is None:
            continue
        level = len(m.group(1))
        if i + 1 < len(lines) and lines[i + 1].strip():
            warnings.append(SpecWarning(source, i + 1, f"Markdown heading {line.strip()!r} has no blank line "
                                                       "after it; read as text"))
            continue
        while len(styles) < level and spare:
            styles.append(spare.pop(0))
        if len(styles) < level:  # deeper than any adornment left to give it
            warnings.append(SpecWarning(source, i + 1, f"Markdown heading {line.strip()!r} is nested too deep; "
                                                       "read as text"))
            continue
        title = m.group(2)
        lines[i] = title
        if i + 1 < len(lines):
            lines[i + 1] = styles[level - 1] * max(len(title), 3)
        else:
            lines.append(styles[level - 1] * max(len(title), 3))
        warnings.append(SpecWarning(source, i + 1, f"Markdown heading {line.strip()!r} in an RST page; read as "
                                                   f"the section {title!r}"))
    return "\n".join(lines)


# -- entry point ---------------------------------------------------------------------------------------
def parse(text: str, source: str, *, include_dirs=()) -> OpSchema:
    warnings: list[SpecWarning] = []
    if _rst_title(text):
        text = _markdown_headings(text, source, warnings)
    document = parse_rst(text, source)
    _resolve_substitutions(document, source, include_dirs)
    title_section = next((n for n in document.children if isinstance(n, nodes.section)), None)
    if title_section is None:
        raise SpecError(source, 1, "expected a document title naming the op (e.g. 'BatchNormTrainingBackward' "
                                   "over a line of '#')")
    name = _title(title_section)
    if not _OP_NAME.fullmatch(name):
        raise SpecError(source, _line(title_section), f"expected the title to be an op name, got {name!r}")
    description = _description(title_section)
    if not description:  # "General" / "Description" as a subsection of its own (Markdown-headed pages)
        general = next((s for s in title_section.findall(nodes.section)
                        if _title(s).lower() in ("general", "description", "overview")), None)
        description = _description(general) if general is not None else ""

    sections = {_title(s).lower(): s for s in document.findall(nodes.section)}
    attr_section = sections.get("operation attributes") or sections.get("attributes")
    in_section, out_section = sections.get("inputs"), sections.get("outputs")
    args_section = sections.get("execution arguments")
    if attr_section is None and in_section is None and out_section is None and args_section is None \
            and next(iter(document.findall(nodes.table)), None) is None:
        return OpSchema(name=name, domain=DOMAIN, version=1, dialect=DIALECT, description=description,
                        source=source, extra=(("stub", True),), warnings=tuple(warnings))
    if in_section is None or out_section is None:
        where = _line(args_section) if args_section is not None else _line(title_section)
        missing = "Inputs" if in_section is None else "Outputs"
        raise SpecError(source, where, f"expected an '{missing}' section with an Index / Argument Name / "
                                       "Required or Optional table")

    _check_tables(document, source)
    attributes = _attributes(attr_section, source, warnings) if attr_section is not None else ()
    notes = _notes(document)
    inputs = _arguments(in_section, "input", source)
    outputs = _arguments(out_section, "output", source)
    inputs, outputs = _mark_variadic(inputs, "input", notes), _mark_variadic(outputs, "output", notes)
    dtype_section = sections.get("supported data types") or sections.get("data types")
    type_info = _data_types(dtype_section, inputs + outputs, source) if dtype_section is not None else None
    type_constraints, type_combinations = (), ()
    if type_info is not None:
        assign, type_constraints, type_combinations = type_info
        inputs = tuple(_with_var(a, assign) for a in inputs)
        outputs = tuple(_with_var(a, assign) for a in outputs)
    arg_names = [a.name for a in inputs + outputs]
    constraints = tuple(Constraint(f"C{i}", text, _mentions(text, arg_names))
                        for i, (text, _line_no) in enumerate(notes, start=1))
    return OpSchema(name=name, domain=DOMAIN, version=1, dialect=DIALECT, description=description,
                    inputs=inputs, outputs=outputs, attributes=attributes, type_constraints=type_constraints,
                    type_combinations=type_combinations, constraints=constraints, source=source,
                    warnings=tuple(warnings))


# -- substitutions -------------------------------------------------------------------------------------
def _resolve_substitutions(document: nodes.document, source: str, include_dirs) -> None:
    """Replace every ``|name|`` reference by its text (see the module docstring for the lookup order)."""
    defs = {name: _fold(node.astext()) for name, node in document.substitution_defs.items()}
    for path in _include_paths(document, source, include_dirs):
        for name, value in _include_definitions(str(path)).items():
            defs.setdefault(name, value)
    for ref in list(document.findall(nodes.substitution_reference)):
        refname = ref.get("refname", ref.astext())
        value = defs.get(refname)
        if value is None:
            value = refname[len("attr_"):] if refname.startswith("attr_") else refname
        ref.parent.replace(ref, nodes.Text(value))


def _include_paths(document: nodes.document, source: str, include_dirs) -> list[Path]:
    """Files named by ``.. include::`` (docutils leaves each disabled directive as a system message)."""
    found = []
    for message in document.findall(nodes.system_message):
        for block in message.findall(nodes.literal_block):
            directive = block.astext().strip()
            if not directive.startswith(".. include::"):
                continue
            target = (directive[len(".. include::"):].strip().splitlines() or [""])[0].strip()
            if not target:
                raise SpecError(source, message.get("line"), "expected a file name after '.. include::'")
            candidates = [Path(source).parent / target] if source and not source.startswith("<") else []
            candidates += [Path(d) / Path(target).name for d in include_dirs]
            resolved = next((c for c in candidates if c.is_file()), None)
            if resolved is not None:
                found.append(resolved.resolve())
    return found


@functools.lru_cache(maxsize=16)
def _include_definitions(path: str) -> dict[str, str]:
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(path, None, f"cannot read the included substitution file: {exc}") from None
    included = parse_rst(text, path)
    return {name: _fold(node.astext()) for name, node in included.substitution_defs.items()}


# -- document structure --------------------------------------------------------------------------------
def _title(section: nodes.section) -> str:
    title = next((n for n in section.children if isinstance(n, nodes.title)), None)
    return _fold(title.astext()) if title is not None else ""


def _description(section: nodes.section) -> str:
    paragraphs = []
    for node in section.children:
        if isinstance(node, (nodes.title, nodes.comment, nodes.system_message, nodes.substitution_definition,
                             nodes.target)):
            continue
        if not isinstance(node, nodes.paragraph) or node.astext().startswith("@note"):
            break
        paragraphs.append(_fold(node.astext()))
    return "\n\n".join(paragraphs)


def _own_tables(section: nodes.section) -> list[nodes.table]:
    """Tables of this section, not of its subsections."""
    tables = []
    for table in section.findall(nodes.table):
        owner = table.parent
        while owner is not None and not isinstance(owner, nodes.section):
            owner = owner.parent
        if owner is section:
            tables.append(table)
    return tables


def _check_tables(document: nodes.document, source: str) -> None:
    """A table docutils could not read (cut short, misaligned) is an error, never prose that loses its rows."""
    for message in document.findall(nodes.system_message):
        text = _fold(message.astext())
        if message.get("level", 0) >= 3 and "table" in text.lower():
            what = text.split(" ", 1)[1] if text.startswith("<") else text
            what = what.split(". ")[0].split(") ", 1)[-1]
            raise SpecError(source, message.get("line"), f"expected a well-formed table: {what}")


def _own_prose(section: nodes.section) -> str:
    """The section's own paragraphs, without its ``@note`` constraints (they say what is not allowed)."""
    return " ".join(_fold(p.astext()) for p in section.children
                    if isinstance(p, nodes.paragraph) and not p.astext().startswith("@note"))


def _notes(document: nodes.document) -> list[tuple[str, int | None]]:
    notes = []
    for paragraph in document.findall(nodes.paragraph):
        text = _fold(paragraph.astext())
        if text.startswith("@note"):
            notes.append((text[len("@note"):].strip(), _line(paragraph)))
    return notes


def _mentions(text: str, arg_names: list[str]) -> tuple[str, ...]:
    """Argument names a note mentions, in order of first mention (``src/dst`` by either alternative)."""
    by_word = {}
    for name in arg_names:
        for alternative in name.split("/"):
            by_word.setdefault(alternative, name)
    mentioned = []
    for word in _IDENT.findall(text):
        name = by_word.get(word)
        if name is not None and name not in mentioned:
            mentioned.append(name)
    return tuple(mentioned)


# -- tables --------------------------------------------------------------------------------------------
class _Table:
    """A docutils table as header texts (one per column) and body rows of entry nodes, with lines."""

    def __init__(self, table: nodes.table, source: str) -> None:
        self.line = _line(table)
        head = next(iter(table.findall(nodes.thead)), None)
        body = next(iter(table.findall(nodes.tbody)), None)
        head_rows = [cells for _, cells in _entry_rows(head)] if head is not None else []
        width = max((len(cells) for cells in head_rows), default=0)
        self.header = [_fold(" ".join(_fold(r[i].astext()) for r in head_rows if i < len(r)))
                       for i in range(width)]
        self.rows = _entry_rows(body) if body is not None else []
        for line, cells in self.rows:
            if len(cells) != width:
                raise SpecError(source, line or self.line, f"expected {width} cells in this table row "
                                                           f"({' | '.join(self.header)}), found {len(cells)}")

    def column(self, source: str, what: str, *accepted: str, required: bool = True) -> int | None:
        """Index of the first column whose header starts with one of ``accepted`` (case-insensitive)."""
        for i, head in enumerate(self.header):
            if head.lower().startswith(accepted):
                return i
        if required:
            raise SpecError(source, self.line, f"expected a {what} column ({accepted[0]!r}) in the table "
                                               f"with columns {self.header}")
        return None


def _entry_rows(part) -> list[tuple[int | None, list[nodes.entry]]]:
    rows = []
    for row in part.findall(nodes.row):
        cells = []
        for entry in row.findall(nodes.entry):
            cells.extend([entry] * (1 + int(entry.get("morecols", 0))))
        rows.append((_line(row), cells))
    return rows


# -- attributes ----------------------------------------------------------------------------------------
def _attributes(section: nodes.section, source: str, warnings: list[SpecWarning]) -> tuple[Attribute, ...]:
    tables = [_Table(t, source) for t in _own_tables(section)]
    if not tables:  # prose: "... does not support any attribute"
        prose = _own_prose(section)
        if not _denies(prose, "attribute"):
            warnings.append(SpecWarning(source, _line(section), "no attribute table and no sentence saying there "
                                                                f"are no attributes; read as none: {prose[:60]!r}"))
        return ()
    attributes: list[Attribute] = []
    for table in tables:
        name_col = table.column(source, "attribute name", "attribute", "name")
        type_col = table.column(source, "value type", "value type", "type")
        req_col = table.column(source, "required or optional", "required", "optional")
        values_col = table.column(source, "supported values", "supported", "values", required=False)
        desc_col = table.column(source, "description", "description", required=False)
        for line, cells in table.rows:
            line = line or table.line
            name = _fold(cells[name_col].astext())
            if not _IDENT.fullmatch(name):
                raise SpecError(source, line, f"expected an attribute name, got {name!r}")
            if any(a.name == name for a in attributes):
                raise SpecError(source, line, f"attribute {name!r} is listed twice")
            required = _required_marker(cells[req_col], source, line)
            values = cells[values_col] if values_col is not None else None
            attr_type = _attribute_type(_fold(cells[type_col].astext()), values, source, line)
            default, allowed = _supported_values(values, attr_type, source, line) if values is not None \
                else (None, ())
            description = _fold(cells[desc_col].astext()) if desc_col is not None else ""
            attributes.append(Attribute(name=name, type=attr_type, required=required,
                                        default=None if required else default, allowed_values=allowed,
                                        description=description))
    return tuple(attributes)


def _attribute_type(cell: str, values: nodes.entry | None, source: str, line: int) -> str:
    words = cell.lower().replace("[]", " list ").replace(",", " ").split()
    is_list = "list" in words or (values is not None and "list" in _IDENT.findall(values.astext().lower()))
    base = [w for w in words if w not in ("list", "of", "a")]
    if len(base) != 1:
        raise SpecError(source, line, f"expected one value type (f32, s64, string, bool ...), got {cell!r}")
    spelled = _ATTR_TYPES.get(base[0]) or normalize_type(base[0])
    if spelled not in ONNX_ELEM_TYPE and spelled not in ("bool", "string"):
        raise SpecError(source, line, f"expected a value type (f32, s64, string, bool ...), got {cell!r}")
    if spelled == "boolean":
        spelled = "bool"
    # a string attribute whose Supported Values merely mention a list stays one string; the Value Type cell
    # itself saying ``string[]`` (or "list of string") makes it a list
    return spelled + "[]" if is_list and (spelled != "string" or "list" in words) else spelled


def _required_marker(entry: nodes.entry, source: str, line: int) -> bool:
    text = _fold(entry.astext())
    word = text.split()[0].strip(".*:;,()").lower() if text else ""
    if word not in _REQUIRED:
        raise SpecError(source, line, f"expected 'Required' or 'Optional', got {text!r}")
    return _REQUIRED[word]


def _supported_values(entry: nodes.entry, attr_type: str, source: str, line: int):
    """(default, allowed values) from a Supported Values cell (forms listed in the module docstring)."""
    items = _cell_items(entry)
    default_raw, fill = None, False
    for i, (text, literals) in enumerate(items):
        plain, marked = _strip_default_marker(text)
        if not marked:
            continue
        if literals:
            default_raw = literals[-1]
            fill = "list of" in text.lower()
        elif plain == "" and _after_default(text):  # "default is 4", "default: NXC"
            default_raw = _after_default(text)
        elif plain == "" and i > 0:  # "``numpy``, (default)": the marker belongs to the value before it
            default_raw = _strip_default_marker(items[i - 1][0])[0]
        else:
            default_raw, fill = _bare_default(plain)
    allowed = tuple(_convert(v, attr_type, source, line, element=True) for v in _enumeration(items))
    if default_raw is None or (attr_type != "string" and default_raw.lower() == "none"):
        return None, allowed
    return _convert(default_raw, attr_type, source, line, element=fill), allowed


def _enumeration(items: list[tuple[str, list[str]]]) -> list[str]:
    """The values a cell enumerates: every item one literal (or a bare marker), or bare words only."""
    pairs = [(_strip_default_marker(text)[0], literals) for text, literals in items]
    if all(v == "" or (len(lits) == 1 and v == lits[0]) for v, lits in pairs):
        return [v for v, _ in pairs if v]
    if len(pairs) > 1 and all(not lits and _IDENT.fullmatch(v) for v, lits in pairs):
        return [v for v, _ in pairs]
    return []


def _cell_items(entry: nodes.entry) -> list[tuple[str, list[str]]]:
    """Split a cell at top-level commas and sentence ends: [(item text, literals in the item)]."""
    items: list[tuple[str, list[str]]] = []
    text, literals, depth = "", [], 0
    for node in entry.findall(lambda n: isinstance(n, (nodes.Text, nodes.literal))
                              and not isinstance(n.parent, nodes.literal)):
        if isinstance(node, nodes.literal):
            literals.append(_fold(node.astext()))
            text += literals[-1]
            continue
        chars = node.astext()
        for k, char in enumerate(chars):
            depth += (char in "([{") - (char in ")]}")
            sentence_end = char == "." and (k + 1 == len(chars) or chars[k + 1].isspace())
            if depth <= 0 and (char == "," or sentence_end):
                if _fold(text):
                    items.append((_fold(text), literals))
                text, literals = "", []
            else:
                text += char
    if _fold(text):
        items.append((_fold(text), literals))
    return items


_DEFAULT_MARKERS = ("(default)", "(in default)", "in default)", "(default", "by default", "is the default",
                    "is default", "as default", "default")


def _strip_default_marker(text: str) -> tuple[str, bool]:
    """``'NXC (default)'`` -> ``('NXC', True)``; ``'(``1`` in default)'`` -> ``('1', True)``."""
    low = text.lower()
    if "default" not in low:
        return text.strip(), False
    for marker in _DEFAULT_MARKERS:
        at = low.find(marker)
        if at >= 0:
            before = text[:at].strip().strip("(").strip()
            return before, True
    return text.strip(), True


def _after_default(text: str) -> str:
    """The value after the word in ``default is X`` / ``default: X`` / ``default value = X`` ('' if none)."""
    words = text[text.lower().find("default") + len("default"):].replace(":", " ").replace("=", " ").split()
    words = [w for w in words if w.lower() not in ("is", "value", "of", "(", ")")]
    return words[0].strip("()") if words else ""


def _bare_default(text: str) -> tuple[str, bool]:
    """The default written without literal markup: ``-1 is default``, ``Empty list``, ``all zeros``."""
    low = text.lower().strip()
    if low in ("empty list", "an empty list", "empty", "[]"):
        return "[]", False
    if low in ("all zeros", "all zeroes", "zeros"):
        return "0", True
    if low in ("all ones", "ones"):
        return "1", True
    words = text.split()
    return (words[-1] if words else text), False


def _convert(raw: str, attr_type: str, source: str, line: int, *, element: bool = False):
    base = attr_type[:-2] if attr_type.endswith("[]") else attr_type
    value = raw.strip()
    if attr_type.endswith("[]") and not element:
        inner = value.strip("[]").strip()
        if value.startswith("[") or value == "[]":
            return [_convert(v, base, source, line) for v in inner.split(",")] if inner else []
        return [_convert(value, base, source, line)]
    try:
        if base == "bool":
            if value.lower() in ("true", "false"):
                return value.lower() == "true"
            raise ValueError(value)
        if base == "string":
            return value
        if base.startswith(("s", "u")):
            return int(value)
        return float(value)
    except ValueError:
        raise SpecError(source, line, f"expected a {base} value in the Supported Values cell, got {value!r}") \
            from None


# -- execution arguments -------------------------------------------------------------------------------
def _arguments(section: nodes.section, kind: str, source: str) -> tuple[Argument, ...]:
    tables = _own_tables(section)
    if not tables:
        prose = _own_prose(section).lower()
        if prose and (any(phrase in prose for phrase in _NO_ARGUMENTS) or _denies(prose, kind)):
            return ()
        raise SpecError(source, _line(section), f"expected an {kind}s table (Index / Argument Name / Required "
                                                f"or Optional) or a sentence saying there are no {kind}s")
    arguments: list[Argument] = []
    first_index = None
    for raw in tables:
        table = _Table(raw, source)
        index_col = table.column(source, "index", "index")
        name_col = table.column(source, "argument name", "argument name", "argument", "name")
        req_col = table.column(source, "required or optional", "required", "optional")
        for line, cells in table.rows:
            line = line or table.line
            index_text = _fold(cells[index_col].astext())
            if not index_text.isdigit():
                raise SpecError(source, line, f"expected an integer {kind} index, got {index_text!r}")
            if first_index is None:
                first_index = int(index_text)
                if first_index not in (0, 1):
                    raise SpecError(source, line, f"expected {kind} indices to start at 0, got {first_index}")
            expected = first_index + len(arguments)
            if int(index_text) != expected:
                raise SpecError(source, line, f"expected {kind} index {expected} (indices in order), "
                                              f"got {index_text}")
            name = _argument_name(cells[name_col], source, line)
            if any(a.name == name for a in arguments):
                raise SpecError(source, line, f"{kind} {name!r} is listed twice")
            optional = not _required_marker(cells[req_col], source, line)
            arguments.append(Argument(name=name, optional=optional, variadic=name.endswith("_i")))
    return tuple(arguments)


def _denies(prose: str, kind: str) -> bool:
    """Some sentence negates and names ``kind`` ("has no output tensor", "doesn't support any attribute")."""
    for sentence in re.split(r"(?<=[.;!])\s+", prose):
        if _NEGATION.search(sentence) and re.search(rf"\b{kind}s?\b", sentence, re.I):
            return True
    return False


def _argument_name(entry: nodes.entry, source: str, line: int) -> str:
    """``src`` / ``gamma (:math:`...`)`` -> ``gamma`` / ``src`` / ``dst`` -> ``src/dst``."""
    text = "".join(t.astext() for t in entry.findall(nodes.Text)
                   if not any(isinstance(p, nodes.math) for p in _ancestors(t)))
    text = _fold(text)
    if "(" in text:
        text = text[: text.index("(")].strip()
    parts = [p.strip() for p in text.split("/")]
    if not all(_IDENT.fullmatch(p) for p in parts):
        raise SpecError(source, line, f"expected an argument name, got {_fold(entry.astext())!r}")
    return "/".join(parts)


def _ancestors(node):
    node = node.parent
    while node is not None:
        yield node
        node = node.parent


def _mark_variadic(arguments, kind: str, notes) -> tuple[Argument, ...]:
    """A note saying the op takes an arbitrary number of inputs (outputs) makes the last one variadic."""
    if not arguments or arguments[-1].variadic:
        return arguments
    for text, _ in notes:
        low = text.lower()
        for phrase in _VARIADIC_PHRASES:
            at = low.find(phrase)
            if at >= 0 and kind in low[at:].split(".")[0]:
                last = arguments[-1]
                return arguments[:-1] + (Argument(last.name, last.optional, True),)
    return arguments


# -- data types ----------------------------------------------------------------------------------------
def _data_types(section: nodes.section, arguments, source: str):
    """(argument -> type var, type_constraints, type_combinations), or None for prose only."""
    tables = [_Table(t, source) for t in _own_tables(section)]
    if not tables:
        return None
    header = tables[0].header
    combos: list[tuple[str, ...]] = []
    for table in tables:
        if [h.lower() for h in table.header] != [h.lower() for h in header]:
            raise SpecError(source, table.line, f"expected the data-type tables to share the columns {header}, "
                                                f"got {table.header}")
        for line, cells in table.rows:
            line = line or table.line
            choices = [_types_in_cell(cell, source, line) for cell in cells]
            combos.extend(c for c in itertools.product(*choices) if c not in combos)
    if not combos:
        raise SpecError(source, tables[0].line, "expected at least one row of data types")

    # Columns equal in every legal combination are one variable.
    group = list(range(len(header)))
    for j in range(len(header)):
        for i in range(j):
            if group[i] == i and all(c[i] == c[j] for c in combos):
                group[j] = i
                break
    leaders = sorted(set(group))
    names = {lead: "T" if len(leaders) == 1 else f"T{k}" for k, lead in enumerate(leaders, start=1)}
    column_var = [names[group[j]] for j in range(len(header))]

    named: dict[str, str] = {}
    for j, head in enumerate(header):
        for word in head.split("/"):
            named.setdefault(word.strip().lower(), column_var[j])
    assign = {}
    for arg in arguments:
        alternatives = [a.lower() for a in arg.name.split("/")]
        var = next((named[a] for a in alternatives if a in named), None)
        if var is None:
            for a in alternatives:
                partner = a[len("diff_"):] if a.startswith("diff_") else "diff_" + a
                if partner in named:
                    var = named[partner]
                    break
        assign[arg.name] = var or column_var[0]

    constraints = []
    for lead in leaders:
        allowed = []
        for c in combos:
            if c[lead] not in allowed:
                allowed.append(c[lead])
        constraints.append((names[lead], tuple(allowed)))
    combinations = tuple(tuple((names[lead], c[lead]) for lead in leaders) for c in combos)
    combinations = tuple(dict.fromkeys(combinations))
    return assign, tuple(constraints), combinations


def _types_in_cell(entry: nodes.entry, source: str, line: int) -> list[str]:
    spelled = [t.strip() for t in _fold(entry.astext()).split(",")]
    if not all(spelled):
        raise SpecError(source, line, f"expected data types (e.g. 'f32, bf16') in every cell, got "
                                      f"{_fold(entry.astext())!r}")
    types = [normalize_type(t) for t in spelled]
    for written, t in zip(spelled, types, strict=True):
        if not is_known_type(t):
            raise SpecError(source, line, f"expected a data type (f32, bf16, f16, s32, s8, u8 ..., seq(f32)), "
                                          f"got {written!r}")
    return types


def _with_var(arg: Argument, assign: dict[str, str]) -> Argument:
    return Argument(name=arg.name, optional=arg.optional, variadic=arg.variadic, type_var=assign.get(arg.name))


# -- small helpers -------------------------------------------------------------------------------------
def _fold(text: str) -> str:
    return " ".join(text.split())


def _line(node) -> int | None:
    if node is None:
        return None
    if getattr(node, "line", None):
        return node.line
    for child in node.findall():
        if getattr(child, "line", None):
            return child.line
    return None
