"""The demo's progress line on stderr: rewritten in place on a terminal, one line per
step otherwise (logs, CI). Never writes to stdout (the report goes there)."""

from __future__ import annotations

import time
from typing import TextIO


class Progress:
    def __init__(self, stream: TextIO, *, interactive: bool | None = None) -> None:
        self.stream = stream
        self.interactive = stream.isatty() if interactive is None else interactive
        self.started = time.perf_counter()
        self._shown = False

    def __call__(self, text: str) -> None:
        line = f"gpuplace demo [{time.perf_counter() - self.started:5.1f}s] {text}"
        if self.interactive:
            self.stream.write("\r\x1b[K" + line)
            self._shown = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def clear(self) -> None:
        if self.interactive and self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False
