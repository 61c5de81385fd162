"""Per-rank memory of a training run, from the config alone: what each tensor family costs at the peak.

Everything follows what moetron's trainer actually keeps (train/trainer.py, train/precision.py):

  weights       fp32 parameters, 4 B each; they are also the master copy (no separate fp32 master).
  gradients     fp32, 4 B per parameter; DDP adds a bucket copy (4 B) of every parameter it reduces.
  optimizer     AdamW exp_avg + exp_avg_sq, fp32: 8 B per parameter (fused kernel: no temporaries).
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
optimizer). Layouts: data parallel and expert parallel (experts / EP per rank); TP and PP are accepted as
1 only — `layer_bytes` and `local_parameters` are the seams where they will divide the work.

Shape legend: T tokens per micro-batch per rank (mbs · seq), h hidden, f ffn, a heads, s seq, V vocab.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from moetron.config import RunConfig
from moetron.model.config import ModelConfig
from moetron.model.flops import attention_params, count_parameters, embedding_params, mlp_params, moe_layer_params
from moetron.parallel.dims import ParallelDims
from moetron.plan.lm_head import lm_loss_bytes

MATH_ATTENTION_BYTES = {4: 12, 2: 13}  # per token, head and key: scores, probabilities, dropout mask (measured)


@dataclass(frozen=True)
class LocalParams:
    total: int  # parameters this rank holds
    experts: int  # of which routed experts (num_experts / EP per MoE layer)
    replicated: int  # of which replicated on every data-parallel rank (all but sharded experts)
    matmul: int  # of which are matmul weights (cast to fp16/bf16 under autocast)


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

    def to_dict(self) -> dict:
        return asdict(self)


def compute_bytes(cfg: RunConfig) -> int:
    return 2 if cfg.train.fp16 or cfg.train.bf16 else 4


def local_parameters(model: ModelConfig, dims: ParallelDims) -> LocalParams:
    """Parameters of one rank: experts are split over EP ranks, everything else is replicated."""
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
    return LocalParams(counts.total - counts.expert + experts, experts, replicated, matmul)


def routed_rows(model: ModelConfig, num_experts: int, tokens: int, ep: int) -> int:
    """Rows one rank's experts process per micro-batch: T·k balanced, at most E·capacity when dropping."""
    routes = tokens * model.topk
    if not model.moe_token_dropping:
        return routes  # dropless: planned for balanced routing (one rank can get up to EP× more)
    capacity = math.ceil(tokens / num_experts * model.topk * model.moe_train_capacity_factor)
    capacity = max(capacity, model.moe_min_capacity)
    return num_experts * capacity if ep > 1 else min(routes, num_experts * capacity)


def mlp_activation_bytes(model: ModelConfig, tokens: int, c: int) -> int:
    """fc1 input, fc1 output (2F for SwiGLU) and the activation's output(s), in the compute dtype."""
    f = model.ffn_size
    per_token = model.hidden_size + (4 * f if model.swiglu else 2 * f)
    return tokens * per_token * c


def expert_activation_bytes(model: ModelConfig, num_experts: int, tokens: int, c: int, ep: int) -> int:
    """Router tensors, then per kept route: expert input, hidden, activation, output (+ residual/shared MLP)."""
    h, f = model.hidden_size, model.expert_ffn_size
    rows = routed_rows(model, num_experts, tokens, ep)
    per_route = 2 * h + (4 * f if model.swiglu else 2 * f)
    router = tokens * (4 * h + 5 * 4 * num_experts)  # fp32 input and [T, E] logits/probs/masks
    total = router + rows * per_route * c
    dense_branches = [f] if model.mlp_type == "residual" else []  # PR-MoE's MLP: output kept for the mix
    dense_branches += [f * model.num_shared_experts] if model.num_shared_experts else []
    for ffn in dense_branches:
        total += tokens * (2 * h + (4 * ffn if model.swiglu else 2 * ffn)) * c
    return total


