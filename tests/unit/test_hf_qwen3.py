"""Qwen3-MoE both ways: a random tiny `Qwen3MoeForCausalLM` built by transformers imports with its logits and its
greedy continuation, and the imported run exports back to a `Qwen3MoeForCausalLM` with the same logits; the shipped
recipes are Qwen3-MoE models (the real size's config.json is the published one)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from data_helpers import make_tiny_tokenizer
from interchange_support import VOCAB, tokens

from moetron.config_cli import load_config
from moetron.eval.generate import GenerationOptions, generate_batch, load_model
from moetron.interchange.hf_architectures import QWEN3_MOE, Tokens, find_architecture
from moetron.interchange.hf_export import export_hf
from moetron.interchange.hf_import import import_hf
from moetron.model.config import ModelConfig
from moetron.model.rotary import rotary_angles, yarn_of
from moetron.recipes import resolve_config_path

transformers = pytest.importorskip("transformers", reason="checked against transformers itself")

TINY_QWEN3 = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=12, intermediate_size=48, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                  decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=32, rms_norm_eps=1e-6,
                  rope_theta=1e6, tie_word_embeddings=False)  # fmt: skip


@torch.no_grad()
def random_qwen3():
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**TINY_QWEN3)).eval()
    for name, param in model.named_parameters():
        if "norm" in name:  # q_norm / k_norm (and the others) away from 1: a dropped or swapped norm shows
            param.add_(torch.randn_like(param) * 0.2)
    return model


def greedy(model, prompt: torch.Tensor, new: int = 8) -> list[int]:
    return generate_batch(model, [prompt[0].tolist()], GenerationOptions(max_new_tokens=new, temperature=0))[0]


def test_qwen3_moe_imports_and_exports_with_its_logits_and_greedy_tokens(tmp_path):
    hf = random_qwen3()
    hf.save_pretrained(tmp_path / "hf")
    tok = make_tiny_tokenizer(tmp_path)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(tok / name, tmp_path / "hf" / name)
    assert import_hf(str(tmp_path / "hf"), str(tmp_path / "run")).hf_class == "Qwen3MoeForCausalLM"
    model, cfg, _ = load_model(str(tmp_path / "run"), "cpu")
    m = cfg.model
    assert (m.qk_layernorm, m.qk_layernorm_scope, m.head_dim, m.num_experts, m.topk) == (True, "head", 12, [8], 2)
    x, prompt = tokens(), tokens(1, 5, seed=3)
    with torch.no_grad():
        want = hf(x).logits
        torch.testing.assert_close(model(x).logits[..., :VOCAB], want, atol=1e-4, rtol=0)
    hf_tokens = hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, prompt.shape[1] :].tolist()
    assert greedy(model, prompt) == hf_tokens

    assert export_hf(str(tmp_path / "run"), str(tmp_path / "back")).hf_class == "Qwen3MoeForCausalLM"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, want, atol=1e-4, rtol=0)


# Qwen/Qwen3-30B-A3B's config.json (the values that shape the model)
PUBLISHED_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                         num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
                         tie_word_embeddings=False, attention_bias=False, router_aux_loss_coef=0.001)  # fmt: skip


@pytest.mark.parametrize("recipe", ["qwen3-30B-A3B", "qwen3-moe-tiny"])
def test_qwen3_recipes_are_qwen3_moe_models(recipe):
    cfg, _ = load_config(str(resolve_config_path(recipe)), {})
    assert find_architecture(cfg.model) is QWEN3_MOE  # exports natively
    if recipe == "qwen3-30B-A3B":
        hf = QWEN3_MOE.hf_config(cfg.model, Tokens())
        assert {key: hf[key] for key in PUBLISHED_30B_A3B} == PUBLISHED_30B_A3B


def test_qwen3_yarn_config_imports_to_transformers_rotary_angles():
    """Qwen3's YaRN (`rope_parameters` without mscale: transformers' attention factor 0.1·ln s + 1 on cos and sin)
    gives moetron the same angles as transformers' rotary embedding, and exports back to the same settings."""
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 8}
    hf_config = transformers.Qwen3MoeConfig(**{**TINY_QWEN3, "rope_parameters": yarn})
    fields = QWEN3_MOE.model_fields(hf_config.to_dict())
    assert (fields["rope_type"], fields["mscale"], fields["mscale_all_dim"]) == ("yarn", 1.0, 0.0)
    cfg = ModelConfig(**{**fields, "seq_length": 16})
    positions = torch.arange(32)
    x = torch.zeros(1, 32, 1)
    want_cos, want_sin = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRotaryEmbedding(hf_config)(
        x, positions[None]
    )
    cos, sin = rotary_angles(positions, cfg.rotary_dim, cfg.rotary_base, yarn=yarn_of(cfg))
    torch.testing.assert_close(cos, want_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, want_sin[0], atol=1e-6, rtol=0)
    assert abs(cos[0, 0].item() - (0.1 * math.log(4.0) + 1)) < 1e-6  # the attention factor is there
    exported = QWEN3_MOE.hf_config(cfg, Tokens())["rope_parameters"]
    assert {k: exported[k] for k in yarn} == yarn and "attention_factor" not in exported
