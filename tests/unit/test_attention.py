"""Attention pieces: fused QKV layout, causal masking with a KV cache offset, GQA, rotary positions."""

from __future__ import annotations

import math

import pytest
import torch

from moetron.model.attention import SelfAttention, fuse_qkv, split_qkv_weight
from moetron.model.config import ModelConfig
from moetron.model.kv_cache import KVCache
from moetron.model.rotary import apply_rotary, rotary_angles


def tiny_cfg(**overrides) -> ModelConfig:
    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=50, seq_length=16)
    base.update(hidden_dropout=0.0, attention_dropout=0.0)
    base.update(overrides)
    return ModelConfig(**base)


def naive_attention(attn: SelfAttention, x_BTC: torch.Tensor, H: int, K: int) -> torch.Tensor:
    """Softmax(QKᵀ/√D + causal mask)·V with K/V heads repeated by hand; the fused output is read group by group:
    for each key/value group g, its H/K query heads, then its key head, then its value head."""
    B, T, C = x_BTC.shape
    D, R = attn.head_dim, H // K
    qkv = x_BTC @ attn.query_key_value.weight.T + attn.query_key_value.bias
    heads = qkv.reshape(B, T, K * (R + 2), D)
    q = torch.stack([heads[:, :, g * (R + 2) + r] for g in range(K) for r in range(R)], dim=2)
    k = torch.stack([heads[:, :, g * (R + 2) + R] for g in range(K)], dim=2)
    v = torch.stack([heads[:, :, g * (R + 2) + R + 1] for g in range(K)], dim=2)
    q = q.permute(0, 2, 1, 3)
    k = k.permute(0, 2, 1, 3).repeat_interleave(R, dim=1)
    v = v.permute(0, 2, 1, 3).repeat_interleave(R, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(B, T, H * D)
    return y @ attn.dense.weight.T + attn.dense.bias


@pytest.mark.parametrize("kv_heads", [None, 2, 1])
def test_attention_matches_naive_reference(kv_heads):
    torch.manual_seed(0)
    attn = SelfAttention(tiny_cfg(num_key_value_heads=kv_heads), layer_index=0)
    x = torch.randn(2, 7, 32)
    reference = naive_attention(attn, x, 4, kv_heads or 4)
    torch.testing.assert_close(attn(x), reference, atol=1e-5, rtol=1e-5)


def test_fuse_and_split_qkv_round_trip_and_shard_by_whole_groups():
    H, K, D, C = 4, 2, 8, 32
    q, k, v = torch.randn(H * D, C), torch.randn(K * D, C), torch.randn(K * D, C)
    fused = fuse_qkv(q, k, v, H, K)
    for mine, theirs in zip(split_qkv_weight(fused, H, K), (q, k, v), strict=True):
        assert torch.equal(mine, theirs)
    # the first half of the rows (a tensor-parallel column shard of 2) is group 0: query heads 0-1, key 0, value 0
    shard = fuse_qkv(q[: 2 * D], k[:D], v[:D], 2, 1)
    assert torch.equal(fused[: fused.shape[0] // 2], shard)
    # a layer built with the shard's weight computes that group's heads: attention is independent per group
    torch.manual_seed(4)
    full = SelfAttention(tiny_cfg(num_key_value_heads=K), layer_index=0)
    half = SelfAttention(tiny_cfg(num_key_value_heads=K), layer_index=0)
    rows = full.query_key_value.weight.shape[0] // 2
    half.query_key_value = torch.nn.Linear(C, rows)
    with torch.no_grad():
        half.query_key_value.weight.copy_(full.query_key_value.weight[:rows])
        half.query_key_value.bias.copy_(full.query_key_value.bias[:rows])
    x = torch.randn(2, 5, C)
    q_full = full.split_qkv(x)[0]
    q_half = half.split_qkv(x)[0]
    torch.testing.assert_close(q_half, q_full[:, : H // 2])


def test_fused_qkv_sizes_follow_gqa():
    attn = SelfAttention(tiny_cfg(num_key_value_heads=2), layer_index=0)
    assert attn.query_key_value.weight.shape == ((4 + 2 * 2) * 8, 32)
    assert attn.dense.weight.shape == (32, 32)


@pytest.mark.parametrize("chunks", [[7], [3, 4], [4, 1, 1, 1], [2, 3, 1, 1]])
def test_cached_chunks_equal_full_sequence(chunks):
    """Prefill and later multi-token chunks must see exactly the keys at or before their position."""
    torch.manual_seed(1)
    attn = SelfAttention(tiny_cfg(num_key_value_heads=2), layer_index=0).eval()
    x = torch.randn(2, sum(chunks), 32)
    cache = KVCache(num_layers=1, batch_size=2, kv_heads=2, max_length=16, head_dim=8)
    outputs, start = [], 0
    for n in chunks:
        outputs.append(attn(x[:, start : start + n], kv_cache=cache))
        cache.advance(n)
        start += n
    torch.testing.assert_close(torch.cat(outputs, dim=1), attn(x), atol=1e-5, rtol=1e-5)


def test_cache_refuses_overflow_and_wrong_batch():
    cache = KVCache(num_layers=1, batch_size=2, kv_heads=1, max_length=4, head_dim=8)
    cache.advance(3)
    with pytest.raises(ValueError, match="cannot take 2 more"):
        cache.check_room(2, 2)
    with pytest.raises(ValueError, match="batch size 2"):
        cache.check_room(3, 1)


def test_rotary_scores_depend_only_on_relative_position():
    torch.manual_seed(2)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(pos_q: int, pos_k: int) -> torch.Tensor:
        cos_q, sin_q = rotary_angles(torch.tensor([pos_q]), 16, 10000.0)
        cos_k, sin_k = rotary_angles(torch.tensor([pos_k]), 16, 10000.0)
        return (apply_rotary(q, cos_q, sin_q) * apply_rotary(k, cos_k, sin_k)).sum()

    torch.testing.assert_close(score(5, 2), score(105, 102), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(score(3, 3), (q * k).sum(), atol=1e-5, rtol=1e-5)  # distance 0: plain dot product
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_rotary_matches_complex_rotation():
    """Channel pairs (i, i + D/2) rotate as complex numbers by position · base^(-2i/D)."""
    torch.manual_seed(3)
    x = torch.randn(1, 2, 5, 8)
    positions = torch.arange(5)
    cos, sin = rotary_angles(positions, 8, 500.0)
    as_complex = torch.complex(x[..., :4], x[..., 4:])
    theta = positions[:, None] * 500.0 ** (-torch.arange(0, 8, 2) / 8)
    rotated = as_complex * torch.polar(torch.ones_like(theta), theta)
    expected = torch.cat([rotated.real, rotated.imag], dim=-1)
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected, atol=1e-5, rtol=1e-5)
