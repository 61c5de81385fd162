"""Host reads per MoE layer forward+backward on the code path CUDA runs — each one a host sync on a GPU.

    python benchmarks/host_syncs.py                      # the grouped_mm backend (auto's pick on sm90/sm100, bf16)
    python benchmarks/host_syncs.py --backend batched    # auto's pick on other GPUs

Runs on a CPU, counting instead of timing: one MoE layer (8 experts, GELU experts with biases, so the
per-row bias gather is exercised) runs forward and backward (output and aux/z losses) inside
`HostReadCounter`, which counts every Python-level read of a tensor's value (`.item()`, `.tolist()`,
`int()`, `bool()`, `float()`, `__index__`, `.cpu()`, `.numpy()`, `.to("cpu")`). How the CUDA path is taken
on a CPU: the expert backend is forced (never the CPU-only expert-by-expert SwiGLU kernel), and the whole
step runs inside `cuda_code_path()`, so every `host_reads_are_free(device)` switch takes its CUDA branch —
for top-1 RTS that is `keep_top_keys_top1` (a topk, no read) instead of the CPU's sort-based keep, which
reads the device once on purpose. Syncs inside C++ kernels are not visible to the counter; the MoE code
avoids the ones CUDA has (bincount, nonzero, repeat_interleave without output_size) by construction.

Prints one line per mode, `host reads per MoE layer: <mode> <N>`. Expected with grouped_mm: 0 for the three
local modes, 1 for `EP=2 all-to-all` (two gloo processes; the split sizes' `.tolist()`). With batched, the
dropless modes read the max load once. tests/unit/test_host_reads.py and tests/distributed/test_host_reads_ep.py
assert these counts.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys

import torch
import torch.distributed as dist

from moetron.model.config import ModelConfig
from moetron.model.moe.host_reads import HostReadCounter, cuda_code_path
from moetron.model.moe.layer import MoELayer

EXPERTS, HIDDEN, FFN, TOKENS = 8, 64, 128, 256
LOCAL_MODES = {
    "dropless top-2": dict(topk=2, moe_token_dropping=False),
    "capacity top-1 RTS": dict(topk=1, moe_use_rts=True, moe_noisy_gate_policy="Jitter"),
    "capacity top-2": dict(topk=2),
}
EP_MODE = "EP=2 all-to-all"  # dropless top-2, experts split over 2 processes


def layer_config(backend: str, **routing) -> ModelConfig:
    cfg = ModelConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=FFN, num_experts=[EXPERTS]
    )
    cfg.moe_expert_backend, cfg.moe_min_capacity = backend, 1
    for name, value in routing.items():
        setattr(cfg, name, value)
    return cfg


def count_layer_reads(layer: MoELayer, x_BTD: torch.Tensor) -> HostReadCounter:
    """One training step of `layer` (forward, losses, backward) on the CUDA code path, reads counted. The aux and
    z losses reach the router through the output's backward (they are attached to it)."""
    with HostReadCounter() as reads, cuda_code_path():
        y_BTD, _ = layer(x_BTD)
        y_BTD.float().square().mean().backward()
    return reads


def local_reads(mode: str, backend: str = "grouped_mm") -> HostReadCounter:
    torch.manual_seed(0)
    layer = MoELayer(layer_config(backend, **LOCAL_MODES[mode]), EXPERTS, layer_index=1)
    return count_layer_reads(layer, torch.randn(2, TOKENS // 2, HIDDEN, requires_grad=True))


def _ep_worker(rank: int, world: int, port: int, backend: str, results) -> None:
    from moetron.parallel.ep.all_to_all import AllToAllDispatcher, shard_layer_experts

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    layer = MoELayer(layer_config(backend, **LOCAL_MODES["dropless top-2"]), EXPERTS, layer_index=1)
    shard_layer_experts(layer, rank, world)
    layer.dispatcher = AllToAllDispatcher(EXPERTS, dist.group.WORLD, world, rank)
    torch.manual_seed(1 + rank)  # different tokens per rank: uneven splits
    reads = count_layer_reads(layer, torch.randn(1, TOKENS + 8 * rank, HIDDEN, requires_grad=True))
    dist.barrier()
    results.put((rank, dict(reads.by_kind)))
    results.close()
    results.join_thread()
    sys.stdout.flush()
    os._exit(0)  # skip gloo's C++ teardown, which sometimes aborts a finished process (see parallel/env.py)


def ep_reads(backend: str = "grouped_mm", world: int = 2, timeout: float = 120.0) -> list[dict[str, int]]:
    """Host reads of each rank of an EP=`world` group (spawned gloo processes), by kind."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_ep_worker, args=(r, world, port, backend, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        by_rank = dict(results.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return [by_rank[r] for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["grouped_mm", "batched"], default="grouped_mm")
    args = parser.parse_args()
    for mode in LOCAL_MODES:
        print(f"host reads per MoE layer: {mode} {local_reads(mode, args.backend).total}")
    per_rank = ep_reads(args.backend)
    print(f"host reads per MoE layer: {EP_MODE} {max(sum(kinds.values()) for kinds in per_rank)}")


if __name__ == "__main__":
    main()
