"""Damage that applies to any spec document, whatever its dialect: encodings, line ends, truncation, garbage.

Each maker takes the document's bytes and returns the damaged bytes; ``EXPECT`` says what the parser must do:
``same`` (parse to the undamaged schema), ``error`` (SpecError with the given line and message fragment, the
line computed from the document), or ``error_or_parse`` (a SpecError naming the file and a line inside the
document, or a schema: cutting a document short may leave a valid, smaller one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Generic:
    id: str
    make: Callable[[bytes], bytes]
    expect: str  # same | error | error_or_parse
    line: Callable[[bytes], int | None] | None = None  # expected error line, from the undamaged bytes
    fragment: str = ""


def _lines(raw: bytes) -> list[bytes]:
    return raw.split(b"\n")


def _latin1_in_middle(raw: bytes) -> bytes:
    lines = _lines(raw)
    mid = len(lines) // 2
    return b"\n".join(lines[:mid] + [b"caf\xe9"] + lines[mid:])


def _nul_after_first_line(raw: bytes) -> bytes:
    at = raw.find(b"\n") + 1 or len(raw) // 2
    return raw[:at] + b"\x00" + raw[at:]


def _first_lines(fraction: float) -> Callable[[bytes], bytes]:
    return lambda raw: b"\n".join(_lines(raw)[: max(1, int(len(_lines(raw)) * fraction))])


GENERIC = [
    Generic("empty", lambda raw: b"", "error", lambda raw: None, "empty document"),
    Generic("blank-lines", lambda raw: b"\n  \n\t\n\n", "error", lambda raw: None, "empty document"),
    Generic("random-bytes", lambda raw: bytes(range(256)) * 3, "error", lambda raw: 2, "not UTF-8"),
    Generic("latin1-byte-mid-document", _latin1_in_middle, "error", lambda raw: len(_lines(raw)) // 2 + 1,
            "not UTF-8"),
    Generic("utf16", lambda raw: raw.decode("utf-8").encode("utf-16"), "error", lambda raw: 1, "UTF-16"),
    Generic("utf16-be-no-bom", lambda raw: b"\x00B\x00N\x00\n" + raw.decode("utf-8").encode("utf-16-be"),
            "error", lambda raw: 1, "NUL byte"),
    Generic("html-page", lambda raw: b"<html><body><p>not a spec</p></body></html>\n", "error",
            lambda raw: None, "cannot tell which spec dialect"),
    Generic("json", lambda raw: b'{"name": "BatchNormTrainingBackward", "inputs": []}\n', "error",
            lambda raw: None, "cannot tell which spec dialect"),
    Generic("bom", lambda raw: b"\xef\xbb\xbf" + raw, "same"),
    Generic("crlf", lambda raw: raw.replace(b"\n", b"\r\n"), "same"),
    Generic("cr-only", lambda raw: raw.replace(b"\n", b"\r"), "same"),
    Generic("bom-crlf", lambda raw: b"\xef\xbb\xbf" + raw.replace(b"\n", b"\r\n"), "same"),
    Generic("trailing-whitespace", lambda raw: b"\n".join(line + b"  " for line in _lines(raw)), "same"),
    Generic("first-quarter", _first_lines(0.25), "error_or_parse"),
    Generic("first-half", _first_lines(0.5), "error_or_parse"),
    Generic("cut-mid-line", lambda raw: raw[: len(raw) * 3 // 5], "error_or_parse"),
    Generic("doubled", lambda raw: raw + b"\n" + raw, "error_or_parse"),
    Generic("nul-bytes", _nul_after_first_line, "error", lambda raw: 2 if b"\n" in raw else 1, "NUL byte"),
]
