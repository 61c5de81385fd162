"""Multi-head latent attention (`model/mla.py`): the parameter and FLOP counts of the config equal the module's,
the KV cache holds only the latent and the shared rotary key, and decoding with it equals decoding without a cache;
the config's MLA problems are found before anything is built."""

from __future__ import annotations

import pytest
import torch

from moetron.eval.generate import GenerationOptions, generate_batch
from moetron.model.config import ModelConfig
from moetron.model.flops import attention_score_flops, count_parameters
from moetron.model.gpt import create_model
from moetron.model.kv_cache import KVCache
from moetron.model.mla import MultiLatentAttention, latent_cache_channels
from moetron.model.rotary import rotary_angles

TINY_MLA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=97,
                multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                v_head_dim=6, position_embedding_type="rope", normalization="rmsnorm", swiglu=True,
                add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2)  # fmt: skip


def mla_config(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY_MLA, **overrides})


@pytest.mark.parametrize(
    "overrides",
    [{}, {"q_lora_rank": None}, {"add_bias_linear": True, "num_experts": [4], "expert_interval": 1}],
    ids=["q-latent", "q-proj", "biases-moe"],
)
def test_parameter_count_is_the_modules(overrides):
    cfg = mla_config(**overrides)
    model = create_model(cfg)
    assert isinstance(model.layers["0"].self_attention, MultiLatentAttention)
    assert count_parameters(cfg).total == sum(p.numel() for p in model.parameters())
    has_q_latent = model.layers["0"].self_attention.linear_q_down_proj is not None
    assert has_q_latent == bool(cfg.q_lora_rank)


def test_attention_flops_count_query_key_and_value_head_sizes():
    cfg = mla_config()
    assert attention_score_flops(cfg, 32) == 6 * 32 * 4 * ((8 + 4) + 6)
    gqa = ModelConfig(hidden_size=32, num_attention_heads=4)
    assert attention_score_flops(gqa, 32) == 12 * 32 * 4 * 8  # PaLM's 12·s·H·D, as before


@torch.no_grad()
def test_latent_cache_decoding_equals_decoding_without_a_cache():
    cfg = mla_config()
    model = create_model(cfg, seed=3).eval()
    x_BT = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    full_BTV = model(x_BT).logits
    cache = KVCache.for_model(cfg, batch_size=2, max_length=16)
    assert cache.keys[0].shape == (2, 1, 16, cfg.kv_lora_rank)  # the latent, not H keys
    assert cache.values[0].shape == (2, 1, 16, cfg.qk_pos_emb_head_dim)  # the one shared rotary key
    assert cache.keys[0][0, :, 0].numel() + cache.values[0][0, :, 0].numel() == latent_cache_channels(cfg)
    steps = [model(x_BT[:, :5], kv_cache=cache).logits]  # a prompt, then one token at a time
    steps += [model(x_BT[:, t : t + 1], kv_cache=cache).logits for t in range(5, 11)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full_BTV, atol=1e-5, rtol=0)
    # greedy generation (always through the cache) equals the greedy loop that re-reads the whole sequence
    prompt = x_BT[:1, :4]
    cached = generate_batch(model, [prompt[0].tolist()], GenerationOptions(max_new_tokens=8, temperature=0))[0]
    seq = prompt
    for _ in range(8):
        seq = torch.cat([seq, model(seq).logits[:, -1, : cfg.vocab_size].argmax(-1, keepdim=True)], dim=1)
    assert cached == seq[0, 4:].tolist()


def test_rope_rotates_only_the_decoupled_channels():
    """A position shift changes nothing when the rotary channels see no signal: scores are then position-free."""
    cfg = mla_config()
    attention = create_model(cfg, seed=1).layers["0"].self_attention.eval()
    with torch.no_grad():
        attention.linear_kv_down_proj.weight[cfg.kv_lora_rank :] = 0  # the shared rotary key is 0
        x_BTC = torch.randn(1, 6, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        at_0 = attention(x_BTC, rotary_angles(torch.arange(6), 4, cfg.rotary_base))
        at_9 = attention(x_BTC, rotary_angles(torch.arange(9, 15), 4, cfg.rotary_base))
    torch.testing.assert_close(at_0, at_9, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"position_embedding_type": "learned_absolute"}, "--multi-latent-attention puts rotary positions"),
        ({"qk_pos_emb_head_dim": 5}, "--qk-pos-emb-head-dim must be even and >= 2"),
        ({"kv_lora_rank": 0}, "--kv-lora-rank must be >= 1"),
        ({"q_lora_rank": -1}, "--q-lora-rank must be >= 0"),
        ({"num_key_value_heads": 2}, "--num-key-value-heads 2 has no meaning with --multi-latent-attention"),
        ({"qk_layernorm": True}, "--qk-layernorm True has no meaning"),
    ],
)
def test_config_problems_name_the_flag(overrides, message):
    problems = mla_config(**overrides).problems()
    assert len(problems) == 1 and problems[0].startswith(message), problems


def test_hidden_size_need_not_divide_into_heads():
    assert mla_config(hidden_size=30).problems() == []  # MLA's head sizes are their own flags
