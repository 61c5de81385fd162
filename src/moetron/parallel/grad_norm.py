"""The true global gradient norm: every gradient counted exactly once, however the model is split.

Each rank holds some gradients in full (dense tensors replicated over data parallelism: every replica holds the
same values after the reduction) and some as one shard of a larger tensor: routed experts (a different slice of
the experts on every expert-parallel rank), tensor-parallel shards (plain local tensors the registry marks as split
over `tp`; replicated ones — norms, routers, row-parallel biases — are counted once), DTensor shards (ZeRO), and
whole layers on one pipeline stage. A squared norm is summed locally per kind of sharding, then all-reduced over
exactly the groups its tensor is split across (EP for experts, TP for tensor-parallel shards, a DTensor's sharded
mesh dimensions, PP for everything), so every rank clips by the same norm — the norm of the one-process model's
gradient (DeepSpeed only averages the local norms). Sums over a product of groups are done one group after the
other.

The same number at every layout, to rounding of about 1e-16: each gradient's squared norm is accumulated in float64
(an fp32 element's square is exact there), then the per-tensor squares are summed in float64 in the optimizer's
parameter order. A shard's squared sum plus its peers' over an all-reduce is then the whole tensor's squared sum up
to float64 rounding; in fp32, a million-element tensor's norm alone is ~1e-5 off and a shard's is off differently,
so ZeRO's norms drifted from one process's by 1e-6 to 1e-4 and the clip coefficient with them. Still one
all-reduce per bucket (of one float64 scalar); reading fp32 into float64 accumulators costs a few milliseconds per
10M elements on one CPU thread, nothing beside a step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from moetron.parallel.diagnosis import Site
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.params import ParamRegistry


def _local_and_groups(grad: torch.Tensor) -> tuple[torch.Tensor, list[tuple[str, object]]]:
    """A gradient's local values and the (mesh dimension name, group) pairs a DTensor gradient is sharded (or
    partial) over."""
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor):
        return grad, []
    mesh, groups = grad.device_mesh, []
    for dim, placement in enumerate(grad.placements):
        if placement.is_shard() or placement.is_partial():
            groups.append((mesh.mesh_dim_names[dim], mesh.get_group(dim)))
    return grad.to_local(), groups


NORM_DTYPE = torch.float64  # the accumulator of every squared norm (see the module docstring)


def sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The squared L2 norm of `grads` together, a float64 scalar: per tensor in float64, then summed in list order."""
    if not grads:
        return torch.zeros((), dtype=NORM_DTYPE, device=device)
    return torch.stack(torch._foreach_norm(grads, 2.0, dtype=NORM_DTYPE)).pow(2).sum()


def global_grad_norm_sq(
    model: nn.Module,
    registry: ParamRegistry,
    mesh: ParallelMesh,
    named_params: list[tuple[str, torch.Tensor]] | None = None,
) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """A `grad_norm_sq_fn` for `clip_gradients` over this model's parameters (see the module docstring), or over
    `named_params` when the optimizer steps other tensors (ZeRO-1's shards, named like their parameters).

    Collectives run in an order every rank agrees on: buckets keyed by mesh dimension names, sorted (the ranks of
    one such group share a pipeline stage, hence the same parameters), then one all-reduce over the pipeline
    stages at the end (stages hold different parameters, so nothing per-bucket crosses them)."""
    named = registry.named_parameters(model) if named_params is None else named_params
    expert_ids = {id(p) for n, p in named if registry[n].is_expert}
    ep_group = [("ep", mesh.group("ep"))] if mesh.size("ep") > 1 else []
    # tensor parallelism keeps its shards as plain local tensors and records where they are split (the registry)
    # (by name: at ZeRO-1 the optimizer steps shards of the split parameters, other tensors of the same names)
    tp_split = {id(p) for n, p in named if registry[n].tp_dim is not None}
    tp_group = [("tp", mesh.group("tp"))] if mesh.size("tp") > 1 else []
    pp_group = mesh.group("pp") if mesh.size("pp") > 1 else None
    site = Site("the gradient-norm all-reduce")  # over several groups: its peers are named as the world's

    def norm_sq(params: list[torch.Tensor]) -> torch.Tensor:
        buckets: dict[tuple[str, ...], tuple[list, list[torch.Tensor]]] = {}
        device = torch.device("cpu")
        for p in params:
            if p.grad is None:
                continue
            local, groups = _local_and_groups(p.grad)
            device = local.device
            groups = groups + (ep_group if id(p) in expert_ids else []) + (tp_group if id(p) in tp_split else [])
            key = tuple(sorted(name for name, _ in groups))
            buckets.setdefault(key, ([g for _, g in sorted(groups, key=lambda ng: ng[0])], []))[1].append(local)
        total = torch.zeros((), dtype=NORM_DTYPE, device=device)
        with site:
            for key in sorted(buckets):
                groups, grads = buckets[key]
                partial = sum_of_squares(grads, device)
                for group in groups:
                    dist.all_reduce(partial, group=group)
                total = total + partial
            if pp_group is not None:
                dist.all_reduce(total, group=pp_group)
        return total

    return norm_sq
