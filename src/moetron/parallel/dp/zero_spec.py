"""ZeRO (sharded data parallelism): the stages and their flags.

`--zero-stage` takes DeepSpeed's `zero_optimization.stage`; Megatron's `--use-distributed-optimizer` is stage 1.

    stage 0   everything replicated over data parallelism (DDP; experts reduced over edp)
    stage 1   + Adam state sharded           (parallel/dp/sharded_optimizer.py: DDP's gradients, sharded optimizer)
    stage 2   + gradients reduce-scattered   (parallel/dp/fsdp.py: FSDP2, weights gathered once per step)
    stage 3   + weights sharded              (parallel/dp/fsdp.py: FSDP2, weights gathered per layer, freed after)

Dense tensors are sharded over the data-parallel group (`dp_cp`: dp × cp under context parallelism), routed
experts over their expert-data-parallel group (the ranks holding the same experts), so at EP = ep each expert's
state is split edp ways. The optimizer always keeps fp32 weights (the master copy); bf16/fp16 compute dtype is
what stages 2–3 gather in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moetron.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from moetron.config import RunConfig

STAGES = (0, 1, 2, 3)


def effective_stage(zero_stage: int, use_distributed_optimizer: bool) -> int:
    """The stage a run uses: `--zero-stage`, or 1 for Megatron's `--use-distributed-optimizer` alone."""
    return max(zero_stage, 1) if use_distributed_optimizer else zero_stage


@dataclass(frozen=True)
class ZeroSpec:
    stage: int = 0
    compute_dtype: torch.dtype = torch.float32  # the autocast dtype (bf16/fp16), or fp32
    pipelined: bool = False  # pp > 1: FSDP2 on the pipeline's stage modules (see `reshard_after_forward`)

    @classmethod
    def from_config(cls, cfg: RunConfig) -> ZeroSpec:
        p, t = cfg.parallel, cfg.train
        dtype = torch.float16 if t.fp16 else torch.bfloat16 if t.bf16 else torch.float32
        stage = effective_stage(p.zero_stage, p.use_distributed_optimizer)
        return cls(stage, dtype, pipelined=p.pipeline_model_parallel_size > 1)

    @property
    def shards_optimizer(self) -> bool:
        return self.stage >= 1

    @property
    def uses_fsdp(self) -> bool:
        return self.stage >= 2

    @property
    def reshard_after_forward(self) -> bool:
        """Whether a block's gathered weights are freed after its forward: at stage 3, but not under pipelining
        (torchtitan's rule: a stage runs many micro-batches' forwards before their backwards, and torch's stage
        keeps the weights gathered until the step's last backward anyway, so freeing them would only gather them
        again per micro-batch). Stage 3 with pp > 1 shards the weights between steps."""
        return self.stage == 3 and not self.pipelined


REPLICATED = ZeroSpec()  # stage 0


def zero_problems(zero_stage: int, use_distributed_optimizer: bool, dims: ParallelDims) -> list[str]:
    """What is wrong with `--zero-stage` / `--use-distributed-optimizer`, each with its fix. Every layout `dims`
    describes composes with every stage (tensor, sequence, pipeline — any schedule —, expert and expert-tensor
    parallelism: `parallel/dp/`), so only the flags themselves are checked."""
    if zero_stage not in STAGES:
        return [
            f"--zero-stage {zero_stage} is not one of 0, 1, 2, 3 (DeepSpeed's zero_optimization.stage); "
            f"use 1 to shard the optimizer state, 2 to shard gradients too, 3 to shard the weights too"
        ]
    if use_distributed_optimizer and zero_stage >= 2:
        return [
            f"--use-distributed-optimizer is Megatron's sharded optimizer state (ZeRO stage 1) and --zero-stage "
            f"{zero_stage} asks for stage {zero_stage}; give one: --zero-stage {zero_stage} alone (it shards the "
            f"optimizer state too), or --use-distributed-optimizer alone for stage 1"
        ]
    return []
