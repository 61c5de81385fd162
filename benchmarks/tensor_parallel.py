"""Tensor parallelism on a small MoE GPT: per-rank parameter and activation memory, communication bytes per step and
training tokens/s of TP = 2 (with and without sequence parallelism, and folded with EP = 2) against TP = 1 on one
process and against DP = 2, measured one after another in this one script (it spawns each process group itself).

    python benchmarks/tensor_parallel.py                      # seq 128, micro batch 4, 4 measured steps
    python benchmarks/tensor_parallel.py --seq 512 --global-batch 2 --vocab-size 8192   # activations dominate

Model: 4 layers, hidden 256, 8 heads, 8 experts every 2nd layer (2 MoE layers), top-2 dropless, GPT-2 vocabulary
(50,304 padded rows: the vocab-parallel embedding and loss matter), hidden dropout 0.1; AdamW. Every layout trains
the same global batch (micro batch × data-parallel ranks), so tokens/s compares the same work per step; gloo on
CPU, one thread per process. Reported per rank:
  params       parameters held (all, and dense = all but routed experts), ratio to TP = 1;
  activations  bytes of the tensors autograd saves in one training forward (parameters excluded, each storage
               once), ratio to TP = 1, and `moetron plan`'s estimate of the same (its activations + the loss's
               saved fp32 log-softmax of the vocabulary shard) as a ratio to this measurement;
  TP comm      bytes this rank sends in the tensor-parallel collectives of one step (ring algorithms: an
               all-reduce of n bytes sends 2·(t−1)/t·n, an all-gather or reduce-scatter of n bytes (t−1)/t·n), counted
               from the collectives DTensor issues, next to the plan's `comm_bytes_per_step`;
  a2a          all-to-all bytes sent per step (expert parallelism);
  tokens/s     of the whole group, ratio to TP = 1 on one process.
"""

from __future__ import annotations

import argparse
import os

import torch
from moetron.data.synthetic import RandomTokenLoader
from torch.utils._python_dispatch import TorchDispatchMode

from moetron.config import RunConfig
from moetron.parallel.env import init_distributed
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.parallelize import build
from moetron.plan.estimate import make_plan
from moetron.plan.hardware import accelerator
from moetron.train.executor import MicroBatch
from moetron.train.trainer import Trainer
from process_group import spawn_group, timed_steps

# name, processes, tp, sp, ep
LAYOUTS = [
    ("TP=1, 1 process", 1, 1, False, 1),
    ("DP=2 (no TP)", 2, 1, False, 1),
    ("TP=2", 2, 2, False, 1),
    ("TP=2 + SP", 2, 2, True, 1),
    ("TP=2 × EP=2 (folded)", 2, 2, False, 2),
]


def bench_config(args: argparse.Namespace, world: int, tp: int, sp: bool, ep: int) -> RunConfig:
    cfg = RunConfig()
    m, t, p = cfg.model, cfg.train, cfg.parallel
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 4, 256, 8, args.seq
    m.num_experts, m.topk, m.moe_token_dropping, m.vocab_size = [8], 2, False, args.vocab_size
    m.hidden_dropout, m.attention_dropout = 0.1, 0.0
    dp = world // tp
    t.micro_batch_size, t.global_batch_size = args.global_batch // dp, args.global_batch
    t.train_iters, t.log_interval, t.eval_iters = args.warmup + args.steps, 1000, 0
    p.tensor_model_parallel_size, p.sequence_parallel, p.moe_expert_parallel_size = tp, sp, ep
    return cfg


