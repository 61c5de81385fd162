"""This process's peak resident set, read without torch (the `plan --measure` worker reads it before and after
`moetron train`, whose CPU defaults must be set before torch is imported)."""

from __future__ import annotations

import resource
import sys
from pathlib import Path


def peak_rss_bytes() -> int:
    """This process's own peak resident set: /proc/self/status VmHWM on Linux (per address space, so it starts
    afresh at exec), else `ru_maxrss` — which on Linux a child inherits from its launcher at fork and keeps until
    it exceeds it: a small run started from a large process (a test runner, a notebook) would report the
    launcher's peak as its own."""
    hwm = vmhwm_bytes()
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes


def vmhwm_bytes() -> int | None:
    """/proc/self/status VmHWM in bytes; None where there is no /proc (not Linux)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    return None
