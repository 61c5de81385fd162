"""AdamW (or Muon, `--optimizer muon`) with Megatron's parameter groups, and gradient clipping by the true global norm.

Groups (Megatron's `get_param_groups`, reference §4.8): no weight decay for biases, normalisation weights and
every other tensor with fewer than two dimensions; expert biases are stored stacked as `[E, F]` but are still
biases, so the name decides for them. The rule lives in the parameter registry (`moetron.parallel.params`).
The torch AdamW is used with its fused kernel when the device supports it (CUDA, and CPU in recent torch), else
the foreach one. `--optimizer muon` (train/muon.py) adds Muon groups of the registry's hidden matrices
(`ParamInfo.matrix`); the rest keeps these AdamW groups and kernels.

Clipping uses the true global norm: `grad_norm_sq_fn` is `ParallelModel.grad_norm_sq` (moetron.parallel.grad_norm),
which sums every shard's squared norm over exactly the groups it is split across.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from moetron.parallel.grad_norm import sum_of_squares
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.params import ParamRegistry
from moetron.parallel.whole_matrix import matrix_part
from moetron.train.muon import MatrixPlan, Muon


def param_groups(
    model: nn.Module,
    weight_decay: float,
    registry: ParamRegistry | None = None,
    named_params: list[tuple[str, torch.Tensor]] | None = None,
) -> list[dict]:
    """The decay / no-decay groups, as the parameter registry classifies each parameter. `named_params`: what the
    optimizer steps when it is not the model's own parameters (ZeRO-1: this rank's shards of them)."""
    registry = registry or ParamRegistry.from_model(model)
    decay, no_decay = [], []
    for name, param in registry.named_parameters(model) if named_params is None else named_params:
        if param.requires_grad:
            (decay if registry[name].decay else no_decay).append(param)
    groups = [
        {"name": "decay", "params": decay, "weight_decay": weight_decay, "lr_mult": 1.0},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0, "lr_mult": 1.0},
    ]
    return [g for g in groups if g["params"]]


def _fused_supported(device: torch.device) -> bool:
    probe = torch.zeros(1, device=device, requires_grad=True)
    try:
        torch.optim.AdamW([probe], fused=True)
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


def muon_param_groups(
    named_params: list[tuple[str, torch.Tensor]], registry: ParamRegistry, train
) -> tuple[list[dict], list[tuple[str, torch.Tensor]]]:
    """(Muon groups of the registry's hidden matrices, the remaining (name, parameter) for AdamW's groups)."""
    muon = {"momentum": train.muon_momentum, "nesterov": train.muon_use_nesterov, "ns_steps": train.muon_num_ns_steps}
    muon |= {"scale_mode": train.muon_scale_mode, "extra_scale_factor": train.muon_extra_scale_factor}
    muon |= {"split_qkv": train.muon_split_qkv}
    decay, no_decay, rest = [], [], []
    for name, param in named_params:
        if not param.requires_grad:
            continue
        if not registry[name].matrix:
            rest.append((name, param))
        else:
            (decay if registry[name].decay else no_decay).append(param)
    groups = [
        {"name": "muon", "params": decay, "weight_decay": train.weight_decay, "lr_mult": 1.0, "muon": True, **muon},
        {"name": "muon_no_decay", "params": no_decay, "weight_decay": 0.0, "lr_mult": 1.0, "muon": True, **muon},
    ]
    return [g for g in groups if g["params"]], rest


def build_optimizer(
    model: nn.Module,
    registry: ParamRegistry,
    train,
    device: torch.device,
    named_params: list[tuple[str, torch.Tensor]] | None = None,
    mesh: ParallelMesh | None = None,
) -> torch.optim.AdamW:
    """AdamW over `named_params` (default: the model's), or under `--optimizer muon` the `Muon` optimizer, whose
    matrices are made whole through `mesh` where this rank holds part of them (parallel/whole_matrix.py)."""
    fused = _fused_supported(device)
    adamw = {"lr": train.lr, "betas": (train.adam_beta1, train.adam_beta2), "eps": train.adam_eps}
    adamw |= {"fused": fused or None, "foreach": None if fused else True}
    if train.optimizer != "muon":
        return torch.optim.AdamW(param_groups(model, train.weight_decay, registry, named_params), **adamw)
    named = registry.named_parameters(model) if named_params is None else named_params
    muon_groups, rest = muon_param_groups(named, registry, train)
    plans = {
        id(p): MatrixPlan(registry[n], matrix_part(n, p, registry, mesh, train.muon_tp_mode))
        for n, p in named
        if p.requires_grad and registry[n].matrix
    }
    adam_groups = param_groups(model, train.weight_decay, registry, rest) if rest else []
    return Muon(muon_groups + adam_groups, plans, **adamw)


def local_grad_norm_sq(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """The squared norm of one process's gradients, accumulated exactly as the distributed one (float64)."""
    grads = [p.grad for p in params if p.grad is not None]
    return sum_of_squares(grads, grads[0].device if grads else torch.device("cpu"))


def local_grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Every gradient as the tensor this rank holds (a DTensor's local shard): scaling shards in place scales the
    whole gradient, and one foreach kernel can take gradients sharded over different meshes (dp, edp)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    return [g.to_local() if isinstance(g, DTensor) else g for g in grads]


def clip_gradients(
    params: list[torch.Tensor],
    max_norm: float,
    grad_norm_sq_fn: Callable[[list[torch.Tensor]], torch.Tensor] = local_grad_norm_sq,
) -> torch.Tensor:
    """Clip to `max_norm` by the global L2 norm (0 = only measure); returns the norm before clipping (a float64
    tensor: the coefficient comes from the layout-free float64 norm and is rounded once, to the gradients' fp32).

    Non-finite norms leave the gradients untouched: the trainer skips such steps.
    """
    total = grad_norm_sq_fn(params).sqrt()
    if max_norm > 0:
        # the coefficient is clamped to 1 and applied only when finite, all on device: no host sync here
        coeff = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        coeff = torch.where(torch.isfinite(coeff), coeff, torch.ones_like(coeff))
        grads = local_grads(params)
        torch._foreach_mul_(grads, coeff.to(grads[0].device, torch.float32))
    return total
