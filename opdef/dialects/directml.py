"""The ``directml`` dialect: DirectML operator-description pages (Markdown).

Two spellings of one grammar are read:

* the upstream *source* files (``sdk-api-src/content/directml/ns-directml-*.md``): YAML front matter
  (``title``, ``api_name`` ...), ``## -description``, ``## -struct-fields`` with one ``### -field Name``
  per struct member; older files add an H1 (``# DML_X_OPERATOR_DESC structure``), blank-line padding and
  HTML (``<b><a href=...>FLOAT</a></b>`` type lines, ``<table>`` tables);
* the *rendered* page (seed 003): no front matter, ``## Members`` with ``### `Name```; the struct name
  appears only in bold in the text, or in a ``struct DML_..._DESC { ... }`` syntax block.

Both continue with ``## Availability``, ``## Tensor constraints`` (bullets or paragraphs) and
``## Tensor support`` pipe tables (Tensor, Kind, [Dimensions,] Supported dimension counts, Supported
data types), possibly one table per ``DML_FEATURE_LEVEL_x_y and above`` heading, possibly grouped under
further headings (``### ARGMIN and ARGMAX`` in DML_REDUCE).

Choices (DESIGN.md section 3):

* name: ``api_name`` > ``title`` > H1 > syntax-block struct > an unlinked bold ``**DML_..._DESC**`` > the
  file name (``ns-directml-dml_x_operator_desc.md``); the schema name drops ``DML_`` and
  ``_OPERATOR_DESC``; the full struct name is ``extra["struct_name"]``. No name found: SpecError.
* version is always 1; the feature level that introduced the op is ``extra["feature_level"]``
  (``DML_FEATURE_LEVEL_3_1``). Feature levels are not ONNX opset versions.
* members of type ``DML_TENSOR_DESC`` are arguments in struct order; the tables' Kind column says input
  or output (``Optional input``, ``Array of inputs`` ...). A tensor no table names is an output when its
  name starts with ``Output`` (old pages have no tables); ``extra["kind_guessed"]`` lists those. A table
  row whose name matches no member is paired, in order, with the tensor members no row names (upstream
  relu_grad calls its ``OutputTensor`` member ``OutputGradientTensor`` in the tables); the pairs are
  ``extra["aliases"]`` and constraint bullets are read through them. Rows left over: SpecError.
* optional: ``_Maybenull_``/``_Field_size_opt_`` in the type, "optional"/"may be null"/"can be null" in
  the member text, or an ``Optional`` Kind. Attributes (every other member) are required otherwise and
  keep the struct member's name; types: FLOAT -> f32, UINT -> u32, INT -> s32, BOOL -> bool ..., enums
  and structs keep their C name, pointers to scalars or ``_Field_size_`` arrays get ``[]``.
* tables: per tensor the *union* over every table (feature levels are cumulative, "and above", so the
  union is what the newest level supports; across function groups it is what some function supports):
  types in first-seen order, min/max rank, the first Dimensions cell as ``shape``. Each table's rows are
  kept per heading path in ``extra["tensor_support"]``.
* constraints: every bullet (or paragraph) of "Tensor constraints" is a Constraint C1, C2 ... in
  document order, with the tensors it names. Bullets saying "the same *DataType*" merge the tensors
  they name into one type variable; each other tensor gets its own. One variable is named ``T``,
  several ``T1``, ``T2`` ... in argument order. The allowed types are the intersection of the members'
  table types (the union, noted in ``extra["type_conflicts"]``, when the document contradicts itself).
* a page with no members (a stub) yields an empty but valid schema with its name; with no member
  section but tensor tables, the tables' rows are the arguments (``extra["members_from"] == "table"``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from markdown_it import MarkdownIt
from markdown_it.token import Token

from opdef.errors import SpecError
from opdef.schema import Argument, Attribute, Constraint, OpSchema, SpecWarning
from opdef.types import normalize_type

DOMAIN = "directml"
DIALECT = "directml"

_IDENT = re.compile(r"[A-Za-z_]\w*")
_DML_NAME = re.compile(r"\bDML_[A-Z0-9_]*DESC\b")
_OPERATOR_NAME = re.compile(r"DML_[A-Z0-9_]*OPERATOR[A-Z0-9_]*_DESC")  # not DML_OPERATOR_DESC itself
_FEATURE_LEVEL = re.compile(r"DML_FEATURE_LEVEL_\d+_\d+")
_SAL = re.compile(r"\s*(_[A-Za-z][A-Za-z_]*_)\s*(?:\(([^)]*)\))?")
_C_TYPE = re.compile(r"(?:(?:const|struct)\s+)*([A-Za-z_]\w*)\s*((?:\*|\bconst\b|\s)*)(.*)$")
_OPTIONAL_TEXT = re.compile(r"(?<!not )\boptional\b|\b(?:may|can)\s+be\s+(?:null|nullptr|NULL)\b", re.I)
_FORMULA = re.compile(r"\s*[A-Za-z_]\w*\s*=\s*\S")
_STRUCT_BLOCK = re.compile(r"struct\s+(DML_\w+)\s*\{(.*?)\}", re.S)

# C scalar types of struct members -> the schema's type spelling.
_C_SCALARS = {
    "FLOAT": "f32", "float": "f32", "DOUBLE": "f64", "double": "f64",
    "UINT": "u32", "UINT32": "u32", "INT": "s32", "INT32": "s32", "int": "s32",
    "UINT64": "u64", "INT64": "s64", "UINT16": "u16", "INT16": "s16", "UINT8": "u8", "INT8": "s8",
    "BYTE": "u8", "SIZE_T": "u64", "BOOL": "bool", "bool": "bool",
}
_TENSOR_TYPE = "DML_TENSOR_DESC"


# ------------------------------------------------------------------------------------------------
# detection

def looks_like(text: str) -> float:
    """> 0 when the text is a DirectML operator page (source or rendered form)."""
    if re.search(r"^## -struct-fields\s*$|^### -field \w", text, re.M):
        return 1.0
    has_tensor_desc = "DML_TENSOR_DESC" in text
    has_members = re.search(r"^##\s+Members\s*$", text, re.M) is not None
    has_support = re.search(r"^#{2,6}\s+Tensor support", text, re.M) is not None
    if not (has_tensor_desc or has_members or has_support):
        return 0.0
    rst = re.search(r"^\.\. [\w:-]+::|^(={3,}|-{3,}|~{3,}|\#{3,})\s*$", text, re.M) and not re.search(
        r"^#{1,6} ", text, re.M)
    if rst:
        return 0.0
    return 0.4 * has_tensor_desc + 0.3 * has_members + 0.3 * has_support


# ------------------------------------------------------------------------------------------------
# text -> rows

@dataclass
class _Inline:
    text: str
    emphasized: list[str]
    bold_unlinked: list[str]


@dataclass
class _Block:
    kind: str  # heading | para | item | code | table
    line: int
    text: str = ""
    level: int = 0
    info: str = ""  # code fence language
    inline: _Inline | None = None
    header: list[str] = field(default_factory=list)
    rows: list[tuple[int, list[str]]] = field(default_factory=list)


@dataclass
class _Member:
    name: str
    line: int
    type_text: str | None = None
    type_line: int | None = None
    description: str = ""
    formulas: list[str] = field(default_factory=list)


@dataclass
class _Table:
    label: str
    line: int
    rows: list[dict[str, Any]]


def _render_inline(tok: Token) -> _Inline:
    """Plain text of an inline token; also the emphasized spans and the bold spans outside links."""
    out: list[str] = []
    stack: list[tuple[str, int, int]] = []  # (kind, start offset, links opened before it)
    emphasized: list[str] = []
    bold: list[str] = []
    link_depth = links_seen = 0

    def open_(kind: str) -> None:
        stack.append((kind, len("".join(out)), links_seen if link_depth == 0 else -1))

    def close(kind: str) -> None:
        for i in range(len(stack) - 1, -1, -1):
            if stack[i][0] == kind:
                _, start, links_before = stack.pop(i)
                span = "".join(out)[start:].strip()
                if kind == "em":
                    emphasized.append(span)
                elif links_before == links_seen and link_depth == 0:  # no link around or inside it
                    bold.append(span)
                return

    for c in tok.children or ():
        t = c.type
        if t in ("text", "code_inline"):
            out.append(c.content)
        elif t == "softbreak":
            out.append("\n")
        elif t == "hardbreak":
            out.append("\n")
        elif t == "em_open":
            open_("em")
        elif t == "em_close":
            close("em")
        elif t == "strong_open":
            open_("strong")
        elif t == "strong_close":
            close("strong")
        elif t == "link_open":
            link_depth += 1
            links_seen += 1
        elif t == "link_close":
            link_depth = max(0, link_depth - 1)
        elif t == "image":
            out.append(c.content)
        elif t == "html_inline":
            tag = c.content.strip().lower()
            m = re.match(r"<(/?)([a-z0-9]+)", tag)
            if not m:
                continue
            closing, name = m.group(1) == "/", m.group(2)
            if name == "br":
                out.append("\n")
            elif name in ("b", "strong"):
                close("strong") if closing else open_("strong")
            elif name in ("i", "em"):
                close("em") if closing else open_("em")
            elif name == "a" and closing:
                link_depth = max(0, link_depth - 1)
            elif name == "a":
                link_depth += 1
                links_seen += 1
    return _Inline("".join(out), emphasized, bold)


class _HtmlTables(HTMLParser):
    """Rows of ``<table>`` markup: [(line within the block, [cell text]), ...], header flags."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tables: list[list[tuple[int, bool, list[str]]]] = []
        self.text: list[str] = []
        self._row: list[str] | None = None
        self._row_line = 0
        self._row_header = False
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self._row, self._row_line, self._row_header = [], self.getpos()[0], False
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
            self._row_header |= tag == "th"
        elif tag == "br" and self._cell is not None:
            self._cell.append(" ")

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "tr" and self._row is not None and self.tables:
            self.tables[-1].append((self._row_line, self._row_header, self._row))
            self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        else:
            self.text.append(data)


