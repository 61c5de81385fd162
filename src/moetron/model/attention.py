"""Causal self-attention: fused QKV projection grouped by key/value head, optional RoPE and GQA, SDPA.

Shapes: B batch, T new tokens, S attended tokens (T, or cache length + T), C hidden size,
H query heads, K key/value heads (H % K == 0), R = H / K query heads per group, D head dim.

`query_key_value` is one projection whose output channels are ordered by key/value group (Megatron-LM's
layout): for group g = 0 … K−1, the R query heads of g, then g's key head, then g's value head, each D
channels. So a tensor-parallel column shard of the weight (rows split evenly over ranks) is a contiguous
block of whole groups, and one GEMM still computes q, k and v. `fuse_qkv` / `split_qkv_weight` convert from
and to separate q/k/v projections (Hugging Face, and Megatron-DeepSpeed's contiguous [Q | K | V] thirds).

The forward derives the number of local groups from the projection's output width, so the same code runs a
full layer or a tensor-parallel shard of it. Optional QK normalisation (`--qk-layernorm`) normalises queries and
keys before RoPE: per head over D (Qwen3, Megatron-Core), or over all heads' channels at once (OLMoE's
`all_heads`; a tensor-parallel shard would need the other shards' heads for that one). Attention runs through
`F.scaled_dot_product_attention` (flash / memory-efficient kernels on GPU, the math kernel on CPU).

Attention dropout draws from a stream of its own (`moetron.model.rng`), so the layer's other draws (hidden
dropout, the router's random token selection) never depend on how many attention probabilities there are. A
tensor-parallel shard holds only some heads: its `stream_shard` key (set by tensor parallelism) makes the shards
draw independent masks (SDPA draws inside the kernel, so a head shard cannot reproduce the one-process masks).

`attend_fn` (None by default) replaces the causal SDPA call of a training forward: context parallelism
(`parallel/cp/`) hands in a function with SDPA's signature that attends to keys held by other ranks, so this
module never runs a collective itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moetron.model.config import ModelConfig
from moetron.model.kv_cache import KVCache
from moetron.model.norm import build_norm
from moetron.model.rng import STREAMS
from moetron.model.rotary import apply_rotary

# `enable_gqa` lets SDPA broadcast K key/value heads over H query heads without copying (torch >= 2.5).
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, kv_heads: int) -> torch.Tensor:
    """Separate q `[H·D, …]`, k and v `[K·D, …]` (weights or biases) → the grouped `query_key_value` layout."""
    per_group = num_heads // kv_heads
    head_dim = q.shape[0] // num_heads
    rest = q.shape[1:]
    q_KRD = q.reshape(kv_heads, per_group, head_dim, *rest)
    k_K1D = k.reshape(kv_heads, 1, head_dim, *rest)
    v_K1D = v.reshape(kv_heads, 1, head_dim, *rest)
    return torch.cat([q_KRD, k_K1D, v_K1D], dim=1).reshape(-1, *rest)


def split_grouped_qkv(
    fused: torch.Tensor, queries_per_group: int, head_dim: int, dim: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one rule of the grouped `query_key_value` layout, along `dim` of `fused`: per key/value group, its R query
    heads, then its key head, then its value head, each `head_dim` wide. Returns views q `[..., K, R, D, ...]`, k and
    v `[..., K, D, ...]` (K groups in place of `dim`) for the weight (dim 0) and the projected activations (dim -1)."""
    dim %= fused.dim()
    R = queries_per_group
    grouped = fused.reshape(*fused.shape[:dim], -1, R + 2, head_dim, *fused.shape[dim + 1 :])
    before = (slice(None),) * (dim + 1)  # every index up to the groups' dim
    return grouped[(*before, slice(0, R))], grouped[(*before, R)], grouped[(*before, R + 1)]


