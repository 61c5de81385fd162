"""Pipeline parallelism on CPU (gloo): the measured bubble against (p − 1) / (m + p − 1), tokens/s against one
process and against DP = 2, and each stage's peak memory against `moetron plan`'s — all measured in this one
script, one layout after the other (it spawns each process group itself).

    python benchmarks/pipeline_parallel.py                          # m = 4, 8, 16 micro-batches
    python benchmarks/pipeline_parallel.py --steps 4 --seq 256

Model: 8 layers, hidden 256, 4 heads, 8 experts on every 2nd layer (4 MoE layers), top-2, vocabulary 4096, dropout
off; micro batch 2; AdamW. PP = 2 runs 1F1B (and interleaved 1F1B with 2 virtual stages per rank at m = 8) on 2
processes; the baseline runs the same global batch (micro batch × m) on 1 process, and DP = 2 the same global batch
on 2 processes. One thread per process (`tests/support/launch.py` spawns each group).

Bubble: each rank's busy time is the time inside its stages' forward and backward of a micro-batch and the loss;
the bubble is 1 − busy / (the schedule's step time), the mean over ranks and measured steps. (p − 1)/(m + p − 1)
assumes equal stages; the "unequal stages" column is 1F1B's bubble for the measured per-rank busy times t_r (step =
(m − 1)·max t + Σ t; the last stage also runs the head and the loss). Each layout runs `--repeats` times, alternating
with the others, and the fastest run counts (the machine is shared). Memory: the peak of torch's CPU allocator
during one steady-state step, above what is live when it starts (weights and Adam state), against the plan's peak
of that rank minus the same weights and Adam state.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from memory_peak import peak_cpu_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from launch import run_distributed  # noqa: E402 - spawns a gloo group (torchrun's environment, 1 thread each)
from moetron.data.synthetic import RandomTokenLoader

from moetron.config import RunConfig
from moetron.parallel.env import init_distributed
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.parallelize import build
from moetron.train.trainer import Trainer

MICRO_BATCHES = (4, 8, 16)


def bench_config(args: argparse.Namespace, pp: int, micro: int, dp: int, virtual: int | None = None) -> RunConfig:
    cfg = RunConfig()
    m, t, p = cfg.model, cfg.train, cfg.parallel
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 8, 256, 4, args.seq
    m.num_experts, m.topk, m.vocab_size, m.make_vocab_size_divisible_by = [8], 2, 4096, 128
    m.hidden_dropout = m.attention_dropout = 0.0
    t.micro_batch_size, t.global_batch_size = args.micro_batch, args.micro_batch * micro
    t.train_iters, t.log_interval, t.eval_iters = args.warmup + args.steps + 1, 1000, 0
    p.pipeline_model_parallel_size, p.num_layers_per_virtual_pipeline_stage = pp, virtual
    return cfg


class BusyClock:
    """Adds up the time this rank spends computing micro-batches (patched into the stage and the executor)."""

    def __init__(self):
        self.busy = 0.0

    def wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)

        def timed(*a, **kw):
            start = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                self.busy += time.perf_counter() - start

        setattr(owner, name, timed)


def measure(rank: int, world: int, cfg: RunConfig, args: argparse.Namespace) -> tuple:
    """One rank of a layout (run by `run_distributed`: gloo, one thread): its timings and memory."""
    env = init_distributed()
    clock = BusyClock()
    pipelined = cfg.parallel.pipeline_model_parallel_size > 1
    if pipelined:
        from moetron.parallel.pp.schedules import MoetronStage
        from moetron.train.pipeline_executor import PipelineExecutor

        for owner, name in ((MoetronStage, "forward_one_chunk"), (MoetronStage, "backward_one_chunk"),
                            (PipelineExecutor, "_scaled_loss")):  # fmt: skip
            clock.wrap(owner, name)
    mesh = ParallelMesh.build(cfg.dims(world), env)
    parallel = build(cfg, mesh, env.device)
    model = parallel.model
    loader = RandomTokenLoader(cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.vocab_size, seed=rank)
    trainer = Trainer(cfg, env, parallel, loader)
    step_clock = BusyClock()
    if pipelined:
        step_clock.wrap(trainer.executor.schedule, "step")
    for _ in range(args.warmup):
        trainer.train_step()
    times, bubbles, busy = [], [], []
    for _ in range(args.steps):
        env.barrier()
        clock.busy = step_clock.busy = 0.0
        start = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - start)
        if pipelined:
            bubbles.append(1 - clock.busy / step_clock.busy)
            busy.append(clock.busy)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    adam = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values() for t in s.values())
    env.barrier()
    peak = peak_cpu_bytes(trainer.train_step)
    busy_s = statistics.median(busy) if busy else 0.0
    return mesh.coords.pp, statistics.median(times), bubbles, peak, weights + adam, busy_s


def run_layout(cfg: RunConfig, world: int, args: argparse.Namespace) -> dict:
    rows = run_distributed(measure, world_size=world, args=(cfg, args), timeout=3600)
    step = max(r[1] for r in rows)
    bubbles = [b for r in rows for b in r[2]]
    tokens = cfg.global_batch(cfg.dims(world).dp) * cfg.model.seq_length
    m = cfg.num_micro_batches(cfg.dims(world).dp)
    per_micro = [r[5] / m for r in rows]  # each rank's busy seconds per micro-batch
    unequal = 0.0
    if any(per_micro):
        step_1f1b = (m - 1) * max(per_micro) + sum(per_micro)
        unequal = statistics.mean(1 - m * t / step_1f1b for t in per_micro)
    return {
        "tokens_per_s": tokens / step,
        "bubble": statistics.mean(bubbles) if bubbles else 0.0,
        "unequal": unequal,
        "peaks": {r[0]: r[3] for r in rows},  # pipeline rank → measured step peak above weights + Adam
    }


def planned_step_peaks(cfg: RunConfig, world: int) -> dict[int, int]:
    """The plan's per-rank peak minus the weights and Adam state (what is live before a step), CPU device."""
    from moetron.plan.memory import estimate_memory
    from moetron.plan.stages import plan_stages

    dims = cfg.dims(world)
    if dims.pp == 1:
        est = estimate_memory(cfg, dims, "cpu")
        return {0: est.peak - est.weights - est.optimizer - est.ddp_buckets}
    return {s.rank: s.memory.peak - s.memory.weights - s.memory.optimizer - s.memory.ddp_buckets
            for s in plan_stages(cfg, dims, "cpu")}  # fmt: skip


