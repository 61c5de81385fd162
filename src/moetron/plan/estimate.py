"""One plan: parameters, FLOPs, per-rank memory, the verdict and a step-time estimate for a config on N devices.

`make_plan`'s own step time is compute only: FLOPs per step per device (6·N_active + attention per token, ×4/3 when
activations are recomputed; tensor parallelism splits each token's FLOPs over its ranks) divided by `peak × mfu`.
`moetron plan` prices the plan as `plan --search` prices every layout (`cost_model.priced`: compute at
`--efficiency` plus each dimension's communication, the pipeline bubble and kernel launches), so both commands give
one step time for one layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moetron.config import RunConfig
from moetron.errors import ConfigError
from moetron.model.flops import ParamCounts, count_parameters, flops_per_token
from moetron.parallel.dims import ParallelDims, runnable_expert_parallel
from moetron.parallel.pp.cost import pipeline_bubble
from moetron.parallel.terms.model_cache import cached
from moetron.parallel.tp.cost import comm_bytes_per_step
from moetron.plan.hardware import Accelerator
from moetron.plan.memory import LocalParams, MemoryEstimate, compute_bytes, estimate_memory, local_parameters
from moetron.plan.stages import StagePlan, pipeline_step_time, plan_stages
from moetron.validate import output_problems, validate

DEFAULT_MFU = 0.30


@dataclass
class Plan:
    cfg: RunConfig
    gpus: int
    device: Accelerator
    mfu: float
    dims: ParallelDims
    params: ParamCounts
    local: LocalParams
    flops_per_token: float
    memory: MemoryEstimate
    step_time_s: float
    stages: list[StagePlan] = field(default_factory=list)  # per pipeline rank (pp > 1)
    bubble: float = 0.0  # idle share of a step (pipeline bubble)
    tp_comm_bytes: float = 0.0  # bytes one GPU sends over its tensor-parallel group per step
    # `plan --search`'s pricing of this layout (`cost_model.priced`): compute at --efficiency plus each dimension's
    # communication, the bubble and launches; then `step_time_s` is its total. None: compute at `mfu` only.
    cost: object | None = None
    efficiency: float | None = None

    @property
    def needed_bytes(self) -> int:
        """The peak plus the device's context (CUDA context, library workspaces)."""
        return self.memory.peak + self.device.context_bytes

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.device.memory_bytes

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.global_batch(self.dims.dp) * self.cfg.model.seq_length

    @property
    def accumulation_steps(self) -> int:
        return self.cfg.num_micro_batches(self.dims.dp)


# How `DataConfig.problems()` words the absence of data on this machine (tests/unit/test_plan_matches_train.py
# checks the plan's verdict on these next to train's, so a change of wording shows there)
NO_DATA_GIVEN = "no data given"
NO_DATASET_AT = ": no dataset at prefix "


def on_disk_problems(cfg: RunConfig) -> set[str]:
    """`validate()`'s problems about this machine's files rather than about the config: datasets and tokenizer
    files that are not here, output directories that cannot be written or hold an earlier run.

    A plan reads no data and writes nothing, and is often made away from the training machine (a recipe's example
    paths, a cluster's mounts), so it leaves these to `moetron train`. Every other problem — the layout, the
    model, the schedule, and how the data flags are written (a blend, --split) — is refused as train refuses it.
    """
    d = cfg.data
    missing_data = {p for p in d.problems() if p.startswith(NO_DATA_GIVEN) or NO_DATASET_AT in p}
    return missing_data | set(d.tokenizer_file_problems()) | set(output_problems(cfg))


def layout_problems(cfg: RunConfig, gpus: int) -> list[str]:
    """What `moetron train` would refuse in `cfg` on `gpus` processes (`validate`, the same rules and messages),
    apart from the files on this machine (`on_disk_problems`)."""
    ignored = on_disk_problems(cfg)
    return [p for p in validate(cfg, gpus) if p not in ignored]


def adapted_expert_parallel(cfg: RunConfig, gpus: int) -> int | None:
    """The expert-parallel size to plan with when the config's cannot run on `gpus`, else None: the largest size that
    divides the data-parallel size and every MoE layer's expert count and is at most the config's (a recipe's EP 64
    on 2 GPUs plans with EP 2), what a user of these GPUs would set."""
    ep, dims = cfg.parallel.moe_expert_parallel_size, cfg.dims(gpus)
    counts = [e for e in cfg.model.experts_per_layer() if e > 1]
    runnable = runnable_expert_parallel(ep, dims.dense_replicas, counts)  # experts fold over every dense replica
    return None if runnable == ep else runnable


def step_time(cfg: RunConfig, dims: ParallelDims, device: Accelerator, mfu: float) -> tuple[float, float]:
    """(seconds per optimizer step, training FLOPs per token) at `mfu` of the device's peak."""
    per_token = cached(flops_per_token, cfg.model, cfg.model.seq_length)  # one model, thousands of layouts
    recompute = 4 / 3 if cfg.model.checkpoint_activations else 1.0  # one more forward pass
    # TP ranks share each token's FLOPs (the replicated norms, routers and shared experts are small)
    tokens_per_device = cfg.global_batch(dims.dp) * cfg.model.seq_length / (dims.dp * dims.tp * dims.cp)
    return tokens_per_device * per_token * recompute / (device.peak_tflops * 1e12 * mfu), per_token


def make_plan(cfg: RunConfig, gpus: int, device: Accelerator, mfu: float = DEFAULT_MFU) -> Plan:
    """The plan of `cfg` on `gpus` devices; raises ConfigError (every problem) for a config `moetron train`
    refuses (`layout_problems`)."""
    problems = layout_problems(cfg, gpus)
    if problems:  # all at once, as `moetron train` reports them (also the layouts it cannot run yet)
        raise ConfigError(problems)
    dims = cfg.dims(gpus)
    seconds, per_token = step_time(cfg, dims, device, mfu)
    stages, bubble = [], 0.0
    if dims.pp > 1:
        stages, bubble = plan_stages(cfg, dims, device.kind), pipeline_bubble(cfg, dims)
        seconds = pipeline_step_time(cfg, dims, stages, device.peak_tflops * 1e12 * mfu)
        memory = max((s.memory for s in stages), key=lambda m: m.peak)  # `estimate_memory`, without pricing twice
    else:
        memory = estimate_memory(cfg, dims, device.kind)
    return Plan(
        cfg=cfg,
        gpus=gpus,
        device=device,
        mfu=mfu,
        dims=dims,
        params=cached(count_parameters, cfg.model),
        local=local_parameters(cfg.model, dims),
        flops_per_token=per_token,
        memory=memory,
        step_time_s=seconds,
        stages=stages,
        bubble=bubble,
        tp_comm_bytes=comm_bytes_per_step(
            cfg.model, dims, cfg.train.micro_batch_size, cfg.num_micro_batches(dims.dp), compute_bytes(cfg)
        ),
    )
