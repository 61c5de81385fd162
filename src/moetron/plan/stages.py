"""Pipeline parallelism in the memory plan: every pipeline rank's part of the model priced with every dimension's
terms (the ends are heavier), and its step time.

Memory of pipeline rank r (the rest as in `memory_terms.py`): its layers' parameters, plus the embedding on the
first stage and the final norm and head on the last (tied embeddings: both ends hold the matrix), with their
gradients, Adam state, DDP buckets and casts; the activations of the micro-batches in flight at the peak and the
deferred weight-gradient state of zero bubble (`parallel/pp/memory.py`); the logits and loss buffers on the last
stage. Each dimension's view of the tokens (`memory_terms.rank_view`: context parallelism's seq / cp) and what it
keeps beyond the per-token terms (`memory_terms.saved_by_dimensions`: CP's gathered K/V of `--cp-comm-type
all_gather`, for the stage's layers) are taken per stage. The bubble is `parallel/pp/cost.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from moetron.config import RunConfig
from moetron.model.config import ModelConfig
from moetron.model.flops import (
    attention_params,
    attention_score_flops,
    mlp_params,
    moe_layer_params,
    mtp_module_params,
    mtp_module_routed_params,
    norm_params,
)
from moetron.parallel.dims import ParallelDims
from moetron.parallel.pp.cost import pipeline_bubble
from moetron.parallel.pp.memory import deferred_weight_grad_bytes, in_flight, pending_weight_grads
from moetron.parallel.pp.stage_layout import PipelineLayout
from moetron.parallel.terms.model_cache import cached
from moetron.parallel.terms.optimizer_state import layer_adamw, mtp_module_adamw
from moetron.parallel.tp.memory import activation_split, shard_parameters
from moetron.plan import memory_terms as mem


@dataclass(frozen=True)
class StagePlan:
    rank: int  # pipeline rank
    layers: tuple[int, ...]  # global layer indices it holds
    first: bool  # holds the embedding
    last: bool  # holds the final norm, the head and the loss
    in_flight: float  # micro-batches of this rank's activations alive at the peak
    flops_per_token: float  # training FLOPs per token of this rank's part
    memory: mem.MemoryEstimate


def layer_params(model: ModelConfig, num_experts: int, ep: int) -> tuple[int, int, int]:
    """(parameters, of which routed experts on this rank, matmul weights) of one layer."""
    total = 2 * norm_params(model) + attention_params(model)
    if num_experts > 1:
        routed, other = moe_layer_params(model, num_experts)
        matmul = attention_params(model) + routed // ep + other - model.hidden_size * num_experts
        return total + routed // ep + other, routed // ep, matmul
    ffn = mlp_params(model, model.ffn_size)
    return total + ffn, 0, attention_params(model) + ffn


def stage_parameters(model: ModelConfig, layers: tuple[int, ...], first: bool, last: bool, ep: int) -> mem.LocalParams:
    """`memory.local_parameters` for one pipeline rank's part of the model (kept in an open `model_cache`: the
    search prices the same stages in thousands of layouts)."""
    return cached(_stage_parameters, model, tuple(layers), first, last, ep)


def _stage_parameters(model: ModelConfig, layers: tuple[int, ...], first: bool, last: bool, ep: int) -> mem.LocalParams:
    experts_per_layer = model.experts_per_layer()
    vocab = model.padded_vocab_size() * model.hidden_size
    untied = model.untie_embeddings_and_output_weights
    total = experts = matmul = adamw = adamw_experts = 0
    for i in layers:
        t, e, mm = layer_params(model, experts_per_layer[i], ep)
        total, experts, matmul = total + t, experts + e, matmul + mm
        a, ae = layer_adamw(model, experts_per_layer[i], ep)
        adamw, adamw_experts = adamw + a, adamw_experts + ae
    root = 0  # embeddings, final norm, head: every one AdamW's under Muon too
    if first:
        learned = model.position_embedding_type == "learned_absolute"
        root += vocab + (model.max_positions * model.hidden_size if learned else 0)
        matmul += vocab if untied else 0
    if last:
        root += norm_params(model) + (vocab if untied or not first else 0)
        matmul += vocab
    if last and model.mtp_num_layers:  # the MTP modules (pp/split.py), and the embeddings they look tokens up in
        module, routed = mtp_module_params(model), mtp_module_routed_params(model) // ep  # a MoE MTP: E / ep
        total += model.mtp_num_layers * (module + routed)
        experts += model.mtp_num_layers * routed
        a, ae = mtp_module_adamw(model, ep)
        adamw, adamw_experts = adamw + model.mtp_num_layers * a, adamw_experts + model.mtp_num_layers * ae
        matmul += model.mtp_num_layers * (module - 5 * norm_params(model) + routed)
        if not first:
            learned = model.position_embedding_type == "learned_absolute"
            root += (vocab if untied else 0) + (model.max_positions * model.hidden_size if learned else 0)
    total, adamw = total + root, adamw + root
    return mem.LocalParams(total, experts, total - (experts if ep > 1 else 0), matmul, adamw, adamw_experts)


def tensor_parallel_ratios(model: ModelConfig, dims: ParallelDims) -> tuple[mem.LocalParams, mem.LocalParams]:
    """(the whole model's parameters at TP 1, what TP leaves of them): the ratios `tensor_parallel_share` scales a
    stage by, the same for every stage of a layout (computed once per plan: the search prices thousands)."""
    whole = mem.local_parameters(model, replace(dims, tp=1, etp=1, sequence_parallel=False))
    return whole, shard_parameters(whole, model, dims)


Ratios = tuple[mem.LocalParams, mem.LocalParams]


def tensor_parallel_share(stage: mem.LocalParams, model: ModelConfig, dims: ParallelDims,
                          ratios: Ratios | None = None) -> mem.LocalParams:  # fmt: skip
    """A stage's parameters under tensor parallelism: each count scaled by the share TP leaves of the whole
    model's (`parallel/tp/memory.py: shard_parameters`; the unsplit norms and biases are spread evenly)."""
    if dims.tp == 1:
        return stage
    whole, split = ratios or tensor_parallel_ratios(model, dims)

    def share(field: str) -> int:
        full = getattr(whole, field)
        return int(getattr(stage, field) * getattr(split, field) / full) if full else 0

    return mem.LocalParams(*(share(f.name) for f in fields(mem.LocalParams)))


def stage_flops_per_token(model: ModelConfig, layers: tuple[int, ...], last: bool, seq: int) -> float:
    """6 · (matmul weights a token meets here) + attention, as `model.flops.flops_per_token` counts the whole
    (kept in an open `model_cache`, as `stage_parameters`)."""
    return cached(_stage_flops_per_token, model, tuple(layers), last, seq)


def _stage_flops_per_token(model: ModelConfig, layers: tuple[int, ...], last: bool, seq: int) -> float:
    experts_per_layer, active = model.experts_per_layer(), 0
    for i in layers:
        active += attention_params(model)
        if experts_per_layer[i] > 1:
            routed, other = moe_layer_params(model, experts_per_layer[i])
            active += routed * model.topk // experts_per_layer[i] + other
        else:
            active += mlp_params(model, model.ffn_size)
    active += model.padded_vocab_size() * model.hidden_size if last else 0
    mtp = model.mtp_num_layers if last else 0  # each MTP module: its layer and projection, and the head once more
    active += mtp * (mtp_module_params(model) - 5 * norm_params(model) + model.padded_vocab_size() * model.hidden_size)
    active += mtp * (mtp_module_routed_params(model) * model.topk // model.mtp_layer_experts())
    return float(6 * active + (len(layers) + mtp) * attention_score_flops(model, seq))


def stage_activation_bytes(cfg: RunConfig, dims: ParallelDims, stage: tuple[int, ...], first: bool, last: bool,
                           micro_batches: float, device_kind: str, pending_w: float = 0.0) -> int:  # fmt: skip
    """Saved activations of `micro_batches` micro-batches of this rank's layers (+ the ends it holds), and the
    deferred weight-gradient state of `pending_w` micro-batches (zero bubble). `cfg`: the full sequence (CP's
    per-rank share is taken here)."""
    local = mem.rank_view(cfg, dims)  # context parallelism: this rank's seq / cp tokens of every sequence
    model, c = local.model, mem.compute_bytes(cfg)
    seq, experts = model.seq_length, model.experts_per_layer()
    tokens, h = cfg.train.micro_batch_size * seq, model.hidden_size
    ends = tokens * h * ((4 if first else 0) + (4 + c if last else 0))
    split = activation_split(dims)  # tensor (and sequence) parallelism within the stage
    ends = int(ends * split.sequence)
    layers = [mem.layer_bytes(model, experts[i], tokens, seq, c, device_kind, dims.ep, split) for i in stage]
    deferred = pending_w * sum(deferred_weight_grad_bytes(model, experts[i], tokens, c, dims.ep, split) for i in stage)
    # what the dimensions keep beyond (--cp-comm-type all_gather: every layer's gathered K/V, per micro-batch)
    gathered = mem.saved_by_dimensions(cfg, dims, c, len(stage), micro_batches)
    if model.checkpoint_activations:
        saved = int(micro_batches * (ends + len(layers) * tokens * h * 4)) + max(layers, default=0)
    else:
        saved = int(micro_batches * (ends + sum(layers)))
    return saved + int(deferred + gathered)


def plan_stages(cfg: RunConfig, dims: ParallelDims, device_kind: str = "cuda") -> list[StagePlan]:
    """One `StagePlan` per pipeline rank (one, the whole model, when pp == 1)."""
    layout = PipelineLayout.from_config(cfg.model.num_layers, cfg.parallel)
    m = cfg.num_micro_batches(dims.dp)
    seq = cfg.model.seq_length
    local = mem.rank_view(cfg, dims)  # the per-token buffers at seq / cp
    ratios = tensor_parallel_ratios(cfg.model, dims) if dims.tp > 1 else None
    experts = cfg.model.experts_per_layer()
    out = []
    for rank in range(layout.pp):
        layers, first, last = layout.layers_of(rank), layout.holds_first(rank), layout.holds_last(rank)
        flight = in_flight(layout, rank, m) if layout.pp > 1 else 1.0
        pending = pending_weight_grads(layout, rank, m)
        stage = stage_parameters(cfg.model, layers, first, last, dims.ep)
        params = tensor_parallel_share(stage, cfg.model, dims, ratios)
        has_moe = any(experts[i] > 1 for i in layers)
        memory = mem.assemble(
            cfg, dims, params,
            activations=stage_activation_bytes(cfg, dims, layers, first, last, flight, device_kind, pending),
            logits=mem.logits_bytes(local, dims, device_kind) if last else 0,
            all_to_all=mem.all_to_all_bytes(local, dims) if has_moe else 0,
        )  # fmt: skip
        flops = stage_flops_per_token(cfg.model, layers, last, seq)
        out.append(StagePlan(rank, layers, first, last, flight, flops, memory))
    return out


def pipeline_step_time(cfg: RunConfig, dims: ParallelDims, stages: list[StagePlan], peak_flops: float) -> float:
    """Seconds per step: the slowest stage's compute for the data-parallel rank's tokens (split over its
    tensor-parallel ranks), over 1 − bubble."""
    recompute = 4 / 3 if cfg.model.checkpoint_activations else 1.0
    tokens = cfg.global_batch(dims.dp) * cfg.model.seq_length / (dims.dp * dims.tp * dims.cp)
    slowest = max(s.flops_per_token for s in stages) * tokens * recompute / peak_flops
    return slowest / (1 - pipeline_bubble(cfg, dims))


# ---------------------------------------------------------------- the report's lines (plan/report.py)
def pipeline_words(plan) -> str:
    layout = PipelineLayout.from_config(plan.cfg.model.num_layers, plan.cfg.parallel)
    virtual = f", {layout.virtual} virtual stages per GPU" if layout.virtual > 1 else ""
    return f"pipeline {layout.pp} ({layout.schedule}{virtual}, bubble {plan.bubble:.0%})"


def _stage_name(stage: StagePlan) -> str:
    ends = [e for e, held in (("embedding", stage.first), ("head", stage.last)) if held]
    span = f"layers {stage.layers[0]}–{stage.layers[-1]}" if stage.layers else "no layers"
    if stage.layers and list(stage.layers) != list(range(stage.layers[0], stage.layers[-1] + 1)):
        span = f"{len(stage.layers)} layers"
    return f"stage {stage.rank}: {span}" + (f" + {' + '.join(ends)}" if ends else "")


def stage_lines(plan) -> list[str]:
    """One memory line per pipeline rank, under the heaviest rank's breakdown."""
    if not plan.stages:
        return []
    lines = ["  needed per pipeline rank (micro-batches in flight):"]
    for stage in plan.stages:
        label = f"  {_stage_name(stage)} ({stage.in_flight:g} in flight)"
        lines.append(f"  {label:<52} {(stage.memory.peak + plan.device.context_bytes) / 2**30:>8.2f}")
    return lines


def pipeline_dict(plan) -> dict | None:
    if not plan.stages:
        return None
    layout = PipelineLayout.from_config(plan.cfg.model.num_layers, plan.cfg.parallel)
    return {
        "schedule": layout.schedule,
        "virtual_stages": layout.virtual,
        "micro_batches": plan.accumulation_steps,
        "bubble_fraction": plan.bubble,
        "stages": [
            {"rank": s.rank, "layers": list(s.layers), "embedding": s.first, "head": s.last,
             "in_flight": s.in_flight, "peak_bytes": s.memory.peak, "activations_bytes": s.memory.activations}
            for s in plan.stages
        ],
    }  # fmt: skip
