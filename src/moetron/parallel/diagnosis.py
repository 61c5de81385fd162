"""Where each rank is in its collectives, so that a timeout or a dead peer ends a run with one line per rank.

torch's own error for a collective that never completed (a peer stalled: gloo waits `--distributed-timeout-minutes`)
or that lost its peer (a peer died: gloo fails at once with "Connection closed by peer") names a C++ source line,
not what the rank was doing. Every collective site of moetron is therefore labelled with a `Site`:

    SITE = Site("the all-to-all of MoE layer 3 (forward)", group, "expert-parallel")   # built once
    with SITE:                                                                           # two attribute writes
        dist.all_to_all_single(...)

A site that an exception leaves is recorded as the failure's site (the innermost one: it is left first), and the
training loop's boundary (`train/failures.py`) turns a collective failure into one line naming the rank, its mesh
coordinates, the site and the peers it waited for:

    rank 0 (pp 0, dp 0, tp 0, ep 0): the all-to-all of MoE layer 1 (forward) timed out after 0.05 min waiting for
    its expert-parallel peers [0, 1]

Cost on the hot path: Python attribute writes, no collective, no host sync. The record is process-wide rather than
per thread, because on CUDA autograd runs the backward's all-to-alls on its device threads.

NCCL (GPUs): moetron leaves torch's defaults. `TORCH_NCCL_ASYNC_ERROR_HANDLING` (torch's default 3) lets NCCL's
watchdog end a process whose collective timed out, so nothing hangs, but it does so from C++ with its own log (the
watchdog's "WorkNCCL(SeqNum=…, OpType=ALLTOALL_BASE …) ran for … milliseconds before timing out"); a failure that
reaches Python (`DistBackendError`: a peer's communicator aborted, or handling mode 2 set by the user) gets the same
one line. `TORCH_NCCL_BLOCKING_WAIT=1` would make every collective block the host (a sync per collective), so it is
not set.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

# torch's messages for a collective that waited too long, and for one whose peer went away (gloo, NCCL)
TIMEOUT_MARKERS = ("timed out", "timeout")
PEER_LOST_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "read error",
    "communicator was aborted",
    "remote process exited",
)


class _Record:
    """The site this process is in (None outside every site), and the first site an exception left."""

    __slots__ = ("current", "failed", "failed_error", "timeout_minutes")

    def __init__(self):
        self.current: Site | None = None
        self.failed: Site | None = None
        self.failed_error: BaseException | None = None
        self.timeout_minutes: float | None = None


RECORD = _Record()


class Site:
    """A labelled collective site, reusable (build it once where the group is known, enter it at every call).

    `what` completes "rank r (…): <what> timed out"; `group` is the process group (None: the world); `peers` names
    it ("expert-parallel", "data-parallel", "pipeline"; "" for several groups)."""

    __slots__ = ("what", "group", "peers", "_outer")

    def __init__(self, what: str, group=None, peers: str = ""):
        self.what, self.group, self.peers = what, group, peers
        self._outer: Site | None = None

    def __enter__(self) -> Site:
        self._outer, RECORD.current = RECORD.current, self
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        RECORD.current = self._outer
        if exc is not None and not _recorded_in(exc):  # the innermost site: the first one this error leaves
            RECORD.failed, RECORD.failed_error = self, exc
        return False

    def peer_ranks(self) -> list[int] | None:
        """The global ranks of the group (None when no process group exists)."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self.group is None:
            return list(range(dist.get_world_size()))
        return list(dist.get_process_group_ranks(self.group))


NO_SITE = Site("a collective")  # a default for code paths that have no label of their own


def reset() -> None:
    """Forget a recorded failure (a new run in the same process)."""
    RECORD.current = RECORD.failed = RECORD.failed_error = None


def _chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)


def failure_kind(err: BaseException) -> str | None:
    """What kind of collective failure `err` is: "timeout", "peer" (a peer died or closed its connection), or
    None (not a collective's failure)."""
    for link in _chain(err):
        if not isinstance(link, RuntimeError):  # gloo raises RuntimeError; NCCL DistBackendError (a subclass)
            continue
        text = str(link).lower()
        if any(marker in text for marker in PEER_LOST_MARKERS):
            return "peer"
        if any(marker in text for marker in TIMEOUT_MARKERS):
            return "timeout"
    return None


def _recorded_in(err: BaseException) -> bool:
    """Whether the recorded failure is `err` or an error `err` was raised from."""
    return RECORD.failed_error is not None and any(link is RECORD.failed_error for link in _chain(err))


def failed_site(err: BaseException) -> Site | None:
    """The innermost site `err` (or an error it was raised from) left."""
    return RECORD.failed if _recorded_in(err) else None


def coordinates_text(coords) -> str:
    """The rank's place in the mesh: pp 0, dp 1, tp 0, ep 1."""
    return f"pp {coords.pp}, dp {coords.dp}, tp {coords.tp}, ep {coords.ep}"


def set_timeout(minutes: float) -> None:
    """Remember the process group's timeout for the lines (`init_distributed` calls this)."""
    RECORD.timeout_minutes = minutes


def set_group_timeouts(*meshes) -> None:
    """Give every group of these DeviceMeshes the process group's timeout: DeviceMesh creates its groups with
    torch's default (30 min on gloo, 10 on NCCL), not the world's, so an all-to-all over the EP group would wait
    30 minutes whatever --distributed-timeout-minutes says (Megatron passes the timeout to every `new_group`)."""
    if RECORD.timeout_minutes is None:
        return
    timeout = datetime.timedelta(minutes=RECORD.timeout_minutes)
    for mesh in meshes:
        for dim in range(mesh.ndim):
            dist.distributed_c10d._set_pg_timeout(timeout, mesh.get_group(dim))  # torch's own setter (private)


def failure_line(err: BaseException, rank: int, coords, minutes: float | None = None) -> str | None:
    """One line for a collective failure (None when `err` is not one)."""
    kind = failure_kind(err)
    if kind is None:
        return None
    site = failed_site(err)
    what = site.what if site is not None else "a collective"
    ranks = site.peer_ranks() if site is not None else None
    group = f"{site.peers} " if site is not None and site.peers else ""
    peers = f"its {group}peers{f' {ranks}' if ranks else ''}"
    who = f"rank {rank} ({coordinates_text(coords)})"
    if kind == "timeout":
        minutes = RECORD.timeout_minutes if minutes is None else minutes
        after = f" after {minutes:g} min" if minutes is not None else ""
        return (
            f"{who}: {what} timed out{after} waiting for {peers} (one of them is stalled or far behind; "
            f"--distributed-timeout-minutes sets the wait)"
        )
    return f"{who}: {what} lost {peers}: a peer process died or closed its connection (see that rank's own error)"