def _split_front_matter(text: str, source: str) -> tuple[dict[str, Any], str]:
    """Front matter as {key: str | list[str]}; the body keeps its line numbers (front matter blanked)."""
    lines = text.split("\n")
    if not lines or lines[0].strip() != "---":
        return {}, text
    end = next((i for i in range(1, len(lines)) if lines[i].strip() == "---"), None)
    if end is None:
        raise SpecError(source, 1, "front matter opened by '---' is never closed by a '---' line")
    meta: dict[str, Any] = {}
    key = None
    for i in range(1, end):
        line = lines[i]
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        item = re.match(r"\s*-\s+(.*)$", line)
        if item and key is not None:
            if not isinstance(meta[key], list):
                meta[key] = [meta[key]] if meta[key] else []
            meta[key].append(item.group(1).strip().strip("'\""))
            continue
        if line[0] in " \t" and key is not None and isinstance(meta[key], str):
            meta[key] = (meta[key] + " " + line.strip()).strip()
            continue
        kv = re.match(r"([\w.\-]+)\s*:(.*)$", line)
        if not kv:
            raise SpecError(source, i + 1, f"front matter: expected 'key: value' or '- item', got {line.strip()!r}")
        key = kv.group(1)
        meta[key] = kv.group(2).strip().strip("'\"")
    body = "\n" * (end + 1) + "\n".join(lines[end + 1:])
    return meta, body


