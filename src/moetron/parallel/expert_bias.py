"""Aux-loss-free balancing, once per optimizer step: every router's expert bias moves from the loads it saw.

    update_expert_biases(model, step_applied=ok, mesh=mesh)   # after optimizer.step() (or its skip)

The pieces: each `Router` accumulates its routes per expert in training (`load_since_update_E`, in forward) and
owns the rule (`Router.update_expert_bias`: bias += rate · sign(mean load − load), then zero the loads). This
function is the only caller and decides the step-level part: a skipped step (non-finite gradients) forgets its
loads without an update, and data-parallel replicas first sum their loads so that every replica applies the same
update (the biases are buffers, which DDP does not reduce).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moetron.parallel.diagnosis import Site
from moetron.parallel.mesh import ParallelMesh


def update_expert_biases(model: nn.Module, step_applied: bool, mesh: ParallelMesh | None = None) -> None:
    """Nudge every router's expert bias from the loads since the last step (`step_applied`), or forget those loads
    (a skipped step). `mesh` None: one process."""
    routers = [moe.router for moe in model.moe_layers()]
    if not step_applied:
        for router in routers:
            router.load_since_update_E.zero_()
        return
    if mesh is not None:
        sync_router_loads(model, mesh)
    for router in routers:
        router.update_expert_bias()


def sync_router_loads(model: nn.Module, mesh: ParallelMesh) -> None:
    """Sum every router's routes-per-expert over the data-parallel ranks before the bias update. Routers see the
    tokens of their data-parallel rank; tensor-parallel peers route the same tokens, so the sum runs over dp only
    (and context-parallel peers, whose tokens are other parts of the same sequences: dp_cp)."""
    if mesh.size("dp_cp") == 1 or model.cfg.moe_router_bias_update_rate == 0:
        return
    loads = [moe.router.load_since_update_E for moe in model.moe_layers()]
    if not loads:
        return
    flat = torch.cat(loads)
    with Site("the router-load all-reduce", mesh.group("dp_cp"), "data-parallel"):
        dist.all_reduce(flat, group=mesh.group("dp_cp"))
    torch._foreach_copy_(loads, list(flat.split([t.numel() for t in loads])))
