"""A progress bar on stderr that never runs into the lines printed on stdout.

Drawn only when stderr is a terminal (piped or redirected runs get their stdout lines and nothing else):
before a stdout line the bar is erased (carriage return + erase-line), after it the bar is drawn again
below, so in a terminal each line starts at the left margin and the bar stays the last line.
"""

from __future__ import annotations

import sys
from typing import TextIO

ERASE = "\r\x1b[K"


class Progress:
    def __init__(self, total: int, *, width: int = 30, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.width = width
        self.stream = stream if stream is not None else sys.stderr
        self.active = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0
        self.text = ""

    def update(self, done: int, text: str = "") -> None:
        self.done, self.text = done, text
        self._draw()

    def write(self, line: str) -> None:
        """Print ``line`` on stdout above the bar."""
        if self.active:
            self.stream.write(ERASE)
            self.stream.flush()
        print(line, flush=True)
        self._draw()

    def close(self) -> None:
        if self.active:
            self.stream.write(ERASE)
            self.stream.flush()

    def _draw(self) -> None:
        if not self.active:
            return
        filled = self.width * self.done // self.total
        bar = f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total}"
        self.stream.write(f"{ERASE}{bar}{' ' + self.text if self.text else ''}")
        self.stream.flush()
