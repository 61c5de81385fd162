"""Time the training loop loses per checkpoint save: `--async-save` vs the synchronous save, on a ~100 MB model.

One process, a dense GPT of `--hidden-size` × `--num-layers` (default 512 × 8: 25M parameters, 101 MB of fp32
weights; with AdamW's two moments a checkpoint holds ~300 MB), trained by hand step by step (the trainer's own
`train_step` and `save`). Each round runs three segments of `--steps-per-save` steps, in an order that rotates from
round to round so the shared machine's load drifts over all of them alike:

  baseline  the steps alone
  sync      a synchronous save (the loop is blocked for all of it), then the steps
  async     an asynchronous save (the loop is blocked for building the state dict and starting the copy), then the
            steps, the first of which waits for the staging copy before its optimizer update while the write runs
            in the background, and more steps until the write is published: all of the write's effect on the loop
            is inside the segment

The time a save costs the loop is the segment's wall time minus the same round's baseline for as many steps (paired,
so drift cancels): the save call, the wait for the copy, and whatever the background threads took from the steps
(CPU, the GIL, memory bandwidth, the disk). On a shared host the wall time is mostly other jobs' doing, so the loop
thread's clocks are read too (Linux schedstat): "net of run-queue waits" is the wall time less the time the loop
was runnable but another task had its core (the other jobs, and the save's own threads when they take the loop's
core: on a host with a core to spare for them, every GPU host, that part is zero); what remains is its CPU time
and its waits (the GIL, the copy, I/O). Also printed: the loop thread's CPU time (`time.thread_time`), inside
`save()` and over the segment, and the process CPU time the save added (all threads: what it costs the machine).
Prints the median over `--rounds` and the ratios async / sync (the issue's target: time lost at most 0.2).

    python benchmarks/async_save.py [--rounds 6] [--steps-per-save 8] [--threads 1] [--hidden-size 512] [--num-layers 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # the tests' in-memory trainer
from trainer_support import build_trainer, tiny_config  # noqa: E402

SIDES = ("baseline", "sync", "async")


def step(trainer) -> None:
    trainer._account(trainer.train_step())


def loop_thread_clock() -> dict[str, float]:
    """The loop thread's wall clock, CPU time and run-queue wait (Linux schedstat: time it was runnable while
    another task had the core; on a shared host that is the other jobs' doing, not the save's)."""
    out = {"wall": time.perf_counter(), "loop_cpu": time.thread_time(), "cpu": time.process_time(), "queued": 0.0}
    stat = Path(f"/proc/self/task/{threading.get_native_id()}/schedstat")
    if stat.exists():
        out["queued"] = int(stat.read_text().split()[1]) / 1e9
    return out


def segment(trainer, side: str, steps: int) -> dict[str, float]:
    """One segment: (a save, then) `steps` steps, and for the async save more steps until its write is published
    (so that all the write's effect on the steps is inside the segment); the clocks' differences and the steps."""
    start = loop_thread_clock()
    out = {"blocked": 0.0, "save_thread_cpu": 0.0, "write": 0.0, "copy_wait": 0.0}
    if side != "baseline":
        trainer.save()
        out["blocked"], out["save_thread_cpu"] = (
            time.perf_counter() - start["wall"],
            time.thread_time() - start["loop_cpu"],
        )
    saver = trainer.async_saver if side == "async" else None
    if saver is not None:  # time the optimizer updates' waits for the staging copy (inside the steps)
        original = type(saver).before_update

        def timed_wait():
            begin = time.perf_counter()
            original(saver)
            out["copy_wait"] += time.perf_counter() - begin

        saver.before_update = timed_wait
    done = 0
    while done < steps or (saver is not None and saver._thread.is_alive()):
        step(trainer)
        done += 1
        if saver is not None and not out["write"] and not saver._thread.is_alive():
            out["write"] = time.perf_counter() - start["wall"]  # from the save call until the write was published
    if saver is not None:
        del saver.before_update
        saver.wait()
    end = loop_thread_clock()
    out.update({key: end[key] - start[key] for key in end}, steps=done)
    out["unqueued"] = out["wall"] - out["queued"]
    return out


def build(run: Path, async_save: bool, args):
    cfg = tiny_config(moe=False, save=str(run), async_save=async_save, keep_last_n=1, train_iters=10**6)
    cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_attention_heads = args.hidden_size, args.num_layers, 8
    cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.0
    trainer = build_trainer(cfg)
    trainer.model.train()
    for _ in range(2):  # warm up: allocator, optimizer state (so the first save holds Adam's moments)
        step(trainer)
    return trainer


def load_average() -> str:
    return Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "n/a"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps-per-save", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the training loop")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loads = [load_average()]
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {"sync": build(Path(tmp) / "sync", False, args), "async": build(Path(tmp) / "async", True, args)}
        trainers["baseline"] = trainers["sync"]
        for trainer in ("sync", "async"):  # a first save of each, not counted: DCP's and the stager's first-use costs
            segment(trainers[trainer], trainer, 1)
        params = sum(p.numel() for p in trainers["sync"].model.parameters())
        runs: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
        for round_ in range(args.rounds):
            order = SIDES[round_ % 3 :] + SIDES[: round_ % 3]
            for side in order:
                runs[side].append(segment(trainers[side], side, args.steps_per_save))
            lost = {s: lost_per_save(runs, s, -1, "wall") for s in ("sync", "async")}
            print(
                f"round {round_ + 1} ({' '.join(order)}): lost sync {lost['sync']:.3f} s, async {lost['async']:.3f} s"
                f" (net of run-queue waits: sync {lost_per_save(runs, 'sync', -1, 'unqueued'):.3f} s, async"
                f" {lost_per_save(runs, 'async', -1, 'unqueued'):.3f} s; async segment {runs['async'][-1]['steps']}"
                " steps)"
            )
            loads.append(load_average())
        checkpoint_mb = sum(f.stat().st_size for f in (Path(tmp) / "sync").rglob("*.distcp")) / 1e6

    def median(side: str, key: str, minus_baseline: bool = False) -> float:
        if minus_baseline:
            return statistics.median(lost_per_save(runs, side, i, key) for i in range(args.rounds))
        return statistics.median(r[key] for r in runs[side])

    step_s = statistics.median(r["wall"] for r in runs["baseline"]) / args.steps_per_save
    model = f"{params / 1e6:.1f}M parameters ({params * 4 / 1e6:.0f} MB fp32), checkpoint {checkpoint_mb:.0f} MB"
    print(f"model: {model}; {args.threads} thread(s); median step {step_s:.3f} s; {args.rounds} rounds of ", end="")
    print(f"{args.steps_per_save} steps; load average (1 min): {', '.join(loads)}")
    columns = [  # (header, key, minus the round's baseline per step)
        ("loop time lost per save s", "wall", True),
        ("same, net of run-queue waits s", "unqueued", True),
        ("loop-thread CPU lost per save s", "loop_cpu", True),
        ("blocked in save() s", "blocked", False),
        ("loop-thread CPU in save() s", "save_thread_cpu", False),
        ("optimizer waits for the copy s", "copy_wait", False),
        ("process CPU added s", "cpu", True),
    ]
    print("| save | " + " | ".join(c[0] for c in columns) + " | write done after s |")
    print("|---" * (len(columns) + 2) + "|")
    for side in ("sync", "async"):
        write = f"{median(side, 'write'):.2f}" if side == "async" else "(in save())"
        cells = [f"{median(side, key, minus):.3f}" for _, key, minus in columns]
        print(f"| {side} | " + " | ".join(cells) + f" | {write} |")
    for label, key, minus in (("time lost per save", "wall", True), ("time lost net of run-queue waits",
                              "unqueued", True), ("loop-thread CPU lost per save", "loop_cpu", True),
                              ("blocked in save()", "blocked", False)):  # fmt: skip
        print(f"async / sync {label}: {median('async', key, minus) / median('sync', key, minus):.2f}")
    for key, what in (("wall", "time lost"), ("unqueued", "net of run-queue waits")):
        spread = statistics.quantiles([r[key] / r["steps"] * args.steps_per_save for r in runs["baseline"]], n=4)
        print(f"baseline segment interquartile range, {what}: {spread[2] - spread[0]:.3f} s (the noise of '{what}')")
    return 0


def lost_per_save(runs: dict[str, list[dict[str, float]]], side: str, round_: int, key: str) -> float:
    """`key`'s value over round `round_`'s `side` segment minus the same round's baseline for as many steps."""
    run, base = runs[side][round_], runs["baseline"][round_]
    return run[key] - base[key] / base["steps"] * run["steps"]


if __name__ == "__main__":
    sys.exit(main())
