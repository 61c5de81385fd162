"""Progress of a long command on stderr: one updating line on a terminal, a plain line now and then elsewhere.

    with Progress("export", total=len(names), unit="tensors") as progress:
        for name in names:
            ...
            progress.advance()

Why stderr: `moetron eval --json | jq`, `moetron plan ... > plan.txt` and every other pipeline read stdout, which
progress never touches. On a terminal the line is rewritten in place (at most every `REDRAW_S`) and left showing
the final count; elsewhere (a log file, CI, a test capturing stderr) a line is printed only once the task has run
`LOG_EVERY_S` and then every `LOG_EVERY_S` — a task that finishes sooner prints nothing, so logs and the one-line
error rule stay as they are. Under torchrun only rank 0 reports (every rank runs the same loop).

A leaf module (no moetron imports): data, eval, plan, interchange and the commands all use it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

T = TypeVar("T")

REDRAW_S = 0.1  # a terminal line redrawn more often is flicker, not information
LOG_EVERY_S = 30.0  # a log line every half minute says "still working" without flooding a log


class Progress:
    """Counts `advance()` calls towards `total` (None: unknown) and reports them on `stream` (stderr)."""

    def __init__(
        self,
        label: str,
        total: int | None = None,
        unit: str = "",
        stream: TextIO | None = None,
        log_every_s: float | None = None,
        enabled: bool | None = None,
    ):
        self.label, self.total, self.unit = label, total, unit
        self.stream = sys.stderr if stream is None else stream
        self.enabled = on_rank_zero() if enabled is None else enabled
        self.terminal = self.enabled and _is_terminal(self.stream)
        self.every_s = REDRAW_S if self.terminal else LOG_EVERY_S if log_every_s is None else log_every_s
        self.done, self.start = 0, time.monotonic()
        self.next_report = self.start + self.every_s
        self.drawn = False

    def advance(self, count: int = 1) -> None:
        self.done += count
        now = time.monotonic()
        if self.enabled and now >= self.next_report:
            self._report(now)
            self.next_report = now + self.every_s

    def track(self, items: Iterable[T]) -> Iterator[T]:
        """`items`, one `advance()` each; closed once they are done (or the loop is left)."""
        try:
            for item in items:
                yield item
                self.advance()
        finally:
            self.close()

    def line(self, now: float | None = None) -> str:
        """`label: done/total unit (rate/s, elapsed)`, e.g. `export: 12/40 tensors (3.1/s, 4 s)`."""
        elapsed = (time.monotonic() if now is None else now) - self.start
        count = f"{self.done}/{self.total}" if self.total is not None else str(self.done)
        rate = f"{self.done / elapsed:.1f}/s, " if elapsed > 0 else ""
        return f"{self.label}: {count}{' ' + self.unit if self.unit else ''} ({rate}{elapsed:.0f} s)"

    def _report(self, now: float) -> None:
        if self.terminal:
            self.stream.write("\r\033[K" + self.line(now))
            self.drawn = True
        else:
            self.stream.write(self.line(now) + "\n")
        self.stream.flush()

    def close(self) -> None:
        """On a terminal: the final count, and the cursor on a line of its own for what the command prints next."""
        if self.terminal and self.drawn:
            self.stream.write("\r\033[K" + self.line() + "\n")
            self.stream.flush()
            self.drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def on_rank_zero() -> bool:
    """True outside torchrun and on its global rank 0 (torchrun's RANK): the process that prints a command's
    messages, before any process group exists."""
    return os.environ.get("RANK", "0") in ("", "0")


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream: no terminal to redraw
        return False
