"""AdamW with Megatron's parameter groups, and gradient clipping by the true global norm.

Groups (Megatron's `get_param_groups`, reference §4.8): no weight decay for biases, normalisation weights and
every other tensor with fewer than two dimensions; expert biases are stored stacked as `[E, F]` but are still
biases, so the name decides for them. The torch AdamW is used with its fused kernel when the device supports it
(CUDA, and CPU in recent torch), else the foreach one.

Clipping computes the norm over every gradient this process holds. Dense gradients are identical on every
data-parallel rank after DDP's all-reduce, so the local norm is the global one. Expert-parallel shards hold
different experts: `grad_norm_sq_fn` takes the squared norm from `ParallelModel.grad_norm_sq`, which all-reduces the
expert part over the expert-parallel group.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

NO_DECAY_NAME_PARTS = ("bias", "norm", "ln_", "layernorm")


def decays(name: str, param: torch.Tensor) -> bool:
    """Whether weight decay applies: matrices yes; biases, norms and any 1-D tensor no."""
    leaf = name.rsplit(".", 1)[-1].lower()
    if param.ndim < 2 or re.match(r"b\d", leaf):  # stacked expert biases b1_EF, b2_ED
        return False
    return not any(part in name.lower() for part in NO_DECAY_NAME_PARTS)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (decay if decays(name, param) else no_decay).append(param)
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


def build_optimizer(model: nn.Module, train, device: torch.device) -> torch.optim.AdamW:
    fused = _fused_supported(device)
    return torch.optim.AdamW(
        param_groups(model, train.weight_decay),
        lr=train.lr,
        betas=(train.adam_beta1, train.adam_beta2),
        eps=train.adam_eps,
        fused=fused or None,
        foreach=None if fused else True,
    )


def local_grad_norm_sq(params: Iterable[torch.Tensor]) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = torch._foreach_norm(grads, 2.0)
    return torch.stack([n.float() for n in norms]).pow(2).sum()


def clip_gradients(
    params: list[torch.Tensor],
    max_norm: float,
    grad_norm_sq_fn: Callable[[list[torch.Tensor]], torch.Tensor] = local_grad_norm_sq,
) -> torch.Tensor:
    """Clip to `max_norm` by the global L2 norm (0 = only measure); returns the norm before clipping (a tensor).

    Non-finite norms leave the gradients untouched: the trainer skips such steps.
    """
    total = grad_norm_sq_fn(params).sqrt()
    if max_norm > 0:
        # the coefficient is clamped to 1 and applied only when finite, all on device: no host sync here
        coeff = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        coeff = torch.where(torch.isfinite(coeff), coeff, torch.ones_like(coeff))
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, coeff.to(grads[0].device))
    return total
