"""ZeRO stages 0–3 side by side on 4 gloo processes: per-rank memory of weights, gradients, Adam state and gathered
weights, step time against stage 0, and `moetron plan`'s numbers for the same run.

    python benchmarks/zero.py                        # 4 processes, EP 2 (edp 2), 16 experts per MoE layer
    python benchmarks/zero.py --steps 6 --hidden 256

One spawned group runs the four stages one after another (same weights, same batches). Memory is what the
rank's tensors store (each storage once, a DTensor's local shard, FSDP2's padding included):
  weights      the parameters between steps
  gradients    once reduced, before the optimizer (stage 1: the whole gradients it slices)
  optimizer    Adam's exp_avg, exp_avg_sq and step
  gathered     the most held at once beyond that: FSDP2's all-gather outputs, sampled as every FSDP2 unit starts
               its forward and backward (stages 2–3), or the stage-1 all-gather's send + receive buffers
Step time: the four trainers exist side by side and take turns (`--rounds` rounds of `--steps` steps each); the
ratio to stage 0 is taken within each round (same machine load), the median over rounds is printed. Gloo on CPU,
one thread per process.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # test instruments live there
from random_tokens import RandomTokenLoader  # noqa: E402

from moetron.config import RunConfig  # noqa: E402
from moetron.parallel.dp import sharded_optimizer
from moetron.parallel.env import init_distributed
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.parallelize import build
from moetron.plan.memory import estimate_memory
from moetron.train.trainer import Trainer

WORLD, STAGES = 4, (0, 1, 2, 3)
KINDS = ("weights", "gradients", "optimizer", "gathered")


def bench_config(args: argparse.Namespace, stage: int) -> RunConfig:
    cfg = RunConfig()
    m, t = cfg.model, cfg.train
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = args.layers, args.hidden, 4, args.seq
    m.num_experts, m.expert_interval, m.topk, m.vocab_size = [args.experts], 1, 2, args.vocab
    m.hidden_dropout = m.attention_dropout = 0.0
    t.micro_batch_size, t.global_batch_size = args.micro_batch, args.micro_batch * WORLD
    t.train_iters, t.log_interval, t.eval_iters = args.warmup + args.steps + 1, 1000, 0
    t.bf16 = args.bf16
    cfg.parallel.moe_expert_parallel_size, cfg.parallel.zero_stage = args.ep, stage
    return cfg


def storage_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def gathered_now(model: torch.nn.Module) -> int:
    """Bytes of FSDP2's all-gather outputs allocated right now (prefetched groups included)."""
    from torch.distributed.fsdp import FSDPModule

    outputs = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                outputs += [t for p in group.fsdp_params for t in p.all_gather_outputs]
    return storage_bytes(outputs)


class Sampler:
    """Samples `gathered_now` as every FSDP2 unit (block, experts, router) starts its forward and its backward (a
    hook on its output, run after FSDP2's own gather); records the stage-1 all-gather buffers."""

    def __init__(self, model: torch.nn.Module):
        from torch.distributed.fsdp import FSDPModule

        self.model, self.peak = model, 0
        for module in model.modules():
            if isinstance(module, FSDPModule) and module is not model:
                module.register_forward_pre_hook(self.sample)
                module.register_forward_hook(self._forward)
        self.gather_bucket = sharded_optimizer._all_gather_bucket
        sharded_optimizer._all_gather_bucket = self._gather_bucket

    def sample(self, *_) -> None:
        self.peak = max(self.peak, gathered_now(self.model))

    def _forward(self, module, inputs, output) -> None:
        first = output[0] if isinstance(output, tuple) else output
        if isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(self.sample)

    def _gather_bucket(self, bucket, mesh) -> None:
        """Stage 1's all-gather of one bucket, recording its receive + send buffers."""
        all_gather = torch.distributed.all_gather_single

        def recorded(out, inp, *args, **kwargs):
            self.peak = max(self.peak, out.untyped_storage().nbytes() + inp.untyped_storage().nbytes())
            return all_gather(out, inp, *args, **kwargs)

        torch.distributed.all_gather_single = recorded
        try:
            self.gather_bucket(bucket, mesh)
        finally:
            torch.distributed.all_gather_single = all_gather

    def close(self) -> None:
        sharded_optimizer._all_gather_bucket = self.gather_bucket


def by_kind(trainer: Trainer, named, bytes_of) -> dict[str, int]:
    """`bytes_of(tensors)` of the dense and of the expert tensors among `named` (name, tensor)."""
    registry = trainer.parallel.registry
    return {kind: bytes_of([t for n, t in named if registry[n].kind == kind]) for kind in ("dense", "expert")}