COLLECTIVES = {  # functional-collective op → kind (c10d's own ops are DDP's, the grad norm's and the all-to-all)
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


class CountCollectives(TorchDispatchMode):
    """Adds up the bytes this rank sends in DTensor's functional collectives (the TP group) and all-to-alls."""

    def __init__(self, group_size: int):
        super().__init__()
        self.size, self.sent = group_size, {"tp": 0.0, "a2a": 0.0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace in ("_c10d_functional", "c10d"):
            sent = args[1] if name.startswith("alltoall") else args[0]  # c10d's all-to-all: (output, input, …)
            n = sent.numel() * sent.element_size() if isinstance(sent, torch.Tensor) else 0
            kind = COLLECTIVES.get(name) or ("all_to_all" if name.startswith("alltoall") else None)
            share = (self.size - 1) / self.size
            if kind == "all_reduce":
                self.sent["tp"] += 2 * share * n
            elif kind == "all_gather":
                self.sent["tp"] += (self.size - 1) * n  # n is this rank's shard
            elif kind == "reduce_scatter":
                self.sent["tp"] += share * n
            elif kind == "all_to_all":
                self.sent["a2a"] += n  # every row this rank sends (its own included, as in expert_parallel.py)
        return func(*args, **(kwargs or {}))


def saved_activation_bytes(trainer: Trainer) -> int:
    """Bytes of the non-parameter tensors autograd saves in one training forward (each storage once)."""
    from torch.distributed.tensor import DTensor

    params = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        if storage.data_ptr() not in params and storage.device.type != "meta":
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    trainer.model.train()
    batch = MicroBatch.from_loader(trainer.train_loader, trainer.env.device)
    with trainer.parallel.micro_batch(last=True):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = trainer.parallel.module(batch.tokens_BT).logits
            loss = trainer.parallel.head_loss.loss_fn(logits, batch.labels_BT)
        loss.backward()  # the vocab-parallel loss's backward needs the micro-batch scope
    trainer.parallel.finish_gradients()
    trainer.optimizer.zero_grad(set_to_none=True)
    return sum(seen.values())


def measure(rank: int, world: int, port: int, args: argparse.Namespace, layout: tuple, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    env = init_distributed(backend="gloo")
    _, _, tp, sp, ep = layout
    cfg = bench_config(args, world, tp, sp, ep)
    mesh = ParallelMesh.build(cfg.dims(world), env)
    parallel = build(cfg, mesh, env.device)
    model = parallel.model
    dp, dp_rank = mesh.size("dp"), mesh.coords.dp  # TP peers read the same tokens
    loader = RandomTokenLoader(cfg.train.micro_batch_size, args.seq, cfg.model.vocab_size, dp_rank, dp_rank, dp)
    trainer = Trainer(cfg, env, parallel, loader)
    params = sum(p.numel() for p in model.parameters())
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    activations = saved_activation_bytes(trainer)
    for _ in range(args.warmup):
        trainer.train_step()
    counter = CountCollectives(tp)
    with counter:
        trainer.train_step()
    elapsed = timed_steps(trainer, env, args.steps)
    results.put((rank, elapsed, params, dense, activations, counter.sent["tp"], counter.sent["a2a"]))
    env.close()


def run_layout(layout: tuple, args: argparse.Namespace) -> dict:
    world = layout[1]
    rows = spawn_group(measure, world, (args, layout))
    _, elapsed, params, dense, activations, tp_bytes, a2a = rows[0]
    cfg = bench_config(args, world, *layout[2:])
    plan = make_plan(cfg, world, accelerator("cpu", "64GB"))
    # the plan's activations plus what the loss saves of the logits (the fp32 log-softmax of this rank's vocab shard;
    # the rest of the plan's logits term is the gradient buffers of the backward)
    tokens_per_rank = cfg.train.micro_batch_size * args.seq
    planned = plan.memory.activations + tokens_per_rank * cfg.model.padded_vocab_size() // layout[2] * 4
    tokens = args.global_batch * args.seq * args.steps
    return {
        "tokens_per_s": tokens / max(r[1] for r in rows),
        "params": params,
        "dense": dense,
        "activations": activations,
        "planned_activations": planned,
        "tp_bytes": tp_bytes,
        "planned_tp_bytes": plan.tp_comm_bytes,
        "a2a": a2a,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=4, help="samples per step (every layout the same)")
    parser.add_argument("--steps", type=int, default=4, help="measured optimizer steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--vocab-size", type=int, default=50257, help="GPT-2's by default")
    args = parser.parse_args()
    measured = {layout[0]: run_layout(layout, args) for layout in LAYOUTS}
    base = measured[LAYOUTS[0][0]]
    print(
        f"small MoE GPT, vocab {args.vocab_size}, seq {args.seq}, global batch {args.global_batch}, {args.steps} "
        "steps (CPU, gloo, per rank)"
    )
    print(
        "| layout | params (ratio) | dense params (ratio) | saved activations (ratio) | plan / measured "
        "| TP comm / step (plan) | a2a / step | tokens/s ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, *_ in LAYOUTS:
        r = measured[name]
        print(
            f"| {name} | {r['params'] / 1e6:.2f}M ({r['params'] / base['params']:.2f}) | "
            f"{r['dense'] / 1e6:.2f}M ({r['dense'] / base['dense']:.2f}) | "
            f"{r['activations'] / 2**20:.1f} MiB ({r['activations'] / base['activations']:.2f}) | "
            f"{r['planned_activations'] / r['activations']:.2f} | "
            f"{r['tp_bytes'] / 2**20:.1f} MiB ({r['planned_tp_bytes'] / 2**20:.1f}) | {r['a2a'] / 2**20:.1f} MiB | "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x |"
        )


if __name__ == "__main__":
    main()