def _blocks(body: str) -> list[_Block]:
    """The document's block structure, flattened, with 1-based line numbers."""
    tokens = MarkdownIt("commonmark").enable("table").parse(body)
    blocks: list[_Block] = []
    list_depth = 0
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        line = tok.map[0] + 1 if tok.map else 0
        t = tok.type
        if t in ("bullet_list_open", "ordered_list_open"):
            list_depth += 1
        elif t in ("bullet_list_close", "ordered_list_close"):
            list_depth -= 1
        elif t == "heading_open":
            inl = _render_inline(tokens[i + 1])
            blocks.append(_Block("heading", line, " ".join(inl.text.split()), level=int(tok.tag[1:]), inline=inl))
            i += 2
        elif t == "paragraph_open":
            inl = _render_inline(tokens[i + 1])
            blocks.append(_Block("item" if list_depth else "para", line, inl.text, inline=inl))
            i += 2
        elif t in ("fence", "code_block"):
            blocks.append(_Block("code", line, tok.content.rstrip("\n"), info=tok.info.strip()))
        elif t == "html_block":
            blocks.extend(_html_blocks(tok.content, line))
        elif t == "table_open":
            i = _pipe_table(tokens, i, blocks)
            continue
        i += 1
    return blocks


def _pipe_table(tokens: list[Token], i: int, blocks: list[_Block]) -> int:
    line = tokens[i].map[0] + 1
    header: list[str] = []
    rows: list[tuple[int, list[str]]] = []
    row: list[str] | None = None
    row_line = line
    in_head = False
    while tokens[i].type != "table_close":
        tok = tokens[i]
        if tok.type == "thead_open":
            in_head = True
        elif tok.type == "thead_close":
            in_head = False
        elif tok.type == "tr_open":
            row, row_line = [], (tok.map[0] + 1 if tok.map else row_line)
        elif tok.type == "inline" and row is not None:
            row.append(" ".join(_render_inline(tok).text.split()))
        elif tok.type == "tr_close" and row is not None:
            if in_head:
                header = row
            else:
                rows.append((row_line, row))
            row = None
        i += 1
    blocks.append(_Block("table", line, header=header, rows=rows))
    return i + 1


