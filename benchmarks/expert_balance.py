"""`--moe-expert-replicas`: the slowest EP rank's MoE-layer compute with and without hot-expert replicas, at routed
skews (max/mean rows per EP rank) of 1.5×, 2× and 4×, plus the bytes the replica weights add.

    python benchmarks/expert_balance.py                     # EP 4 on 4 gloo processes, 2048 tokens per rank
    python benchmarks/expert_balance.py --tokens 4096 --reps 8

One MoE layer (hidden 256, SwiGLU experts of ffn 1024 without biases: the CPU expert-by-expert kernel, 8 experts,
2 per rank), top-1, dropless. The routing is set, not learned: every rank sends the same share of its tokens to each
expert, rank 0's two experts get `skew / 4` of all rows (half each), the other six share the rest evenly, so the
routed load of rank 0 is `skew` × the mean. Each rep is one forward + backward of dispatch → experts → combine; per
rank the CPU time of its main thread (`time.thread_time`: its own work, not the waits of the all-to-alls: on a loaded
machine this is the number that does not depend on the neighbours) and the wall time of the rep (barriers on both
sides; noisy where the machine is shared). Reported: the slowest rank's median CPU time with / without one replica
slot per rank and their ratio, the computed load (`moe_ep_load_computed`), and the all-to-all bytes of one rep
(forward + backward, summed over the ranks; a rank's rows or weights for itself included): the tokens' against the
replica weights' (and their gradients on the way back).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moetron.model.config import ModelConfig  # noqa: E402
from moetron.model.moe.layer import MoELayer  # noqa: E402
from moetron.model.moe.routing.router import Routing  # noqa: E402
from moetron.parallel.dims import ParallelDims  # noqa: E402
from moetron.parallel.env import DistEnv, init_distributed  # noqa: E402
from moetron.parallel.ep import all_to_all as expert_parallel  # noqa: E402
from moetron.parallel.ep.all_to_all import AllToAllDispatcher, shard_layer_experts  # noqa: E402
from moetron.parallel.ep.replicas import ReplicatingDispatcher  # noqa: E402
from moetron.parallel.mesh import ParallelMesh  # noqa: E402
from process_group import spawn_group  # noqa: E402

EXPERTS, EP, HIDDEN, FFN = 8, 4, 256, 1024
SKEWS = (1.5, 2.0, 4.0)


def expert_shares(skew: float) -> list[float]:
    hot = skew / EP  # rank 0's share of every row
    return [hot / 2, hot / 2] + [(1 - hot) / (EXPERTS - 2)] * (EXPERTS - 2)


def skewed_routing(tokens: int, skew: float) -> Routing:
    counts = [round(share * tokens) for share in expert_shares(skew)]
    counts[-1] += tokens - sum(counts)
    ids = torch.repeat_interleave(torch.arange(EXPERTS), torch.tensor(counts))[torch.randperm(tokens)][:, None]
    weights = torch.ones(tokens, 1)
    zero = torch.zeros(())
    return Routing(
        ids,
        weights,
        torch.ones(tokens, 1, dtype=torch.bool),
        tokens,
        zero,
        torch.bincount(ids[:, 0], minlength=EXPERTS),
    )


class CountingAllToAll:
    """Adds up the bytes `all_to_all_rows` sends: token rows (width = hidden) and replica weights (wider)."""

    def __init__(self):
        self.tokens = self.weights = 0
        self.original = expert_parallel.all_to_all_rows
        expert_parallel.all_to_all_rows = self

    def __call__(self, x, out_splits, in_splits, group):
        size = x.numel() * x.element_size()
        if x.shape[-1] == HIDDEN:
            self.tokens += size
        else:
            self.weights += size
        return self.original(x, out_splits, in_splits, group)


def layer_step(layer: MoELayer, x: torch.Tensor, grad: torch.Tensor, routing: Routing) -> None:
    x_ND, counts, ctx = layer.dispatcher.dispatch(x, routing)
    y = layer.dispatcher.combine(layer.experts(x_ND, counts), ctx)
    y.backward(grad)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    env = init_distributed()
    mesh = ParallelMesh.build(ParallelDims(world_size=world, dp=world, ep=EP), DistEnv(rank=rank, world_size=world))
    cfg = ModelConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN, vocab_size=64)
    cfg.num_experts, cfg.topk, cfg.swiglu, cfg.add_bias_linear = [EXPERTS], 1, True, False
    cfg.moe_token_dropping = False
    torch.manual_seed(0)
    layer = MoELayer(cfg, EXPERTS, layer_index=1)
    shard_layer_experts(layer, rank, EP)
    counter = CountingAllToAll()
    rows = []
    for skew in SKEWS:
        torch.manual_seed(1 + rank)
        routing = skewed_routing(args.tokens, skew)
        x = torch.randn(args.tokens, HIDDEN, requires_grad=True)
        grad = torch.randn(args.tokens, HIDDEN)
        for replicas in (0, 1):
            layer.dispatcher = (
                ReplicatingDispatcher(layer, mesh.group("ep"), EP, rank, replicas)
                if replicas
                else AllToAllDispatcher(EXPERTS, mesh.group("ep"), EP, rank)
            )
            layer_step(layer, x, grad, routing)  # warm-up
            cpu, wall = [], []
            counter.tokens = counter.weights = 0
            for _ in range(args.reps):
                env.barrier()
                start_wall, start_cpu = time.perf_counter(), time.thread_time()
                layer_step(layer, x, grad, routing)
                cpu.append(time.thread_time() - start_cpu)
                env.barrier()
                wall.append(time.perf_counter() - start_wall)
            layer.zero_grad(set_to_none=True)
            x.grad = None
            per_rep = (counter.tokens / args.reps, counter.weights / args.reps)  # before the check's own dispatch
            computed = replicated_load(layer, x, routing)
            rows.append((skew, replicas, statistics.median(cpu), statistics.median(wall), computed, *per_rep))
    results.put((rank, rows))


def replicated_load(layer: MoELayer, x: torch.Tensor, routing: Routing) -> float:
    with torch.no_grad():
        _, _, ctx = layer.dispatcher.dispatch(x, routing)
    return float(ctx.ep_load[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank and step")
    parser.add_argument("--reps", type=int, default=6)
    args = parser.parse_args()
    ranks = spawn_group(worker, EP, (args,))
    print(f"EP {EP}, {EXPERTS} experts (hidden {HIDDEN}, ffn {FFN}, SwiGLU), top-1 dropless, {args.tokens} tokens/rank")
    print("| routed skew | replicas | computed load | slowest rank CPU ms | ratio | slowest wall ms | token a2a MB | "
          "replica weights MB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    by_key = {}
    for _, rows in ranks:
        for skew, replicas, cpu, wall, computed, token_bytes, weight_bytes in rows:
            entry = by_key.setdefault((skew, replicas), [0.0, 0.0, computed, 0.0, 0.0])
            entry[0], entry[1] = max(entry[0], cpu), max(entry[1], wall)
            entry[3], entry[4] = entry[3] + token_bytes, entry[4] + weight_bytes
    for skew in SKEWS:
        base = by_key[(skew, 0)][0]
        for replicas in (0, 1):
            cpu, wall, computed, token_bytes, weight_bytes = by_key[(skew, replicas)]
            print(
                f"| {skew:g}x | {replicas} | {computed:.2f} | {1e3 * cpu:.1f} | {cpu / base:.2f} | {1e3 * wall:.1f} | "
                f"{token_bytes / 1e6:.2f} | {weight_bytes / 1e6:.2f} |"
            )


if __name__ == "__main__":
    main()
