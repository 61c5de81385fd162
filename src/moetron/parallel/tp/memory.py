"""Tensor and sequence parallelism in the memory plan: what one rank holds and saves (`parallel/tp/cost.py`: what
it sends).

Parameters (the split of parallel/tp/apply_tp.py): attention's `query_key_value` (weight and bias) and `dense`
weight, the dense MLPs' first projections (weights and biases) and second weight, and the vocabulary rows of the
word embeddings (and of an untied output layer) hold 1 / tp on every rank; row-parallel biases, norms, routers,
position embeddings, shared experts and PR-MoE's MLP are whole. Experts: whole with --expert-tensor-parallel-size
1 (split by EP only), else 1 / etp of every expert's channels (w1, w3, w2, b1).

Activations (the terms of memory.layer_bytes, scaled by `Split`): per token q/k/v, the attention output, its
logsumexp and the dense MLP's hidden tensors hold 1 / tp; under folding each rank's experts compute 1 / tp of the
routes, under expert TP every route with 1 / etp of its hidden channels. The inputs of the column-parallel GEMMs
stay whole (autograd keeps the gathered input), and so do the residual stream, the norms and the dropout masks —
unless --sequence-parallel, which divides those by tp. The logits and loss buffers hold 1 / tp of the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moetron.model.config import ModelConfig
from moetron.model.flops import attention_params, expert_mlp_params, mlp_params
from moetron.parallel.dims import ParallelDims
from moetron.parallel.terms.model_cache import cached


@dataclass(frozen=True)
class Split:
    """The share of each kind of activation one rank saves (1.0: the whole tensor)."""

    heads: float = 1.0  # q/k/v, attention output, logsumexp, attention probabilities
    ffn: float = 1.0  # the dense MLP's hidden tensors
    sequence: float = 1.0  # the residual stream at the norms, dropout masks (sequence parallelism)
    routes: float = 1.0  # routed rows a rank's experts compute (folding: its share of the tokens)
    expert_ffn: float = 1.0  # the experts' hidden tensors (expert tensor parallelism)
    vocab: float = 1.0  # logits and loss buffers


WHOLE = Split()  # no tensor parallelism


def activation_split(dims: ParallelDims) -> Split:
    if dims.tp == 1:
        return WHOLE
    share = 1.0 / dims.tp
    folding = dims.etp == 1
    return Split(
        heads=share,
        ffn=share,
        sequence=share if dims.sp else 1.0,
        routes=share if folding else 1.0,
        expert_ffn=1.0 if folding else 1.0 / dims.etp,
        vocab=share,
    )


def split_parameters(model: ModelConfig) -> tuple[int, int]:
    """(dense parameters split by TP, routed-expert parameters split by expert TP), counted at TP 1 (once per model
    in an open `model_cache`)."""
    return cached(_split_parameters, model)


def _split_parameters(model: ModelConfig) -> tuple[int, int]:
    h, bias = model.hidden_size, model.hidden_size if model.add_bias_linear else 0
    dense = model.padded_vocab_size() * h * (2 if model.untie_embeddings_and_output_weights else 1)
    experts = 0
    for num_experts in model.experts_per_layer():
        dense += _head_split_attention_params(model)
        if num_experts > 1:
            experts += num_experts * (expert_mlp_params(model, model.expert_ffn_size) - bias)  # all but b2
        else:
            dense += mlp_params(model, model.ffn_size) - bias
    # each MTP module's layer follows the main layers' plan (its norms and eh_proj stay whole)
    mtp_experts = model.mtp_layer_experts()
    dense += model.mtp_num_layers * _head_split_attention_params(model)
    if mtp_experts > 1:
        experts += model.mtp_num_layers * mtp_experts * (expert_mlp_params(model, model.expert_ffn_size) - bias)
    else:
        dense += model.mtp_num_layers * (mlp_params(model, model.ffn_size) - bias)
    return dense, experts


def _head_split_attention_params(model: ModelConfig) -> int:
    """Attention parameters split by heads: all but the row-parallel `dense` bias; MLA: the up projections (or the
    query projection) and `dense`'s weight (its down projections and latent norms are replicated)."""
    bias = model.add_bias_linear
    if not model.multi_latent_attention:
        return attention_params(model) - (model.hidden_size if bias else 0)
    heads = model.num_attention_heads
    q_in = model.q_lora_rank or model.hidden_size
    q_out = heads * (model.qk_head_dim + model.qk_pos_emb_head_dim)
    kv_up_out = heads * (model.qk_head_dim + model.v_head_dim)
    dense = heads * model.v_head_dim * model.hidden_size
    return q_out * (q_in + bias) + kv_up_out * (model.kv_lora_rank + bias) + dense


def shard_parameters(local, model: ModelConfig, dims: ParallelDims):
    """`local` (a `LocalParams` at TP 1) less what tensor parallelism takes off this rank."""
    if dims.tp == 1:
        return local
    dense, experts = split_parameters(model)
    dense_saved = dense - dense // dims.tp
    expert_saved = (experts // dims.ep - experts // (dims.ep * dims.etp)) if dims.etp > 1 else 0
    saved = dense_saved + expert_saved
    vocab = model.padded_vocab_size() * model.hidden_size * (2 if model.untie_embeddings_and_output_weights else 1)
    return replace(
        local,
        total=local.total - saved,
        experts=local.experts - expert_saved,
        replicated=local.replicated - dense_saved - (expert_saved if dims.ep == 1 else 0),
        matmul=local.matmul - saved,
        adamw=local.adamw - (vocab - vocab // dims.tp),  # the vocabulary rows (norms and biases: counted whole)
    )
