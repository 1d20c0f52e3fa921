"""Dispatch a specification document to its dialect's parser; detect the dialect from content."""

from __future__ import annotations

import importlib
from pathlib import Path

from opdef.errors import SpecError
from opdef.schema import DIALECTS, OpSchema


def _dialect_module(dialect: str):
    if dialect not in DIALECTS:
        raise SpecError("<dialect>", None, f"unknown dialect {dialect!r}; expected one of {list(DIALECTS)}")
    return importlib.import_module(f"opdef.dialects.{dialect}")


_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def read_spec_text(path: Path) -> str:
    """Read a document as text: UTF-8 (a BOM is dropped), CRLF folded; undecodable bytes are a SpecError."""
    try:
        data = Path(path).read_bytes()
    except IsADirectoryError:
        raise SpecError(str(path), None, "is a directory, expected a spec document") from None
    except OSError as exc:
        raise SpecError(str(path), None, f"cannot read: {exc.strerror or exc}") from None
    if data.startswith(_UTF16_BOMS):
        raise SpecError(str(path), 1, "UTF-16 text (it starts with a UTF-16 byte-order mark); save the document "
                                      "as UTF-8")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise SpecError(str(path), line, f"not UTF-8 text (byte 0x{data[exc.start]:02x})") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def detect_dialect(text: str, source: str = "<string>") -> str:
    """The dialect whose grammar the text is written in (each dialect module scores the text)."""
    scores = {d: _dialect_module(d).looks_like(text) for d in DIALECTS}
    best = max(scores, key=scores.get)
    if scores[best] <= 0:
        raise SpecError(source, None, "cannot tell which spec dialect this document is written in "
                                      f"(none of {list(DIALECTS)} matched); pass --dialect")
    return best


def parse_spec_text(text: str, source: str = "<string>", dialect: str | None = None,
                    include_dirs: tuple[Path, ...] = ()) -> OpSchema:
    if text.startswith("\ufeff"):
        text = text[1:]
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text.strip():
        raise SpecError(source, None, "empty document; expected a spec document of one of the dialects "
                                      f"{list(DIALECTS)}")
    nul = text.find("\0")
    if nul >= 0:  # text never holds NUL; a binary file or UTF-16 without a byte-order mark does
        raise SpecError(source, text.count("\n", 0, nul) + 1, "NUL byte in the text: a binary file, or UTF-16 "
                                                              "without a byte-order mark? expected UTF-8 text")
    dialect = dialect or detect_dialect(text, source)
    return _dialect_module(dialect).parse(text, source, include_dirs=include_dirs)


def parse_spec(path: Path | str, dialect: str | None = None,
               include_dirs: tuple[Path, ...] = ()) -> OpSchema:
    path = Path(path)
    return parse_spec_text(read_spec_text(path), str(path), dialect, include_dirs)