def _html_blocks(content: str, line: int) -> list[_Block]:
    parser = _HtmlTables()
    parser.feed(content)
    parser.close()
    out: list[_Block] = []
    text = " ".join("".join(parser.text).split())
    if text:
        out.append(_Block("para", line, text, inline=_Inline(text, [], [])))
    for table in parser.tables:
        if not table:
            continue
        head = next((i for i, row in enumerate(table) if row[1]), 0)
        out.append(_Block("table", line + table[0][0] - 1, header=table[head][2],
                          rows=[(line + ln - 1, cells) for i, (ln, _, cells) in enumerate(table) if i != head]))
    return out


# ------------------------------------------------------------------------------------------------
# sections

def _section_key(title: str) -> str:
    t = title.strip().lstrip("-").strip().lower()
    if t in ("struct-fields", "members", "fields", "struct fields"):
        return "members"
    for key in ("description", "availability", "tensor constraint", "tensor support", "syntax", "remarks"):
        if t.startswith(key):
            return key
    return t


def _sections(blocks: list[_Block]) -> list[tuple[str, _Block | None, list[_Block]]]:
    """Split at H1/H2 headings: [(section key, heading block, blocks), ...]; the preamble has key ''."""
    out: list[tuple[str, _Block | None, list[_Block]]] = [("", None, [])]
    for b in blocks:
        if b.kind == "heading" and b.level <= 2:
            out.append((_section_key(b.text) if b.level == 2 else "#title", b, []))
        else:
            out[-1][2].append(b)
    return out


def _members(sections, source: str) -> list[_Member]:
    members: list[_Member] = []
    current: _Member | None = None
    for key, _, blocks in sections:
        in_members = key == "members"
        current = None
        for b in blocks:
            if b.kind == "heading":
                field_heading = b.text.startswith("-field")
                if b.level <= 3 and (field_heading or (in_members and b.level == 3)):
                    words = (b.text[len("-field"):] if field_heading else b.text).split()
                    name = words[0].strip("`*") if words else ""
                    if not _IDENT.fullmatch(name):
                        raise SpecError(source, b.line, f"expected a struct member name in heading {b.text!r}")
                    if any(m.name == name for m in members):
                        raise SpecError(source, b.line, f"struct member {name!r} is documented twice")
                    current = _Member(name, b.line)
                    members.append(current)
                    continue
                if b.level <= 3:
                    current = None
                continue
            if current is None:
                continue
            if b.kind in ("para", "item") and current.type_text is None and re.match(r"[ \t]*Type[ \t]*:", b.text):
                first, _, rest = b.text.partition("\n")
                current.type_text = first.split(":", 1)[1].strip()
                current.type_line = b.line
                b = _Block(b.kind, b.line, rest)
            if b.kind == "table" or not b.text.strip():
                continue
            text = b.text.strip()
            current.description = (current.description + "\n" + text).strip()
            current.formulas += [ln.strip().rstrip(".;").strip() for ln in text.split("\n") if _FORMULA.match(ln)]
    return members


def _struct_block(blocks: list[_Block]) -> tuple[str, dict[str, str]] | None:
    """A ``struct DML_X_DESC { type Name; ... }`` syntax block: (struct name, {member: C type})."""
    for b in blocks:
        if b.kind != "code":
            continue
        m = _STRUCT_BLOCK.search(b.text)
        if not m:
            continue
        members: dict[str, str] = {}
        body = re.sub(r"//[^\n]*|/\*.*?\*/", "", m.group(2), flags=re.S)
        for decl in body.split(";"):
            decl = " ".join(decl.split())
            dm = re.match(r"(.*?)([A-Za-z_]\w*)\s*(\[[^\]]*\])?$", decl)
            if decl and dm and dm.group(1).strip():
                members[dm.group(2)] = dm.group(1).strip() + ("*" if dm.group(3) else "")
        return m.group(1), members
    return None


