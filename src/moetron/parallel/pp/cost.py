"""Pipeline parallelism in the cost model: the bubble, the activations sent between stages, FSDP's re-gathers.

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

The sends (`pp_seconds`): per micro-batch and virtual stage, the [mbs, seq, h] activations forward and their
gradients back. Under ZeRO 2–3 each stage module's weights are gathered once per step, unless a rank runs more
stage modules than torch keeps unsharded (`fsdp_gathers_per_step`, which the data-parallel cost reads).
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

from moetron.config import RunConfig
from moetron.parallel.dimension import StepContext
from moetron.parallel.dims import ParallelDims
from moetron.parallel.pp.stage_layout import MULTI_STAGE, PipelineLayout
from moetron.parallel.terms.rank import compute_bytes


def bubble_fraction(schedule: str, pp: int, num_micro: int, virtual: int = 1) -> float:
    """The idle share of a step (0 without pipelining)."""
    if pp == 1:
        return 0.0
    work = num_micro * (virtual if schedule in MULTI_STAGE else 1) * (3 if schedule == "zero-bubble" else 1)
    return (pp - 1) / (work + pp - 1)


def pipeline_bubble(cfg: RunConfig, dims: ParallelDims) -> float:
    """The bubble fraction of the run's pipeline schedule at its micro-batch count."""
    layout = PipelineLayout.from_config(cfg.model.num_layers, cfg.parallel)
    return bubble_fraction(layout.schedule, layout.pp, cfg.num_micro_batches(dims.dp), layout.virtual)


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


def pp_seconds(step: StepContext) -> float:
    """The activations and their gradients sent between pipeline stages in one step."""
    d, cfg = step.plan.dims, step.plan.cfg
    if d.pp == 1:
        return 0.0
    layout = PipelineLayout.from_config(cfg.model.num_layers, cfg.parallel)
    v = layout.virtual if layout.schedule in MULTI_STAGE else 1
    seq = step.local.model.seq_length // (d.tp if d.sp else 1)  # this rank's tokens of each sequence
    message = cfg.train.micro_batch_size * seq * cfg.model.hidden_size * compute_bytes(cfg)
    sends = 2 * step.plan.accumulation_steps * v  # activations forward, their gradients backward
    return step.net.seconds(sends * message, sends, d.world_size)
