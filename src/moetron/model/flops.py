"""Parameter counts, FLOPs per token, Megatron's TFLOP/s formula and MFU — all from the config alone.

Nothing is allocated, so a 52B-parameter MoE is counted as easily as a toy one. The counts mirror the
modules exactly (tests compare them with `numel()` of real models): the embedding holds the padded
vocabulary, biases follow `add_bias_linear`, SwiGLU doubles the first projection, GQA shrinks K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetron.model.config import ModelConfig
from moetron.model.mla import latent_attention_params

# THE table of GPU peaks (moetron.plan.hardware builds on it, so MFU and plans agree): dense bf16/fp16
# tensor-core TFLOP/s with fp32 accumulation, no sparsity, from the vendors' data sheets. Keys are matched
# as substrings of `torch.cuda.get_device_name()` ("NVIDIA GeForce RTX 4090", "NVIDIA RTX A6000"), longest
# first so that a more specific key wins over a shorter one it contains.
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A6000": 155.0,
    "RTX 5090": 209.5,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "V100": 125.0,
}
# fp32 matmul throughput measured on the 2-core development machine; pass your own with `override`.
CPU_PEAK_TFLOPS = 0.086


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every parameter of the model
    active: int  # touched by one token: all dense parameters + top-k routed experts per MoE layer
    embedding: int  # word (+ position) embeddings, + the output layer when untied
    expert: int  # all routed experts of all MoE layers
    dense: int  # everything else: attention, norms, dense MLPs, routers, shared experts, PR-MoE's MLP


def norm_params(cfg: ModelConfig) -> int:
    return cfg.hidden_size * (1 if cfg.normalization == "rmsnorm" else 2)


def mlp_params(cfg: ModelConfig, ffn_size: int) -> int:
    """`dense_h_to_4h` (2·F outputs for SwiGLU) + `dense_4h_to_h`, with biases when enabled."""
    h, up = cfg.hidden_size, (2 * ffn_size if cfg.swiglu else ffn_size)
    bias = (up + h) if cfg.add_bias_linear else 0
    return h * up + ffn_size * h + bias


def attention_params(cfg: ModelConfig) -> int:
    if cfg.multi_latent_attention:
        return latent_attention_params(cfg)
    h, d = cfg.hidden_size, cfg.head_dim
    qkv_out = (cfg.num_attention_heads + 2 * cfg.kv_heads) * d
    proj_in = cfg.num_attention_heads * d
    bias = (qkv_out + h) if cfg.add_bias_linear else (qkv_out if cfg.add_qkv_bias else 0)
    return h * qkv_out + proj_in * h + bias + qk_norm_params(cfg)


def qk_norm_params(cfg: ModelConfig) -> int:
    """`--qk-layernorm`'s query and key norms: one head's D channels (shared by the heads), or all heads'."""
    if not cfg.qk_layernorm:
        return 0
    q, k = (1, 1) if cfg.qk_layernorm_scope == "head" else (cfg.num_attention_heads, cfg.kv_heads)
    return (q + k) * cfg.head_dim * (1 if cfg.normalization == "rmsnorm" else 2)


def expert_mlp_params(cfg: ModelConfig, ffn_size: int) -> int:
    """One expert (or a dense branch inside a MoE layer): w1 [+ w3 for SwiGLU] and w2, biases b1 [F] and b2."""
    h = cfg.hidden_size
    bias = (ffn_size + h) if cfg.add_bias_linear else 0
    return h * ffn_size * (3 if cfg.swiglu else 2) + bias


def moe_layer_params(cfg: ModelConfig, num_experts: int) -> tuple[int, int]:
    """(routed expert parameters, other parameters of the MoE block: router, shared experts, PR-MoE)."""
    h, ffn = cfg.hidden_size, cfg.expert_ffn_size
    experts = num_experts * expert_mlp_params(cfg, ffn)
    other = h * num_experts  # router gate, no bias
    if cfg.num_shared_experts:
        other += expert_mlp_params(cfg, cfg.num_shared_experts * ffn)
        other += h if cfg.shared_expert_gate else 0
    if cfg.mlp_type == "residual":
        other += expert_mlp_params(cfg, ffn) + 2 * h + 2  # PR-MoE's dense MLP + `coefficient` Linear(h, 2)
    return experts, other


def embedding_params(cfg: ModelConfig) -> int:
    vocab = cfg.padded_vocab_size() * cfg.hidden_size
    positions = cfg.max_positions * cfg.hidden_size if cfg.position_embedding_type == "learned_absolute" else 0
    output = vocab if cfg.untie_embeddings_and_output_weights else 0
    return vocab + positions + output


