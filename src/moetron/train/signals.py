"""Graceful stop on SIGTERM / SIGINT: finish the current step, save a checkpoint, exit 0.

Schedulers (SLURM, Kubernetes) send SIGTERM before killing a job. The handler only raises a flag; the
trainer checks it between steps, so no step is ever cut in half. With several processes the flag is
agreed on by all ranks (a MAX all-reduce), so every rank stops after the same step and saves together.
"""

from __future__ import annotations

import signal


class StopSignal:
    """Installs handlers for SIGTERM and SIGINT while active (a context manager); `requested` says a signal came."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name

    def __enter__(self) -> StopSignal:
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be caught here
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
