"""OpenMP wait policy on a busy CPU: the same small-op loop in three child processes, printed as ratios to the default.

    python benchmarks/omp_wait.py [--iters 3000]

Each child runs `--iters` times a 256×64 @ 64×256 matmul, relu and sum (a 64-wide model's kind of op) with torch's
default thread count, under: OpenMP's default (threads spin between ops), `OMP_WAIT_POLICY=PASSIVE` (what the
moetron CLI sets on a CPU machine when the user set no OMP_* variable, see `moetron.cli.cpu_thread_defaults`), and
`OMP_NUM_THREADS=1` (what torchrun sets). Wall clock counts the waits for a core on a shared machine; CPU time is
printed beside it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = """
import time, torch
x, w = torch.randn(256, 64), torch.randn(64, 256)
cpu, wall = time.process_time(), time.perf_counter()
for _ in range({iters}):
    (x @ w).relu().sum()
print(time.perf_counter() - wall, time.process_time() - cpu, torch.get_num_threads())
"""
SETTINGS = {"default (spinning)": {}, "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}}
SETTINGS["OMP_NUM_THREADS=1"] = {"OMP_NUM_THREADS": "1"}


def measure(extra: dict, iters: int) -> tuple[float, float, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")} | extra
    out = subprocess.run([sys.executable, "-c", CHILD.format(iters=iters)], env=env, capture_output=True, text=True)
    wall, cpu, threads = out.stdout.split()
    return float(wall), float(cpu), int(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=3000)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {args.iters} iterations per child")
    base = None
    for name, extra in SETTINGS.items():
        wall, cpu, threads = measure(extra, args.iters)
        base = base or wall
        ratio = wall / base
        print(f"{name:<26} {threads} thread(s): wall {wall:7.2f} s, cpu {cpu:6.2f} s, wall vs default {ratio:.3f}x")


if __name__ == "__main__":
    main()
