"""ZeRO composed with tensor and pipeline parallelism on 4 gloo processes: each rank's measured weights, gradients and
Adam state beside what `moetron plan` predicts for the same layout.

    python benchmarks/zero_compose.py                 # ZeRO 0-3 × TP 2 (dp 2) and ZeRO 0-3 × PP 2 (dp 2)
    python benchmarks/zero_compose.py --hidden 256

One spawned group builds each layout in turn (as `moetron train` does: meta device, this rank's shards and stages),
runs one step to create the optimizer state, then measures one more step with `zero.py`'s `storage_bytes`: the
parameters' storage, the reduced gradients just before the optimizer (stage 1: the whole gradients it slices) and
Adam's exp_avg / exp_avg_sq / step, each storage once and a DTensor's local shard. Counted over all tensors at once,
not per kind as `zero.py` splits them: under PP each stage is one FSDP2 unit, whose reduce-scatter output holds a
layer's dense and expert gradient shards in one storage (per kind, that storage counted twice). The plan's terms are
`estimate_memory(cfg, dims, "cpu")`'s weights, gradients and optimizer (with PP: the heaviest pipeline rank).
Printed: the largest rank's bytes per term and their sum against the plan's (planned / measured).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # test instruments live there
from random_tokens import RandomTokenLoader  # noqa: E402

from moetron.config import RunConfig  # noqa: E402
from moetron.parallel.env import init_distributed  # noqa: E402
from moetron.parallel.mesh import ParallelMesh  # noqa: E402
from moetron.parallel.parallelize import build  # noqa: E402
from moetron.plan.memory import estimate_memory  # noqa: E402
from moetron.train.trainer import Trainer  # noqa: E402
from process_group import spawn_group  # noqa: E402
from zero import storage_bytes  # noqa: E402

WORLD = 4
TERMS = ("weights", "gradients", "optimizer")
LAYOUTS = {f"zero{z} tp2": {"zero": z, "tp": 2, "pp": 1} for z in range(4)}
LAYOUTS |= {f"zero{z} pp2": {"zero": z, "tp": 1, "pp": 2} for z in range(4)}


def bench_config(args: argparse.Namespace, layout: dict) -> RunConfig:
    cfg = RunConfig()
    m, t, p = cfg.model, cfg.train, cfg.parallel
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = args.layers, args.hidden, 4, args.seq
    m.num_experts, m.expert_interval, m.topk, m.vocab_size = [args.experts], 1, 2, args.vocab
    m.hidden_dropout = m.attention_dropout = 0.0
    dp = WORLD // (layout["tp"] * layout["pp"])
    t.micro_batch_size, t.global_batch_size = args.micro_batch, args.micro_batch * dp * 2
    t.train_iters, t.log_interval, t.eval_iters = 4, 1000, 0
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = layout["tp"], layout["pp"]
    p.zero_stage = layout["zero"]
    return cfg


def state_of_one_step(trainer: Trainer) -> dict[str, int]:
    """Bytes of this rank's parameters, of its gradients as the optimizer gets them, and of its Adam state."""
    model, finish = trainer.model, trainer.parallel.finish_gradients
    out = {"weights": storage_bytes(list(model.parameters()))}

    def count_then_finish() -> None:
        out["gradients"] = storage_bytes([p.grad for p in model.parameters() if p.grad is not None])
        finish()

    trainer.parallel.finish_gradients = count_then_finish
    trainer.train_step()
    trainer.parallel.finish_gradients = finish
    out["optimizer"] = storage_bytes([t for s in trainer.optimizer.state.values() for t in s.values()])
    return out


def measure(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    env = init_distributed(backend="gloo")
    for name, layout in LAYOUTS.items():
        cfg = bench_config(args, layout)
        mesh = ParallelMesh.build(cfg.dims(WORLD), env)
        parallel = build(cfg, mesh, env.device)
        loader = RandomTokenLoader(args.micro_batch, args.seq, cfg.model.vocab_size, seed=rank,
                                   dp_rank=mesh.coords.dp, dp_size=mesh.size("dp"))  # fmt: skip
        trainer = Trainer(cfg, env, parallel, loader)
        trainer.train_step()  # the optimizer state exists from here on
        results.put((rank, name, state_of_one_step(trainer)))
        del trainer, parallel
    env.close()


def run_group(args: argparse.Namespace) -> dict[str, list[dict]]:
    measured: dict[str, list[dict]] = {name: [None] * WORLD for name in LAYOUTS}
    for rank, name, row in spawn_group(measure, WORLD, (args,), per_rank=len(LAYOUTS)):
        measured[name][rank] = row
    return measured


def mib(n: float) -> str:
    return f"{n / 2**20:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8, help="per MoE layer (every layer is MoE)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args()
    measured = run_group(args)
    print(f"{args.layers} layers, hidden {args.hidden}, {args.experts} experts per layer, vocab {args.vocab}, "
          f"seq {args.seq}, micro batch {args.micro_batch}, {WORLD} gloo ranks, fp32")  # fmt: skip
    print("| layout | weights MiB (plan) | gradients MiB (plan) | Adam MiB (plan) | state MiB | planned MiB | "
          "planned / measured |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, layout in LAYOUTS.items():
        cfg = bench_config(args, layout)
        plan = estimate_memory(cfg, cfg.dims(WORLD), "cpu")
        worst = {term: max(r[term] for r in measured[name]) for term in TERMS}
        total = max(sum(r[term] for term in TERMS) for r in measured[name])
        planned = sum(getattr(plan, term) for term in TERMS)
        cells = " | ".join(f"{mib(worst[t])} ({mib(getattr(plan, t))})" for t in TERMS)
        print(f"| {name} | {cells} | {mib(total)} | {mib(planned)} | {planned / total:.3f} |")
    print("(the largest rank's bytes per term; state = weights + gradients + Adam of the heaviest rank)")


if __name__ == "__main__":
    main()
