"""The dense feed-forward block: Megatron's `ParallelMLP` (GELU) or SwiGLU.

Shapes: B batch, T tokens, C hidden size, F ffn size.

GELU is the tanh approximation: Megatron's default `--bias-gelu-fusion` path computes
`0.5·x·(1 + tanh(0.79788456·x·(1 + 0.044715·x²)))` on `x + bias` (reference §4.1, "bias added before
GELU"), and GPT-2 itself uses the same `gelu_new`; `F.gelu(approximate="tanh")` is that function.
SwiGLU follows Megatron's fused layout: `dense_h_to_4h` outputs `[gate | up]` (2·F channels) and the
activation is `silu(gate) · up`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetron.model.config import ModelConfig


def gelu(x: torch.Tensor) -> torch.Tensor:
    """Megatron's bias-GELU fusion activation (tanh approximation)."""
    return F.gelu(x, approximate="tanh")


def swiglu(x_2F: torch.Tensor) -> torch.Tensor:
    """`silu(gate) · up` where the last dim holds `[gate | up]`."""
    gate, up = x_2F.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    """`dense_4h_to_h(act(dense_h_to_4h(x)))`; `ffn_size` defaults to the config's dense FFN size."""

    def __init__(self, cfg: ModelConfig, ffn_size: int | None = None):
        super().__init__()
        ffn = ffn_size or cfg.ffn_size
        self.swiglu = cfg.swiglu
        up_channels = 2 * ffn if cfg.swiglu else ffn
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, up_channels, bias=cfg.add_bias_linear)
        self.dense_4h_to_h = nn.Linear(ffn, cfg.hidden_size, bias=cfg.add_bias_linear)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        h = self.dense_h_to_4h(x_BTC)
        h = swiglu(h) if self.swiglu else gelu(h)
        return self.dense_4h_to_h(h)
