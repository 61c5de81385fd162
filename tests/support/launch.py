"""Run a function in N gloo processes (like `torchrun --nproc-per-node N`) and collect what each returns.

    from launch import run_distributed
    results = run_distributed(check_fn, world_size=2, args=(tmp_path,))   # results[rank] = check_fn(rank, ...)

`fn` must be a module-level function (it is pickled by name into spawned processes) taking `(rank, world_size,
*args)`; its return value must be picklable (tensors are fine). Each process gets torchrun's environment
variables, one CPU thread, and a gloo process group (initialised by `moetron.parallel.env.init_distributed`,
so the code under test sees exactly what it sees under torchrun). A failure in any rank raises here with that
rank's traceback; a hang raises after `timeout` seconds. Keep groups few: put several checks in one `fn`.
`fn`'s module resolves in the children because spawn hands them the parent's `sys.path` (pytest's `pythonpath`).

A rank killed by a signal (a segfault in a native thread: gloo's, say) reports nothing itself; the error then
names its exit signal and quotes its `faulthandler` dump, the Python stack of every one of its threads at the
moment it died — which line the main thread was running, e.g. which collective. Such a rank is noticed within
about a second even when its peers finish without it.
"""

from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_bytes(value) -> bytes:
    """Tensors in a multiprocessing queue travel as shared-memory handles that die with their process; send
    plain bytes instead, so results survive the worker's exit."""
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes):
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(fn, rank: int, world_size: int, port: int, args: tuple, results, dump_dir: str) -> None:
    # on SIGSEGV / SIGABRT / SIGBUS / SIGFPE / SIGILL: every thread's Python stack, read back by the parent
    dump = open(_dump_path(dump_dir, rank), "w")  # noqa: SIM115 - open until the process dies
    faulthandler.enable(file=dump, all_threads=True)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import torch

    from moetron.parallel.env import init_distributed

    torch.set_num_threads(1)
    env = None
    try:
        env = init_distributed(backend="gloo", timeout_minutes=2)
        results.put((rank, "ok", _to_bytes(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if env is not None:
            env.close()


def _dump_path(dump_dir: str, rank: int) -> Path:
    return Path(dump_dir) / f"rank_{rank}.faulthandler"


def _signal_dump(dump_dir: str, rank: int) -> str:
    """What faulthandler wrote when `rank` died (empty when it did not die of a fatal signal)."""
    path = _dump_path(dump_dir, rank)
    return path.read_text(errors="replace").strip() if path.exists() else ""


def _died_silently(procs, collected: dict, errors: list[str]) -> bool:
    """A rank has exited with a failure code but reported nothing (a signal, or os._exit)."""
    reported = set(collected) | {int(e.split()[1]) for e in errors}
    return any(p.exitcode not in (None, 0) and rank not in reported for rank, p in enumerate(procs))


def _late_errors(results, procs, collected: dict, errors: list[str], dump_dir: str) -> list[str]:
    """What the other ranks reported after the first error, and which ranks exited without reporting."""
    late, reported = [], set(collected) | {int(e.split()[1]) for e in errors}
    while True:
        try:
            rank, status, value = results.get(timeout=1)
        except queue.Empty:
            break
        reported.add(rank)
        if status == "error":
            late.append(f"rank {rank} failed too:\n{value}")
    for rank, p in enumerate(procs):
        if rank not in reported:
            late.append(f"rank {rank} exited with code {p.exitcode} without a result (negative: killed by that signal)")
            if dump := _signal_dump(dump_dir, rank):
                late.append(f"rank {rank}'s faulthandler dump (every thread's Python stack when it died):\n{dump}")
    return late


class RankSegfaulted(AssertionError):
    """A rank of the group died of SIGSEGV (the message holds its threads' Python stacks)."""


def run_distributed(fn, world_size: int = 2, args: tuple = (), timeout: float = 180.0) -> list:
    """`[fn(0, world_size, *args), fn(1, world_size, *args), ...]`, each computed in its own process.

    A group in which a rank dies of SIGSEGV runs once more, and the test fails only if it crashes again. Why: under a
    loaded 2-core machine torch 2.13's functional all-reduce in a DTensor backward (gloo) was seen to segfault about
    once in 20 runs of tests/distributed/test_mla_tensor_parallel.py (never alone on an idle machine, never twice in
    a row); the first crash's stacks are printed to stderr, so a crash that repeats is still a failure, with both."""
    try:
        with tempfile.TemporaryDirectory(prefix="launch_dumps_") as dump_dir:
            return _run(fn, world_size, args, timeout, dump_dir)
    except RankSegfaulted as crash:
        print(f"distributed test: a rank segfaulted; running the group once more. The crash:\n{crash}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="launch_dumps_") as dump_dir:
        return _run(fn, world_size, args, timeout, dump_dir)


def _run(fn, world_size: int, args: tuple, timeout: float, dump_dir: str) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results, dump_dir)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    collected: dict[int, object] = {}
    errors = []
    deadline = time.monotonic() + timeout
    try:
        while len(collected) + len(errors) < world_size:
            try:
                rank, status, value = results.get(timeout=1)
            except queue.Empty:
                if _died_silently(procs, collected, errors):
                    break  # its peers may finish, or wait in a collective until their own timeout: report it now
                if time.monotonic() > deadline:
                    raise TimeoutError(f"distributed test: no result from every rank within {timeout}s") from None
                continue
            if status == "ok":
                collected[rank] = _from_bytes(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break  # the other ranks are likely blocked in a collective
    finally:
        failed = bool(errors) or len(collected) < world_size
        for p in procs:
            p.join(timeout=5 if failed else 30)
            if p.is_alive():
                p.terminate()
                p.join()
    if failed:
        # the first error is often a peer's "connection reset": name the rank that died without a word (a
        # signal, e.g. -11 for a segfault, with its threads' Python stacks) and the other ranks' own errors
        errors += _late_errors(results, procs, collected, errors, dump_dir)
        crashed = any(p.exitcode == -signal.SIGSEGV for p in procs)
        raise (RankSegfaulted if crashed else AssertionError)("\n".join(errors))
    return [collected[r] for r in range(world_size)]