def best_of(runs: list[dict]) -> dict:
    return max(runs, key=lambda r: r["tokens_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="measured optimizer steps per layout")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each layout, alternating; the fastest counts")
    args = parser.parse_args()
    print(f"8 layers, hidden 256, 4 MoE layers of 8 experts, seq {args.seq}, micro batch {args.micro_batch} (CPU)")
    print("| layout | m | tokens/s | ratio vs 1 process | bubble measured | (p−1)/(m+p−1) | unequal stages |")
    print("|---|---|---|---|---|---|---|")
    memory_rows = []
    for m in MICRO_BATCHES:
        layouts = [("1 process", bench_config(args, 1, m, 1), 1, None)]
        layouts.append(("PP=2 1F1B", bench_config(args, 2, m, 1), 2, 1 / (m + 1)))
        if m == 8:
            layouts.append(("PP=2 interleaved (v=2)", bench_config(args, 2, m, 1, virtual=2), 2, 1 / (2 * m + 1)))
            layouts.append(("DP=2", bench_config(args, 1, m, 2), 2, None))
        runs: dict[str, list[dict]] = {name: [] for name, *_ in layouts}
        for _ in range(args.repeats):
            for name, cfg, world, _ in layouts:
                runs[name].append(run_layout(cfg, world, args))
        base = best_of(runs["1 process"])
        for name, cfg, world, theory in layouts:
            r = best_of(runs[name])
            ratio = r["tokens_per_s"] / base["tokens_per_s"]
            pipelined = "PP" in name
            cells = [f"{r['bubble']:.3f}", f"{theory:.3f}", f"{r['unequal']:.3f}"] if pipelined else ["–"] * 3
            cells[2] = cells[2] if name == "PP=2 1F1B" else "–"
            print(f"| {name} | {m} | {r['tokens_per_s']:.0f} | {ratio:.2f}x | {' | '.join(cells)} |", flush=True)
            if name == "PP=2 1F1B":
                memory_rows.append((m, r["peaks"], planned_step_peaks(cfg, world)))
    print("\nper-stage peak memory of one step (MiB above weights + Adam): measured / planned")
    print("| m | stage 0 | stage 1 |")
    print("|---|---|---|")
    for m, measured, planned in memory_rows:
        cells = [
            f"{measured[s] / 2**20:.1f} / {planned[s] / 2**20:.1f} ({measured[s] / planned[s]:.2f})" for s in (0, 1)
        ]
        print(f"| {m} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
