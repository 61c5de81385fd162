"""Data parallelism: DistributedDataParallel over the dense parameters, `no_sync` during accumulation.

Every rank holds the whole model (same seed ⇒ identical initial weights; DDP also broadcasts rank 0's at
construction). Gradients are averaged over the data-parallel group in backward of the last micro-batch only.

The seam for expert parallelism: `expert_parameter_names(model, dims)` lists parameters DDP must leave alone.
With `ep == 1` every expert is replicated, so experts are reduced with the dense parameters and the list is
empty. With `ep > 1` each rank holds different experts: they are excluded here, and the expert-parallel code
reduces them over the expert-data-parallel group (divided by the full DP size, DeepSpeed's rule).
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
