"""A process id no process has: above the kernel's largest (`/proc/sys/kernel/pid_max`), so `os.kill(pid, 0)`
fails with ESRCH. The tests of stale locks and temporaries use it instead of starting a process to let it die."""

from __future__ import annotations

from pathlib import Path

LINUX_PID_MAX = Path("/proc/sys/kernel/pid_max")


def dead_pid() -> int:
    largest = int(LINUX_PID_MAX.read_text()) if LINUX_PID_MAX.exists() else 99_999  # macOS: 99,998
    return largest + 1
