"""Expert parallelism on the seed's small MoE model: training tokens/s of EP = 2 on 2 processes against EP = 1
on 1 process and against DP = 2 without EP, measured one after the other in this one script (it spawns each
process group itself), plus the bytes the all-to-alls move per step against the model's activation size.

    python benchmarks/expert_parallel.py                    # seq 64 (the seed uses 2048: shortened for CPU)
    python benchmarks/expert_parallel.py --seq 128 --steps 6 --micro-batch 2

Model: 4 layers, hidden 256, 4 heads, 128 experts every 2nd layer (2 MoE layers), top-1, capacity factor 1.0,
GPT-2 vocabulary; AdamW. Each process trains on its own micro-batch (global batch = micro batch × processes),
so tokens/s counts every process's tokens. Gloo on CPU: one thread per process.
Reported: tokens/s and its ratio to EP = 1 on one process; per-rank expert parameters; all-to-all bytes per
step (dispatch + combine, forward + backward, every MoE layer; rows a rank keeps for itself included) and
their ratio to the activation bytes of one step (the [tokens, hidden] input of every transformer layer).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # test instruments live there
from random_tokens import RandomTokenLoader  # noqa: E402

from moetron.config import RunConfig  # noqa: E402
from moetron.parallel.env import init_distributed
from moetron.parallel.ep import all_to_all as expert_parallel
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.parallelize import build
from moetron.train.trainer import Trainer
from process_group import spawn_group, timed_steps

LAYOUTS = [("EP=1, 1 process", 1, 1), ("DP=2 (no EP)", 2, 1), ("EP=2, 2 processes", 2, 2)]


def seed_config(args: argparse.Namespace, world: int, ep: int) -> RunConfig:
    cfg = RunConfig()
    m, t = cfg.model, cfg.train
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 4, 256, 4, args.seq
    m.num_experts, m.topk, m.vocab_size = [128], 1, 50257
    m.hidden_dropout = m.attention_dropout = 0.0
    t.micro_batch_size, t.global_batch_size = args.micro_batch, args.micro_batch * world
    t.train_iters, t.log_interval, t.eval_iters = args.warmup + args.steps, 1000, 0
    cfg.parallel.moe_expert_parallel_size = ep
    return cfg


class CountingAllToAll:
    """Wraps `expert_parallel.all_to_all_rows` to add up the bytes every call sends."""

    def __init__(self):
        self.bytes, self.original = 0, expert_parallel.all_to_all_rows
        expert_parallel.all_to_all_rows = self

    def __call__(self, x, out_splits, in_splits, group):
        self.bytes += x.numel() * x.element_size()
        return self.original(x, out_splits, in_splits, group)


def measure(rank: int, world: int, port: int, args: argparse.Namespace, ep: int, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    env = init_distributed(backend="gloo")
    cfg = seed_config(args, world, ep)
    torch.manual_seed(rank)
    mesh = ParallelMesh.build(cfg.dims(world), env)
    parallel = build(cfg, mesh, env.device)
    model = parallel.model
    loader = RandomTokenLoader(args.micro_batch, args.seq, cfg.model.vocab_size, seed=rank)
    trainer = Trainer(cfg, env, parallel, loader)
    counter = CountingAllToAll()
    for _ in range(args.warmup):
        trainer.train_step()
    counter.bytes = 0
    elapsed = timed_steps(trainer, env, args.steps)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    results.put((rank, elapsed, counter.bytes / args.steps, experts))
    env.close()


def run_layout(world: int, ep: int, args: argparse.Namespace) -> dict:
    rows = spawn_group(measure, world, (args, ep), timeout=1800)
    elapsed = max(r[1] for r in rows)
    tokens = args.micro_batch * args.seq * world * args.steps
    return {"tokens_per_s": tokens / elapsed, "a2a_bytes": sum(r[2] for r in rows) / world, "experts": rows[0][3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=64, help="sequence length (the seed uses 2048)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="measured optimizer steps")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    measured = {name: run_layout(world, ep, args) for name, world, ep in LAYOUTS}
    base = measured[LAYOUTS[0][0]]
    activation = args.micro_batch * args.seq * 256 * 4 * 4  # [tokens, hidden] fp32 input of each of 4 layers
    print(f"seed model, seq {args.seq}, micro batch {args.micro_batch} per process, {args.steps} steps (CPU, gloo)")
    print("| layout | tokens/s | ratio vs EP=1 | expert params per rank | a2a bytes/step/rank | a2a / activations |")
    print("|---|---|---|---|---|---|")
    for name, _, _ in LAYOUTS:
        r = measured[name]
        a2a = r["a2a_bytes"]
        print(
            f"| {name} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
            f"{r['experts'] / 1e6:.1f}M | {a2a / 1e6:.2f} MB | {a2a / activation:.2f}x |"
        )
    ep2, dp2 = measured[LAYOUTS[2][0]], measured[LAYOUTS[1][0]]
    print(f"EP=2 vs DP=2 without EP: {ep2['tokens_per_s'] / dp2['tokens_per_s']:.2f}x tokens/s")


if __name__ == "__main__":
    main()
