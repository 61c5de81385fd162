"""Pipeline parallelism in the plan: the bubble, each stage's memory and step time (the ends are heavier).

Bubble fraction — the idle share of a step with equal stage times, p stages, m micro-batches, v virtual stages:
  1f1b, gpipe        (p − 1) / (m + p − 1)
  interleaved-1f1b   (p − 1) / (v·m + p − 1)       (Narayanan et al. 2021: the bubble shrinks v-fold)
  zero-bubble        (p − 1) / (3·v·m + p − 1)     (ZB-H1 with equal F, B and W times: a third of 1F1B's bubble)

Zero bubble: Qi et al. 2024, "Zero Bubble Pipeline Parallelism" (ICLR), §2–3: splitting each backward into B (input
gradients) and W (weight gradients) and filling the warm-up/cool-down gaps with W leaves 1F1B's (p−1)·(F+B+W) idle
time at (p−1)·(F+B−2W) for ZB-H1; the handcrafted ZB-H1 schedule of the paper's Figure 3 reaches (p−1)·(F+B−W),
i.e. with F = B = W (the paper's working assumption, T_F ≈ T_B ≈ T_W) one step of time (p−1)·T against 3·v·m·T of
work. torch.distributed.pipelining's ScheduleInterleavedZeroBubble (the schedule `--pipeline-schedule zero-bubble`
runs, parallel/pp/schedules.py) is that schedule generalised to v stages per rank (its docs: "ZB1P").

Memory of pipeline rank r (the rest as in `memory_terms.py`): its layers' parameters, plus the embedding on the first
stage and the final norm and head on the last (tied embeddings: both ends hold the matrix), with their gradients,
Adam state, DDP buckets and casts; the activations of the micro-batches in flight at the peak — 1F1B holds
min(m, p − r) micro-batches (the first stage p of them), GPipe all m, the interleaved schedules torch's warm-up
count of chunk forwards + 1 (each a 1/v of the rank's layers), zero bubble p on every rank (W frees a micro-batch's
activations, and torch's ZB1P order keeps p micro-batches between F and W: counted from its action lists) plus
the deferred weight-gradient state of the micro-batches whose B ran and W has not (rank r: r + 1 chunks): the
gradients at the outputs of every matmul, which W multiplies with the saved inputs (`deferred_weight_grad_bytes`);
the logits and loss buffers on the last stage. Context parallelism: every per-token term at seq / cp
(`plan/context_parallel.py`), plus the gathered K/V of `--cp-comm-type all_gather` for the stage's layers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields, replace
from functools import lru_cache

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
from moetron.parallel.pp.stage_layout import MULTI_STAGE, PipelineLayout
from moetron.plan import memory_terms as mem
from moetron.plan.context_parallel import gathered_kv_bytes, per_rank_sequence
from moetron.plan.optimizer_state import layer_adamw, mtp_module_adamw
from moetron.plan.tensor_parallel import activation_split, shard_parameters


@dataclass(frozen=True)
class StagePlan:
    rank: int  # pipeline rank
    layers: tuple[int, ...]  # global layer indices it holds
    first: bool  # holds the embedding
    last: bool  # holds the final norm, the head and the loss
    in_flight: float  # micro-batches of this rank's activations alive at the peak
    flops_per_token: float  # training FLOPs per token of this rank's part
    memory: mem.MemoryEstimate


def bubble_fraction(schedule: str, pp: int, num_micro: int, virtual: int = 1) -> float:
    """The idle share of a step (0 without pipelining)."""
    if pp == 1:
        return 0.0
    work = num_micro * (virtual if schedule in MULTI_STAGE else 1) * (3 if schedule == "zero-bubble" else 1)
    return (pp - 1) / (work + pp - 1)


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
        rows = mem.routed_rows(model, num_experts, tokens, ep) * split.routes
        f = model.expert_ffn_size * (2 if model.swiglu else 1) * split.expert_ffn
        mlp = rows * (f + h) + tokens * num_experts
    else:
        mlp = tokens * (model.ffn_size * (2 if model.swiglu else 1) * split.ffn + h)
    return int((attention + mlp) * c)


MAX_UNSHARDED_STAGES = 3  # torch's `_add_unshard_reshard(max_active_stages=3)`: stage modules FSDP keeps gathered


@lru_cache(maxsize=256)
def _runtime_gathers(schedule: str, pp: int, virtual: int, num_micro: int) -> int:
    """The most UNSHARD actions of one local stage module in torch's lowered action list of a runtime schedule
    (interleaved 1F1B, zero bubble), over the pipeline ranks: what FSDP all-gathers per step. Needs the (slow to
    import) pipelining package, so asked only when it can differ from 1."""
    from torch.distributed.pipelining import schedules

    cls = schedules.ScheduleInterleavedZeroBubble if schedule == "zero-bubble" else schedules.ScheduleInterleaved1F1B
    most = 1
    for rank in range(pp):
        plan = cls.__new__(cls)  # only the arithmetic of its action list: no stages, no process group
        plan.pp_group_size, plan.n_local_stages, plan._n_microbatches, plan.rank = pp, virtual, num_micro, rank
        plan.number_of_rounds = max(1, num_micro // pp)
        plan.microbatches_per_round = num_micro // plan.number_of_rounds
        plan.stage_index_to_group_rank = {s: s % pp for s in range(pp * virtual)}
        stages = [a.stage_index for a in plan._calculate_single_rank_operations(rank) if a is not None]
        most = max(most, *unshard_counts(stages).values())
    return most


def unshard_counts(stages: list[int], active_max: int = MAX_UNSHARDED_STAGES) -> Counter:
    """UNSHARD actions per stage that torch's `_add_unshard_reshard` inserts into a rank's compute actions (their
    stage indices, in order): before each action the next `active_max` distinct stages ahead are made active,
    the others evicted. The same rule in linear time (torch's rescans the rest of the list at every action)."""
    ahead: list[list[int]] = [[] for _ in stages]
    following: list[int] = []
    for i in range(len(stages) - 1, -1, -1):
        following = ([stages[i]] + [s for s in following if s != stages[i]])[:active_max]
        ahead[i] = following
    active: set[int] = set()
    counts: Counter = Counter()
    for window in ahead:
        active &= set(window)
        for stage in window:
            if stage not in active:
                active.add(stage)
                counts[stage] += 1
    return counts


def fsdp_gathers_per_step(layout: PipelineLayout, num_micro: int) -> int:
    """All-gathers of each stage module's weights per step under ZeRO 2–3 with pipelining: 1 (gathered at the
    first forward, resharded after the step), unless a rank runs more stage modules than torch keeps unsharded."""
    if layout.schedule not in MULTI_STAGE or layout.virtual <= MAX_UNSHARDED_STAGES:
        return 1
    try:
        return _runtime_gathers(layout.schedule, layout.pp, layout.virtual, num_micro)
    except Exception:  # a torch whose private schedule internals moved: the worst case, every micro-batch
        return 2 * num_micro


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
    return mem.cached(_stage_parameters, model, tuple(layers), first, last, ep)


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
    model's (`plan/tensor_parallel.py: shard_parameters`; the unsplit norms and biases are spread evenly)."""
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
    return mem.cached(_stage_flops_per_token, model, tuple(layers), last, seq)


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
    whole_seq = cfg.model.seq_length
    local = per_rank_sequence(cfg, dims)  # context parallelism: this rank's seq / cp tokens of every sequence
    model, c = local.model, mem.compute_bytes(cfg)
    seq, experts = model.seq_length, model.experts_per_layer()
    tokens, h = cfg.train.micro_batch_size * seq, model.hidden_size
    ends = tokens * h * ((4 if first else 0) + (4 + c if last else 0))
    split = activation_split(dims)  # tensor (and sequence) parallelism within the stage
    ends = int(ends * split.sequence)
    layers = [mem.layer_bytes(model, experts[i], tokens, seq, c, device_kind, dims.ep, split) for i in stage]
    deferred = pending_w * sum(deferred_weight_grad_bytes(model, experts[i], tokens, c, dims.ep, split) for i in stage)
    gathered = 0  # --cp-comm-type all_gather: every layer's gathered K/V (one with recomputation), per micro-batch
    if dims.cp > 1 and stage:
        full = gathered_kv_bytes(cfg, dims, c)
        mask = (whole_seq // dims.cp) * whole_seq * c if full else 0
        per_layer = (full - mask) // (1 if model.checkpoint_activations else model.num_layers)
        gathered = mask + per_layer * (1 if model.checkpoint_activations else len(stage)) * micro_batches
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
    local = per_rank_sequence(cfg, dims)  # the per-token buffers at seq / cp
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


def pipeline_bubble(cfg: RunConfig, dims: ParallelDims) -> float:
    layout = PipelineLayout.from_config(cfg.model.num_layers, cfg.parallel)
    return bubble_fraction(layout.schedule, layout.pp, cfg.num_micro_batches(dims.dp), layout.virtual)


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
