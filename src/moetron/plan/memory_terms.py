"""Per-rank memory of a training run, from the config alone: what each tensor family costs at the peak.

Everything follows what moetron's trainer actually keeps (train/trainer.py, train/precision.py):

  weights       fp32 parameters, 4 B each; they are also the master copy (no separate fp32 master).
  gradients     fp32, 4 B per parameter; DDP adds a bucket copy (4 B) of every parameter it reduces.
  optimizer     AdamW exp_avg + exp_avg_sq, fp32: 8 B per parameter (fused kernel: no temporaries); --optimizer
                muon: 4 B (one momentum buffer) per hidden-matrix parameter (`parallel/terms/optimizer_state.py`).
  weight casts  fp16/bf16 copies of the matmul weights that autocast (and the experts) make: 2 B each.
  activations   per layer, from the tensors autograd saves (counted with saved_tensors_hooks while writing
                this model; `tests/unit/test_plan.py` keeps the counts honest): the fp32 residual stream
                at both norms, the compute-dtype inputs of each matmul, q/k/v, the attention output, the
                MLP's pre- and post-activation, dropout masks, and for MoE layers the router's [T, E]
                tensors and, per kept route, the expert's input, hidden, activation and output.
  logits/loss   the LM head + loss buffers (`plan/lm_head.py`): fused (the default) a chunk of rows and dX; else
                [mbs·seq, V] logits, their fp32 log-softmax and both gradients, 16 B per token per vocab entry
                at the start of backward — then often the largest single buffer.
  all-to-all    with EP > 1: send + receive buffers of one MoE layer's routed tokens.

Activation checkpointing keeps each layer's fp32 input and recomputes one layer at a time in backward.
The peak is the larger of "start of backward" (everything above; gradients only what is already there:
the LM head's, or all of them when accumulating micro-batches) and "after backward" (weights, gradients,
optimizer). Layouts: data parallel, expert parallel (experts / EP per rank), tensor and sequence parallel
(`parallel/tp/memory.py`: what each rank holds and saves, as a `Split` of the terms below) and pipeline
parallel (per stage, `plan/stages.py`). ZeRO stages shard weights, gradients and optimizer state and add
gathered weights (`parallel/dp/memory.py`).

Multi-head latent attention (`model/mla.py`) saves its per-head q, k, v and output at its own head sizes
(`latent_heads_bytes`) plus its replicated latents (`latent_bytes`). The KV cache of generation is not a training
term; `kv_cache_bytes_per_token` (the plan's "KV cache" line) is what it costs per token of context.

Shape legend: T tokens per micro-batch per rank (mbs · seq), h hidden, f ffn, a heads, s seq, V vocab.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moetron.config import RunConfig
from moetron.model.config import ModelConfig
from moetron.model.flops import (
    attention_params,
    count_parameters,
    embedding_params,
    mlp_params,
    moe_layer_params,
)
from moetron.parallel.dimensions import DIMENSIONS
from moetron.parallel.dims import ParallelDims
from moetron.parallel.dp.memory import zero_memory
from moetron.parallel.ep.memory import all_to_all_bytes, replica_slot_bytes, routed_rows
from moetron.parallel.terms.model_cache import cached
from moetron.parallel.terms.optimizer_state import model_adamw
from moetron.parallel.terms.rank import LocalParams, compute_bytes
from moetron.parallel.tp.memory import WHOLE, Split, activation_split, shard_parameters
from moetron.plan.lm_head import lm_loss_bytes

__all__ = ["LocalParams", "MemoryEstimate", "accumulating", "activation_bytes", "all_to_all_bytes", "assemble"]
__all__ += ["compute_bytes", "expert_activation_bytes", "latent_bytes", "latent_heads_bytes", "layer_bytes"]
__all__ += ["local_parameters", "logits_bytes", "mlp_activation_bytes", "rank_view", "replica_slot_bytes"]
__all__ += ["routed_rows", "saved_by_dimensions"]

MATH_ATTENTION_BYTES = {4: 12, 2: 13}  # per token, head and key: scores, probabilities, dropout mask (measured)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank; `peak` is what the accelerator must hold (plus its context)."""

    weights: int
    gradients: int
    ddp_buckets: int
    optimizer: int
    weight_casts: int
    activations: int
    logits: int
    all_to_all: int
    peak: int
    phase: str  # which moment sets the peak: "start of backward" | "after backward"
    gathered: int = 0  # ZeRO: weights gathered whole (stages 2–3) or the stage-1 all-gather bucket
    zero_stage: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def rank_view(cfg: RunConfig, dims: ParallelDims) -> RunConfig:
    """`cfg` as one rank's per-token terms see it: every dimension's view in turn (context parallelism: this rank's
    seq / cp tokens of every sequence); `cfg` itself when no dimension changes it."""
    for dimension in DIMENSIONS:
        cfg = dimension.rank_view(cfg, dims)
    return cfg


