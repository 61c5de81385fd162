"""Data parallelism: DistributedDataParallel over the dense parameters, `no_sync` during accumulation.

Every rank holds the whole model (same seed ⇒ identical initial weights; DDP also broadcasts rank 0's at
construction). Gradients are averaged over the data-parallel group in backward of the last micro-batch only.

Expert parallelism: `expert_parameter_names(model, dims)` lists parameters DDP must leave alone. With
`ep == 1` every expert is replicated, so experts are reduced with the dense parameters and the list is empty.
With `ep > 1` each rank holds different experts: DDP skips them, `reduce_expert_gradients` sums them over the
expert-data-parallel group divided by the FULL DP size (DeepSpeed's rule: values equal the ep = 1 run), and
`global_grad_norm_sq` makes clipping use the true global norm across the EP shards.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from moetron.parallel.dims import ParallelDims
from moetron.parallel.env import DistEnv


def expert_parameter_names(model: nn.Module, dims: ParallelDims) -> list[str]:
    """Parameters (and buffers) DDP must not reduce: the sharded experts when ep > 1, nothing otherwise."""
    if dims.ep == 1:
        return []
    return [n for n, _ in model.named_parameters() if ".experts." in n]


def wrap_data_parallel(model: nn.Module, env: DistEnv, dims: ParallelDims) -> nn.Module:
    """DDP when there is more than one data-parallel rank; the model itself otherwise."""
    if not dims.dp_enabled:
        return model
    ignored = expert_parameter_names(model, dims)
    if ignored:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    # no buffer sync per forward: the only buffers that change (expert biases) are updated identically on every
    # rank from all-reduced counts, so re-broadcasting them before each forward would be a wasted collective
    return DistributedDataParallel(model, device_ids=device_ids, **_no_forward_buffer_sync())


def _no_forward_buffer_sync() -> dict:
    """`forward_sync_buffers=False` where torch has it (it deprecates `broadcast_buffers`), else the old flag."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def accumulation_context(model: nn.Module, last_micro_batch: bool):
    """Skip DDP's gradient all-reduce on every micro-batch but the last of an optimizer step."""
    if isinstance(model, DistributedDataParallel) and not last_micro_batch:
        return model.no_sync()
    return contextlib.nullcontext()


def sync_router_loads(model: nn.Module, env: DistEnv) -> None:
    """Sum every router's routes-per-expert over all ranks before the aux-loss-free bias update, so every rank
    applies the same update (the biases are buffers DDP does not reduce)."""
    if not env.distributed or model.cfg.moe_router_bias_update_rate == 0:
        return
    loads = [moe.router.load_since_update_E for moe in model.moe_layers()]
    if not loads:
        return
    flat = torch.cat(loads)
    env.all_reduce_(flat)
    torch._foreach_copy_(loads, list(flat.split([t.numel() for t in loads])))


def all_reduce_mean(env: DistEnv):
    """A function averaging a tensor over the data-parallel ranks (identity in one process)."""

    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        if not env.distributed:
            return tensor
        out = tensor.clone()
        env.all_reduce_(out)
        return out / env.world_size

    return reduce


# ---------------------------------------------------------------- expert-parallel gradients (ep > 1)
def is_expert_parameter(name: str) -> bool:
    """Routed-expert tensors (sharded over EP); shared experts and PR-MoE's MLP are dense."""
    return ".experts." in name


def reduce_expert_gradients(model: nn.Module, edp_group, dp_size: int) -> None:
    """Sum each local expert's gradient over its expert-data-parallel replicas, divided by the FULL DP size.

    The all-to-all backward already brought every EP peer's tokens into this rank's expert gradients, so the
    EDP sum covers every data-parallel rank's loss once and `/ dp` makes it their mean: the same value as with
    ep = 1 (DeepSpeed's rule, PR #5259). Missing gradients count as zeros so every rank joins the collective."""
    params = [p for n, p in model.named_parameters() if is_expert_parameter(n) and p.requires_grad]
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    if edp_group is not None:
        torch.distributed.all_reduce(flat, group=edp_group)
    flat /= dp_size
    for p, piece in zip(params, flat.split([p.numel() for p in params]), strict=True):
        p.grad.copy_(piece.view_as(p.grad))


def global_grad_norm_sq(model: nn.Module, ep_group):
    """A `grad_norm_sq_fn` for `clip_gradients`: dense part local (identical on every rank after DDP), expert
    part summed over the expert-parallel group (each rank holds different experts), so every rank clips by
    the TRUE global norm of the whole model's gradient (DeepSpeed only averages the local norms)."""
    expert_ids = {id(p) for n, p in model.named_parameters() if is_expert_parameter(n)}
    device = next(model.parameters()).device

    def norm_sq(params: list[torch.Tensor]) -> torch.Tensor:
        dense = _sum_sq([p.grad for p in params if p.grad is not None and id(p) not in expert_ids], device)
        experts = _sum_sq([p.grad for p in params if p.grad is not None and id(p) in expert_ids], device)
        if ep_group is not None:
            torch.distributed.all_reduce(experts, group=ep_group)
        return dense + experts

    return norm_sq


def _sum_sq(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([n.float() for n in torch._foreach_norm(grads, 2.0)]).pow(2).sum()
