"""Optimizer state in the memory plan: what `--optimizer` keeps per parameter (`parallel/dp/memory.py` shards it).

    adam   AdamW's exp_avg + exp_avg_sq, fp32: 8 B for every parameter
    muon   one momentum_buffer, fp32, 4 B, for every parameter of a hidden matrix (train/muon.py); AdamW's 8 B for the
           rest: embeddings, the LM head, norms, biases, routers and gates (the registry's `ParamInfo.matrix` rule,
           `parallel/params.py`)

The parameters Muon leaves to AdamW are counted from the config alone, as `model/flops.py` counts the modules
(tests/unit/test_plan_optimizer.py compares the counts with a real model's registry); they are few but for the
embeddings, so a Muon run keeps about half of AdamW's state. Under tensor parallelism the vocabulary rows are split
like the embedding; the norms and biases are counted whole. The per-step scratch of Muon (the one matrix gathered
whole for its Newton–Schulz iteration, `parallel/whole_matrix.py`) is transient and not a term of its own.
"""

from __future__ import annotations

from moetron.model.config import ModelConfig
from moetron.model.flops import embedding_params, norm_params, qk_norm_params

ADAMW_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MUON_MATRIX_BYTES = 4  # momentum_buffer, fp32


def state_bytes(optimizer: str, params: int, adamw: int) -> int:
    """Bytes of optimizer state for `params` parameters of which `adamw` are AdamW's even under Muon."""
    if optimizer != "muon":
        return ADAMW_BYTES * params
    return ADAMW_BYTES * adamw + MUON_MATRIX_BYTES * (params - adamw)


def _biases(model: ModelConfig, outputs: int) -> int:
    return outputs if model.add_bias_linear else 0


def attention_adamw(model: ModelConfig) -> int:
    """Attention's parameters that are no hidden matrix: biases and norms (--qk-layernorm's, MLA's latent norms)."""
    h, heads = model.hidden_size, model.num_attention_heads
    if model.multi_latent_attention:  # the Linears of `model/mla.py`: q (down + up, or one), kv down and up, dense
        rq, rkv, rope = model.q_lora_rank or 0, model.kv_lora_rank, model.qk_pos_emb_head_dim
        q_out, kv_up_out = heads * (model.qk_head_dim + rope), heads * (model.qk_head_dim + model.v_head_dim)
        return rq + rkv + _biases(model, rq + q_out + rkv + rope + kv_up_out + h)
    qkv_out = (heads + 2 * model.kv_heads) * model.head_dim
    qkv_bias = qkv_out if model.add_bias_linear or model.add_qkv_bias else 0
    return qkv_bias + _biases(model, h) + qk_norm_params(model)


def mlp_adamw(model: ModelConfig, ffn_size: int) -> int:
    """A dense MLP's biases (its weights are matrices)."""
    return _biases(model, (2 * ffn_size if model.swiglu else ffn_size) + model.hidden_size)


def expert_adamw(model: ModelConfig, ffn_size: int) -> int:
    """One expert's biases b1 [F] and b2 (its `[in, out]` weights are matrices)."""
    return _biases(model, ffn_size + model.hidden_size)


def layer_adamw(model: ModelConfig, num_experts: int, ep: int) -> tuple[int, int]:
    """(AdamW's parameters of one transformer layer on a rank holding E / `ep` experts, of which routed experts')."""
    h, dense = model.hidden_size, 2 * norm_params(model) + attention_adamw(model)
    if num_experts == 1:
        return dense + mlp_adamw(model, model.ffn_size), 0
    routed = num_experts * expert_adamw(model, model.expert_ffn_size) // ep
    dense += h * num_experts  # the router's gate
    if model.num_shared_experts:
        dense += expert_adamw(model, model.num_shared_experts * model.expert_ffn_size)
        dense += h if model.shared_expert_gate else 0
    if model.mlp_type == "residual":
        dense += expert_adamw(model, model.expert_ffn_size) + 2 * h + 2  # PR-MoE's MLP biases + `coefficient`
    return dense + routed, routed


def mtp_module_adamw(model: ModelConfig, ep: int = 1) -> tuple[int, int]:
    """(AdamW's parameters of one MTP module on a rank holding E / `ep` of its MoE layer's experts, of which routed
    experts'): its three own norms and its layer's (eh_proj is a matrix: Muon's)."""
    layer, routed = layer_adamw(model, model.mtp_layer_experts(), ep)
    return 3 * norm_params(model) + layer, routed


def model_adamw(model: ModelConfig, ep: int) -> tuple[int, int]:
    """(AdamW's parameters of the whole model on a rank holding E / `ep` of each MoE layer's experts, of which
    routed experts'): embeddings and head, the final norm, every layer's and every MTP module's."""
    mtp, mtp_routed = mtp_module_adamw(model, ep)
    total = embedding_params(model) + norm_params(model) + model.mtp_num_layers * mtp
    experts = model.mtp_num_layers * mtp_routed
    for num_experts in model.experts_per_layer():
        layer, routed = layer_adamw(model, num_experts, ep)
        total, experts = total + layer, experts + routed
    return total, experts
