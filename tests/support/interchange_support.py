"""Helpers for the interchange tests: tiny moetron checkpoints of each architecture, written locally.

Every architecture's config is small (2–3 layers, hidden 32) and its weights random, with the norms and the expert
biases perturbed away from their initial values so a mapping that swaps or drops one of them shows in the logits.
"""

from __future__ import annotations

from pathlib import Path

import torch
from data_helpers import make_tiny_tokenizer

from moetron.checkpoint.state import write_checkpoint
from moetron.config import RunConfig
from moetron.config_cli import to_yaml
from moetron.model.gpt import GPTModel, create_model

VOCAB = 300  # the tiny tokenizer's vocabulary (data_helpers.make_tiny_tokenizer)
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=VOCAB)
BASE.update(make_vocab_size_divisible_by=64, hidden_dropout=0.0, attention_dropout=0.0, ffn_hidden_size=48)
MODERN = dict(normalization="rmsnorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False)
MODERN.update(untie_embeddings_and_output_weights=True, num_key_value_heads=2, rotary_base=5e5)
DROPLESS = dict(moe_token_dropping=False, moe_top2_2nd_expert_sampling=False, moe_ffn_hidden_size=24)

ARCHITECTURES = {
    "gpt2": dict(),  # Megatron's default GPT
    "llama": dict(MODERN),
    "llama_biases": dict(MODERN, add_bias_linear=True, untie_embeddings_and_output_weights=False),
    "mixtral": dict(MODERN, **DROPLESS, num_experts=[4], expert_interval=1, topk=2),
    "qwen2_moe": dict(MODERN, **DROPLESS, num_layers=3, num_experts=[4], expert_interval=1, topk=2,
                      moe_router_topk_renorm=False, num_shared_experts=2, shared_expert_gate=True,
                      add_qkv_bias=True, moe_first_dense_layers=1),
    "qwen3_moe": dict(MODERN, **DROPLESS, num_layers=4, num_experts=[4], expert_interval=2, topk=2,
                      moe_router_topk_renorm=True, qk_layernorm=True, kv_channels=12),
    "olmoe": dict(MODERN, **DROPLESS, num_experts=[4], expert_interval=1, topk=2, qk_layernorm=True,
                  qk_layernorm_scope="all_heads", moe_router_topk_renorm=False),
    "glm4_moe": dict(MODERN, **DROPLESS, num_layers=3, num_experts=[8], expert_interval=1, topk=3,
                     moe_first_dense_layers=1, moe_router_score_function="sigmoid", num_expert_groups=4,
                     topk_groups=2, moe_router_topk_scaling_factor=2.5, moe_router_bias_update_rate=1e-3,
                     num_shared_experts=1, add_qkv_bias=True, qk_layernorm=True),
}  # fmt: skip
HF_CLASSES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "llama_biases": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}


def run_config(tokenizer_dir: Path, **model) -> RunConfig:
    cfg = RunConfig()
    for key, value in {**BASE, **model}.items():
        assert hasattr(cfg.model, key), key  # a typo (or another section's field) must not pass silently
        setattr(cfg.model, key, value)
    cfg.data.tokenizer_type = "GPT2BPETokenizer"
    cfg.data.vocab_file = str(tokenizer_dir / "vocab.json")
    cfg.data.merge_file = str(tokenizer_dir / "merges.txt")
    return cfg


@torch.no_grad()
def perturb(model: GPTModel, seed: int = 0) -> GPTModel:
    """Norm weights/biases and expert biases away from 1 / 0, so every one of them matters."""
    g = torch.Generator().manual_seed(seed)
    for name, tensor in model.state_dict().items():
        if "norm" in name or name.endswith("expert_bias") or name.endswith(".bias"):
            tensor.add_(torch.randn(tensor.shape, generator=g) * 0.1)
    return model


def save_model(run_dir: Path, cfg: RunConfig, model: GPTModel, iteration: int = 0) -> Path:
    state = {"iteration": iteration, "consumed_samples": 0, "consumed_tokens": 0}
    return write_checkpoint(run_dir, iteration, model.state_dict(), state, to_yaml(cfg))


def tiny_checkpoint(root: Path, arch: str, seed: int = 0, **overrides) -> tuple[Path, RunConfig, GPTModel]:
    """A run directory holding a random `arch` model; returns (run dir, config, the model in eval mode)."""
    tok = root / "tok" if (root / "tok" / "vocab.json").is_file() else make_tiny_tokenizer(root)
    cfg = run_config(tok, **{**ARCHITECTURES[arch], **overrides})
    model = perturb(create_model(cfg.model, "cpu", seed=seed), seed).eval()
    run = root / f"run_{arch}"
    save_model(run, cfg, model)
    return run, cfg, model


def tokens(batch: int = 2, length: int = 12, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
