"""Graceful stop on SIGTERM / SIGINT (or a wall-clock limit): finish the current step, save a checkpoint, exit 0.

Schedulers (SLURM, Kubernetes) send SIGTERM before killing a job. The handler only raises a flag; the
trainer checks it between steps, so no step is ever cut in half. With several processes the flag is
agreed on by all ranks (a MAX all-reduce), so every rank stops after the same step and saves together.
`--exit-duration-in-mins` raises the same flag (`request`): each rank's clock differs slightly, and the
agreement makes them stop together.

Under `moetron launch` a worker also asks the kernel for a SIGTERM when the launcher dies (`PR_SET_PDEATHSIG`): a
launcher killed with SIGKILL (an OOM killer, `kill -9`) forwards nothing, and workers left on their own would train
unsupervised to the end. With it they stop after the step, save and exit, as on a forwarded SIGTERM.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import torch
import torch.distributed as dist

from moetron.parallel.diagnosis import Site

STOP_SITE = Site("the stop-flag all-reduce (SIGTERM agreement)")


class StopSignal:
    """Installs handlers for SIGTERM and SIGINT while active (a context manager); `requested` says a signal came."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        self.requested = f"received {signal.Signals(signum).name}"

    def request(self, reason: str) -> None:
        """Ask for a stop after this step for a reason of the run's own (e.g. --exit-duration-in-mins)."""
        if self.requested is None:
            self.requested = reason

    def __enter__(self) -> StopSignal:
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be caught here
                pass
        stop_with_launcher(self)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


LAUNCHER_PID = "MOETRON_LAUNCH"  # set by `moetron launch` to its pid (commands/launch.py)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_with_launcher(stop: StopSignal) -> None:
    """A worker of `moetron launch` (whose pid is in MOETRON_LAUNCH, and who is its parent): SIGTERM this process
    when the launcher dies; if it is gone already, stop now. Elsewhere (plain torchrun, one process, not Linux):
    nothing."""
    launcher = os.environ.get(LAUNCHER_PID, "")
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return
    if os.getppid() != int(launcher):
        return  # not the launcher's own child (e.g. a process a worker started): its parent is not the launcher
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != int(launcher):  # it died between the check and the prctl: no signal will come
        stop.request("the launcher (moetron launch) is gone")


class StopFlag:
    """The all-ranks "a signal arrived" verdict of one step, carried by the step's one host read.

    `start` launches an asynchronous MAX all-reduce of this rank's flag (before the step's work, so it completes
    while the step runs); `read_with(norm)` waits for it and reads it in the same device-to-host transfer as the
    gradient norm. In one process there is nothing to agree on: only the norm is read.
    """

    def __init__(self, flag: torch.Tensor | None = None, work=None):
        self.flag, self.work = flag, work

    @classmethod
    def start(cls, stop: StopSignal | None, mesh, device: torch.device) -> StopFlag:
        if not mesh.distributed:
            return cls()
        # torch.full launches a fill: no blocking host-to-device copy (torch.tensor(x, device=cuda) would be one)
        flag = torch.full((), float(stop is not None and stop.requested is not None), device=device)
        return cls(flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True))

    def read_with(self, norm: torch.Tensor) -> tuple[float, bool]:
        """(gradient norm, whether any rank got a signal before this step started)."""
        if self.flag is None:
            return float(norm), False
        with STOP_SITE:
            self.work.wait()
        # float64: the norm is read as computed (the 0/1 flag is exact in any dtype)
        norm_value, flag_value = torch.stack([norm.to(self.flag.device, torch.float64), self.flag.double()]).tolist()
        return norm_value, flag_value > 0
