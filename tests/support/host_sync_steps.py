"""The MoE layer steps whose host reads benchmarks/host_syncs.py prints and tests/unit/test_host_reads.py and
tests/distributed/test_host_reads_ep.py assert: one layer (8 experts) forward and backward on the CUDA code path,
locally in three routing modes and with the all-to-all dispatcher over two gloo processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys

import torch
import torch.distributed as dist
from host_read_counter import HostReadCounter, cuda_code_path

from moetron.model.config import ModelConfig
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
