"""docutils front end shared by the RST dialects: lenient parsing of Sphinx-flavoured documents.

Upstream documents use Sphinx roles and directives docutils does not know (``:any:``, ``:ref:``,
``.. doxygenclass::``); they are parsed leniently here so the tables around them survive.
"""

from __future__ import annotations

import docutils.frontend
import docutils.nodes
import docutils.parsers.rst
import docutils.utils
from docutils.parsers.rst import roles

_SPHINX_ROLES = ("any", "ref", "doc", "term", "class", "func", "meth", "attr", "cpp:class", "cpp:any",
                 "cpp:func", "cpp:enum", "cpp:type", "program", "option", "envvar", "abbr", "numref",
                 "download", "guilabel", "menuselection", "file", "samp", "kbd")


def _text_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    """Render a Sphinx cross-reference role as its visible text: ``:any:`epsilon<dnnl::...>``` -> epsilon."""
    shown = text
    if shown.endswith(">") and "<" in shown:
        shown = shown[: shown.rindex("<")].strip() or shown[shown.rindex("<") + 1 : -1]
    return [docutils.nodes.literal(rawtext, shown)], []


for _role in _SPHINX_ROLES:
    roles.register_local_role(_role, _text_role)


def parse_rst(text: str, source: str = "<string>") -> docutils.nodes.document:
    """Parse RST into a doctree without ever raising or printing on markup problems.

    System messages stay in the tree (``docutils.nodes.system_message``) for callers that want them.
    """
    parser = docutils.parsers.rst.Parser()
    settings = docutils.frontend.get_default_settings(docutils.parsers.rst.Parser)
    settings.report_level = 5  # never print
    settings.halt_level = 5  # never raise
    settings.warning_stream = False
    settings.file_insertion_enabled = False  # includes are resolved by the dialect, not by docutils
    settings.raw_enabled = False
    settings.input_encoding = "unicode"
    document = docutils.utils.new_document(source, settings)
    parser.parse(text, document)
    return document


def table_rows(table: docutils.nodes.table) -> tuple[list[list[str]], list[list[str]], int | None]:
    """(header rows, body rows, line) of a docutils table; each cell as whitespace-folded text.

    Works for grid and simple tables alike; multi-line cells are joined with single spaces. Cells
    spanning several columns (``morecols``) are repeated so every row has one entry per column.
    """

    def rows_of(part) -> list[list[str]]:
        out = []
        for row in part.findall(docutils.nodes.row):
            cells = []
            for entry in row.findall(docutils.nodes.entry):
                text = " ".join(entry.astext().split())
                cells.extend([text] * (1 + int(entry.get("morecols", 0))))
            out.append(cells)
        return out

    head = next(iter(table.findall(docutils.nodes.thead)), None)
    body = next(iter(table.findall(docutils.nodes.tbody)), None)
    line = table.line
    if line is None:
        for node in table.findall():
            if getattr(node, "line", None):
                line = node.line
                break
    return (rows_of(head) if head is not None else [], rows_of(body) if body is not None else [], line)