def layer_bytes(model: ModelConfig, num_experts: int, tokens: int, seq: int, c: int, device_kind: str, ep: int) -> int:
    """Activations one transformer layer saves for backward (micro-batch of `tokens` = mbs·seq)."""
    h, a, d = model.hidden_size, model.num_attention_heads, model.head_dim
    mask = c if device_kind == "cpu" else 1  # dropout masks: the input dtype on CPU, bool on CUDA
    residual = 2 * 4 * h  # the fp32 residual stream saved by both norms
    attention = (h + (a + 2 * model.kv_heads) * d + a * d) * c + 4 * a  # qkv in, q/k/v, output, logsumexp
    dropout = 2 * mask * h * (model.hidden_dropout > 0)
    per_token = residual + attention + dropout
    if device_kind == "cpu" and model.attention_dropout > 0:
        per_token += MATH_ATTENTION_BYTES[c] * a * seq  # CPU SDPA with dropout runs the math kernel
    if num_experts > 1:
        mlp = expert_activation_bytes(model, num_experts, tokens, c, ep)
    else:
        mlp = mlp_activation_bytes(model, tokens, c)
    return tokens * per_token + mlp


def activation_bytes(cfg: RunConfig, dims: ParallelDims, device_kind: str) -> int:
    """Saved activations of one micro-batch at the start of backward (all layers, or checkpointed inputs)."""
    model, c = cfg.model, compute_bytes(cfg)
    seq = model.seq_length
    tokens = cfg.train.micro_batch_size * seq
    layers = [layer_bytes(model, e, tokens, seq, c, device_kind, dims.ep) for e in model.experts_per_layer()]
    ends = tokens * model.hidden_size * (4 + 4 + c)  # embedding output + final norm input and output
    if model.checkpoint_activations:
        return ends + len(layers) * tokens * model.hidden_size * 4 + max(layers)
    return ends + sum(layers)


def accumulating(cfg: RunConfig, dims: ParallelDims) -> bool:
    return dims.dp > 0 and cfg.num_micro_batches(dims.dp) > 1


def logits_bytes(cfg: RunConfig, dims: ParallelDims, device_kind: str = "cuda") -> int:
    """The LM head + loss buffers (fused chunks, or [T, V] logits: then, accumulating, the trainer still holds the
    previous micro-batch's logits)."""
    return lm_loss_bytes(cfg, compute_bytes(cfg), accumulating(cfg, dims), device_kind)


def all_to_all_bytes(cfg: RunConfig, dims: ParallelDims) -> int:
    """Send + receive buffers of the largest MoE layer's routed tokens (only with EP > 1)."""
    model = cfg.model
    moe = [e for e in model.experts_per_layer() if e > 1]
    if dims.ep == 1 or not moe:
        return 0
    tokens = cfg.train.micro_batch_size * model.seq_length
    rows = max(routed_rows(model, e, tokens, dims.ep) for e in moe)
    return 2 * rows * model.hidden_size * compute_bytes(cfg)


def estimate_memory(cfg: RunConfig, dims: ParallelDims, device_kind: str = "cuda") -> MemoryEstimate:
    """Peak bytes per rank for `cfg` under the layout `dims` on a `device_kind` ("cuda" or "cpu") device."""
    params = local_parameters(cfg.model, dims)
    weights = 4 * params.total
    gradients = 4 * params.total
    ddp = 4 * params.replicated if dims.dp > 1 else 0
    optimizer = 8 * params.total
    casts = 2 * params.matmul if compute_bytes(cfg) == 2 else 0
    activations = activation_bytes(cfg, dims, device_kind)
    logits = logits_bytes(cfg, dims, device_kind)
    a2a = all_to_all_bytes(cfg, dims)
    lm_head_grad = 4 * embedding_params(cfg.model)
    grads_at_backward = gradients if accumulating(cfg, dims) else lm_head_grad
    backward_start = weights + optimizer + ddp + grads_at_backward + casts + activations + logits + a2a
    after_backward = weights + optimizer + ddp + gradients
    peak, phase = max((backward_start, "start of backward"), (after_backward, "after backward"))
    return MemoryEstimate(weights, gradients, ddp, optimizer, casts, activations, logits, a2a, peak, phase)