# ------------------------------------------------------------------------------------------------
# member types

@dataclass(frozen=True)
class _CType:
    base: str
    pointer: bool
    array_count: str | None  # the _Field_size_(X) count member, or "" for an unsized pointer array
    maybe_null: bool
    text: str


def _parse_c_type(text: str, source: str, line: int | None) -> _CType:
    rest = " ".join(text.replace("\\", "").split())
    maybe_null = False
    count: str | None = None
    while True:
        m = _SAL.match(rest)
        if not m:
            break
        ann = m.group(1).lower()
        if "maybenull" in ann or ann.endswith("_opt_"):
            maybe_null = True
        if "size" in ann or "reads" in ann or "count" in ann:
            count = (m.group(2) or "").strip()
        rest = rest[m.end():]
    m = _C_TYPE.match(rest.strip())
    if not m:
        raise SpecError(source, line, f"expected a C type such as 'const DML_TENSOR_DESC*' or 'FLOAT', got {text!r}")
    pointer = "*" in m.group(2)
    maybe_null |= bool(_OPTIONAL_TEXT.search(m.group(3)))  # a trailing "(optional)" note
    full = " ".join(text.replace("\\", "").split())
    return _CType(m.group(1), pointer, count, maybe_null, full[: len(full) - len(m.group(3))].strip())


def _attribute_type(ct: _CType) -> str:
    base = _C_SCALARS.get(ct.base, ct.base)
    scalar = ct.base in _C_SCALARS
    if ct.array_count is not None or (ct.pointer and scalar):
        return base + "[]"
    return base


# ------------------------------------------------------------------------------------------------
# tensor-support tables

def _column_roles(header: list[str]) -> dict[str, int]:
    roles: dict[str, int] = {}
    for i, h in enumerate(header):
        k = h.strip().lower()
        if "kind" in k:
            roles.setdefault("kind", i)
        elif "data type" in k or "datatype" in k:
            roles.setdefault("types", i)
        elif "dimension count" in k or "rank" in k:
            roles.setdefault("ranks", i)
        elif k in ("dimensions", "dimension", "sizes", "shape"):
            roles.setdefault("shape", i)
        elif k.startswith("tensor") or k in ("name", "member"):
            roles.setdefault("tensor", i)
    return roles


class _Cells:
    def __init__(self, cells: list[str], roles: dict[str, int]) -> None:
        self.cells, self.roles = cells, roles

    def __call__(self, role: str) -> str:
        idx = self.roles.get(role)
        return self.cells[idx].strip() if idx is not None and idx < len(self.cells) else ""


def _parse_ranks(cell: str, source: str, line: int) -> tuple[int, int]:
    m = re.search(r"(\d+)\s*(?:to|through|-|–|\.\.)\s*(\d+)", cell)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
        return min(lo, hi), max(lo, hi)
    nums = [int(n) for n in re.findall(r"\d+", cell)]
    if not nums:
        raise SpecError(source, line, f"expected supported dimension counts such as '4' or '1 to 8', got {cell!r}")
    return min(nums), max(nums)


