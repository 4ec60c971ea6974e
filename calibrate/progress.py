"""A one-line progress display on stderr (no tqdm dependency).

On a terminal the line is rewritten in place (`\\r`) at most every 0.1 s:
    [ 37/157  24%  12.3 s] gemm bf16 4096x6144x4096 (llama3-8b tp1 t4096 qkv fwd)
Elsewhere (a log file, CI, a test's pipe) it prints one line per phase, never a carriage return.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool = True,
                 clock=time.monotonic) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self._clock = clock
        self._start = clock()
        self._last_draw = -1.0
        self._phase = None
        self._width = 0

    @property
    def elapsed(self) -> float:
        return self._clock() - self._start

    def phase(self, name: str, count: int) -> None:
        """A new group of `count` items begins (one line when not on a terminal)."""
        self._phase = name
        if self.enabled and not self.tty:
            self._write(f"calibrate: {name} ({count} item{'s' if count != 1 else ''}, {self.elapsed:.1f} s elapsed)\n")

    def step(self, what: str) -> None:
        """The next item starts: `what` names it."""
        if self.tty:
            now = self._clock()
            if now - self._last_draw >= 0.1:
                self._last_draw = now
                pct = 100 * self.done // self.total
                line = f"[{self.done:>4}/{self.total} {pct:3d}% {self.elapsed:6.1f} s] {what}"
                pad = max(0, self._width - len(line))
                self._width = len(line)
                self._write("\r" + line + " " * pad)
        self.done += 1

    def note(self, text: str) -> None:
        """A message on its own line (a skipped op, an unsupported collective)."""
        if self.enabled:
            self.clear()
            self._write(f"calibrate: {text}\n")

    def clear(self) -> None:
        if self.tty and self._width:
            self._write("\r" + " " * self._width + "\r")
            self._width = 0

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
