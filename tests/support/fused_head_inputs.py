"""Small inputs of the fused LM head + cross-entropy and the plain head's loss on them, shared by its tests
(tests/unit/test_fused_cross_entropy.py, tests/unit/cpu/test_cpu_head_loss.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

N, C, V = 37, 16, 96


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g, requires_grad=True)
    w = (torch.randn(V, C, generator=g) * 0.5).requires_grad_(True)
    labels = torch.randint(0, V, (N,), generator=g)
    mask = (torch.rand(N, generator=g) > 0.3).float()
    return x, w, labels, mask


def plain_loss(x, w, labels, mask):
    losses = F.cross_entropy(F.linear(x, w).float(), labels, reduction="none")
    return (losses * mask).sum() / mask.sum()
