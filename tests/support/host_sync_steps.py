"""The MoE layer steps whose host reads benchmarks/host_syncs.py prints and tests/unit/test_host_reads.py and
tests/distributed/test_host_reads_ep.py assert: one layer (8 experts) forward and backward on the CUDA code path,
locally in three routing modes and with the all-to-all dispatchers (uneven splits, and `--moe-ep-dispatch static`)
over two gloo processes (one spawned group measures both)."""

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
# dropless top-2, experts split over 2 processes: the uneven-split dispatcher and the static-shape one
EP_MODES = {"EP=2 all-to-all": "uneven", "EP=2 all-to-all static": "static"}


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


def _ep_layer(backend: str, rank: int, world: int, dispatch: str) -> MoELayer:
    from moetron.parallel.ep.all_to_all import AllToAllDispatcher, shard_layer_experts
    from moetron.parallel.ep.static_all_to_all import StaticAllToAllDispatcher

    torch.manual_seed(0)
    layer = MoELayer(layer_config(backend, **LOCAL_MODES["dropless top-2"]), EXPERTS, layer_index=1)
    shard_layer_experts(layer, rank, world)
    kind = StaticAllToAllDispatcher if dispatch == "static" else AllToAllDispatcher
    layer.dispatcher = kind(EXPERTS, dist.group.WORLD, world, rank)
    return layer


def _ep_worker(rank: int, world: int, port: int, backend: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    by_mode = {}
    for mode, dispatch in EP_MODES.items():
        layer = _ep_layer(backend, rank, world, dispatch)
        torch.manual_seed(1 + rank)  # different tokens per rank: uneven splits
        # the static blocks need one token count on every rank (training's micro-batches have one shape)
        tokens = TOKENS if dispatch == "static" else TOKENS + 8 * rank
        reads = count_layer_reads(layer, torch.randn(1, tokens, HIDDEN, requires_grad=True))
        by_mode[mode] = dict(reads.by_kind)
    dist.barrier()
    results.put((rank, by_mode))
    results.close()
    results.join_thread()
    sys.stdout.flush()
    os._exit(0)  # skip gloo's C++ teardown, which sometimes aborts a finished process (see parallel/env.py)


def ep_reads(backend: str = "grouped_mm", world: int = 2, timeout: float = 120.0) -> list[dict[str, dict[str, int]]]:
    """Host reads of each rank of an EP=`world` group (spawned gloo processes), by mode (`EP_MODES`), by kind."""
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
