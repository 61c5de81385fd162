"""Analytic parameter counts equal the real modules; Megatron's TFLOP/s formula; MFU helpers."""

from __future__ import annotations

import pytest
import torch

from moetron.model import GPTModel, ModelConfig
from moetron.model.flops import (
    CPU_PEAK_TFLOPS,
    count_parameters,
    flops_per_token,
    megatron_tflops,
    mfu,
    peak_tflops,
)


def cfg(**overrides) -> ModelConfig:
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=100, seq_length=16)
    base.update(overrides)
    return ModelConfig(**base)


DENSE_CONFIGS = {
    "megatron": {},
    "modern": dict(
        normalization="rmsnorm",
        position_embedding_type="rope",
        swiglu=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        num_key_value_heads=2,
    ),
    "gqa_bias": dict(num_key_value_heads=1, ffn_hidden_size=40),
    "qkv_bias_qk_norm_all_heads": dict(add_qkv_bias=True, qk_layernorm=True, qk_layernorm_scope="all_heads"),
}


@pytest.mark.parametrize("name", DENSE_CONFIGS)
def test_dense_counts_equal_module_numel(name):
    c = cfg(**DENSE_CONFIGS[name])
    with torch.device("meta"):
        model = GPTModel(c)
    counts = count_parameters(c)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.expert == 0 and counts.active == counts.total
    embedding = model.word_embeddings.weight.numel()
    embedding += model.position_embeddings.weight.numel() if model.position_embeddings is not None else 0
    embedding += model.output_layer.weight.numel() if model.output_layer is not None else 0
    assert counts.embedding == embedding
    assert counts.dense == counts.total - embedding


MOE_CONFIGS = {
    "top1": dict(num_experts=[4]),
    "pyramid_residual_top2": dict(num_experts=[4, 8], mlp_type="residual", topk=2),
    "shared_gated_swiglu": dict(
        num_experts=[4], num_shared_experts=2, shared_expert_gate=True, swiglu=True, moe_ffn_hidden_size=16
    ),
    "mixtral_like": dict(
        num_experts=[8],
        topk=2,
        expert_interval=1,
        swiglu=True,
        add_bias_linear=False,
        normalization="rmsnorm",
        position_embedding_type="rope",
        num_key_value_heads=2,
        untie_embeddings_and_output_weights=True,
    ),
    "qwen3_like": dict(
        num_experts=[8],
        topk=2,
        expert_interval=1,
        swiglu=True,
        add_bias_linear=False,
        normalization="rmsnorm",
        position_embedding_type="rope",
        num_key_value_heads=2,
        kv_channels=12,
        qk_layernorm=True,
        untie_embeddings_and_output_weights=True,
    ),
    "mtp_two_modules": dict(num_experts=[4], topk=2, mtp_num_layers=2, swiglu=True, normalization="rmsnorm"),
    "swiglu_bias_first_dense": dict(num_experts=[4], expert_interval=1, moe_first_dense_layers=1, swiglu=True),
}


@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_moe_counts_equal_module_numel(name):
    c = cfg(**MOE_CONFIGS[name])
    with torch.device("meta"):
        model = GPTModel(c)
    counts = count_parameters(c)
    assert counts.total == sum(p.numel() for p in model.parameters())
    experts = [moe.experts for moe in model.moe_layers()]
    assert counts.expert == sum(p.numel() for e in experts for p in e.parameters())
    active_experts = sum(sum(p.numel() for p in e.parameters()) * c.topk // e.num_experts for e in experts)
    assert counts.active == counts.total - counts.expert + active_experts
    assert counts.dense == counts.total - counts.expert - counts.embedding


def test_large_config_counts_without_allocating():
    """1.3B+MoE-128 (DeepSpeed's "52B" recipe): 52.5B total, 1.3B active, counted without allocating."""
    big = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, num_experts=[128])
    counts = count_parameters(big)
    assert 52.0e9 < counts.total < 53.0e9
    assert 1.2e9 < counts.active < 1.4e9


def test_megatron_tflops_matches_the_head_formula_by_hand():
    c = cfg(num_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=4, vocab_size=128)
    c.ffn_hidden_size, c.topk, c.make_vocab_size_divisible_by = 96, 2, 128
    B, s, t, world = 8, 32, 0.5, 2
    g, L, h, V, f = 2, 2, 64, 128, 96
    fwd = B * L * (2 + 1) * h * h * s + B * L * 2 * h * s * s + B * L * 2 * f * h * s * 2 + B * V * h * s
    assert megatron_tflops(c, B, s, t, world) == pytest.approx(2 * 3 * fwd / (t * world * 1e12))
    assert megatron_tflops(c, B, s, t, world, checkpoint_activations=True) == pytest.approx(
        2 * 4 * fwd / (t * world * 1e12)
    )
    assert g == c.num_attention_heads // c.kv_heads


def test_megatron_tflops_keeps_the_integer_gqa_quirk():
    """g = 4 → 2 // g = 0: Megatron's HEAD formula drops the K/V projections from the count."""
    a = megatron_tflops(cfg(num_key_value_heads=1), 1, 16, 1.0, 1)
    b = megatron_tflops(cfg(num_key_value_heads=2), 1, 16, 1.0, 1)
    c, h, L = cfg(), 32, 4
    assert b - a == pytest.approx(2 * 3 * (1 * L * 1 * h * h * 16) / 1e12)
    assert megatron_tflops(cfg(swiglu=True, ffn_hidden_size=128), 1, 16, 1.0, 1) > megatron_tflops(c, 1, 16, 1.0, 1)


def test_flops_per_token_is_six_n_plus_attention():
    c = cfg()
    counts = count_parameters(c)
    n = counts.active - counts.embedding + c.padded_vocab_size() * c.hidden_size
    assert flops_per_token(c, 16) == 6 * n + 12 * 4 * 16 * 32
    assert flops_per_token(c, 32) - flops_per_token(c, 16) == 12 * 4 * 16 * 32


def test_peak_table_and_mfu():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-40GB") == 312.0
    assert peak_tflops("NVIDIA GeForce RTX 4090") == 165.0
    assert peak_tflops("cpu") == CPU_PEAK_TFLOPS
    assert peak_tflops("anything", override=42.0) == 42.0
    assert mfu(1.0, None) is None
    assert mfu(123.6, 989.0) == pytest.approx(0.125, rel=1e-3)


@pytest.mark.parametrize(
    "device, expected",
    [
        ("NVIDIA L40S", 362.0),
        ("NVIDIA RTX A6000", 155.0),
        ("NVIDIA GeForce RTX 3090", 71.0),
        ("NVIDIA GeForce RTX 5090", 209.5),
        ("NVIDIA H200", 989.0),
    ],
)
def test_known_gpus_get_the_table_value(device, expected):
    assert peak_tflops(device) == expected


def test_unknown_gpu_has_no_peak_so_mfu_is_not_invented():
    # the old fallback (the CPU's 0.086) made MFU ~1000x too flattering on any GPU missing from the table
    assert peak_tflops("NVIDIA GeForce GTX 1080") is None
    assert peak_tflops("Some Future Accelerator", override=123.0) == 123.0


def test_planner_uses_the_same_peaks():
    from moetron.plan.hardware import accelerator

    for gpu_type, device_name in [
        ("L40S", "NVIDIA L40S"),
        ("A6000", "NVIDIA RTX A6000"),
        ("3090", "RTX 3090"),
        ("5090", "RTX 5090"),
        ("4090", "RTX 4090"),
        ("H100", "H100 SXM"),
    ]:
        assert accelerator(gpu_type).peak_tflops == peak_tflops(device_name)
