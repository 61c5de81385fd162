"""The transformers classes a moetron model can be exported to (and imported from), one `Architecture` each.

    arch = find_architecture(cfg)        # the first class that expresses cfg exactly, or None (→ remote code)
    arch.problems(cfg)                   # why a class cannot express cfg: one line per option, naming the flag
    arch.hf_config(cfg, tokens)          # config.json;  arch.model_fields(hf_config) is the way back
    arch.rules(cfg)                      # tensor by tensor (hf_tensor_rules.Rule)

The Llama family here shares one layout (RMSNorm, RoPE rotate-half, SwiGLU, separate q/k/v projections):
  Llama      dense; attention and MLP biases together (`attention_bias` = `mlp_bias` = --add-bias-linear)
  Mixtral    a MoE block in every layer; softmax top-k renormalised (DeepSpeed's top-2/top-k or pre-softmax)
  Qwen2-MoE  MoE every --expert-interval layers; raw or renormalised top-k; shared experts with a sigmoid gate;
             QKV bias (--add-qkv-bias)
  Qwen3-MoE  as Qwen2-MoE without shared experts, with per-head QK RMSNorm (--qk-layernorm)
  OLMoE      MoE in every layer, QK RMSNorm over all heads (--qk-layernorm-scope all_heads)
  DeepSeek-V3 DeepSeek-V3's MoE (sigmoid scores, selection-only expert bias, group-limited top-k, scaling factor,
             shared experts, first k layers dense) with multi-head latent attention (--multi-latent-attention;
             its tensors and RoPE layout: `hf_deepseek_v3.py`)
  GLM-4-MoE  DeepSeek-V3's MoE with GQA attention (what a DeepSeek-V3-style config without MLA exports to), its
             MTP modules in DeepSeek-V3's layout (GLM-4.5's releases)
GPT-2 (`hf_gpt2.py`) is Megatron's default dense GPT; the base they share is `hf_architecture_base.py`. Every model
routes dropless in transformers, so a config that drops tokens is expressed only when exported `--dropless` (how
`moetron generate` routes anyway).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moetron.interchange.hf_architecture_base import (
    Architecture,
    Tokens,
    experts_of,
    moe_layout_problems,
    normalised_weights,
    routing_problems,
)
from moetron.interchange.hf_deepseek_v3 import (
    mla_fields,
    mla_hf_config,
    mla_problems,
    mla_rules,
    mtp_fields,
    mtp_problems,
    mtp_rules,
    rope_interleaved,
)
from moetron.interchange.hf_gpt2 import GPT2
from moetron.interchange.hf_rope import hf_rope_keys, hf_rope_parameters
from moetron.interchange.hf_tensor_rules import Rule, per_expert, qkv, same, single_expert, vocab_rows
from moetron.model.config import ModelConfig

__all__ = [
    "Architecture",
    "Tokens",
    "architectures",
    "by_name",
    "experts_of",
    "find_architecture",
    "normalised_weights",
]


# ---------------------------------------------------------------------------- the Llama family
@dataclass(frozen=True)
class LlamaFamily(Architecture):
    name: str = "llama"
    hf_class: str = "LlamaForCausalLM"
    model_type: str = "llama"
    placement: str | None = None  # None: dense; "every" | "interval" | "first_k"
    moe_prefix: str = "mlp"  # HF module of the MoE block ("block_sparse_moe" in Mixtral)
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared: str | None = None  # HF name of the shared-expert MLP (None: the class has none)
    shared_gate: bool = False  # Qwen2-MoE's sigmoid gate on the shared experts
    qk_norm: str | None = None  # None | "head" | "all_heads" | "optional" (GLM: per head, or none)
    bias: str = "none"  # none | qkv (Qwen2-MoE, GLM: --add-qkv-bias) | all (Llama: --add-bias-linear)
    sigmoid: bool = False  # DeepSeek-V3 routing (GLM-4-MoE, DeepSeek-V3)
    mla: bool = False  # multi-head latent attention (DeepSeek-V3)
    mtp: bool = False  # MTP modules in the checkpoint (DeepSeek-V3's layout, GLM-4-MoE's too: `hf_deepseek_v3.py`)

    # ------------------------------------------------------------ what it expresses
    def problems(self, cfg: ModelConfig) -> list[str]:
        p: list[str] = []
        for field, wanted in [("normalization", "rmsnorm"), ("position_embedding_type", "rope"), ("swiglu", True)]:
            self.need(cfg, field, wanted, p)
        self.need(cfg, "rotary_compat", "none", p)  # transformers' RoPE is the standard one
        if not self.mtp:  # these classes have no MTP modules (remote code keeps them)
            self.need(cfg, "mtp_num_layers", 0, p)
        self._bias_problems(cfg, p)
        self._qk_norm_problems(cfg, p)
        p += mla_problems(cfg, self.hf_class) if self.mla else []
        if not self.mla:
            self.need(cfg, "multi_latent_attention", False, p)
        moe = experts_of(cfg) != 0
        if self.placement is None and moe:
            p.append(f"--num-experts {cfg.num_experts}: {self.hf_class} is dense")
        if self.placement is not None and not moe:
            p.append(f"{self.hf_class} is a MoE class; this config has no MoE layer (--num-experts {cfg.num_experts})")
        if self.placement is not None and moe:
            p += moe_layout_problems(self, cfg, self.placement)
            p += routing_problems(self, cfg, self.sigmoid)
            p += self._shared_problems(cfg)
            p += mtp_problems(cfg, experts_of(cfg), self.hf_class) if self.mtp else []
            if self.sigmoid and experts_of(cfg) // cfg.num_expert_groups < 2:
                p.append(
                    f"--num-expert-groups {cfg.num_expert_groups}: {self.hf_class} scores a group by its two "
                    f"best experts, so each group needs at least 2 of the {experts_of(cfg)} experts"
                )
            if self.hf_class == "MixtralForCausalLM" and not normalised_weights(cfg):
                p.append(
                    f"--topk {cfg.topk} without renormalised weights (DeepSpeed's raw top-1 probability) has "
                    f"no MixtralForCausalLM equivalent; use --moe-router-topk-renorm"
                )
        return p

    def _bias_problems(self, cfg: ModelConfig, p: list[str]) -> None:
        if self.bias == "all":
            if cfg.add_qkv_bias and not cfg.add_bias_linear:
                p.append(f"--add-qkv-bias without --add-bias-linear has no {self.hf_class} equivalent")
            return
        self.need(cfg, "add_bias_linear", False, p)
        if self.bias == "none":
            self.need(cfg, "add_qkv_bias", False, p)

    def _qk_norm_problems(self, cfg: ModelConfig, p: list[str]) -> None:
        if self.qk_norm in (None, "optional"):
            if self.qk_norm is None:
                self.need(cfg, "qk_layernorm", False, p)
            elif cfg.qk_layernorm:
                self.need(cfg, "qk_layernorm_scope", "head", p)
            return
        self.need(cfg, "qk_layernorm", True, p)
        self.need(cfg, "qk_layernorm_scope", self.qk_norm, p)
        if self.qk_norm == "all_heads" and cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:
            p.append(
                f"--kv-channels {cfg.kv_channels} has no {self.hf_class} equivalent (its key norm assumes "
                f"hidden_size / num_attention_heads channels per head)"
            )

    def _shared_problems(self, cfg: ModelConfig) -> list[str]:
        p: list[str] = []
        if self.shared is None:
            self.need(cfg, "num_shared_experts", 0, p)
            return p
        if cfg.num_shared_experts < 1:
            p.append(f"--num-shared-experts 0: {self.hf_class} always has shared experts")
        self.need(cfg, "shared_expert_gate", self.shared_gate, p)
        return p

    # ------------------------------------------------------------ config.json
    def hf_config(self, cfg: ModelConfig, tokens: Tokens) -> dict:
        out = {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_positions,
            "rms_norm_eps": cfg.layernorm_epsilon,
            **hf_rope_keys(cfg),
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
            "attention_dropout": cfg.attention_dropout,
            "initializer_range": cfg.init_method_std,
            "bos_token_id": tokens.bos,
            "eos_token_id": tokens.eos,
            "use_cache": True,
        }
        if self.bias == "all":
            out.update(attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear)
        elif self.bias == "qkv":
            out["qkv_bias" if self.model_type == "qwen2_moe" else "attention_bias"] = cfg.add_qkv_bias
        else:
            out["attention_bias"] = False
        if self.qk_norm == "optional":
            out["use_qk_norm"] = cfg.qk_layernorm
        if self.placement is not None:
            out.update(self._moe_config(cfg))
        if self.mtp:  # the releases' own key (transformers reads it as num_mtp_layers)
            out["num_nextn_predict_layers"] = cfg.mtp_num_layers
        return out

    def _moe_config(self, cfg: ModelConfig) -> dict:
        experts, ffn = experts_of(cfg), cfg.expert_ffn_size
        out = {
            "num_experts_per_tok": cfg.topk,
            "router_aux_loss_coef": cfg.moe_loss_coeff,
            "output_router_logits": False,
        }
        if self.model_type == "mixtral":
            out.update(num_local_experts=experts, intermediate_size=ffn, sliding_window=None, router_jitter_noise=0.0)
            return out
        out.update(moe_intermediate_size=ffn, norm_topk_prob=normalised_weights(cfg))
        if self.model_type in ("qwen2_moe", "qwen3_moe"):
            sparse_layers = [i for i in range(cfg.num_layers) if (i + 1) % cfg.expert_interval == 0]
            out.update(
                num_experts=experts,
                decoder_sparse_step=cfg.expert_interval,
                use_sliding_window=False,
                mlp_only_layers=[i for i in sparse_layers if i < cfg.moe_first_dense_layers],
            )
        if self.model_type == "qwen2_moe":
            out["shared_expert_intermediate_size"] = cfg.num_shared_experts * ffn
        if self.model_type == "olmoe":  # every layer is MoE: its experts take intermediate_size
            out.update(num_experts=experts, intermediate_size=ffn, clip_qkv=None)
        if self.model_type in ("glm4_moe", "deepseek_v3"):
            out.update(
                n_routed_experts=experts,
                n_shared_experts=cfg.num_shared_experts,
                first_k_dense_replace=cfg.moe_first_dense_layers,
                n_group=cfg.num_expert_groups,
                topk_group=cfg.topk_groups if cfg.num_expert_groups > 1 else 1,
                routed_scaling_factor=cfg.moe_router_topk_scaling_factor,
            )
            out["rope_parameters"] = {**hf_rope_parameters(cfg), "partial_rotary_factor": 1.0}
        return out

    # ------------------------------------------------------------ import: config.json → ModelConfig fields
    def model_fields(self, hf: dict) -> dict:
        from moetron.interchange.hf_config_import import llama_family_fields

        return {**llama_family_fields(self, hf), **(mtp_fields(hf) if self.mtp else {})}

    # ------------------------------------------------------------ tensors
    def rules(self, cfg: ModelConfig, mtp_copies: bool = True) -> list[Rule]:
        """Every tensor; with MTP modules (`mtp`) theirs too, and (`mtp_copies`, export) their copies of the shared
        embedding and head, which import leaves (the model shares one)."""
        return self._trunk_rules(cfg) + (mtp_rules(self, cfg, copies=mtp_copies) if self.mtp else [])

    def import_rules(self, cfg: ModelConfig, hf: dict) -> list[Rule]:
        return self.rules(cfg, mtp_copies=False)

    def _trunk_rules(self, cfg: ModelConfig) -> list[Rule]:
        vocab, padded = cfg.vocab_size, cfg.padded_vocab_size()
        rules = [vocab_rows("word_embeddings.weight", "model.embed_tokens.weight", vocab, padded)]
        for i, experts in enumerate(cfg.experts_per_layer()):
            rules += self._attention_rules(cfg, f"layers.{i}.", f"model.layers.{i}.")
            m, h = f"layers.{i}.mlp.", f"model.layers.{i}."
            rules += self._moe_rules(cfg, m, h, experts) if experts > 1 else self._mlp_rules(cfg, m, h + "mlp.")
        rules.append(same("final_layernorm.weight", "model.norm.weight"))
        if cfg.untie_embeddings_and_output_weights:
            rules.append(vocab_rows("output_layer.weight", "lm_head.weight", vocab, padded))
        return rules

    def _attention_rules(self, cfg: ModelConfig, m: str, h: str) -> list[Rule]:
        heads, kv = cfg.num_attention_heads, cfg.kv_heads
        a = h + "self_attn."
        rules = [
            same(m + "input_layernorm.weight", h + "input_layernorm.weight"),
            same(m + "post_attention_layernorm.weight", h + "post_attention_layernorm.weight"),
            qkv(
                m + "self_attention.query_key_value.weight",
                a + "q_proj.weight",
                a + "k_proj.weight",
                a + "v_proj.weight",
                heads,
                kv,
            ),
            same(m + "self_attention.dense.weight", a + "o_proj.weight"),
        ]
        if cfg.add_bias_linear or cfg.add_qkv_bias:
            b = m + "self_attention.query_key_value.bias"
            rules.append(qkv(b, a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias", heads, kv))
        if cfg.add_bias_linear:
            rules.append(same(m + "self_attention.dense.bias", a + "o_proj.bias"))
        if cfg.qk_layernorm:
            rules += [
                same(m + "self_attention.q_layernorm.weight", a + "q_norm.weight"),
                same(m + "self_attention.k_layernorm.weight", a + "k_norm.weight"),
            ]
        return rules

    def _mlp_rules(self, cfg: ModelConfig, m: str, h: str) -> list[Rule]:
        pairs = [("dense_h_to_4h", "gate_proj"), ("dense_h_to_4h_up", "up_proj"), ("dense_4h_to_h", "down_proj")]
        kinds = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
        return [same(f"{m}{ours}.{kind}", f"{h}{theirs}.{kind}") for ours, theirs in pairs for kind in kinds]

    def _moe_rules(self, cfg: ModelConfig, m: str, h: str, experts: int) -> list[Rule]:
        b = h + self.moe_prefix + "."
        gate, up, down = self.expert_names
        rules = [
            same(m + "router.weight", b + "gate.weight"),
            per_expert(m + "experts.w1_EDF", b + "experts.{e}." + gate + ".weight", experts),
            per_expert(m + "experts.w3_EDF", b + "experts.{e}." + up + ".weight", experts),
            per_expert(m + "experts.w2_EFD", b + "experts.{e}." + down + ".weight", experts),
        ]
        if self.sigmoid:
            rules.append(same(m + "router.expert_bias", b + "gate.e_score_correction_bias"))
        if self.shared is not None:
            s = b + self.shared + "."
            rules += [
                single_expert(m + "shared_experts.w1_EDF", s + "gate_proj.weight"),
                single_expert(m + "shared_experts.w3_EDF", s + "up_proj.weight"),
                single_expert(m + "shared_experts.w2_EFD", s + "down_proj.weight"),
            ]
        if self.shared_gate:
            rules.append(same(m + "shared_expert_gate.weight", b + "shared_expert_gate.weight"))
        return rules


LLAMA = LlamaFamily(bias="all")
MIXTRAL = LlamaFamily("mixtral", "MixtralForCausalLM", "mixtral", "every", "block_sparse_moe", ("w1", "w3", "w2"))
QWEN2_MOE = LlamaFamily(
    "qwen2_moe", "Qwen2MoeForCausalLM", "qwen2_moe", "interval", shared="shared_expert", shared_gate=True, bias="qkv"
)
QWEN3_MOE = LlamaFamily("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", "interval", qk_norm="head")
OLMOE = LlamaFamily("olmoe", "OlmoeForCausalLM", "olmoe", "every", qk_norm="all_heads")


@dataclass(frozen=True)
class DeepseekV3Family(LlamaFamily):
    """DeepSeek-V3's MoE layout with multi-head latent attention (`hf_deepseek_v3.py`)."""

    rope_interleave: bool = True  # the rotary channels' order in the HF tensors (export: DeepSeek's interleaved)

    def hf_config(self, cfg: ModelConfig, tokens: Tokens) -> dict:
        out = super().hf_config(cfg, tokens)
        out.pop("head_dim")  # DeepseekV3Config derives it (qk_rope_head_dim)
        return {**out, **mla_hf_config(cfg)}

    def model_fields(self, hf: dict) -> dict:
        return {**super().model_fields(hf), **mla_fields(hf)}

    def import_rules(self, cfg: ModelConfig, hf: dict) -> list[Rule]:
        return replace(self, rope_interleave=rope_interleaved(hf)).rules(cfg, mtp_copies=False)

    def _attention_rules(self, cfg: ModelConfig, m: str, h: str) -> list[Rule]:
        return mla_rules(cfg, m, h, self.rope_interleave)


DEEPSEEK_V3 = DeepseekV3Family(
    "deepseek_v3",
    "DeepseekV3ForCausalLM",
    "deepseek_v3",
    "first_k",
    shared="shared_experts",
    sigmoid=True,
    mla=True,
    mtp=True,
)
GLM4_MOE = LlamaFamily(
    "glm4_moe",
    "Glm4MoeForCausalLM",
    "glm4_moe",
    "first_k",
    shared="shared_experts",
    qk_norm="optional",
    bias="qkv",
    sigmoid=True,
    mtp=True,  # GLM-4.5's releases: DeepSeek-V3's MTP layout at model.layers.<num_hidden_layers>
)


def architectures() -> list[Architecture]:
    """Every native class, most specific first (the first that expresses a config is chosen)."""
    return [GPT2, LLAMA, MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE, DEEPSEEK_V3, GLM4_MOE]


def by_name(name: str) -> Architecture | None:
    return next((a for a in architectures() if name in (a.name, a.hf_class, a.model_type)), None)


def find_architecture(cfg: ModelConfig) -> Architecture | None:
    return next((a for a in architectures() if not a.problems(cfg)), None)