def saved_by_dimensions(cfg: RunConfig, dims: ParallelDims, c: int, layers: int, micro_batches: float = 1) -> float:
    """What the dimensions save for backward beyond the per-token terms (the gathered K/V of context parallelism),
    for `layers` layers and `micro_batches` micro-batches in flight; `cfg`: the whole sequence."""
    return sum(dimension.saved_bytes(cfg, dims, c, layers, micro_batches) for dimension in DIMENSIONS)


def local_parameters(model: ModelConfig, dims: ParallelDims) -> LocalParams:
    """Parameters of one rank: experts are split over EP ranks, everything else is replicated."""
    return cached(_local_parameters, model, dims)


def _local_parameters(model: ModelConfig, dims: ParallelDims) -> LocalParams:
    counts = count_parameters(model)
    experts = counts.expert // dims.ep
    replicated = counts.total - counts.expert + (experts if dims.ep == 1 else 0)
    matmul = model.padded_vocab_size() * model.hidden_size * (2 if model.untie_embeddings_and_output_weights else 1)
    for num_experts in model.experts_per_layer():
        matmul += attention_params(model)
        if num_experts > 1:
            routed, other = moe_layer_params(model, num_experts)
            matmul += routed // dims.ep + other - model.hidden_size * num_experts  # the router runs in fp32
        else:
            matmul += mlp_params(model, model.ffn_size)
    adamw, adamw_experts = model_adamw(model, dims.ep)
    local = LocalParams(counts.total - counts.expert + experts, experts, replicated, matmul, adamw, adamw_experts)
    return shard_parameters(local, model, dims)


def mlp_activation_bytes(model: ModelConfig, tokens: int, c: int, split: Split = WHOLE) -> int:
    """fc1 input, fc1 output (2F for SwiGLU) and the activation's output(s), in the compute dtype."""
    f = model.ffn_size
    per_token = model.hidden_size + (4 * f if model.swiglu else 2 * f) * split.ffn
    return int(tokens * per_token * c)


def expert_activation_bytes(
    model: ModelConfig, num_experts: int, tokens: int, c: int, ep: int, split: Split = WHOLE
) -> int:
    """Router tensors, then per kept route: expert input, hidden, activation, output (+ residual/shared MLP)."""
    h, f = model.hidden_size, model.expert_ffn_size
    rows = routed_rows(model, num_experts, tokens, ep) * split.routes
    per_route = 2 * h + (4 * f if model.swiglu else 2 * f) * split.expert_ffn
    router = tokens * (4 * h + 5 * 4 * num_experts)  # fp32 input and [T, E] logits/probs/masks
    total = int(router + rows * per_route * c)
    dense_branches = [f] if model.mlp_type == "residual" else []  # PR-MoE's MLP: output kept for the mix
    dense_branches += [f * model.num_shared_experts] if model.num_shared_experts else []
    for ffn in dense_branches:
        total += tokens * (2 * h + (4 * ffn if model.swiglu else 2 * ffn)) * c
    return total


