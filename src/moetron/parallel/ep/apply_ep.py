"""`apply_ep`: expert parallelism placed on a model (this rank's experts, the dispatcher that reaches the others)."""

from __future__ import annotations

from moetron.model.gpt import GPTModel
from moetron.parallel.ep.all_to_all import AllToAllDispatcher, shard_layer_experts
from moetron.parallel.ep.dispatch_spec import PLAIN, EPDispatchSpec
from moetron.parallel.ep.overlap import OverlappedAllToAllDispatcher
from moetron.parallel.ep.replicas import ReplicatingDispatcher
from moetron.parallel.ep.static_all_to_all import StaticAllToAllDispatcher
from moetron.parallel.mesh import ParallelMesh


def apply_ep(model: GPTModel, mesh: ParallelMesh, expert_replicas: int = 0, dispatch: EPDispatchSpec = PLAIN) -> None:
    """Keep only this rank's experts in every MoE layer and route tokens to the others by all-to-all;
    `expert_replicas` K > 0: with K replica slots per rank for hot experts (`replicas.py`); `dispatch`: the
    static-shape dispatcher (`--moe-ep-dispatch static`) or the overlapped one (`--moe-ep-overlap-chunks N`).

    Call on the meta device before materialising (expert memory then scales as 1 / ep from the start); a
    built model is sharded too (correct, but it briefly holds every expert). No-op when ep == 1."""
    ep_size = mesh.size("ep")
    if ep_size == 1:
        return
    ep_rank, group = mesh.coords.ep, mesh.group("ep")
    for moe in model.moe_layers():
        shard_layer_experts(moe, ep_rank, ep_size)
        if group is None:
            continue
        args = (moe.num_experts, group, ep_size, ep_rank, moe.layer_index)
        if expert_replicas:
            moe.dispatcher = ReplicatingDispatcher(moe, group, ep_size, ep_rank, expert_replicas)
        elif dispatch.mode == "static":
            moe.dispatcher = StaticAllToAllDispatcher(*args, buffer_factor=dispatch.buffer_factor)
        elif dispatch.overlap_chunks > 1:
            moe.dispatcher = OverlappedAllToAllDispatcher(*args, chunks=dispatch.overlap_chunks)
        else:
            moe.dispatcher = AllToAllDispatcher(*args)
