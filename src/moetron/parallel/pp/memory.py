"""Pipeline parallelism in the memory plan: the micro-batches each pipeline rank holds at its peak.

`plan/stages.py` prices every pipeline rank's part of the model (the rest as in `plan/memory_terms.py`): its
layers' parameters, plus the embedding on the first stage and the final norm and head on the last (tied
embeddings: both ends hold the matrix), with their gradients, Adam state, DDP buckets and casts; the activations
of the micro-batches in flight at the peak (`in_flight`) — 1F1B holds min(m, p − r) micro-batches (the first stage
p of them), GPipe all m, the interleaved schedules torch's warm-up count of chunk forwards + 1 (each a 1/v of the
rank's layers), zero bubble p on every rank (W frees a micro-batch's activations, and torch's ZB1P order keeps p
micro-batches between F and W: counted from its action lists) plus the deferred weight-gradient state of the
micro-batches whose B ran and W has not (rank r: r + 1 chunks, `pending_weight_grads`): the gradients at the
outputs of every matmul, which W multiplies with the saved inputs (`deferred_weight_grad_bytes`); the logits and
loss buffers on the last stage.
"""

from __future__ import annotations

from moetron.model.config import ModelConfig
from moetron.parallel.ep.memory import routed_rows
from moetron.parallel.pp.stage_layout import MULTI_STAGE, PipelineLayout


def in_flight(layout: PipelineLayout, rank: int, num_micro: int) -> float:
    """Micro-batches of rank `rank`'s activations held at the peak (fractions: interleaved chunks of 1/v)."""
    p, v = layout.pp, layout.virtual
    if layout.schedule == "gpipe":
        return float(num_micro)
    if layout.schedule == "zero-bubble":  # ZB1P: p micro-batches (p·v chunks) between F and W on every rank
        return float(min(num_micro, p))
    if layout.schedule not in MULTI_STAGE:
        return float(min(num_micro, p - rank))
    per_round = num_micro // max(1, num_micro // p)  # torch's _get_warmup_ops
    chunks = min(v * num_micro, (v - 1) * per_round + 2 * (p - 1 - rank) + 1)
    return chunks / v


def pending_weight_grads(layout: PipelineLayout, rank: int, num_micro: int) -> float:
    """Micro-batches (in 1/v chunks) whose input gradients (B) ran and weight gradients (W) did not, at most, on
    rank `rank` under zero bubble (torch's ZB1P order: rank r defers r + 1 chunks); 0 for the other schedules."""
    if not layout.splits_backward:
        return 0.0
    v = layout.virtual
    return min(v * num_micro, rank + 1) / v


def deferred_weight_grad_bytes(model: ModelConfig, num_experts: int, tokens: int, c: int, ep: int, split) -> int:
    """What one layer keeps from B to W per micro-batch: the gradient at each matmul's output (compute dtype),
    which W multiplies with the matmul's saved input: q/k/v and the attention output projection, the MLP's fc1
    (2F with SwiGLU) and fc2, or for MoE the routed rows' fc1/fc2 outputs (and the router's [T, E] logits)."""
    h, d = model.hidden_size, model.head_dim
    attention = ((model.num_attention_heads + 2 * model.kv_heads) * d * split.heads + h) * tokens
    if num_experts > 1:
        rows = routed_rows(model, num_experts, tokens, ep) * split.routes
        f = model.expert_ffn_size * (2 if model.swiglu else 1) * split.expert_ffn
        mlp = rows * (f + h) + tokens * num_experts
    else:
        mlp = tokens * (model.ffn_size * (2 if model.swiglu else 1) * split.ffn + h)
    return int((attention + mlp) * c)
