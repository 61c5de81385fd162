"""One error line per rank, and no hang, when a rank of a multi-process run fails, stalls or dies.

A pipeline stage that fails (in its forward, its loss, its backward, its optimizer step, …) cannot tell the other
stages: they are waiting in a receive from it. So the failing rank records its error in the process group's
store — the first rank to record wins (`compare_set`) — and raises it as `RankFailed`, which the CLI prints as
one `error:` line on whichever rank it happened. Its process then exits, taking its sockets with it, and the
ranks that waited on it fail in their collective (gloo at once; NCCL's watchdog, or torchrun stopping the job
when a worker exits, otherwise). Those find the record, know they are not the origin, and leave quietly
(`PeerFailed`: no second message; exit status 1).

A collective that times out (a stalled peer: `--distributed-timeout-minutes`) or loses its peer (a rank that died
without a word: SIGKILL, out of memory) with no record in the store becomes `CollectiveFailed`, printed by every
rank it happens on: its rank, mesh coordinates, and the collective it was in (`moetron.parallel.diagnosis`):

    error: rank 0 (pp 0, dp 0, tp 0, ep 0): the all-to-all of MoE layer 1 (forward) timed out after 0.1 min …

    with rank_failures(mesh, rank):        # every multi-process run; stage errors claimed as above when pp > 1
        the trainer's loop
    with collective_failures(mesh, rank):  # only the collective part (loading a checkpoint)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from moetron.errors import UserError
from moetron.parallel import diagnosis

KEY = "moetron/first_failure"


class RankFailed(UserError):
    """The first failure of a run, on the rank it happened on (printed there, whatever its rank)."""

    every_rank = True
    exit_code = 1


class PeerFailed(UserError):
    """This rank stopped because another rank failed first (and said so)."""

    quiet = True
    exit_code = 1


class CollectiveFailed(UserError):
    """This rank's collective timed out or lost its peer, and no rank recorded a failure first (said by every
    rank it happens on, each naming where it was)."""

    every_rank = True
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


def recorded() -> bool:
    """Whether some rank recorded a failure (False too when the store went away with the rank hosting it)."""
    try:
        return dist.distributed_c10d._get_default_store().check([KEY])
    except Exception:  # noqa: BLE001 - the store is gone: nobody can have said anything there
        return False


@contextlib.contextmanager
def one_failure_line(rank: int, where: str | None, coords=None) -> Iterator[None]:
    """Turn a collective's timeout or lost peer into `CollectiveFailed` (`PeerFailed` when another rank recorded
    the failure behind it), and, when `where` names a pipeline stage, any other exception in the block into
    `RankFailed` (first failure of the run) or `PeerFailed`. Only for multi-process runs (the store must exist)."""
    try:
        yield
    except (RankFailed, PeerFailed, CollectiveFailed):
        raise
    except Exception as err:
        line = diagnosis.failure_line(err, rank, coords) if coords is not None else None
        if line is not None:  # only pipeline stages record failures (and a dead store host costs a C++ warning)
            raise (PeerFailed if where is not None and recorded() else CollectiveFailed)(line) from err
        if where is None:
            raise
        message = f"{where} (rank {rank}) failed: {summary(err)}"
        if claim(message):
            raise RankFailed(message) from err
        raise PeerFailed(message) from err


def collective_failures(mesh, rank: int) -> contextlib.AbstractContextManager:
    """Only the collective part of `one_failure_line` (a timeout or lost peer as one line; other errors pass), for
    the collectives outside the training loop (loading a checkpoint); nothing in one process."""
    return one_failure_line(rank, None, mesh.coords) if mesh.distributed else contextlib.nullcontext()


def rank_failures(mesh, rank: int) -> contextlib.AbstractContextManager:
    """`one_failure_line` around a multi-process run (naming the pipeline stage when pp > 1); nothing in one."""
    if not mesh.distributed:
        return contextlib.nullcontext()
    pp = mesh.size("pp")
    where = f"pipeline stage {mesh.coords.pp} of {pp}" if pp > 1 else None
    return one_failure_line(rank, where, mesh.coords)
