"""Spawn one gloo process group for a benchmark and collect what every rank reports (used by the scripts here)."""

from __future__ import annotations

import multiprocessing as mp
import socket


def spawn_group(target, world: int, args: tuple, timeout: float = 3600, per_rank: int = 1) -> list:
    """Run `target(rank, world, port, *args, results)` in `world` fresh processes; each puts `per_rank` tuples on
    `results` (its rank first). Returns them sorted by rank (a rank's own in the order it put them)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, world, port, *args, results)) for r in range(world)]
    for p in procs:
        p.start()
    rows = sorted((results.get(timeout=timeout) for _ in range(world * per_rank)), key=lambda row: row[0])
    for p in procs:
        p.join()
    return rows


def timed_steps(trainer, env, steps: int) -> float:
    """Wall seconds of `steps` optimizer steps, every rank starting and ending together (barriers)."""
    import time

    env.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    env.barrier()
    return time.perf_counter() - start