def memory_of_one_step(trainer: Trainer) -> dict:
    model = trainer.model
    out = {"weights": by_kind(trainer, list(model.named_parameters()), storage_bytes)}
    finish = trainer.parallel.finish_gradients

    def count_then_finish() -> None:
        grads = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        out["gradients"] = by_kind(trainer, grads, storage_bytes)
        finish()

    sampler = Sampler(model)
    trainer.parallel.finish_gradients = count_then_finish
    trainer.train_step()
    sampler.close()
    trainer.parallel.finish_gradients = finish
    out["gathered"] = {"dense": sampler.peak, "expert": 0}  # not split by kind
    names = {id(p): n for n, p in trainer.parallel.optimizer_parameters()}
    state = [(names[id(p)], t) for p, s in trainer.optimizer.state.items() for t in s.values()]
    out["optimizer"] = by_kind(trainer, state, storage_bytes)
    return out


def timed(trainer: Trainer, steps: int, env) -> float:
    env.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    env.barrier()
    return (time.perf_counter() - start) / steps


def measure(rank: int, port: int, args: argparse.Namespace, results) -> None:
    """Every stage's trainer side by side; their steps timed in interleaved rounds (the machine's load changes
    over a run: each round compares the stages under the same load), memory measured last."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    env = init_distributed(backend="gloo")
    trainers = {}
    for stage in STAGES:
        cfg = bench_config(args, stage)
        mesh = ParallelMesh.build(cfg.dims(WORLD), env)
        parallel = build(cfg, mesh, env.device)
        loader = RandomTokenLoader(args.micro_batch, args.seq, cfg.model.vocab_size, seed=rank)
        trainers[stage] = Trainer(cfg, env, parallel, loader)
        timed(trainers[stage], args.warmup, env)
    rounds = [{stage: timed(trainers[stage], args.steps, env) for stage in STAGES} for _ in range(args.rounds)]
    for stage in STAGES:
        row = memory_of_one_step(trainers[stage])
        row["step_ratios"] = [r[stage] / r[0] for r in rounds]
        row["step_s"] = statistics.median(r[stage] for r in rounds)
        results.put((rank, stage, row))
    env.close()


def run_group(args: argparse.Namespace) -> dict[int, list[dict]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=measure, args=(r, port, args, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    by_stage: dict[int, list[dict]] = {s: [None] * WORLD for s in STAGES}
    for _ in range(WORLD * len(STAGES)):
        rank, stage, row = results.get(timeout=3600)
        by_stage[stage][rank] = row
    for p in procs:
        p.join()
    return by_stage


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--experts", type=int, default=16, help="per MoE layer (every layer is MoE)")
    parser.add_argument("--ep", type=int, default=2, help="expert parallel size (edp = 4 / ep)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per stage and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every stage in turn")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    measured = run_group(args)
    base = measured[0]
    cfg = bench_config(args, 0)
    dims = cfg.dims(WORLD)
    print(
        f"{args.layers} layers, hidden {args.hidden}, {args.experts} experts per layer, EP {args.ep} (edp {dims.edp}), "
        f"vocab {args.vocab}, seq {args.seq}, micro batch {args.micro_batch}, {WORLD} gloo ranks"
        + (", bf16" if args.bf16 else "")
    )
    print(
        "| stage | weights MiB | gradients MiB | Adam MiB | gathered MiB | dense state vs stage 0 | expert state vs "
        "stage 0 | step time vs stage 0 | planned MiB | planned / measured |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    time0 = max(r["step_s"] for r in base)
    for stage in STAGES:
        rows = measured[stage]
        worst = {k: max(sum(r[k].values()) for r in rows) for k in KINDS}
        state = {kind: ratio_to_stage_0(rows, base, kind) for kind in ("dense", "expert")}
        total = max(sum(sum(r[k].values()) for k in KINDS) for r in rows)
        plan = estimate_memory(bench_config(args, stage), dims, "cpu")
        planned = plan.weights + plan.gradients + plan.optimizer + plan.gathered
        print(
            f"| {stage} | {mib(worst['weights'])} | {mib(worst['gradients'])} | {mib(worst['optimizer'])} | "
            f"{mib(worst['gathered'])} | {state['dense']:.2f}x | {state['expert']:.2f}x | "
            f"{step_ratio(rows):.2f}x | {mib(planned)} | {planned / total:.2f} |"
        )
    print(f"(stage 0 step: {time0 * 1e3:.0f} ms; per-rank maxima; planned = weights + gradients + Adam + gathered)")


def step_ratio(rows: list[dict]) -> float:
    """The median over rounds of the slowest rank's step time against stage 0's in the same round."""
    per_round = zip(*(r["step_ratios"] for r in rows), strict=True)
    return statistics.median(max(ratios) for ratios in per_round)


def ratio_to_stage_0(rows: list[dict], base: list[dict], kind: str) -> float:
    """The largest rank's weights + gradients + Adam bytes of one kind, against stage 0's."""

    def state(r: dict) -> int:
        return sum(r[k][kind] for k in KINDS[:3])

    return max(state(r) for r in rows) / max(state(r) for r in base)


if __name__ == "__main__":
    main()
