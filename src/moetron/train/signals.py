"""Graceful stop on SIGTERM / SIGINT (or a wall-clock limit): finish the current step, save a checkpoint, exit 0.

Schedulers (SLURM, Kubernetes) send SIGTERM before killing a job. The handler only raises a flag; the
trainer checks it between steps, so no step is ever cut in half. With several processes the flag is
agreed on by all ranks (a MAX all-reduce), so every rank stops after the same step and saves together.
`--exit-duration-in-mins` raises the same flag (`request`): each rank's clock differs slightly, and the
agreement makes them stop together.
"""

from __future__ import annotations

import signal

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
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


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