def layer_bytes(
    model: ModelConfig,
    num_experts: int,
    tokens: int,
    seq: int,
    c: int,
    device_kind: str,
    ep: int,
    split: Split = WHOLE,
) -> int:
    """Activations one transformer layer saves for backward (micro-batch of `tokens` = mbs·seq), on one rank."""
    h, a, d = model.hidden_size, model.num_attention_heads, model.head_dim
    mask = c if device_kind == "cpu" else 1  # dropout masks: the input dtype on CPU, bool on CUDA
    residual = 2 * 4 * h * split.sequence  # the fp32 residual stream saved by both norms
    heads = ((a + 2 * model.kv_heads) * d + a * d) * c + 4 * a  # q/k/v, output, logsumexp
    if model.multi_latent_attention:
        heads = latent_heads_bytes(model, c)
    attention = h * c + heads * split.heads + latent_bytes(model, c)  # input (whole: gathered), heads, MLA latents
    dropout = 2 * mask * h * (model.hidden_dropout > 0) * split.sequence
    per_token = residual + attention + dropout
    if device_kind == "cpu" and model.attention_dropout > 0:
        per_token += MATH_ATTENTION_BYTES[c] * a * seq * split.heads  # CPU SDPA with dropout: the math kernel
    elif device_kind == "cpu" and model.multi_latent_attention:  # CPU SDPA of unequal q/k and v sizes: the math
        per_token += c * a * seq * split.heads  # kernel's probabilities
    if num_experts > 1:
        mlp = expert_activation_bytes(model, num_experts, tokens, c, ep, split)
    else:
        mlp = mlp_activation_bytes(model, tokens, c, split)
    return int(tokens * per_token) + mlp


def latent_heads_bytes(model: ModelConfig, c: int) -> int:
    """MLA's per-head tensors per token: q and the expanded k (Dn + Dr each), v and the output (Dv), logsumexp."""
    if not model.multi_latent_attention:
        return 0
    qk, v = model.qk_head_dim + model.qk_pos_emb_head_dim, model.v_head_dim
    return model.num_attention_heads * ((2 * qk + 2 * v) * c + 4)


def latent_bytes(model: ModelConfig, c: int) -> int:
    """MLA's replicated latents per token: each latent norm's fp32 input, normalised values and rstd, and its
    output (the up projection's input); the shared key's rows of the down projection's output; 0 without MLA."""
    if not model.multi_latent_attention:
        return 0
    latents = [r for r in (model.q_lora_rank or 0, model.kv_lora_rank) if r]
    return sum(r * (8 + c) + 4 for r in latents) + model.qk_pos_emb_head_dim * c


def activation_bytes(cfg: RunConfig, dims: ParallelDims, device_kind: str) -> int:
    """Saved activations of one micro-batch at the start of backward (all layers, or checkpointed inputs)."""
    model, c, split = cfg.model, compute_bytes(cfg), activation_split(dims)
    seq = model.seq_length
    tokens = cfg.train.micro_batch_size * seq
    layers = [layer_bytes(model, e, tokens, seq, c, device_kind, dims.ep, split) for e in model.experts_per_layer()]
    ends = int(tokens * model.hidden_size * (8 * split.sequence + c))  # embedding output, final norm in and out
    if model.checkpoint_activations:
        return ends + int(len(layers) * tokens * model.hidden_size * 4 * split.sequence) + max(layers)
    return ends + sum(layers)


def accumulating(cfg: RunConfig, dims: ParallelDims) -> bool:
    return dims.dp > 0 and cfg.num_micro_batches(dims.dp) > 1


def logits_bytes(cfg: RunConfig, dims: ParallelDims, device_kind: str = "cuda") -> int:
    """The LM head + loss buffers (fused chunks, or [T, V / tp] logits: then, accumulating, the trainer still
    holds the previous micro-batch's logits)."""
    return lm_loss_bytes(cfg, compute_bytes(cfg), accumulating(cfg, dims), device_kind, dims)


def assemble(
    cfg: RunConfig, dims: ParallelDims, params: LocalParams, activations: int, logits: int, all_to_all: int
) -> MemoryEstimate:
    """The peak of one rank holding `params`, given its activations, logits and all-to-all buffers."""
    z = zero_memory(cfg, dims, params, compute_bytes(cfg))
    weights, gradients, ddp, optimizer, casts = z.weights, z.gradients, z.ddp_buckets, z.optimizer, z.weight_casts
    a2a = all_to_all
    lm_head_grad = 4 * min(embedding_params(cfg.model), params.total)  # a pipeline stage may hold less
    grads_at_backward = gradients if accumulating(cfg, dims) else lm_head_grad
    backward_start = weights + optimizer + ddp + grads_at_backward + casts + activations + logits + a2a
    backward_start += z.gathered_in_backward
    after_backward = weights + optimizer + ddp + gradients + z.gathered_after_step
    peak, phase = max((backward_start, "start of backward"), (after_backward, "after backward"))
    return MemoryEstimate(
        weights, gradients, ddp, optimizer, casts, activations, logits, a2a, peak, phase, z.gathered, z.stage
    )