def _parse_types(cell: str, source: str, line: int) -> tuple[str, ...]:
    words = [w for w in re.split(r"[,\s/]+|\band\b|\bor\b", cell) if w]
    if not words or any(not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", w) for w in words):
        raise SpecError(source, line, f"expected a comma-separated list of data types such as 'FLOAT32, FLOAT16', "
                                      f"got {cell!r}")
    return tuple(dict.fromkeys(normalize_type(w.removeprefix("DML_TENSOR_DATA_TYPE_")) for w in words))


def _tables(sections, source: str) -> list[_Table]:
    tables: list[_Table] = []
    for key, head, blocks in sections:
        path: list[tuple[int, str]] = []
        for b in blocks:
            if b.kind == "heading":
                path = [p for p in path if p[0] < b.level] + [(b.level, b.text)]
                continue
            if b.kind != "table":
                continue
            roles = _column_roles(b.header)
            if "tensor" not in roles or "kind" not in roles:
                if key == "tensor support":
                    raise SpecError(source, b.line, "expected a tensor-support table with columns Tensor, Kind, "
                                                    f"Supported dimension counts, Supported data types; got {b.header}")
                continue
            if "types" not in roles and "ranks" not in roles:
                raise SpecError(source, b.line, "tensor-support table has neither a 'Supported data types' nor a "
                                                "'Supported dimension counts' column")
            label = " / ".join(t for _, t in path) or (head.text if head is not None else "")
            rows = []
            for line, cells in b.rows:
                cell = _Cells(cells, roles)
                name = re.sub(r"\[[^\]]*\]$", "", cell("tensor").strip("`*"))
                if not name:
                    raise SpecError(source, line, "tensor-support row has an empty Tensor cell")
                if not _IDENT.fullmatch(name):
                    raise SpecError(source, line, f"expected a tensor name in the Tensor column, got {name!r}")
                kind = cell("kind").lower()
                if "output" not in kind and "input" not in kind:
                    raise SpecError(source, line, f"expected Kind 'Input' or 'Output' (possibly 'Optional ...' or "
                                                  f"'Array of ...') for {name}, got {cell('kind')!r}")
                row: dict[str, Any] = {
                    "tensor": name, "line": line,
                    "kind": "output" if "output" in kind else "input",
                    "optional": "optional" in kind, "variadic": "array" in kind,
                    "shape": cell("shape") or None, "ranks": None, "types": (),
                }
                if "ranks" in roles:
                    row["ranks"] = _parse_ranks(cell("ranks"), source, line)
                if "types" in roles:
                    row["types"] = _parse_types(cell("types"), source, line)
                rows.append(row)
            tables.append(_Table(label, b.line, rows))
    return tables


# ------------------------------------------------------------------------------------------------
# rows -> schema

def _op_name(meta, sections, struct, source) -> str | None:
    """The struct name, from the most to the least explicit place that states it."""
    candidates: list[str] = []
    for key in ("api_name", "title", "UID"):
        candidates += _as_list(meta.get(key))
    candidates += [h.text for k, h, _ in sections if k == "#title" and h is not None and h.level == 1]
    if struct:
        candidates.append(struct[0])
    bold = {k: [s for b in bl if b.inline for s in b.inline.bold_unlinked if _OPERATOR_NAME.fullmatch(s)]
            for k, _, bl in sections}
    candidates += bold.get("description", [])
    stem = re.search(r"dml_\w+_desc", Path(source).name, re.I)
    candidates += [stem.group(0).upper()] if stem else []
    candidates += [s for spans in bold.values() for s in spans]
    for c in candidates:
        m = _DML_NAME.search(c)
        if m:
            return m.group(0)
    return None


def _as_list(value: str | list[str] | None) -> list[str]:
    return value if isinstance(value, list) else [value] if value else []


def _schema_name(struct_name: str) -> str:
    name = struct_name.removeprefix("DML_")
    for suffix in ("_OPERATOR_DESC", "_DESC"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _section_text(sections, key) -> tuple[str, list[_Block]]:
    for k, _, blocks in sections:
        if k == key:
            return "\n".join(b.text.strip() for b in blocks if b.kind in ("para", "item", "code")).strip(), blocks
    return "", []


def parse(text: str, source: str, *, include_dirs: tuple = ()) -> OpSchema:
    meta, body = _split_front_matter(text, source)
    blocks = _blocks(body)
    sections = _sections(blocks)
    struct = _struct_block(blocks)
    struct_name = _op_name(meta, sections, struct, source)
    if struct_name is None:
        raise SpecError(source, None, "cannot find the operator's struct name (front matter 'title'/'api_name', an "
                                      "H1, a 'struct DML_..._OPERATOR_DESC' block or a bold **DML_..._OPERATOR_DESC**)")
    members = _members(sections, source)
    struct_types = struct[1] if struct else {}
    if not members and struct_types:
        members = [_Member(n, 0) for n in struct_types]
    tables = _tables(sections, source)
    extra: dict[str, Any] = {"struct_name": struct_name}

    member_types: dict[str, _CType] = {}
    for m in members:
        raw = m.type_text if m.type_text is not None else struct_types.get(m.name)
        if raw is None:
            raise SpecError(source, m.line, f"struct member {m.name}: expected a 'Type:' line (or a syntax block "
                                            "declaring the struct)")
        if not raw.strip():
            raise SpecError(source, m.type_line or m.line, f"struct member {m.name}: empty 'Type:' line")
        member_types[m.name] = _parse_c_type(raw, source, m.type_line or m.line)

    if not members and tables:
        extra["members_from"] = "table"
        for t in tables:
            for r in t.rows:
                if r["tensor"] not in member_types:
                    members.append(_Member(r["tensor"], r["line"]))
                    member_types[r["tensor"]] = _CType(_TENSOR_TYPE, True, None, False, "const DML_TENSOR_DESC*")

    warnings: list[SpecWarning] = []
    tensor_names = [m.name for m in members if member_types[m.name].base == _TENSOR_TYPE]
    aliases = _match_rows(tables, tensor_names, source, warnings)
    if aliases:
        extra["aliases"] = tuple(aliases.items())

    rows_by_tensor: dict[str, list[dict[str, Any]]] = {}
    for t in tables:
        for r in t.rows:
            rows_by_tensor.setdefault(aliases.get(r["tensor"], r["tensor"]), []).append(r)

    inputs, outputs, attributes, guessed = _arguments(members, member_types, rows_by_tensor)
    if guessed:
        extra["kind_guessed"] = tuple(guessed)
        line_of = {m.name: m.line for m in members}
        outputs_named = {a.name for a in outputs}
        if tables:  # old pages have no tables at all, and every kind is read from the name: not unusual there
            for name in guessed:
                kind = "output" if name in outputs_named else "input"
                warnings.append(SpecWarning(source, line_of.get(name) or None,
                                            f"no tensor-support row names {name}; read as an {kind} from its name"))

    constraints, groups = _constraints(sections, [a.name for a in inputs + outputs], aliases)
    inputs, outputs, type_constraints, conflicts = _type_vars(inputs, outputs, groups)
    if conflicts:
        extra["type_conflicts"] = tuple(conflicts)
        for var, names in conflicts:
            warnings.append(SpecWarning(source, None, f"{', '.join(names)} share a DataType but their tables allow "
                                                      f"no common type; {var} allows the union"))

    availability, _ = _section_text(sections, "availability")
    level = _FEATURE_LEVEL.search(availability)
    extra["feature_level"] = level.group(0) if level else None
    extra["members"] = tuple((m.name, member_types[m.name].text) for m in members)
    counts = tuple((m.name, member_types[m.name].array_count) for m in members if member_types[m.name].array_count)
    if counts:
        extra["array_counts"] = counts
    formulas = tuple((m.name, f) for m in members for f in dict.fromkeys(m.formulas))
    if formulas:
        extra["formulas"] = formulas
    if tables:
        extra["tensor_support"] = tuple(
            (t.label, tuple((r["tensor"], r["kind"] + (" optional" if r["optional"] else "")
                                       + (" array" if r["variadic"] else ""),
                             r["shape"], r["ranks"], r["types"]) for r in t.rows))
            for t in tables)

    description, _ = _section_text(sections, "description")
    return OpSchema(
        name=_schema_name(struct_name),
        domain=DOMAIN,
        version=1,
        dialect=DIALECT,
        description=description or " ".join(_as_list(meta.get("description"))),
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        attributes=tuple(attributes),
        type_constraints=type_constraints,
        constraints=tuple(constraints),
        source=str(source),
        extra=tuple(extra.items()),
        warnings=tuple(warnings),
    )


def _arguments(members: list[_Member], member_types: dict[str, _CType], rows_by_tensor: dict[str, list[dict]]):
    """Members in struct order -> (inputs, outputs, attributes, tensors whose kind was guessed)."""
    inputs, outputs, attributes, guessed = [], [], [], []
    for m in members:
        ct = member_types[m.name]
        optional = ct.maybe_null or bool(_OPTIONAL_TEXT.search(m.description))
        if ct.base != _TENSOR_TYPE:
            attributes.append(Attribute(m.name, _attribute_type(ct), required=not optional,
                                        description=m.description))
            continue
        rows = rows_by_tensor.get(m.name, [])
        if rows:
            is_output = rows[0]["kind"] == "output"
        else:
            is_output = m.name.startswith("Output")
            guessed.append(m.name)
        types = tuple(dict.fromkeys(t for r in rows for t in r["types"]))
        ranks = [r["ranks"] for r in rows if r["ranks"]]
        arg = Argument(
            m.name,
            optional=optional or any(r["optional"] for r in rows),
            variadic=ct.array_count is not None or any(r["variadic"] for r in rows),
            description=m.description,
            types=types,
            shape=next((r["shape"] for r in rows if r["shape"]), None),
            min_rank=min(lo for lo, _ in ranks) if ranks else None,
            max_rank=max(hi for _, hi in ranks) if ranks else None,
        )
        (outputs if is_output else inputs).append(arg)
    return inputs, outputs, attributes, guessed


def _match_rows(tables: list[_Table], tensor_names: list[str], source: str,
                warnings: list[SpecWarning]) -> dict[str, str]:
    """{table row name: member name} for rows whose name is not a member's (see module docstring)."""
    known = set(tensor_names)
    folded = {n.lower(): n for n in tensor_names}
    unmatched: dict[str, int] = {}
    aliases: dict[str, str] = {}
    for t in tables:
        for r in t.rows:
            n = r["tensor"]
            if n in known:
                continue
            if n.lower() in folded:
                aliases[n] = folded[n.lower()]
            else:
                unmatched.setdefault(n, r["line"])
    if not unmatched:
        return aliases
    named = {aliases.get(r["tensor"], r["tensor"]) for t in tables for r in t.rows}
    unnamed = [n for n in tensor_names if n not in named]
    if len(unnamed) != len(unmatched):
        name, line = next(iter(unmatched.items()))
        raise SpecError(source, line, f"tensor-support row {name!r} names no DML_TENSOR_DESC member of the struct "
                                      f"(members: {', '.join(tensor_names) or 'none'})")
    for (row_name, line), member in zip(unmatched.items(), unnamed, strict=True):
        aliases[row_name] = member
        warnings.append(SpecWarning(source, line, f"tensor-support row {row_name!r} names no struct member; "
                                                  f"paired with {member!r}, the member no row names"))
    return aliases


def _constraints(sections, arg_names: list[str], aliases: dict[str, str]):
    """Constraint C1.. per bullet/paragraph; the groups of arguments that share a DataType."""
    known = set(arg_names)
    _, blocks = _section_text(sections, "tensor constraint")
    constraints: list[Constraint] = []
    groups: list[list[str]] = []
    for b in blocks:
        if b.kind not in ("para", "item") or not b.text.strip():
            continue
        text = " ".join(b.text.split())
        spans = b.inline.emphasized if b.inline else []
        mentioned: list[str] = []
        for s in spans:
            n = aliases.get(s.split(".")[0].strip(), s.split(".")[0].strip())
            if n in known and n not in mentioned:
                mentioned.append(n)
        constraints.append(Constraint(f"C{len(constraints) + 1}", text, tuple(mentioned)))
        if len(mentioned) > 1 and re.search(r"\bsame\b", text, re.I) and re.search(r"DataType|data type", text, re.I):
            groups.append(mentioned)
    return constraints, groups


def _type_vars(inputs: list[Argument], outputs: list[Argument], groups: list[list[str]]):
    args = inputs + outputs
    parent = {a.name: a.name for a in args}

    def find(n):
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for g in groups:
        for n in g[1:]:
            parent[find(n)] = find(g[0])
    components: dict[str, list[Argument]] = {}
    for a in args:
        components.setdefault(find(a.name), []).append(a)
    components = {root: members for root, members in components.items()
                  if len(members) > 1 or any(a.types for a in members)}
    var_of: dict[str, str] = {}
    names = ["T"] if len(components) == 1 else [f"T{i + 1}" for i in range(len(components))]
    type_constraints = []
    conflicts = []
    for var, members in zip(names, components.values(), strict=True):
        for a in members:
            var_of[a.name] = var
        typed = [a.types for a in members if a.types]
        if not typed:
            continue
        allowed = tuple(t for t in typed[0] if all(t in other for other in typed[1:]))
        if not allowed:
            allowed = tuple(dict.fromkeys(t for ts in typed for t in ts))
            conflicts.append((var, tuple(a.name for a in members)))
        type_constraints.append((var, allowed))

    def with_var(a: Argument) -> Argument:
        v = var_of.get(a.name)
        return Argument(a.name, a.optional, a.variadic, v, a.description, a.types, a.shape, a.min_rank, a.max_rank)

    return ([with_var(a) for a in inputs], [with_var(a) for a in outputs], tuple(type_constraints), conflicts)
