"""A small progress bar on stderr for ``python -m cpumoe bench`` (no third-party deps).

On a terminal it redraws one line in place (``\\r``), at most ~10 times a second.
When enabled on a non-terminal (``--progress`` with stderr redirected to a log)
it prints one plain line per phase instead, so logs stay readable.
A disabled bar does nothing, and :meth:`Progress.write` then just prints.
"""

from __future__ import annotations

import re
import sys
import time
from typing import Optional, TextIO

_COUNTER = re.compile(r"\s+\d+/\d+$")


class Progress:
    """Progress over a run of ``total`` equal-weight units (benchmark cases).

    ``update(done, text)`` sets the completed fraction as ``done / total``
    (``done`` may be fractional: 2.5 = half-way through the third case) and a
    short status text. ``write(line)`` prints a line of real output without
    tearing the bar.
    """

    def __init__(self, total: float, enabled: bool, stream: Optional[TextIO] = None,
                 width: int = 24, min_interval: float = 0.1):
        self.total = max(float(total), 1e-9)
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.min_interval = min_interval
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self._done = 0.0
        self._text = ""
        self._last_draw = 0.0
        self._drawn_len = 0
        self._last_phase = None

    # -- public ---------------------------------------------------------------------------

    def update(self, done: Optional[float] = None, text: Optional[str] = None,
               force: bool = False) -> None:
        if done is not None:
            self._done = min(max(float(done), 0.0), self.total)
        if text is not None:
            self._text = text
        if not self.enabled:
            return
        if not self.tty:
            # Log mode: one line per phase (text change), no carriage returns.
            phase = _COUNTER.sub("", self._text)  # "... 3/40" -> one line per phase
            if phase and phase != self._last_phase:
                self._last_phase = phase
                self.stream.write(f"[{self._elapsed():>6}] {phase}\n")
                self.stream.flush()
            return
        now = time.perf_counter()
        if force or now - self._last_draw >= self.min_interval:
            self._last_draw = now
            self._draw()

    def write(self, line: str, stream: Optional[TextIO] = None) -> None:
        """Prints ``line`` (to stdout by default) above the bar."""
        out = stream if stream is not None else sys.stdout
        if self.enabled and self.tty and self._drawn_len:
            self._clear()
        out.write(line + "\n")
        out.flush()
        if self.enabled and self.tty and self._drawn_len == 0 and self._text:
            self._draw()

    def close(self) -> None:
        if self.enabled and self.tty and self._drawn_len:
            self._clear()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- drawing --------------------------------------------------------------------------

    def _elapsed(self) -> str:
        s = int(time.perf_counter() - self.start)
        return f"{s // 60}:{s % 60:02d}"

    def _draw(self) -> None:
        frac = self._done / self.total
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        line = f"[{bar}] {100 * frac:3.0f}% {self._elapsed()} {self._text}"
        cols = _terminal_columns()
        if len(line) > cols - 1:
            line = line[: cols - 1]
        pad = max(self._drawn_len - len(line), 0)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        self._drawn_len = len(line)

    def _clear(self) -> None:
        self.stream.write("\r" + " " * self._drawn_len + "\r")
        self.stream.flush()
        self._drawn_len = 0


def _terminal_columns() -> int:
    try:
        import shutil

        return shutil.get_terminal_size((100, 24)).columns
    except Exception:  # pragma: no cover
        return 100
