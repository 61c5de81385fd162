"""The dense feed-forward block: Megatron's `ParallelMLP` (GELU) or SwiGLU.

Shapes: B batch, T tokens, C hidden size, F ffn size.

GELU is the tanh approximation: Megatron's default `--bias-gelu-fusion` path computes
`0.5·x·(1 + tanh(0.79788456·x·(1 + 0.044715·x²)))` on `x + bias` (reference §4.1, "bias added before
GELU"), and GPT-2 itself uses the same `gelu_new`; `F.gelu(approximate="tanh")` is that function.

SwiGLU is `dense_4h_to_h(silu(dense_h_to_4h(x)) · dense_h_to_4h_up(x))` with two separate input projections
(Llama's gate_proj / up_proj). Megatron fuses them into one `[gate | up]` weight, but then a tensor-parallel
column shard of the fused weight is not a contiguous slice; two projections shard like any column-parallel
linear, and the second GEMM costs the same FLOPs as the wider fused one.

This is the one dense feed-forward block of a dense layer. A MoE layer's dense parts (DeepSpeed's residual MLP,
the shared experts) are one-expert `GroupedExperts` instead, on purpose: they are experts in every respect that
differs — drawn like expert 0 under `--moe-identical-expert-init` (DeepSpeed's residual template), split by expert
tensor parallelism, stored as `[1, …]` tensors in checkpoints and in the Megatron-DeepSpeed / Hugging Face
mappings — and they compute the same function with the same activation (`gelu` below, or SiLU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetron.model.config import ModelConfig


def gelu(x: torch.Tensor) -> torch.Tensor:
    """Megatron's bias-GELU fusion activation (tanh approximation)."""
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    """`dense_4h_to_h(act(dense_h_to_4h(x)) [· dense_h_to_4h_up(x)])`; `ffn_size` defaults to the dense FFN size."""

    def __init__(self, cfg: ModelConfig, ffn_size: int | None = None):
        super().__init__()
        ffn = ffn_size or cfg.ffn_size
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, ffn, bias=cfg.add_bias_linear)
        self.dense_h_to_4h_up = nn.Linear(cfg.hidden_size, ffn, bias=cfg.add_bias_linear) if cfg.swiglu else None
        self.dense_4h_to_h = nn.Linear(ffn, cfg.hidden_size, bias=cfg.add_bias_linear)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        h_BTF = self.dense_h_to_4h(x_BTC)
        if self.dense_h_to_4h_up is None:
            h_BTF = gelu(h_BTF)
        else:
            h_BTF = F.silu(h_BTF) * self.dense_h_to_4h_up(x_BTC)
        return self.dense_4h_to_h(h_BTF)