def split_qkv_weight(
    fused: torch.Tensor, num_heads: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grouped `query_key_value` weight (or bias) → separate (q, k, v), the inverse of `fuse_qkv`."""
    per_group = num_heads // kv_heads
    head_dim = fused.shape[0] // (kv_heads * (per_group + 2))
    rest = fused.shape[1:]
    q, k, v = split_grouped_qkv(fused, per_group, head_dim)
    return (
        q.reshape(num_heads * head_dim, *rest),
        k.reshape(kv_heads * head_dim, *rest),
        v.reshape(kv_heads * head_dim, *rest),
    )


class SelfAttention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention, Megatron parameter names."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.queries_per_group = cfg.num_attention_heads // cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.dropout_p = cfg.attention_dropout
        self.stream_shard: tuple = ()  # extra key of the attention-dropout stream (tensor parallelism: the shard)
        # causal attention over keys of other ranks (context parallelism): (q, k, v, dropout_p=, enable_gqa=) → y
        self.attend_fn: Callable[..., torch.Tensor] | None = None
        qkv_channels = (cfg.num_attention_heads + 2 * cfg.kv_heads) * self.head_dim
        qkv_bias = cfg.add_bias_linear or cfg.add_qkv_bias
        self.query_key_value = nn.Linear(cfg.hidden_size, qkv_channels, bias=qkv_bias)
        self.dense = nn.Linear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias=cfg.add_bias_linear)
        self.q_layernorm = self.k_layernorm = None
        if cfg.qk_layernorm:  # per head: over D; all heads: over H·D (queries) and K·D (keys)
            per_head = cfg.qk_layernorm_scope == "head"
            self.q_layernorm = build_norm(cfg, self.head_dim * (1 if per_head else cfg.num_attention_heads))
            self.k_layernorm = build_norm(cfg, self.head_dim * (1 if per_head else cfg.kv_heads))

    def split_qkv(self, x_BTC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project and split into q `[B, H, T, D]`, k and v `[B, K, T, D]` (H, K: this shard's heads)."""
        B, T, _ = x_BTC.shape
        D = self.head_dim
        q_BTKRD, k_BTKD, v_BTKD = split_grouped_qkv(self.query_key_value(x_BTC), self.queries_per_group, D, dim=-1)
        q_BHTD = q_BTKRD.reshape(B, T, -1, D).transpose(1, 2)
        k_BKTD, v_BKTD = k_BTKD.transpose(1, 2), v_BTKD.transpose(1, 2)
        if self.q_layernorm is not None:
            q_BHTD, k_BKTD = self._qk_norm(self.q_layernorm, q_BHTD), self._qk_norm(self.k_layernorm, k_BKTD)
        return q_BHTD, k_BKTD, v_BKTD

    def _qk_norm(self, norm: nn.Module, x_BHTD: torch.Tensor) -> torch.Tensor:
        """`norm` over each head's D channels, or (all-heads scope) over the H·D channels of each token."""
        if norm.normalized_shape[0] == self.head_dim:
            return norm(x_BHTD)
        B, H, T, D = x_BHTD.shape
        return norm(x_BHTD.transpose(1, 2).reshape(B, T, H * D)).view(B, T, H, D).transpose(1, 2)

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
        with attention_dropout_stream(self):
            y_BHTD = self.attend(q_BHTD, k_BKSD.to(q_BHTD.dtype), v_BKSD.to(q_BHTD.dtype), past)
        y_BTC = y_BHTD.transpose(1, 2).reshape(B, T, -1)
        return self.dense(y_BTC)

    def attend(self, q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, past: int) -> torch.Tensor:
        """Causal SDPA where query t sits at absolute position `past + t`."""
        dropout_p = self.dropout_p if self.training else 0.0
        if self.attend_fn is not None and past == 0:
            k_BKSD, v_BKSD, gqa = grouped_kv(k_BKSD, v_BKSD, self.queries_per_group)
            return self.attend_fn(q_BHTD, k_BKSD, v_BKSD, dropout_p=dropout_p, **gqa)
        return causal_attention(q_BHTD, k_BKSD, v_BKSD, past, dropout_p, self.queries_per_group)


def attention_dropout_stream(layer: nn.Module) -> contextlib.AbstractContextManager:
    """The attention-dropout stream of `layer` (`SelfAttention` or `MultiLatentAttention`; and its tensor-parallel
    shard) while dropout is on; else nothing to swap."""
    if not (layer.training and layer.dropout_p > 0):
        return contextlib.nullcontext()
    return STREAMS.fork("layers", layer.layer_index, "attention", *layer.stream_shard)


def grouped_kv(
    k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, queries_per_group: int
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """K/V heads and SDPA's keyword for `queries_per_group` query heads per K/V head: `enable_gqa` where this torch
    has it, else the K/V heads repeated."""
    if queries_per_group == 1:
        return k_BKSD, v_BKSD, {}
    if _SDPA_HAS_GQA:
        return k_BKSD, v_BKSD, {"enable_gqa": True}
    return k_BKSD.repeat_interleave(queries_per_group, 1), v_BKSD.repeat_interleave(queries_per_group, 1), {}


def causal_attention(
    q_BHTD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    past: int,
    dropout_p: float = 0.0,
    queries_per_group: int = 1,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal SDPA where query t sits at absolute position `past + t` (keys 0 … past + T − 1); K key/value heads
    serve `queries_per_group` query heads each. The value head dim may differ from the query/key one (MLA).
    `scale`: the softmax scale (None: SDPA's 1/sqrt(head dim))."""
    T, S = q_BHTD.shape[2], k_BKSD.shape[2]
    mask_TS, is_causal = None, True
    if past > 0:
        # SDPA's is_causal aligns the mask top-left, which is wrong once keys precede the queries.
        is_causal = False
        if T > 1:
            query_pos_T = torch.arange(past, past + T, device=q_BHTD.device)
            mask_TS = torch.arange(S, device=q_BHTD.device)[None, :] <= query_pos_T[:, None]
    k_BKSD, v_BKSD, gqa = grouped_kv(k_BKSD, v_BKSD, queries_per_group)
    return F.scaled_dot_product_attention(
        q_BHTD, k_BKSD, v_BKSD, attn_mask=mask_TS, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **gqa
    )
