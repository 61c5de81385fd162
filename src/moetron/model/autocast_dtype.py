"""The dtype a hand-written kernel computes in: what autocast would cast its matmul inputs to.

Kernels that bypass autocast (the grouped experts, the fused LM head + cross-entropy) cast their inputs themselves,
and must agree with autocast's choice so that a layer's numbers do not depend on which path ran it."""

from __future__ import annotations

import torch


def autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for x's device (and x is floating), else x's own dtype."""
    if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype
