"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): multi-head latent attention (`model/mla.py`) with DeepSeek-V3's MoE
(sigmoid scores, the selection-only expert bias, group-limited top-k, the scaling factor, shared experts, the first
k layers dense). The class itself (`hf_architectures.DEEPSEEK_V3`) is a Llama-family class whose attention is the
MLA of this module: its config keys, its import fields and its tensors.

Tensors (moetron → HF, `model.layers.<i>.self_attn.`):

    linear_q_down_proj / q_layernorm / linear_q_up_proj   q_a_proj / q_a_layernorm / q_b_proj   (--q-lora-rank > 0)
    linear_q_proj                                         q_proj                                (--q-lora-rank 0)
    linear_kv_down_proj / kv_layernorm / linear_kv_up_proj kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj
    dense                                                 o_proj

RoPE layout: DeepSeek's checkpoints rotate interleaved channel pairs (x0, x1), (x2, x3), … (`rope_interleave`,
transformers' default for the class); moetron rotates halves (x_i, x_{i+Dr/2}). The rotary rows of the query
projection (per head) and of the key/value down projection are permuted between the two, which gives the same
scores. Export writes the interleaved layout (DeepSeek's own, what other DeepSeek-V3 loaders assume); import reads
either, as its config.json says.

MTP modules (`--mtp-num-layers D`, config.json's `num_nextn_predict_layers`) in DeepSeek-V3's own checkpoint layout:
module k (0-based) is `model.layers.<num_hidden_layers + k>.` with `enorm`, `hnorm`, `eh_proj`, its layer's usual
attention and MoE tensors, `shared_head.norm` (moetron's `final_layernorm`) and copies of the shared
`embed_tokens` / `shared_head.head` (export writes them as DeepSeek's release does; import reads the model's own).
DeepseekV3ForCausalLM ignores those layers on load (transformers' `MtpModel` reads them for speculative decoding).
GLM-4-MoE's releases (`Glm4MoeForCausalLM`) store theirs the same way, with that class's attention.
"""

from __future__ import annotations

import torch

from moetron.errors import UserError
from moetron.interchange.hf_rope import hf_rope_parameters
from moetron.interchange.hf_tensor_rules import Rule, same
from moetron.model.config import ModelConfig


# ---------------------------------------------------------------------------- the rotary channel order
def _interleave_rows(t: torch.Tensor, heads: int, block: int, rope: int) -> torch.Tensor:
    """Rows `[heads · block, …]` whose last `rope` rows of each head's block are in halves order → interleaved."""
    half = torch.arange(rope // 2)
    order = torch.stack([half, half + rope // 2], dim=-1).flatten()  # interleaved[2i] = half[i], [2i+1] = half[i+r/2]
    return _permute_rope_rows(t, heads, block, rope, order)


def _halve_rows(t: torch.Tensor, heads: int, block: int, rope: int) -> torch.Tensor:
    """The inverse of `_interleave_rows`: interleaved rotary rows → halves order."""
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    return _permute_rope_rows(t, heads, block, rope, order)


def _permute_rope_rows(t: torch.Tensor, heads: int, block: int, rope: int, order: torch.Tensor) -> torch.Tensor:
    grouped = t.reshape(heads, block, *t.shape[1:])
    rotary = grouped[:, block - rope :][:, order]
    return torch.cat([grouped[:, : block - rope], rotary], dim=1).reshape(t.shape)


def _rope_rows(moetron: str, hf: str, heads: int, block: int, rope: int, interleaved: bool) -> Rule:
    if not interleaved:
        return same(moetron, hf)
    return Rule(
        moetron,
        (hf,),
        lambda t: [_interleave_rows(t, heads, block, rope)],
        lambda ts: _halve_rows(ts[0], heads, block, rope),
    )


def mla_rules(cfg: ModelConfig, m: str, h: str, interleaved: bool) -> list[Rule]:
    """The attention tensors of layer prefix `m` (moetron) / `h` (HF `model.layers.<i>.`)."""
    s, a = m + "self_attention.", h + "self_attn."
    heads, rope = cfg.num_attention_heads, cfg.qk_pos_emb_head_dim
    q_block = cfg.qk_head_dim + rope
    rules = [
        same(m + "input_layernorm.weight", h + "input_layernorm.weight"),
        same(m + "post_attention_layernorm.weight", h + "post_attention_layernorm.weight"),
        _rope_rows(
            s + "linear_kv_down_proj.weight",
            a + "kv_a_proj_with_mqa.weight",
            1,
            cfg.kv_lora_rank + rope,
            rope,
            interleaved,
        ),  # fmt: skip
        same(s + "kv_layernorm.weight", a + "kv_a_layernorm.weight"),
        same(s + "linear_kv_up_proj.weight", a + "kv_b_proj.weight"),
        same(s + "dense.weight", a + "o_proj.weight"),
    ]
    if cfg.q_lora_rank:
        rules += [
            same(s + "linear_q_down_proj.weight", a + "q_a_proj.weight"),
            same(s + "q_layernorm.weight", a + "q_a_layernorm.weight"),
            _rope_rows(s + "linear_q_up_proj.weight", a + "q_b_proj.weight", heads, q_block, rope, interleaved),
        ]
    else:
        rules.append(_rope_rows(s + "linear_q_proj.weight", a + "q_proj.weight", heads, q_block, rope, interleaved))
    return rules


# ---------------------------------------------------------------------------- the MTP modules
def mtp_rules(arch, cfg: ModelConfig, copies: bool) -> list[Rule]:
    """The MTP modules' tensors (`arch`: the DeepSeek-V3 `LlamaFamily`, for its layer rules); `copies`: also the
    per-module copies of the shared embedding and head (export; import leaves them, the model shares one)."""
    from moetron.interchange.hf_tensor_rules import vocab_rows

    rules: list[Rule] = []
    head = "output_layer.weight" if cfg.untie_embeddings_and_output_weights else "word_embeddings.weight"
    for k in range(cfg.mtp_num_layers):
        m, h = f"mtp.layers.{k}.", f"model.layers.{cfg.num_layers + k}."
        rules += [same(m + n + ".weight", h + n + ".weight") for n in ("enorm", "hnorm", "eh_proj")]
        rules.append(same(m + "final_layernorm.weight", h + "shared_head.norm.weight"))
        rules += arch._attention_rules(cfg, m + "transformer_layer.", h)
        rules += arch._moe_rules(cfg, m + "transformer_layer.mlp.", h, cfg.mtp_layer_experts())
        if copies:
            vocab, padded = cfg.vocab_size, cfg.padded_vocab_size()
            rules += [
                vocab_rows("word_embeddings.weight", h + "embed_tokens.weight", vocab, padded),
                vocab_rows(head, h + "shared_head.head.weight", vocab, padded),
            ]
    return rules


def mtp_problems(cfg: ModelConfig, experts: int, hf_class: str) -> list[str]:
    """DeepSeek-V3's (and GLM-4-MoE's) MTP layers are MoE layers like the main ones (`experts`: theirs)."""
    if cfg.mtp_num_layers and cfg.mtp_layer_experts() != experts:
        return [
            f"--mtp-dense-layers has no {hf_class} equivalent (its MTP layers are MoE layers); train "
            "without it, or export with --remote-code"
        ]
    return []


def mtp_fields(hf: dict) -> dict:
    """config.json's `num_nextn_predict_layers` (transformers also writes `num_mtp_layers`)."""
    return {"mtp_num_layers": int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0)}


def mtp_layers_present(cfg: ModelConfig, names) -> int:
    """How many of the config's MTP modules the weights hold (a transformers save_pretrained keeps none)."""
    k = 0
    while k < cfg.mtp_num_layers and f"model.layers.{cfg.num_layers + k}.eh_proj.weight" in names:
        k += 1
    return k


# ---------------------------------------------------------------------------- config.json
def mla_problems(cfg: ModelConfig, hf_class: str) -> list[str]:
    """What the class's attention cannot express (the Llama-family checks cover the rest)."""
    if not cfg.multi_latent_attention:
        return [f"{hf_class} uses multi-head latent attention; this config has none (--multi-latent-attention)"]
    return []


def mla_hf_config(cfg: ModelConfig) -> dict:
    """The attention keys of `DeepseekV3Config`."""
    return {
        "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_head_dim,
        "qk_rope_head_dim": cfg.qk_pos_emb_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "rope_interleave": True,
        "rope_parameters": hf_rope_parameters(cfg),
        "attention_bias": False,
    }


def mla_fields(hf: dict) -> dict:
    """config.json → the ModelConfig attention fields of `--multi-latent-attention`."""
    missing = [k for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if hf.get(k) is None]
    if missing:
        raise UserError(
            f"DeepseekV3ForCausalLM config.json has no {missing[0]!r}; is it a complete Hugging Face config?"
        )
    return {
        "multi_latent_attention": True,
        "q_lora_rank": int(hf.get("q_lora_rank") or 0) or None,
        "kv_lora_rank": int(hf["kv_lora_rank"]),
        "qk_head_dim": int(hf["qk_nope_head_dim"]),
        "qk_pos_emb_head_dim": int(hf["qk_rope_head_dim"]),
        "v_head_dim": int(hf["v_head_dim"]),
        "num_key_value_heads": None,
        "kv_channels": None,
    }


def rope_interleaved(hf: dict) -> bool:
    """Whether the checkpoint's rotary channels are interleaved pairs (transformers' default for DeepSeek-V3)."""
    return bool(hf.get("rope_interleave", True))
