"""Expert-parallel dispatchers side by side: one MoE layer's forward + backward with EP = 2 (two gloo processes).

    python benchmarks/ep_dispatch.py [--rounds 5] [--tokens 2048] [--hidden 256]

Modes (the same weights and tokens; every mode's output is bit-identical, tests/distributed/test_ep_static_overlap.py):
  uneven     the default all-to-all (uneven splits, one host read per layer)
  static     --moe-ep-dispatch static (B-row blocks per peer, no host read per layer)
  overlap N  --moe-ep-overlap-chunks N (async all-to-all of chunk j+1 while chunk j's experts compute)
Rounds are interleaved (every mode once per round), and each mode's median wall time per step on rank 0 (and its
process CPU time) is printed as a ratio to `uneven` measured in the same run. On a CPU, gloo's transfers are memcpy
through loopback TCP on the same cores that compute, so the overlap has little to hide; the numbers that matter
come from NCCL on GPUs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moetron.model.config import ModelConfig
from moetron.model.moe.layer import MoELayer
from moetron.parallel.ep.all_to_all import AllToAllDispatcher, shard_layer_experts
from moetron.parallel.ep.overlap import OverlappedAllToAllDispatcher
from moetron.parallel.ep.static_all_to_all import StaticAllToAllDispatcher

EXPERTS, WORLD = 8, 2
MODES = {
    "uneven": lambda g, r: AllToAllDispatcher(EXPERTS, g, WORLD, r),
    "static": lambda g, r: StaticAllToAllDispatcher(EXPERTS, g, WORLD, r),
    "overlap 2": lambda g, r: OverlappedAllToAllDispatcher(EXPERTS, g, WORLD, r, chunks=2),
    "overlap 4": lambda g, r: OverlappedAllToAllDispatcher(EXPERTS, g, WORLD, r, chunks=4),
}


def layer(args, rank: int, make) -> MoELayer:
    cfg = ModelConfig(num_layers=2, hidden_size=args.hidden, num_attention_heads=2, ffn_hidden_size=2 * args.hidden)
    cfg.num_experts, cfg.topk, cfg.moe_token_dropping, cfg.swiglu = [EXPERTS], 2, False, True
    cfg.num_shared_experts = 1
    torch.manual_seed(0)
    moe = MoELayer(cfg, EXPERTS, layer_index=1)
    shard_layer_experts(moe, rank, WORLD)
    moe.dispatcher = make(dist.group.WORLD, rank)
    return moe


def step(moe: MoELayer, x_TD: torch.Tensor) -> tuple[float, float]:
    """(wall, process CPU) seconds of one forward + backward."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    y_TD, _ = moe(x_TD)
    y_TD.square().mean().backward()
    cpu = time.process_time() - cpu  # before the barrier: gloo's wait spins
    dist.barrier()
    return time.perf_counter() - start, cpu


def worker(rank: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    layers = {mode: layer(args, rank, make) for mode, make in MODES.items()}
    x_TD = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    times = {mode: [] for mode in MODES}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for mode, moe in layers.items():
            elapsed = step(moe, x_TD)
            if round_index:
                times[mode].append(elapsed)
    if rank == 0:
        wall = {mode: statistics.median(t[0] for t in values) for mode, values in times.items()}
        cpu = {mode: statistics.median(t[1] for t in values) for mode, values in times.items()}
        print(f"EP=2 gloo, {args.tokens} tokens/rank, hidden {args.hidden}, E={EXPERTS} top-2 SwiGLU + shared expert")
        for mode in MODES:
            print(
                f"  {mode:10s} wall {wall[mode] * 1e3:8.1f} ms/step {wall[mode] / wall['uneven']:5.2f}x uneven | "
                f"CPU {cpu[mode] * 1e3:8.1f} ms {cpu[mode] / cpu['uneven']:5.2f}x"
            )
    sys.stdout.flush()
    dist.barrier()
    os._exit(0)  # skip gloo's C++ teardown (see parallel/env.py)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--port", type=int, default=29517)
    mp.spawn(worker, args=(parser.parse_args(),), nprocs=WORLD)


if __name__ == "__main__":
    main()
