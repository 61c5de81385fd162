"""ZeRO in the memory plan: what each stage keeps per rank (`plan/memory_terms.py` asks this module for the weights,
gradients, optimizer state and buffers; everything else — activations, logits, all-to-all — is unchanged).

Sharded = dense parameters / dp + this rank's routed experts / edp (`parallel/dp/zero_spec.py`), all fp32.

    stage 0   weights 4·P, gradients 4·P (+ DDP buckets), Adam 8·P (Muon: 4·matrices + 8·the rest; P: this rank's
              parameters)
    stage 1   Adam 8·sharded; after the step the all-gather bucket (parallel/dp/sharded_optimizer.py)
    stage 2   weights, gradients and Adam 4/4/8·sharded; during the step every block and the experts gathered
              whole in the compute dtype, the root (embeddings, final norm, head) in fp32 (parallel/dp/fsdp.py)
    stage 3   as stage 2, but at the start of the backward only the root and two blocks are whole (the block
              being differentiated and the one FSDP2 prefetches)
Under tensor parallelism every term is of the rank's TP-local tensors (sharded = its TP share / dp). Under
pipelining, of its stage's part; at stages 2–3 the whole stage stays gathered through the step (FSDP2 per stage
module, weights not freed between micro-batches) and its gradients accumulate whole until the last micro-batch.
At stages 2–3 autocast no longer casts the blocks' weights (they are gathered in the compute dtype); only the
root's matmul weights (the head) are still cast. In one process nothing is sharded, whatever the stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moetron.config import RunConfig
from moetron.model.flops import attention_params, embedding_params, mlp_params, moe_layer_params, norm_params
from moetron.parallel.dims import ParallelDims
from moetron.parallel.dp.sharded_optimizer import BUCKET_ELEMENTS
from moetron.parallel.dp.zero_spec import effective_stage
from moetron.parallel.terms.optimizer_state import state_bytes
from moetron.parallel.terms.rank import LocalParams


@dataclass(frozen=True)
class ZeroMemory:
    stage: int
    weights: int  # fp32 weights this rank keeps between steps
    gradients: int  # fp32 gradients after the backward
    optimizer: (
        int  # --optimizer's state (parallel/terms/optimizer_state.py): Adam's exp_avg + exp_avg_sq, Muon's momentum
    )
    ddp_buckets: int
    weight_casts: int  # autocast's half-precision copies of matmul weights
    gathered_in_backward: int  # stages 2–3: weights gathered whole at the start of the backward
    gathered_after_step: int  # stage 1: the all-gather bucket after the optimizer step

    @property
    def gathered(self) -> int:
        return self.gathered_in_backward + self.gathered_after_step


def run_stage(cfg: RunConfig, dims: ParallelDims) -> int:
    """The ZeRO stage the run uses (0 in one process: nothing to shard)."""
    stage = effective_stage(cfg.parallel.zero_stage, cfg.parallel.use_distributed_optimizer)
    return stage if dims.world_size > 1 else 0


def block_parameters(cfg: RunConfig, dims: ParallelDims) -> list[int]:
    """Parameters of each transformer block this rank holds (experts: its E / ep)."""
    model, out = cfg.model, []
    for num_experts in model.experts_per_layer():
        dense = 2 * norm_params(model) + attention_params(model)
        if num_experts > 1:
            routed, other = moe_layer_params(model, num_experts)
            out.append(dense + other + routed // dims.ep)
        else:
            out.append(dense + mlp_params(model, model.ffn_size))
    return out


def sharded_parameters(total: int, experts: int, dims: ParallelDims) -> int:
    """What one rank keeps of its `total` parameters when dense ones are split over dp, experts over edp."""
    # dense state is sharded over every replica of the dense weights (parallel/dp/zero_spec.py)
    return math.ceil((total - experts) / dims.dense_replicas) + math.ceil(experts / max(dims.edp, 1))


def zero_memory(cfg: RunConfig, dims: ParallelDims, params: LocalParams, c: int) -> ZeroMemory:
    """Per-rank bytes of the ZeRO-dependent families for a rank holding `params`; `c` = compute bytes (2 under
    bf16/fp16, 4 in fp32)."""
    stage = run_stage(cfg, dims)
    total, experts = params.total, params.experts
    ddp = 4 * params.replicated if dims.dp > 1 else 0
    casts = 2 * params.matmul if c == 2 else 0
    if stage == 0:
        return ZeroMemory(0, 4 * total, 4 * total, optimizer_state(cfg, dims, params, 0), ddp, casts, 0, 0)
    sharded = sharded_parameters(total, experts, dims)
    optimizer = optimizer_state(cfg, dims, params, stage)
    if stage == 1:
        bucket = min(BUCKET_ELEMENTS, max(total - experts, experts))  # the largest bucket: dense or experts
        gather = 4 * (bucket + math.ceil(bucket / dims.dp))  # its receive + send buffers
        return ZeroMemory(1, 4 * total, 4 * total, optimizer, ddp, casts, 0, gather)
    casts, gathered = fsdp_gathered(cfg, dims, params, stage, c)
    return ZeroMemory(stage, 4 * sharded, 4 * sharded, optimizer, 0, casts, gathered, 0)


def optimizer_state(cfg: RunConfig, dims: ParallelDims, params: LocalParams, stage: int) -> int:
    """Bytes of `--optimizer`'s state on a rank holding `params` (`parallel/terms/optimizer_state.py`), sharded
    from stage 1 like the parameters (dense over dp, experts over edp)."""
    total, adamw = params.total, params.adamw
    if stage:
        total = sharded_parameters(params.total, params.experts, dims)
        adamw = sharded_parameters(params.adamw, params.adamw_experts, dims)
    return state_bytes(cfg.train.optimizer, total, adamw)


def fsdp_gathered(cfg: RunConfig, dims: ParallelDims, params: LocalParams, stage: int, c: int) -> tuple[int, int]:
    """(autocast's head casts, bytes gathered whole at the start of the backward) at stage 2–3 for a rank holding
    `params` (its tensor-parallel share of its pipeline stage's part of the model)."""
    if dims.pp > 1:
        # FSDP2 per stage module (parallel/dp/fsdp.py `shard_stage`): the whole stage stays gathered during the
        # step at stage 3 too, and its gradients accumulate unsharded (fp32) until the last micro-batch's sync
        head = embedding_params(cfg.model) if c == 2 else 0
        return 2 * min(head, params.total), (c + 4) * params.total
    root = embedding_params(cfg.model) + norm_params(cfg.model)
    blocks = block_parameters(cfg, dims)
    whole_blocks = sum(blocks) if stage == 2 else min(sum(blocks), 2 * max(blocks, default=0))
    share = params.total / max(root + sum(blocks), 1)  # what tensor parallelism leaves this rank of them
    head_casts = 2 * embedding_params(cfg.model) if c == 2 else 0
    return int(head_casts * share), int((4 * root + c * whole_blocks) * share)


def describe(stage: int, dtype: str) -> str:
    """The label of the `gathered` memory row at ZeRO `stage` (compute dtype `dtype`)."""
    if stage == 1:
        return "ZeRO-1: all-gather of the updated shards (fp32)"
    whole = "all blocks" if stage == 2 else "two blocks"
    return f"ZeRO-{stage}: {whole} gathered ({dtype}; root fp32)"


def stages_to_try(cfg: RunConfig) -> list[int]:
    """ZeRO stages above the run's own, weakest first (on one GPU they matter only stacked with more GPUs)."""
    current = effective_stage(cfg.parallel.zero_stage, cfg.parallel.use_distributed_optimizer)
    return list(range(current + 1, 4))
