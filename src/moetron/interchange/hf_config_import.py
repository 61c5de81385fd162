"""A Hugging Face `config.json` → moetron `ModelConfig` fields (the way back of `Architecture.hf_config`).

Everything the transformers model does at inference is carried over exactly (the import test compares logits);
options moetron cannot express (RoPE scalings other than YaRN, `hf_rope.py`; sliding-window attention, QKV
clipping, partial rotary, other activations) stop the import with one line naming the option. Training-only
choices a `config.json` does not record are set to the model family's published recipe and said so in the written
config.yaml's comments: dropout 0, dropless routing, the family's aux-loss coefficient; DeepSeek-V3-style models
keep updating the selection-only expert bias (`--moe-router-bias-update-rate 1e-3`, DeepSeek-V3's rate) with a
sequence-wise aux loss.
"""

from __future__ import annotations

from moetron.errors import UserError
from moetron.interchange.hf_rope import rope_fields

SEQ_LENGTH_CAP = 4096  # the training --seq-length written for models whose position limit is larger


def vocab_divisor(vocab: int) -> int:
    """The largest power of two (at most 128) dividing `vocab`: moetron's padded vocabulary then equals HF's."""
    divisor = 128
    while vocab % divisor:
        divisor //= 2
    return divisor


def _get(hf: dict, key: str, flag_hint: str = ""):
    if key not in hf or hf[key] is None:
        raise UserError(f"config.json has no {key!r}{flag_hint}; is it a complete Hugging Face config?")
    return hf[key]


def common_fields(hf: dict, heads_key: str, problems: list[str]) -> dict:
    vocab = int(_get(hf, "vocab_size"))
    return {
        "vocab_size": vocab,
        "make_vocab_size_divisible_by": vocab_divisor(vocab),
        "hidden_dropout": 0.0,
        "init_method_std": float(hf.get("initializer_range", 0.02)),
        "num_attention_heads": int(_get(hf, heads_key)),
    }


def llama_family_fields(arch, hf: dict) -> dict:
    """ModelConfig fields of a Llama-family config.json (`arch`: its `LlamaFamily`)."""
    p: list[str] = []
    heads = int(_get(hf, "num_attention_heads"))
    hidden = int(_get(hf, "hidden_size"))
    head_dim = hf.get("head_dim") or hidden // heads
    max_pos = int(_get(hf, "max_position_embeddings"))
    if hf.get("hidden_act", "silu") != "silu":
        p.append(f"hidden_act {hf['hidden_act']!r} has no moetron equivalent (SwiGLU uses silu)")
    if hf.get("use_sliding_window") or (arch.model_type == "mixtral" and hf.get("sliding_window")):
        p.append("sliding-window attention (use_sliding_window / sliding_window) has no moetron equivalent")
    fields = {
        **common_fields(hf, "num_attention_heads", p),
        "num_layers": int(_get(hf, "num_hidden_layers")),
        "hidden_size": hidden,
        "num_key_value_heads": int(hf.get("num_key_value_heads") or heads),
        "kv_channels": None if head_dim == hidden // heads and hidden % heads == 0 else int(head_dim),
        "ffn_hidden_size": int(_get(hf, "intermediate_size")),
        "max_position_embeddings": max_pos,
        "seq_length": min(max_pos, SEQ_LENGTH_CAP),
        "normalization": "rmsnorm",
        "position_embedding_type": "rope",
        **rope_fields(hf, p, mla=arch.mla),
        "swiglu": True,
        "layernorm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", arch.model_type == "llama"),
        "attention_dropout": float(hf.get("attention_dropout", 0.0)),
    }
    fields.update(_bias_fields(arch, hf, p))
    if arch.qk_norm in ("head", "all_heads") or (arch.qk_norm == "optional" and hf.get("use_qk_norm")):
        fields.update(qk_layernorm=True, qk_layernorm_scope="head" if arch.qk_norm != "all_heads" else "all_heads")
    if arch.model_type == "olmoe" and hf.get("clip_qkv") is not None:
        p.append(f"clip_qkv {hf['clip_qkv']} has no moetron equivalent")
    if arch.placement is not None:
        fields.update(_moe_fields(arch, hf, fields, p))
    if p:
        raise UserError(f"{arch.hf_class} config.json: " + "; ".join(p))
    return fields


