"""Expert parallelism in the memory plan: the rows a rank's experts compute, and the all-to-all buffers.

Each MoE layer's experts are split over the EP ranks (E / ep per rank: counted with the parameters), and each
rank computes the routes its experts receive: T·k rows with balanced dropless routing, at most E·capacity when
dropping (`routed_rows`). With EP > 1 the all-to-all keeps send + receive buffers of the largest MoE layer's routed
rows, and `--moe-expert-replicas K` the K replica slots' weights (`all_to_all_bytes`).
"""

from __future__ import annotations

import math

from moetron.config import RunConfig
from moetron.model.config import ModelConfig
from moetron.model.flops import expert_mlp_params
from moetron.parallel.dims import ParallelDims
from moetron.parallel.terms.rank import compute_bytes
from moetron.parallel.tp.memory import activation_split


def routed_rows(model: ModelConfig, num_experts: int, tokens: int, ep: int) -> int:
    """Rows one rank's experts process per micro-batch: T·k balanced, at most E·capacity when dropping."""
    routes = tokens * model.topk
    if not model.moe_token_dropping:
        return routes  # dropless: planned for balanced routing (one rank can get up to EP× more)
    capacity = math.ceil(tokens / num_experts * model.topk * model.moe_train_capacity_factor)
    capacity = max(capacity, model.moe_min_capacity)
    return num_experts * capacity if ep > 1 else min(routes, num_experts * capacity)


def all_to_all_bytes(cfg: RunConfig, dims: ParallelDims) -> int:
    """Send + receive buffers of the largest MoE layer's routed tokens (only with EP > 1), and the expert weights
    `--moe-expert-replicas` receives (`replica_slot_bytes`)."""
    model = cfg.model
    moe = [e for e in model.experts_per_layer() if e > 1]
    if dims.ep == 1 or not moe:
        return 0
    tokens = cfg.train.micro_batch_size * model.seq_length
    rows = max(routed_rows(model, e, tokens, dims.ep) for e in moe) * activation_split(dims).routes
    return int(2 * rows * model.hidden_size * compute_bytes(cfg)) + replica_slot_bytes(cfg, dims)


def replica_slot_bytes(cfg: RunConfig, dims: ParallelDims) -> int:
    """`--moe-expert-replicas K`: every MoE layer receives K experts' weights (this rank's expert-TP slice, in the
    compute dtype) from their owners and holds them for its backward, which sends one layer's weight gradients back
    at a time. K may exceed the rank's own experts: the slots are this memory, on top of its share."""
    model, slots = cfg.model, cfg.parallel.moe_expert_replicas
    moe = [e for e in model.experts_per_layer() if e > 1]
    if not slots or dims.ep == 1 or not moe:
        return 0
    per_expert = expert_mlp_params(model, model.expert_ffn_size) // max(dims.etp, 1)
    return int(slots * per_expert * compute_bytes(cfg) * (len(moe) + 1))
