"""Data parallelism and ZeRO in the cost model: the gradient reduction and ZeRO's gathers, less what overlaps.

    ZeRO 0       all-reduce of the fp32 gradients: dense over dp, each rank's experts over edp (DDP: bucketed,
                 during the last micro-batch's backward)
    ZeRO 1       + all-gather of the updated fp32 parameters after the step (parallel/dp/sharded_optimizer.py)
    ZeRO 2       reduce-scatter of the fp32 gradients after every micro-batch + one all-gather of the weights in
                 the compute dtype per step (parallel/dp/fsdp.py)
    ZeRO 3       reduce-scatter per micro-batch + all-gathers per micro-batch forward and backward
The term overlaps the backward (2/3 of the compute) of the last micro-batch (ZeRO 0–2) or of every micro-batch
(ZeRO 3, FSDP2 prefetches the next unit's gather); only the rest is exposed. Dense groups are every replica of the
dense weights (`ParallelDims.dense_replicas`).

    ZeRO 2–3 under pipelining (parallel/dp/fsdp.py `shard_stage`; torch's PipelineStage): every backward runs with
                 `set_requires_gradient_sync(False)` / `set_reshard_after_backward(False)` and blocks are never
                 resharded after forward, so a stage's weights are all-gathered ONCE per step (its first forward)
                 and its gradients reduce-scattered ONCE (fp32, `perform_reduce_grad` after the step's last
                 backward: nothing left to overlap). With more than 3 stages per rank, torch's runtime schedules
                 (interleaved, zero bubble) keep only 3 stage modules unsharded at a time
                 (`_add_unshard_reshard`), and the gathers per step are counted from its action list
                 (`parallel/pp/cost.py: fsdp_gathers_per_step`). Only the first micro-batch's forward (1/3 of its
                 compute) hides the gathers.
    ZeRO 0–1 under pipelining: DDP's all-reduce during the last backward, as without (zero bubble: after the
                 schedule, split.py `dense_after_backward`, not overlapped).
"""

from __future__ import annotations

import math

from moetron.parallel.dimension import StepContext
from moetron.parallel.pp.cost import fsdp_gathers_per_step
from moetron.parallel.pp.stage_layout import PipelineLayout
from moetron.parallel.terms.rank import compute_bytes, ring_share

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb: one all-reduce per 25 MiB


def dp_seconds(step: StepContext) -> float:
    """The exposed part of the gradient reduction and ZeRO's gathers (see the module docstring)."""
    plan, net, compute = step.plan, step.net, step.compute
    d, stage, m = plan.dims, plan.memory.zero_stage, plan.accumulation_steps
    local = step.params
    experts, dense = local.experts, local.total - local.experts
    replicas = d.dense_replicas  # the dense gradients' group
    extent = replicas * d.tp  # dp and edp groups span one pipeline stage's ranks
    c = compute_bytes(plan.cfg)
    layout = PipelineLayout.from_config(plan.cfg.model.num_layers, plan.cfg.parallel) if d.pp > 1 else None
    if stage == 0 or stage == 1:
        grads = 4 * (dense * 2 * ring_share(replicas) + experts * 2 * ring_share(d.edp))
        gather = 4 * (dense * ring_share(replicas) + experts * ring_share(d.edp)) if stage == 1 else 0.0
        calls = math.ceil(4 * (dense + experts) / DDP_BUCKET_BYTES) * (2 if stage == 1 else 1)
        comm, overlap = net.seconds(grads + gather, calls, extent), compute / m * 2 / 3
        if layout is not None and layout.splits_backward:
            overlap = 0.0  # zero bubble: the dense gradients are reduced after the schedule (pp/split.py)
        gathered_after = net.seconds(gather, 0, extent)  # after the step: nothing left to hide it behind
        return max(0.0, comm - gathered_after - overlap) + gathered_after
    sharded = dense * ring_share(replicas) + experts * ring_share(d.edp)
    if layout is not None:  # FSDP2 per pipeline stage: gathered once per step (or per re-unshard), reduced once
        blocks = len(step.layers) + 1
        gathers = fsdp_gathers_per_step(layout, m)
        gather = net.seconds(gathers * c * sharded, blocks * gathers, extent)
        scatter = net.seconds(4 * sharded, blocks, extent)
        return max(0.0, gather - compute / m / 3) + scatter
    blocks = len(plan.cfg.model.experts_per_layer()) + 1
    scatter = m * 4 * sharded
    gathers = (2 * m if stage == 3 else 1) * c * sharded
    comm = net.seconds(scatter + gathers, blocks * (m + (2 * m if stage == 3 else 1)), extent)
    overlap = compute * 2 / 3 if stage == 3 else compute / m * 2 / 3
    return max(0.0, comm - overlap)