def _bias_fields(arch, hf: dict, p: list[str]) -> dict:
    if arch.bias == "all":  # Llama: attention_bias (q, k, v, o) and mlp_bias must agree
        attention, mlp = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
        if attention != mlp:
            p.append(
                f"attention_bias {attention} with mlp_bias {mlp} has no moetron equivalent (--add-bias-linear "
                f"sets both)"
            )
        return {"add_bias_linear": attention, "add_qkv_bias": False}
    if arch.bias == "qkv":
        key = "qkv_bias" if arch.model_type == "qwen2_moe" else "attention_bias"
        return {"add_bias_linear": False, "add_qkv_bias": bool(hf.get(key, arch.model_type == "qwen2_moe"))}
    if hf.get("attention_bias"):
        p.append("attention_bias true (with a bias-free MLP) has no moetron equivalent")
    return {"add_bias_linear": False, "add_qkv_bias": False}


def _moe_fields(arch, hf: dict, fields: dict, p: list[str]) -> dict:
    t = arch.model_type
    experts = int(hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts") or 0)
    out = {
        "num_experts": [experts],
        "topk": int(_get(hf, "num_experts_per_tok")),
        "expert_interval": 1,
        "moe_token_dropping": False,
        "moe_top2_2nd_expert_sampling": False,
        "moe_loss_coeff": float(hf.get("router_aux_loss_coef", 0.01)),
    }
    if t == "mixtral":
        out["moe_router_topk_renorm"] = True
        return out
    out["moe_router_topk_renorm"] = bool(hf.get("norm_topk_prob", False))
    if t != "olmoe":
        out["moe_ffn_hidden_size"] = int(_get(hf, "moe_intermediate_size"))
    if t in ("qwen2_moe", "qwen3_moe"):
        out.update(_qwen_layout(hf, fields["num_layers"], p))
    if t == "qwen2_moe":
        shared, ffn = int(hf.get("shared_expert_intermediate_size") or 0), out["moe_ffn_hidden_size"]
        if shared % ffn:
            p.append(f"shared_expert_intermediate_size {shared} is not a multiple of moe_intermediate_size {ffn}")
        out.update(num_shared_experts=shared // ffn, shared_expert_gate=True)
    if t in ("glm4_moe", "deepseek_v3"):
        groups = int(hf.get("n_group") or 1)
        out.update(
            moe_first_dense_layers=int(hf.get("first_k_dense_replace") or 0),
            num_shared_experts=int(hf.get("n_shared_experts") or 0),
            moe_router_score_function="sigmoid",
            moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            num_expert_groups=groups,
            topk_groups=int(hf.get("topk_group") or 1) if groups > 1 else 1,
            moe_router_bias_update_rate=1e-3,
            moe_aux_loss_type="seq",
            moe_loss_coeff=1e-4,
        )
    return out


def _qwen_layout(hf: dict, num_layers: int, p: list[str]) -> dict:
    """decoder_sparse_step + mlp_only_layers → --expert-interval + --moe-first-dense-layers."""
    step = int(hf.get("decoder_sparse_step") or 1)
    sparse = [i for i in range(num_layers) if (i + 1) % step == 0]
    dense = sorted(set(hf.get("mlp_only_layers") or []) & set(sparse))
    first_dense = dense[-1] + 1 if dense else 0
    if dense != [i for i in sparse if i < first_dense]:
        p.append(
            f"mlp_only_layers {hf.get('mlp_only_layers')} are not the first MoE layers; moetron makes only "
            f"the first --moe-first-dense-layers layers dense"
        )
    return {"expert_interval": step, "moe_first_dense_layers": first_dense}


def gpt2_fields(arch, hf: dict) -> dict:
    p: list[str] = []
    activation = hf.get("activation_function", "gelu_new")
    if activation not in ("gelu_new", "gelu_pytorch_tanh"):
        p.append(f"activation_function {activation!r} has no moetron equivalent (Megatron's GELU is gelu_new)")
    for key, wanted in [("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)]:
        if bool(hf.get(key, wanted)) != wanted:
            p.append(f"{key} {hf.get(key)} has no moetron equivalent")
    hidden = int(_get(hf, "n_embd"))
    positions = int(_get(hf, "n_positions"))
    fields = {
        **common_fields(hf, "n_head", p),
        "num_layers": int(_get(hf, "n_layer")),
        "hidden_size": hidden,
        "ffn_hidden_size": int(hf.get("n_inner") or 4 * hidden),
        "max_position_embeddings": positions,
        "seq_length": positions,
        "layernorm_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)),
        "hidden_dropout": float(hf.get("resid_pdrop", 0.1)),
        "attention_dropout": float(hf.get("attn_pdrop", 0.1)),
    }
    if p:
        raise UserError(f"{arch.hf_class} config.json: " + "; ".join(p))
    return fields
