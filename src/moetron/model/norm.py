"""Normalisation layers: Megatron's LayerNorm (default) or RMSNorm (`--normalization rmsnorm`).

Both are PyTorch's own modules (no apex): `nn.LayerNorm` / `nn.RMSNorm` have a `weight` (init 1) and,
for LayerNorm, a `bias` (init 0). Statistics are computed in fp32 even under autocast, as Megatron's
fused kernels do, so bf16 training does not lose precision in the variance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetron.model.config import ModelConfig


class LayerNorm(nn.LayerNorm):
    """LayerNorm that normalises in fp32 and returns the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            y = F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


class RMSNorm(nn.RMSNorm):
    """RMSNorm (`x / rms(x) · weight`, no bias, no mean subtraction) computed in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            y = F.rms_norm(x.float(), self.normalized_shape, self.weight.float(), self.eps)
        return y.to(x.dtype)


def build_norm(cfg: ModelConfig, size: int | None = None) -> nn.Module:
    """The normalisation the config asks for, over the hidden dimension (or the last `size` channels)."""
    if cfg.normalization == "rmsnorm":
        return RMSNorm(size or cfg.hidden_size, eps=cfg.layernorm_epsilon)
    return LayerNorm(size or cfg.hidden_size, eps=cfg.layernorm_epsilon)
