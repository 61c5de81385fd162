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

Any other error of one rank after the process group exists is that rank's own (rank 1's corrupt RNG file, a tensor
only pipeline stage 1 loads): `own_errors` around the command's distributed part has the rank say it itself,
`error: rank 1: …` (rank 0's without the prefix), each distinct message once over the run however many ranks hit
it (the store counts them), and records it as the run's first failure so that the ranks it leaves waiting stay
quiet. An internal error (not a `UserError`) keeps its traceback, printed by its own rank. Errors before the
process group exists (the config's) are every rank's alike: rank 0 says them (`moetron.cli.report_user_error`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator

import torch.distributed as dist

from moetron.errors import SaidByAnotherRank, UserError
from moetron.parallel import diagnosis

KEY = "moetron/first_failure"
SAID = "moetron/said/"  # + a digest of an error line: how many ranks raised it (the first one says it)


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


class OwnError(UserError):
    """A rank's own error after startup, said by that rank; `quiet` where another rank already said the same."""

    every_rank = True

    def __init__(self, message: str, exit_code: int, quiet: bool = False):
        super().__init__(message)
        self.exit_code, self.quiet = exit_code, quiet


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


def first_to_say(message: str) -> bool:
    """Whether no rank raised `message` before (True when the store cannot tell: said twice beats never)."""
    key = SAID + hashlib.sha256(message.encode()).hexdigest()[:32]
    try:
        return dist.distributed_c10d._get_default_store().add(key, 1) == 1
    except Exception:  # noqa: BLE001 - the store went away with the rank hosting it
        return True


def store_outlives_peers(rank: int) -> bool:
    """Whether asking the store cannot hit a dead host (which costs a C++ warning): torchrun's agent hosts it, or
    this rank does (global rank 0, when the ranks were started without torchrun)."""
    return rank == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


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
        if line is not None:  # a peer that recorded its failure said it; asking a dead store host costs a warning
            peer_said = (where is not None or store_outlives_peers(rank)) and recorded()
            raise (PeerFailed if peer_said else CollectiveFailed)(line) from err
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


@contextlib.contextmanager
def own_errors() -> Iterator[None]:
    """Around the part of a command that runs in the process group (see the module's docstring): a `UserError`
    becomes `OwnError` (said by this rank unless another rank said the same), an internal error is recorded as
    the run's first failure and keeps its traceback. Nothing changes in one process or before the group exists."""
    try:
        yield
    except (RankFailed, PeerFailed, CollectiveFailed, OwnError, SaidByAnotherRank):
        raise
    except Exception as err:
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            raise
        rank = dist.get_rank()
        if not isinstance(err, UserError):
            claim(f"rank {rank} failed: {summary(err)}")
            raise
        message = str(err) if rank == 0 else f"rank {rank}: {err}"
        claim(message)
        raise OwnError(message, getattr(err, "exit_code", 2), quiet=not first_to_say(str(err))) from err
