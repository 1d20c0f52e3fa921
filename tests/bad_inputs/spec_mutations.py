"""Damaging a spec document by anchored line edits, so a case survives unrelated edits of the document.

An edit names its line by content (``anchor``, a substring of the line; ``nth`` match when it repeats);
the expected error line is given relative to the anchor's line in the undamaged document.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Edit:
    op: str  # drop | dup | replace | truncate_after | drop_block
    anchor: str
    nth: int = 0
    old: str = ""
    new: str = ""
    count: int = 1  # lines dropped by drop_block

    def line_of(self, lines: list[str]) -> int:
        """0-based index of the anchored line."""
        hits = [i for i, line in enumerate(lines) if self.anchor in line]
        if len(hits) <= self.nth:
            raise LookupError(f"anchor {self.anchor!r} (match {self.nth}) not in the document")
        return hits[self.nth]

    def apply(self, text: str) -> str:
        lines = text.split("\n")
        i = self.line_of(lines)
        if self.op == "drop":
            del lines[i]
        elif self.op == "drop_block":
            del lines[i:i + self.count]
        elif self.op == "dup":
            lines.insert(i, lines[i])
        elif self.op == "replace":
            if self.old not in lines[i]:
                raise LookupError(f"{self.old!r} not on the line anchored by {self.anchor!r}")
            lines[i] = lines[i].replace(self.old, self.new, 1)
        elif self.op == "truncate_after":
            lines = lines[: i + 1]
        else:
            raise ValueError(self.op)
        return "\n".join(lines)


@dataclass(frozen=True)
class SpecCase:
    """A damaged bundled document: ``doc`` under specs/, the edit, and the SpecError expected.

    ``line`` is relative to the anchored line (1 = the anchored line itself); None: the error names no
    line. ``fragment`` must appear in the message.
    """

    id: str
    doc: str
    edit: Edit
    line: int | None
    fragment: str
