"""Every problem of a run configuration at once, before any process group, data load or allocation.

`validate(cfg, world_size)` collects the problems of every section, each naming the flag, the value(s) and the
fix, drawing on the packages' own `*_problems` (the degrees in `parallel/dims.py`, every parallel dimension's
split and flags through `parallel/dimensions.py`, the run directory in `checkpoint/`, the LR schedule in `train/`);
`check()` raises them together as one `ConfigError`. It sits on top of those packages so that `config.py` stays a
leaf (docs/architecture.md, "Imports").
"""

from __future__ import annotations

import math

from moetron.checkpoint.run_directory import run_directory_problems
from moetron.config import ParallelConfig, RunConfig, TrainConfig
from moetron.errors import ConfigError
from moetron.fileio import output_dir_problem
from moetron.parallel.dimensions import DIMENSIONS
from moetron.train.muon import muon_problems
from moetron.train.peak_memory import memory_snapshot_problems
from moetron.train.routing_health import routing_health_problems
from moetron.train.schedule import DECAY_STYLES

__all__ = [
    "check",
    "moe_problems",
    "output_problems",
    "run_directory_problems",
    "timeout_problems",
    "train_problems",
    "validate",
]


def _positive(p: list[str], t: TrainConfig, names: tuple[str, ...], allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(t, name)
        if value is not None and (value < 0 if allow_zero else value <= 0):
            bound = ">= 0" if allow_zero else "> 0"
            p.append(f"--{name.replace('_', '-')} must be {bound}, got {value}")


def train_problems(cfg: RunConfig, dp: int) -> list[str]:
    """Problems of the training section, in the light of the model and the data-parallel size."""
    t, p = cfg.train, []
    _positive(p, t, ("micro_batch_size", "global_batch_size", "train_iters", "train_samples", "train_tokens"))
    _positive(p, t, ("log_interval", "loss_scale_window", "hysteresis", "keep_last_n", "save_interval"))
    _positive(p, t, ("lr", "min_lr", "weight_decay", "clip_grad", "eval_interval", "eval_iters"), allow_zero=True)
    _positive(p, t, ("lr_warmup_iters", "lr_warmup_samples", "lr_warmup_tokens", "max_skipped_steps"), True)
    if t.micro_batch_size > 0 and dp > 0 and t.global_batch_size and t.global_batch_size % (t.micro_batch_size * dp):
        p.append(
            f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size {t.micro_batch_size} "
            f"× data-parallel size {dp} = {t.micro_batch_size * dp}; use a multiple of {t.micro_batch_size * dp}"
        )
    if t.train_iters is None and t.train_samples is None and t.train_tokens is None:
        p.append("no stopping criterion: give --train-iters, --train-samples or --train-tokens")
    if t.lr_decay_style not in DECAY_STYLES:
        p.append(f"--lr-decay-style {t.lr_decay_style!r} is not one of {', '.join(DECAY_STYLES)}")
    if t.min_lr > t.lr:
        p.append(f"--min-lr {t.min_lr} is above --lr {t.lr}; lower --min-lr")
    if t.lr_warmup_fraction is not None and not 0.0 <= t.lr_warmup_fraction <= 1.0:
        p.append(f"--lr-warmup-fraction must be in [0, 1], got {t.lr_warmup_fraction}")
    if t.lr_warmup_fraction is not None and (t.lr_warmup_iters or t.lr_warmup_samples):
        p.append("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are exclusive; keep one")
    if t.train_iters is not None and (t.lr_decay_samples is not None or t.lr_warmup_samples):
        p.append("--train-iters is iteration-based; use --lr-decay-iters/--lr-warmup-iters, not the -samples forms")
    if t.lr_warmup_tokens and t.lr_decay_tokens is not None and t.lr_decay_tokens < t.lr_warmup_tokens:
        p.append(f"--lr-decay-tokens {t.lr_decay_tokens} is below --lr-warmup-tokens {t.lr_warmup_tokens}")
    if t.fp16 and t.bf16:
        p.append("--fp16 and --bf16 are both set; choose one")
    if t.save_interval is not None and not t.save:
        p.append(f"--save-interval {t.save_interval} is set without --save; add --save DIR or drop the interval")
    if t.async_save and not t.save:
        p.append("--async-save is set without --save; add --save DIR or drop --async-save")
    if t.finetune and not t.load:
        p.append("--finetune needs --load CHECKPOINT_DIR (the weights to start from)")
    if t.exit_on_missing_checkpoint and not t.load:
        p.append("--exit-on-missing-checkpoint needs --load")
    _positive(p, t, ("exit_interval", "exit_duration_in_mins"))
    p += routing_health_problems(t.moe_dead_expert_steps, t.moe_collapse_entropy, t.moe_aux_hacking_window)
    if t.peak_tflops is not None and not (t.peak_tflops > 0 and math.isfinite(t.peak_tflops)):
        p.append(
            f"--peak-tflops {t.peak_tflops:g} must be a positive number of TFLOP/s per device (e.g. 989 for an "
            f"H100's bf16), or leave it unset to look it up from the device name"
        )
    return p


def output_problems(cfg: RunConfig) -> list[str]:
    """Output locations that cannot be written (a file in the way, read-only), checked without writing; and a run
    directory holding another run's output (never destroyed unless --overwrite says so)."""
    t = cfg.train
    flags = [("--save", t.save), ("--output-dir", t.output_dir), ("--tensorboard-dir", t.tensorboard_dir)]
    flags.append(("--data-cache-path", cfg.data.data_cache_path))
    problems = [problem for flag, path in flags if (problem := output_dir_problem(flag, path))]
    run_dir_flag = "--save " if t.save else "--output-dir "
    if any(problem.startswith(run_dir_flag) for problem in problems):
        return problems  # a run directory that cannot be used (or even looked at) holds no previous run to protect
    return problems + run_directory_problems(t)


def moe_problems(cfg: RunConfig) -> list[str]:
    """MoE settings that have no effect on the model as configured."""
    m = cfg.model
    if m.expert_interval < 1 or any(e > 1 for e in m.experts_per_layer()):
        return []
    if m.topk > 1:
        experts = " ".join(map(str, m.num_experts))
        return [
            f"--topk {m.topk} has no effect: no layer is MoE (--num-experts {experts}, --expert-interval "
            f"{m.expert_interval}, --num-layers {m.num_layers}); give --num-experts N (N >= 2) or drop --topk"
        ]
    return []


def validate(cfg: RunConfig, world_size: int) -> list[str]:
    """Every problem of every section, before any process group, data load or allocation."""
    dims = cfg.dims(world_size)
    problems = list(dims.problems(cfg.model.experts_per_layer()))
    problems += cfg.model.problems()
    for dimension in DIMENSIONS:  # what each split needs of the model and the sequence
        problems += dimension.split_problems(cfg, dims)
    problems += cfg.data.problems()
    problems += train_problems(cfg, dims.dp)
    problems += muon_problems(cfg.train)
    problems += memory_snapshot_problems(cfg.train.memory_snapshot_steps, cfg.run_dir())
    problems += moe_problems(cfg)
    problems += output_problems(cfg)
    for dimension in DIMENSIONS:  # each dimension's own flags (ZeRO stage, pipeline schedule, dispatchers)
        problems += dimension.flag_problems(cfg, dims)
    backend = cfg.parallel.distributed_backend
    if backend not in (None, "gloo", "nccl"):
        problems.append(f"--distributed-backend {backend!r} is not one of gloo, nccl (or leave it unset: automatic)")
    problems += timeout_problems(cfg.parallel)
    return problems


def timeout_problems(p: ParallelConfig) -> list[str]:
    minutes = p.distributed_timeout_minutes
    if not (minutes > 0 and math.isfinite(minutes)):
        return [f"--distributed-timeout-minutes {minutes:g} must be a positive number of minutes (e.g. 10, or 0.5)"]
    return []


def check(cfg: RunConfig, world_size: int) -> None:
    problems = validate(cfg, world_size)
    if problems:
        raise ConfigError(problems)
