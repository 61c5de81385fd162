"""One error line, and no hang, when one rank of a pipelined run fails.

A pipeline stage that fails (in its forward, its loss, its backward, its optimizer step, …) cannot tell the other
stages: they are waiting in a receive from it. So the failing rank records its error in the process group's
store — the first rank to record wins (`compare_set`) — and raises it as `RankFailed`, which the CLI prints as
one `error:` line on whichever rank it happened. Its process then exits, taking its sockets with it, and the
ranks that waited on it fail in their collective (gloo at once; NCCL's watchdog, or torchrun stopping the job
when a worker exits, otherwise). Those find the record, know they are not the origin, and leave quietly
(`PeerFailed`: no second message; exit status 1).

    with pipeline_failures(mesh, rank):      # one_failure_line(rank, "pipeline stage 1 of 2") when pp > 1
        the trainer's loop
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from moetron.errors import UserError

KEY = "moetron/first_failure"


class RankFailed(UserError):
    """The first failure of a run, on the rank it happened on (printed there, whatever its rank)."""

    every_rank = True
    exit_code = 1


class PeerFailed(UserError):
    """This rank stopped because another rank failed first (and said so)."""

    quiet = True
    exit_code = 1


def summary(err: BaseException) -> str:
    """The root cause in one line: torch's pipelining wraps stage errors in RuntimeErrors of its own."""
    while err.__cause__ is not None:
        err = err.__cause__
    if isinstance(err, UserError):
        return str(err)
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def claim(message: str) -> bool:
    """Record `message` as the run's first failure; True when no other rank recorded one before."""
    try:
        store = dist.distributed_c10d._get_default_store()  # the store every rank of the group shares
        return store.compare_set(KEY, "", message) == message.encode()
    except Exception:  # noqa: BLE001 - the store is gone with the rank hosting it, which failed first
        return False


@contextlib.contextmanager
def one_failure_line(rank: int, where: str) -> Iterator[None]:
    """Turn any exception in the block into `RankFailed` (first failure of the run) or `PeerFailed` (another
    rank's failure reached this one). Only for multi-process runs (the store must exist)."""
    try:
        yield
    except (RankFailed, PeerFailed):
        raise
    except Exception as err:
        message = f"{where} (rank {rank}) failed: {summary(err)}"
        if claim(message):
            raise RankFailed(message) from err
        raise PeerFailed(message) from err


def pipeline_failures(mesh, rank: int) -> contextlib.AbstractContextManager:
    """`one_failure_line` around a pipelined run (pp > 1); nothing for other layouts."""
    pp = mesh.size("pp")
    if pp == 1 or not mesh.distributed:
        return contextlib.nullcontext()
    return one_failure_line(rank, f"pipeline stage {mesh.coords.pp} of {pp}")
