"""GPT-2 (`GPT2LMHeadModel`): Megatron's default dense GPT — LayerNorm, learned positions, tanh-GELU MLP with
biases, multi-head attention, tied output layer. GPT-2's `Conv1D` layers store `[in, out]`, and its `c_attn`
holds [Q | K | V] thirds (moetron groups the rows by head; `hf_tensor_rules.gpt2_qkv`)."""

from __future__ import annotations

from dataclasses import dataclass

from moetron.interchange.hf_architecture_base import Architecture, Tokens, experts_of
from moetron.interchange.hf_tensor_rules import Rule, gpt2_qkv, same, transposed, vocab_rows
from moetron.model.config import ModelConfig


@dataclass(frozen=True)
class GPT2Architecture(Architecture):
    name: str = "gpt2"
    hf_class: str = "GPT2LMHeadModel"
    model_type: str = "gpt2"

    def problems(self, cfg: ModelConfig) -> list[str]:
        p: list[str] = []
        for field, wanted in [
            ("normalization", "layernorm"),
            ("position_embedding_type", "learned_absolute"),
            ("swiglu", False),
            ("add_bias_linear", True),
            ("untie_embeddings_and_output_weights", False),
            ("qk_layernorm", False),
            ("kv_channels", None),
            ("mtp_num_layers", 0),
        ]:
            self.need(cfg, field, wanted, p)
        if cfg.kv_heads != cfg.num_attention_heads:
            p.append(
                f"--num-key-value-heads {cfg.kv_heads} (grouped-query attention) has no {self.hf_class} equivalent"
            )
        if experts_of(cfg) != 0:
            p.append(f"--num-experts {cfg.num_experts}: {self.hf_class} is dense")
        return p

    def hf_config(self, cfg: ModelConfig, tokens: Tokens) -> dict:
        return {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "n_positions": cfg.max_positions,
            "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_attention_heads,
            "n_inner": cfg.ffn_size,
            "activation_function": "gelu_new",  # Megatron's bias-GELU: the tanh approximation
            "resid_pdrop": cfg.hidden_dropout,
            "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout,
            "layer_norm_epsilon": cfg.layernorm_epsilon,
            "initializer_range": cfg.init_method_std,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "tie_word_embeddings": True,
            "bos_token_id": tokens.bos,
            "eos_token_id": tokens.eos,
            "use_cache": True,
        }

    def model_fields(self, hf: dict) -> dict:
        from moetron.interchange.hf_config_import import gpt2_fields

        return gpt2_fields(self, hf)

    def rules(self, cfg: ModelConfig) -> list[Rule]:
        heads = cfg.num_attention_heads
        rules = [
            vocab_rows("word_embeddings.weight", "transformer.wte.weight", cfg.vocab_size, cfg.padded_vocab_size()),
            same("position_embeddings.weight", "transformer.wpe.weight"),
        ]
        for i in range(cfg.num_layers):
            m, h = f"layers.{i}.", f"transformer.h.{i}."
            for ours, theirs in [("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2")]:
                rules += [same(f"{m}{ours}.{k}", f"{h}{theirs}.{k}") for k in ("weight", "bias")]
            rules += [
                gpt2_qkv(f"{m}self_attention.query_key_value.{k}", f"{h}attn.c_attn.{k}", heads, heads)
                for k in ("weight", "bias")
            ]
            for ours, theirs in [
                ("self_attention.dense", "attn.c_proj"),
                ("mlp.dense_h_to_4h", "mlp.c_fc"),
                ("mlp.dense_4h_to_h", "mlp.c_proj"),
            ]:
                rules += [
                    transposed(f"{m}{ours}.weight", f"{h}{theirs}.weight"),
                    same(f"{m}{ours}.bias", f"{h}{theirs}.bias"),
                ]
        rules += [same(f"final_layernorm.{k}", f"transformer.ln_f.{k}") for k in ("weight", "bias")]
        return rules


GPT2 = GPT2Architecture()
