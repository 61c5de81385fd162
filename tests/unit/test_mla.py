"""Multi-head latent attention (`model/mla.py`): the parameter and FLOP counts of the config equal the module's,
the KV cache holds only the latent and the shared rotary key, and decoding with it equals decoding without a cache;
the config's MLA problems are found before anything is built."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moetron.config_cli import load_config
from moetron.eval.generate import GenerationOptions, generate_batch
from moetron.interchange.hf_architectures import DEEPSEEK_V3, find_architecture
from moetron.model.config import ModelConfig
from moetron.model.flops import attention_score_flops, count_parameters
from moetron.model.gpt import GPTModel, create_model
from moetron.model.kv_cache import KVCache, kv_cache_bytes_per_token
from moetron.model.mla import MultiLatentAttention, latent_cache_channels
from moetron.model.rotary import rotary_angles
from moetron.plan.estimate import make_plan
from moetron.plan.hardware import accelerator
from moetron.plan.memory import layer_bytes

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
        ({"rope_type": "yarn"}, "--rope-type yarn needs --original-max-position-embeddings"),
        ({"rope_type": "yarn", "original_max_position_embeddings": 8, "beta_slow": 0.0}, "--beta-slow must be"),
        ({"rope_type": "ntk"}, "--rope-type 'ntk' is not one of rope, yarn"),
    ],
)
def test_config_problems_name_the_flag(overrides, message):
    problems = mla_config(**overrides).problems()
    assert len(problems) == 1 and problems[0].startswith(message), problems


def test_latent_sizes_without_mla_are_refused_not_ignored():
    problems = ModelConfig(kv_lora_rank=512, q_lora_rank=0).problems()
    assert problems == [
        "--q-lora-rank 0 has no effect without --multi-latent-attention; add --multi-latent-attention or drop it",
        "--kv-lora-rank 512 has no effect without --multi-latent-attention; add --multi-latent-attention or drop it",
    ]


def test_yarn_settings_without_yarn_are_refused_not_ignored():
    assert ModelConfig(mscale_all_dim=1.0).problems() == [
        "--mscale-all-dim 1.0 has no effect without --rope-type yarn; add --rope-type yarn or drop it"
    ]


def test_hidden_size_need_not_divide_into_heads():
    assert mla_config(hidden_size=30).problems() == []  # MLA's head sizes are their own flags


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_plan_activations_match_what_autograd_saves(q_lora_rank):
    from test_plan import saved_bytes, small

    mla = {k: v for k, v in TINY_MLA.items() if k not in ("num_layers", "hidden_size", "seq_length", "vocab_size")}
    configs = [small(**{**mla, "q_lora_rank": q_lora_rank}, num_layers=n) for n in (2, 4)]
    measured = (saved_bytes(configs[1], None) - saved_bytes(configs[0], None)) / 2
    m = configs[0].model
    tokens = configs[0].train.micro_batch_size * m.seq_length
    assert layer_bytes(m, 1, tokens, m.seq_length, 4, "cpu", ep=1) == pytest.approx(measured, rel=0.15)


def test_deepseek_v3_16b_recipe_plans_the_published_size_on_8_gpus():
    cfg, _ = load_config("deepseek-v3-16B", {})
    plan = make_plan(cfg, 8, accelerator("A100-80GB"))
    assert plan.params.total == pytest.approx(15.7e9, rel=0.01)  # DeepSeek-V2-Lite's published total
    assert plan.fits
    assert plan.params.total == sum(p.numel() for p in meta_model(cfg.model).parameters())
    # the cache holds 512 + 64 numbers per token and layer where 16 heads of GQA-free attention would hold 2·16·192
    assert kv_cache_bytes_per_token(cfg.model, 2) == 27 * (512 + 64) * 2


def test_tiny_recipe_trains_a_step_on_cpu():
    cfg, _ = load_config("deepseek-v3-tiny", {"seq_length": 16})
    model = create_model(cfg.model)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = model(tokens[:, :-1], labels_BT=tokens[:, 1:]).lm_loss
    loss.backward()
    attention = model.layers["1"].self_attention
    assert torch.isfinite(loss) and attention.linear_kv_down_proj.weight.grad.abs().sum() > 0
    assert find_architecture(cfg.model) is DEEPSEEK_V3


def meta_model(cfg: ModelConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return GPTModel(cfg)


def test_deepseek_v3_671b_recipe_has_the_published_counts_with_its_mtp_module():
    """671B without the MTP module (the report's count); DeepSeek's 685B checkpoint adds the module with its own copies
    of the embedding and head, which moetron's module shares."""
    cfg, _ = load_config("deepseek-v3-671B", {})
    counts = count_parameters(cfg.model)
    main = count_parameters(dataclasses.replace(cfg.model, mtp_num_layers=0))
    assert main.total == pytest.approx(671e9, rel=0.01) and main.active == pytest.approx(37e9, rel=0.02)
    shared_copies = 2 * cfg.model.padded_vocab_size() * cfg.model.hidden_size
    assert counts.total + shared_copies == pytest.approx(685e9, rel=0.01)
    plan = make_plan(cfg, 2048, accelerator("H100"))
    assert plan.params.total == counts.total and plan.fits
    assert counts.total == sum(p.numel() for p in meta_model(cfg.model).parameters())