def count_parameters(cfg: ModelConfig) -> ParamCounts:
    """Exact parameter counts of `GPTModel(cfg)` (tensor parallel size 1)."""
    embedding = embedding_params(cfg)
    dense = norm_params(cfg)  # final norm
    expert = active_expert = 0
    for num_experts in cfg.experts_per_layer():
        dense += 2 * norm_params(cfg) + attention_params(cfg)
        if num_experts > 1:
            routed, other = moe_layer_params(cfg, num_experts)
            dense += other
            expert += routed
            active_expert += routed * cfg.topk // num_experts
        else:
            dense += mlp_params(cfg, cfg.ffn_size)
    dense += cfg.mtp_num_layers * mtp_module_params(cfg)
    mtp_routed, mtp_experts = mtp_module_routed_params(cfg), cfg.mtp_layer_experts()
    expert += cfg.mtp_num_layers * mtp_routed
    active_expert += cfg.mtp_num_layers * (mtp_routed * cfg.topk // mtp_experts)
    total = embedding + dense + expert
    return ParamCounts(total, embedding + dense + active_expert, embedding, expert, dense)


def mtp_module_params(cfg: ModelConfig) -> int:
    """One multi-token-prediction module (model/mtp.py) without its routed experts: enorm, hnorm, the 2h → h
    projection, its transformer layer (a dense MLP, or a MoE layer's router and shared experts) and its final norm;
    the embedding and the head are the model's."""
    h, experts = cfg.hidden_size, cfg.mtp_layer_experts()
    mlp = mlp_params(cfg, cfg.ffn_size) if experts == 1 else moe_layer_params(cfg, experts)[1]
    return 5 * norm_params(cfg) + 2 * h * h + attention_params(cfg) + mlp


def mtp_module_routed_params(cfg: ModelConfig) -> int:
    """The routed experts of one MTP module's MoE layer (0 when it is dense)."""
    experts = cfg.mtp_layer_experts()
    return 0 if experts == 1 else moe_layer_params(cfg, experts)[0]


def flops_per_token(cfg: ModelConfig, seq_length: int | None = None) -> float:
    """Training FLOPs (forward + backward) per token: 6·N_active + attention (PaLM, appendix B).

    N_active counts the matmul weights one token meets: active parameters without the embedding
    lookups, plus the LM head's V·h (tied or not). Attention adds 12·L·s·H·D (QKᵀ and AV,
    forward 2 × 2 FLOPs per multiply-add, backward twice that), without halving for causality
    (`attention_score_flops`; MLA's query/key and value head sizes differ).
    """
    s = seq_length or cfg.seq_length
    counts = count_parameters(cfg)
    heads = 1 + cfg.mtp_num_layers  # the LM head, and once more per MTP module (training: each has a loss)
    matmul_params = counts.active - counts.embedding + heads * cfg.padded_vocab_size() * cfg.hidden_size
    return float(6 * matmul_params + (cfg.num_layers + cfg.mtp_num_layers) * attention_score_flops(cfg, s))


def attention_score_flops(cfg: ModelConfig, seq_length: int) -> int:
    """Training FLOPs per token of one layer's QKᵀ and AV: 6·s·H·(D_qk + D_v) (12·s·H·D when both are D; MLA:
    D_qk = --qk-head-dim + --qk-pos-emb-head-dim, D_v = --v-head-dim)."""
    if cfg.multi_latent_attention:
        qk, v = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.v_head_dim
    else:
        qk = v = cfg.head_dim
    return 6 * seq_length * cfg.num_attention_heads * (qk + v)


def megatron_tflops(
    cfg: ModelConfig,
    global_batch: int,
    seq_length: int,
    iter_time_s: float,
    world_size: int,
    checkpoint_activations: bool = False,
) -> float:
    """TFLOP/s per device exactly as Megatron-DeepSpeed's HEAD `throughput_calculator` reports it.

    Quirks kept on purpose so numbers compare with Megatron logs: `2 // g` is integer division (K/V
    projections vanish from the count for g > 2), every layer counts k experts of the *dense* ffn
    size, and the router, all-to-all and PR-MoE's residual MLP are not counted.
    """
    B, s, L, h = global_batch, seq_length, cfg.num_layers, cfg.hidden_size
    g = cfg.num_attention_heads // cfg.kv_heads
    m = 3 if cfg.swiglu else 2
    qkv_and_proj = B * L * (2 + 2 // g) * h * h * s
    attention = B * L * 2 * h * s * s
    ffn = B * L * m * cfg.ffn_size * h * s * cfg.topk
    lm_head = B * cfg.padded_vocab_size() * h * s
    forward_macs = qkv_and_proj + attention + ffn + lm_head
    macs = 3 * forward_macs + (forward_macs if checkpoint_activations else 0)
    return 2 * macs / (iter_time_s * world_size * 1e12)


def mfu(achieved_tflops_per_device: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved / peak (a fraction, 0.4 = 40 %); None when the peak is unknown."""
    return None if peak_tflops is None else achieved_tflops_per_device / peak_tflops


def gpu_peak_tflops(device_name: str) -> float | None:
    """The table entry whose key is in `device_name` (case-insensitive), longest key first; None if none is."""
    lowered = device_name.lower()
    for name in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if name.lower() in lowered:
            return PEAK_TFLOPS[name]
    return None


def peak_tflops(device_name: str | None = None, override: float | None = None) -> float | None:
    """Peak TFLOP/s of one device: `override` if given, else the table entry matching the device name.

    With no name, the first visible CUDA device is asked; "cpu" (or no CUDA) gives the CPU value. An
    unknown GPU gives None — MFU is then reported as n/a: any guess (the CPU value would make MFU
    ~1000× too flattering) is worse than none. Pass `override` (`--peak-tflops`) for such hardware.
    """
    if override is not None:
        return float(override)
    if device_name is None:
        device_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    if device_name.strip().lower() == "cpu":
        return CPU_PEAK_TFLOPS
    return gpu_peak_tflops(device_name)
