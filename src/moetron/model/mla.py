"""Multi-head latent attention (MLA, DeepSeek-V2 §2.1 and DeepSeek-V3; `--multi-latent-attention`).

Shapes: B batch, T new tokens, S attended tokens (T, or cache length + T), C hidden size, H heads (this shard's),
Rq / Rkv the query / key-value latent ranks, Dn `--qk-head-dim` (channels without positions), Dr
`--qk-pos-emb-head-dim` (the decoupled rotary channels), Dv `--v-head-dim`.

    queries   c_q = norm(linear_q_down_proj(x)) [B, T, Rq];  q = linear_q_up_proj(c_q) → H × [q_nope Dn | q_rope Dr]
              (--q-lora-rank 0: q = linear_q_proj(x), no query latent)
    keys and  linear_kv_down_proj(x) = [c_kv Rkv | k_rope Dr]: c_kv = norm(c_kv), the latent the KV cache holds;
    values    linear_kv_up_proj(c_kv) → H × [k_nope Dn | v Dv];  k_rope is ONE key shared by every head
    RoPE      on q_rope (per head) and the shared k_rope only ("decoupled": the latent carries no position, so it
              can be cached compressed); k = [k_nope | k_rope], q = [q_nope | q_rope]
    scores    softmax(q·kᵀ / sqrt(Dn + Dr)) · v → `dense` (H·Dv → C)

The latent norms are RMSNorms with DeepSeek's fixed epsilon 1e-6 (`LATENT_NORM_EPS`: DeepSeek's code and
transformers' DeepseekV3Attention use it whatever `rms_norm_eps` is), so a moetron MLA model is exactly a
DeepseekV3ForCausalLM attention. The softmax scale is DeepSeek's 1/sqrt(Dn + Dr), times YaRN's mscale(s,
--mscale-all-dim)² with --rope-type yarn (`model/rotary.py`, DeepSeek's correction as Megatron-Core applies it).

The KV cache (`KVCache` with keys = the normalised latent `[B, 1, L, Rkv]`, values = the rotated shared key
`[B, 1, L, Dr]`) holds Rkv + Dr numbers per token and layer instead of 2·H·D; keys and values are expanded from it
at every step. Parameter names are Megatron-Core's (`linear_q_down_proj`, `linear_kv_up_proj`, …), the output
projection is `dense` like `SelfAttention`'s (so it gets the scaled output init of `model/init.py`).

Tensor parallelism (`parallel/tp/apply_tp.py`, as Megatron-Core does): the up projections (and `linear_q_proj`) are
column-parallel by heads, `dense` row-parallel; the down projections and the latent norms are replicated. The shared
rotary key feeds every head, so on a head shard its gradient is only this shard's heads' part: `shared_key_hook` (set
by tensor parallelism) sums it over the shards in backward; the forward derives H from the projections' width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moetron.model.attention import attention_dropout_stream, causal_attention
from moetron.model.config import ModelConfig
from moetron.model.kv_cache import KVCache
from moetron.model.norm import RMSNorm
from moetron.model.rotary import apply_rotary, yarn_of, yarn_softmax_factor

LATENT_NORM_EPS = 1e-6


class MultiLatentAttention(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention with decoupled RoPE (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        self.softmax_scale = yarn_softmax_factor(yarn_of(cfg)) / (self.nope_dim + self.rope_dim) ** 0.5
        self.dropout_p = cfg.attention_dropout
        self.stream_shard: tuple = ()  # extra key of the attention-dropout stream (tensor parallelism: the shard)
        # tensor parallelism: identity forward, sum over the head shards backward (see the module docstring)
        self.shared_key_hook: Callable[[torch.Tensor], torch.Tensor] | None = None
        heads, hidden, bias = cfg.num_attention_heads, cfg.hidden_size, cfg.add_bias_linear
        q_channels = heads * (self.nope_dim + self.rope_dim)
        self.linear_q_proj = self.linear_q_down_proj = self.q_layernorm = self.linear_q_up_proj = None
        if cfg.q_lora_rank:
            self.linear_q_down_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=bias)
            self.q_layernorm = RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS)
            self.linear_q_up_proj = nn.Linear(cfg.q_lora_rank, q_channels, bias=bias)
        else:
            self.linear_q_proj = nn.Linear(hidden, q_channels, bias=bias)
        self.linear_kv_down_proj = nn.Linear(hidden, self.kv_rank + self.rope_dim, bias=bias)
        self.kv_layernorm = RMSNorm(self.kv_rank, eps=LATENT_NORM_EPS)
        self.linear_kv_up_proj = nn.Linear(self.kv_rank, heads * (self.nope_dim + self.v_dim), bias=bias)
        self.dense = nn.Linear(heads * self.v_dim, hidden, bias=bias)

    def queries(self, x_BTC: torch.Tensor) -> torch.Tensor:
        """q `[B, H, T, Dn + Dr]` before RoPE."""
        B, T, _ = x_BTC.shape
        if self.linear_q_proj is not None:
            q_BTX = self.linear_q_proj(x_BTC)
        else:
            q_BTX = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x_BTC)))
        return q_BTX.view(B, T, -1, self.nope_dim + self.rope_dim).transpose(1, 2)

    def latent(self, x_BTC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised latent `[B, 1, T, Rkv]`, shared rotary key `[B, 1, T, Dr]` before RoPE): what the cache holds."""
        c_BTR, k_rope_BTD = self.linear_kv_down_proj(x_BTC).split([self.kv_rank, self.rope_dim], dim=-1)
        if self.shared_key_hook is not None:
            k_rope_BTD = self.shared_key_hook(k_rope_BTD)
        return self.kv_layernorm(c_BTR)[:, None], k_rope_BTD[:, None]

    def expand(self, c_B1SR: torch.Tensor, k_rope_B1SD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys `[B, H, S, Dn + Dr]` and values `[B, H, S, Dv]` from the latent and the shared rotated key."""
        B, _, S, _ = c_B1SR.shape
        kv_BHSX = self.linear_kv_up_proj(c_B1SR[:, 0]).view(B, S, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope_BHSD, v_BHSD = kv_BHSX.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope_BHSD = k_rope_B1SD.expand(-1, k_nope_BHSD.shape[1], -1, -1)
        return torch.cat([k_nope_BHSD, k_rope_BHSD.to(k_nope_BHSD.dtype)], dim=-1), v_BHSD

    def forward(
        self,
        x_BTC: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        B, T, _ = x_BTC.shape
        q_nope_BHTD, q_rope_BHTD = self.queries(x_BTC).split([self.nope_dim, self.rope_dim], dim=-1)
        c_B1TR, k_rope_B1TD = self.latent(x_BTC)
        if rope is not None:  # always on (validated); None only if a caller passes no angles
            q_rope_BHTD, k_rope_B1TD = apply_rotary(q_rope_BHTD, *rope), apply_rotary(k_rope_B1TD, *rope)
        past = 0
        if kv_cache is not None:
            past = kv_cache.length
            c_B1TR, k_rope_B1TD = kv_cache.update(self.layer_index, c_B1TR, k_rope_B1TD)
        k_BHSD, v_BHSD = self.expand(c_B1TR.to(x_BTC.dtype), k_rope_B1TD)
        q_BHTD = torch.cat([q_nope_BHTD, q_rope_BHTD], dim=-1)
        with attention_dropout_stream(self):
            dropout_p = self.dropout_p if self.training else 0.0
            k_BHSD, v_BHSD = k_BHSD.to(q_BHTD.dtype), v_BHSD.to(q_BHTD.dtype)
            y_BHTD = causal_attention(q_BHTD, k_BHSD, v_BHSD, past, dropout_p, scale=self.softmax_scale)
        return self.dense(y_BHTD.transpose(1, 2).reshape(B, T, -1))


def latent_attention_params(cfg: ModelConfig) -> int:
    """Parameters of one `MultiLatentAttention(cfg)` (tensor parallel size 1)."""
    h, heads, rq, rkv = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank or 0, cfg.kv_lora_rank
    q_out, kv_up_out = heads * (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim), heads * (cfg.qk_head_dim + cfg.v_head_dim)
    linears = [(h, rq), (rq, q_out)] if rq else [(h, q_out)]
    linears += [(h, rkv + cfg.qk_pos_emb_head_dim), (rkv, kv_up_out), (heads * cfg.v_head_dim, h)]
    weights = sum(i * o for i, o in linears)
    biases = sum(o for _, o in linears) if cfg.add_bias_linear else 0
    return weights + biases + rq + rkv  # + the latent norms' weights


def latent_cache_channels(cfg: ModelConfig) -> int:
    """Numbers the KV cache holds per token and layer: the latent and the shared rotary key (GQA: 2·K·D)."""
    return cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
