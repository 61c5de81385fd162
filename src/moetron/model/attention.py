"""Causal self-attention: fused QKV projection, optional RoPE and grouped-query attention, SDPA.

Shapes: B batch, T new tokens, S attended tokens (T, or cache length + T), C hidden size,
H query heads, K key/value heads (H % K == 0), D head dim.

The fused projection `query_key_value` produces `[Q | K | V]` as contiguous blocks of H·D, K·D and
K·D channels (current Megatron-DeepSpeed layout, reference §4.1), so converting to separate
q/k/v projections is a plain slice. Attention runs through `F.scaled_dot_product_attention`
(flash / memory-efficient kernels on GPU, the math kernel on CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetron.model.config import ModelConfig
from moetron.model.kv_cache import KVCache
from moetron.model.rotary import apply_rotary

# `enable_gqa` lets SDPA broadcast K key/value heads over H query heads without copying (torch >= 2.5).
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


class SelfAttention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention, Megatron parameter names."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.dropout_p = cfg.attention_dropout
        qkv_channels = (self.num_heads + 2 * self.kv_heads) * self.head_dim
        self.query_key_value = nn.Linear(cfg.hidden_size, qkv_channels, bias=cfg.add_bias_linear)
        self.dense = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.add_bias_linear)

    def split_qkv(self, x_BTC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project and split into q `[B, H, T, D]`, k and v `[B, K, T, D]`."""
        B, T, _ = x_BTC.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = self.query_key_value(x_BTC).split([q_size, kv_size, kv_size], dim=-1)
        q_BHTD = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k_BKTD = k.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v_BKTD = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        return q_BHTD, k_BKTD, v_BKTD

    def forward(
        self,
        x_BTC: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        B, T, _ = x_BTC.shape
        q_BHTD, k_BKTD, v_BKTD = self.split_qkv(x_BTC)
        if rope is not None:
            q_BHTD, k_BKTD = apply_rotary(q_BHTD, *rope), apply_rotary(k_BKTD, *rope)
        past = 0
        if kv_cache is not None:
            past = kv_cache.length
            k_BKSD, v_BKSD = kv_cache.update(self.layer_index, k_BKTD, v_BKTD)
        else:
            k_BKSD, v_BKSD = k_BKTD, v_BKTD
        y_BHTD = self.attend(q_BHTD, k_BKSD.to(q_BHTD.dtype), v_BKSD.to(q_BHTD.dtype), past)
        y_BTC = y_BHTD.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        return self.dense(y_BTC)

    def attend(self, q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, past: int) -> torch.Tensor:
        """Causal SDPA where query t sits at absolute position `past + t`."""
        T, S = q_BHTD.shape[2], k_BKSD.shape[2]
        mask_TS, is_causal = None, True
        if past > 0:
            # SDPA's is_causal aligns the mask top-left, which is wrong once keys precede the queries.
            is_causal = False
            if T > 1:
                query_pos_T = torch.arange(past, past + T, device=q_BHTD.device)
                mask_TS = torch.arange(S, device=q_BHTD.device)[None, :] <= query_pos_T[:, None]
        gqa = {}
        if self.kv_heads != self.num_heads:
            if _SDPA_HAS_GQA:
                gqa = {"enable_gqa": True}
            else:
                repeats = self.num_heads // self.kv_heads
                k_BKSD = k_BKSD.repeat_interleave(repeats, dim=1)
                v_BKSD = v_BKSD.repeat_interleave(repeats, dim=1)
        dropout_p = self.dropout_p if self.training else 0.0
        return F.scaled_dot_product_attention(
            q_BHTD, k_BKSD, v_BKSD, attn_mask=mask_TS, dropout_p=dropout_p, is_causal=is_causal, **gqa
        )
