"""Process environment: torchrun's variables, the process group, the device; a no-op path for one process.

`torchrun` sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT. Without them moetron runs as a
single process and never touches `torch.distributed`. The backend is chosen from the device: NCCL when CUDA is
available, gloo otherwise (every feature works on CPU), unless `--distributed-backend` says otherwise.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moetron.parallel import diagnosis

RUN_FINISHED_OBSERVERS: list[Callable[[], None]] = []  # called by `DistEnv.finish` before the process leaves


def world_size_from_env() -> int:
    """The world size torchrun announced (1 without torchrun); readable before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    initialized_here: bool = False  # True when `init_distributed` created the group (so it destroys it too)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce_(self, tensor: torch.Tensor, op=None) -> torch.Tensor:
        """In-place all-reduce (SUM by default) over the world; identity in one process."""
        if self.distributed:
            dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
        return tensor

    def broadcast_object(self, obj):
        """Rank 0's Python object on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.initialized_here and dist.is_initialized():
            dist.destroy_process_group()
            self.initialized_here = False

    def finish(self, returncode: int) -> int:
        """End a finished run: `close()` in one process; under torchrun, leave together and exit at once.

        Tearing down gloo's C++ transport after the work is done sometimes aborts the process ("terminate called
        without an active exception"; seen after torchrun restarts), and torchrun would then count a completed run
        as failed. So every rank waits for the others, flushes its output and exits without that teardown — the
        OS closes the sockets. `os._exit` skips `atexit`, so whoever must see the end of a run (the planner's
        measuring worker) registers in `RUN_FINISHED_OBSERVERS`, called here on both paths.
        """
        for observe in RUN_FINISHED_OBSERVERS:
            observe()
        if not (self.initialized_here and dist.is_initialized() and self.distributed):
            self.close()
            return returncode
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(returncode)


def choose_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


JOIN_MINUTES = 10.0  # how long ranks wait for each other at startup, however short the collective timeout


def restart_safe_store(world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun's agent store, a store whose keys are private to this restart attempt (None otherwise).

    After `torchrun --max-restarts N` restarts the workers, the agent's TCPStore still holds the previous attempt's
    keys, and gloo's rendezvous then reads the dead peers' addresses ("Connection refused"). Prefixing every key
    with the restart count gives each attempt a clean namespace.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"moetron/attempt_{attempt}", store)


def joined_store(world_size: int, rank: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store (torchrun's agent store, or one hosted by rank 0), once every rank has reached it.

    `--distributed-timeout-minutes` may be seconds (to find a stalled rank quickly); the ranks' start-up (imports,
    CUDA) is not held to it: they meet here under `timeout`, then join the process group together."""
    store = restart_safe_store(world_size, timeout)
    if store is None:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=rank == 0,
            timeout=timeout,
        )  # fmt: skip
    if store.add("moetron/joined", 1) == world_size:
        store.set("moetron/all_joined", "1")
    store.wait(["moetron/all_joined"])
    return store


def init_distributed(backend: str | None = None, timeout_minutes: float = 10.0) -> DistEnv:
    """Join torchrun's process group (or reuse an existing one); a plain single-process env without torchrun.

    `timeout_minutes` (`--distributed-timeout-minutes`) is how long any collective waits for its peers before it
    fails (and the run ends with one line per rank: `moetron.parallel.diagnosis`)."""
    world_size = world_size_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = choose_device(local_rank)
    if world_size == 1 and not dist.is_initialized():
        return DistEnv(device=device)
    created = False
    if not dist.is_initialized():
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        timeout = datetime.timedelta(minutes=timeout_minutes)
        rank = int(os.environ["RANK"])
        join = max(timeout, datetime.timedelta(minutes=JOIN_MINUTES))
        kwargs = {"device_id": device} if backend == "nccl" else {}
        store = joined_store(world_size, rank, join)
        dist.init_process_group(backend, timeout=timeout, store=store, rank=rank, world_size=world_size, **kwargs)
        diagnosis.set_timeout(timeout_minutes)
        created = True
    return DistEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        initialized_here=created,
    )
