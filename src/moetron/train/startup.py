"""What a run says before its first (slow) step: a banner of what will run, and warnings about settings that
are legal but almost certainly not what the user meant.

    for line in startup_warnings(cfg, env.device.type, explicit):   # rank 0, after the config is checked
        print(line)
    print(startup_banner(cfg, env.world_size, env.device.type, explicit))

Nothing here touches a process group, the data or the model: both functions read only the config, so they
can run (and be tested) anywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from moetron.config import RunConfig
from moetron.model.flops import count_parameters
from moetron.parallel.dp.zero_spec import effective_stage
from moetron.recipes.scale_down import describe
from moetron.train.schedule import LRScheduler, ScheduleSpec, build_schedule_spec

WARMUP_STEP_FLAGS = ("lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction")
DECAY_STEP_FLAGS = ("lr_decay_iters", "lr_decay_samples")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class RunShape:
    """The sizes every message here is written in: iterations, samples and tokens per step and in total."""

    dp: int
    global_batch: int
    seq_length: int
    total_iters: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_length

    @classmethod
    def of(cls, cfg: RunConfig, world_size: int) -> RunShape:
        dp = cfg.dims(world_size).dp
        return cls(dp, cfg.global_batch(dp), cfg.model.seq_length, cfg.total_iters(dp))


def schedule_spec(cfg: RunConfig, shape: RunShape) -> ScheduleSpec:
    return build_schedule_spec(cfg.train, shape.global_batch, shape.seq_length, shape.total_iters)


def warmup_iters(spec: ScheduleSpec, shape: RunShape) -> float:
    """The warmup in iterations, whether it was given in tokens or in samples."""
    if spec.warmup_tokens is not None:
        return spec.warmup_tokens / shape.tokens_per_step
    return spec.warmup_steps / shape.global_batch


def decay_iters(spec: ScheduleSpec, shape: RunShape) -> float:
    if spec.decay_tokens is not None:
        return spec.decay_tokens / shape.tokens_per_step
    return spec.decay_steps / shape.global_batch


def final_lr(spec: ScheduleSpec, shape: RunShape) -> float:
    """The LR of the last iteration of the run, from the schedule itself."""

    class _Optimizer:  # the scheduler only sets `lr` on param groups
        param_groups: list[dict] = [{}]

    scheduler = LRScheduler(_Optimizer(), spec)
    last = max(shape.total_iters - 1, 0)
    return scheduler.step(last * shape.global_batch, last * shape.tokens_per_step)


def _warmup_source(cfg: RunConfig, spec: ScheduleSpec) -> str:
    t = cfg.train
    if spec.warmup_tokens is not None:
        return f"--lr-warmup-tokens {t.lr_warmup_tokens}"
    if t.lr_warmup_fraction is not None:
        return f"--lr-warmup-fraction {t.lr_warmup_fraction}"
    if t.lr_warmup_samples:
        return f"--lr-warmup-samples {t.lr_warmup_samples}"
    return f"--lr-warmup-iters {t.lr_warmup_iters}"


def _decay_source(cfg: RunConfig, spec: ScheduleSpec) -> str:
    t = cfg.train
    if spec.decay_tokens is not None:
        return f"--lr-decay-tokens {t.lr_decay_tokens}"
    if t.lr_decay_iters is not None:
        return f"--lr-decay-iters {t.lr_decay_iters}"
    if t.lr_decay_samples is not None:
        return f"--lr-decay-samples {t.lr_decay_samples}"
    return "the run length"


def schedule_warnings(cfg: RunConfig, shape: RunShape) -> list[str]:
    """Warmup or decay horizons longer than the run, and step-based options the token-based ones override."""
    t, spec, out = cfg.train, schedule_spec(cfg, shape), []
    total = shape.total_iters
    if total <= 0:
        return out
    warm = warmup_iters(spec, shape)
    if warm > total:
        out.append(
            f"warning: the LR warmup ({_warmup_source(cfg, spec)} = {warm:,.0f} iterations) is longer than the whole "
            f"run ({total} iterations), so the LR never reaches --lr {t.lr:g}; shorten it, e.g. "
            f"--lr-warmup-iters {max(1, total // 10)}"
        )
    decay = decay_iters(spec, shape)
    if t.lr_decay_style not in ("constant", "inverse-square-root") and decay > total:  # with the warmup's: all at once
        out.append(
            f"warning: the LR decay horizon ({_decay_source(cfg, spec)} = {decay:,.0f} iterations) is longer than "
            f"the run ({total} iterations), so the LR ends at {final_lr(spec, shape):.3g}, not --min-lr {t.min_lr:g}; "
            f"give --lr-decay-iters {total} to decay over this run"
        )
    if spec.warmup_tokens is not None:
        shadowed = [n for n in WARMUP_STEP_FLAGS if getattr(t, n) not in (None, 0)]
        out += [_shadowed(n, getattr(t, n), "lr_warmup_tokens", t.lr_warmup_tokens) for n in shadowed]
    if spec.decay_tokens is not None:
        shadowed = [n for n in DECAY_STEP_FLAGS if getattr(t, n) is not None]
        out += [_shadowed(n, getattr(t, n), "lr_decay_tokens", t.lr_decay_tokens) for n in shadowed]
    return out


def _shadowed(name: str, value, winner: str, winner_value) -> str:
    return (
        f"warning: {_flag(name)} {value} is ignored: {_flag(winner)} {winner_value} takes precedence (token-based "
        f"options win, as in Megatron); drop one of the two"
    )


def precision_warnings(cfg: RunConfig, device_type: str) -> list[str]:
    t = cfg.train
    if device_type != "cpu" or not (t.fp16 or t.bf16):
        return []
    flag = "--fp16" if t.fp16 else "--bf16"
    return [
        f"warning: {flag} on a CPU: autocast to {flag[2:]} is several times slower than fp32 here (6-20x measured "
        f"for fp16) and saves no memory that matters; pass --no-{flag[2:]} (it overrides a recipe's {flag[2:]}: true)"
    ]


def moe_warnings(cfg: RunConfig) -> list[str]:
    m = cfg.model
    if m.expert_interval >= 1 and any(e > 1 for e in m.num_experts) and not m.moe_layer_indices():
        return [
            f"warning: --num-experts {' '.join(map(str, m.num_experts))} has no effect: with --num-layers "
            f"{m.num_layers} and --expert-interval {m.expert_interval} no layer is MoE, so this trains a dense "
            f"model; lower --expert-interval (1: every layer) or add layers"
        ]
    return []


def startup_warnings(cfg: RunConfig, device_type: str, world_size: int = 1) -> list[str]:
    """One-line warnings (each starting `warning: `) about a validated config on `device_type` ("cpu", "cuda")."""
    shape = RunShape.of(cfg, world_size)
    return schedule_warnings(cfg, shape) + precision_warnings(cfg, device_type) + moe_warnings(cfg)


# ---------------------------------------------------------------------------- the banner
def human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:g}"


def plural(count: float, word: str) -> str:
    """'1 iteration', '2 iterations', '1,024 iterations' (counts rounded to whole numbers)."""
    return f"{count:,.0f} {word}{'' if round(count) == 1 else 's'}"


def _model_line(cfg: RunConfig) -> str:
    m, counts = cfg.model, count_parameters(cfg.model)
    moe = [e for e in m.experts_per_layer() if e > 1]
    kind = "dense" if not moe else f"{plural(len(moe), 'MoE layer')} of {'/'.join(map(str, sorted(set(moe))))} experts"
    top = f", top-{m.topk}" if moe else ""
    return (
        f"model      {human(counts.total)} parameters, {human(counts.active)} active per token ({m.num_layers} "
        f"layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, seq {m.seq_length}, {kind}{top})"
    )


def _layout_line(cfg: RunConfig, world_size: int) -> str:
    d = cfg.dims(world_size)
    local = sorted({e // max(d.ep, 1) for e in cfg.model.experts_per_layer() if e > 1})
    experts = f" ({'/'.join(map(str, local))} experts per process)" if local else ""
    sp = " + sequence parallel" if d.sequence_parallel and d.tp > 1 else ""  # ignored at TP 1, as in Megatron
    context = f", context parallel {d.cp} (seq {cfg.model.seq_length // d.cp} per process)" if d.cp > 1 else ""
    p = cfg.parallel
    zero = effective_stage(p.zero_stage, p.use_distributed_optimizer)
    return (
        f"layout     {world_size} process(es): data parallel {d.dp}, tensor parallel {d.tp}{sp}, pipeline parallel "
        f"{d.pp}{context}, expert parallel {d.ep}{experts}, ZeRO stage {zero}"
    )


def _stop_reason(cfg: RunConfig, shape: RunShape) -> str:
    t = cfg.train
    limits = {
        "--train-iters": t.train_iters,
        "--train-samples": None if t.train_samples is None else -(-t.train_samples // shape.global_batch),
        "--train-tokens": None if t.train_tokens is None else -(-t.train_tokens // shape.tokens_per_step),
    }
    binding = [flag for flag, iters in limits.items() if iters == shape.total_iters]
    return binding[0] if binding else "the stopping criterion"


def _lr_line(cfg: RunConfig, shape: RunShape) -> str:
    t, spec = cfg.train, schedule_spec(cfg, shape)
    warm = warmup_iters(spec, shape)
    decay = "" if t.lr_decay_style == "constant" else f", decay over {plural(decay_iters(spec, shape), 'iteration')}"
    return (
        f"lr         {t.lr_decay_style} {t.lr:g} → {t.min_lr:g}; warmup {plural(warm, 'iteration')} "
        f"({_warmup_source(cfg, spec)}){decay}"
    )


def _mfu_line(override: float | None, device_type: str) -> str:
    """The peak the logged MFU is measured against, and where it comes from: on a CPU a nominal one."""
    from moetron.model.flops import CPU_PEAK_TFLOPS, peak_tflops

    if override is not None:
        return f"MFU        against {override:g} TFLOP/s per device (--peak-tflops)"
    if device_type == "cpu":
        return (f"MFU        against {CPU_PEAK_TFLOPS:g} TFLOP/s, a nominal fp32 peak of a 2-core CPU (not this "
                f"machine's: --peak-tflops sets it)")  # fmt: skip
    peak = peak_tflops()
    if peak is None:
        return "MFU        n/a: this GPU is not in moetron's table; --peak-tflops sets its dense bf16 peak"
    return f"MFU        against {peak:g} TFLOP/s per device (this GPU's dense bf16 peak; --peak-tflops overrides)"


def _threads_line() -> str:
    """The CPU's thread settings (cli.cpu_thread_defaults sets a passive OpenMP wait when the user set none)."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    wait = f"OMP_WAIT_POLICY={policy}" if policy else "OpenMP's default wait policy (threads spin between ops)"
    count = "OMP_NUM_THREADS" if "OMP_NUM_THREADS" in os.environ else "torch's default"
    return (
        f"threads    {torch.get_num_threads()} intra-op thread(s) ({count}), {wait}; set OMP_NUM_THREADS / "
        f"OMP_WAIT_POLICY to choose"
    )


def _output_line(cfg: RunConfig) -> str:
    """Where the run writes, absolute: a recipe's relative `save` / `tensorboard_dir` are from the current directory."""
    run, board = cfg.run_dir(), cfg.train.tensorboard_dir
    where = [f"run directory {os.path.abspath(run)}" if run else "no run directory"]
    if board:
        where.append(f"TensorBoard {os.path.abspath(board)}")
    return f"output     {', '.join(where)} (relative paths are from {os.getcwd()})"


def startup_banner(cfg: RunConfig, world_size: int, device_type: str = "cpu", explicit: set[str] | None = None) -> str:
    """Lines that say what is about to run: model size, layout, batch and run length, LR schedule, precision.

    `explicit` (from `config_cli.load_config`) adds a line naming YAML values that flags replaced.
    """
    shape = RunShape.of(cfg, world_size)
    t = cfg.train
    micro = cfg.num_micro_batches(shape.dp)
    precision = "fp16 autocast (dynamic loss scaling)" if t.fp16 else "bf16 autocast" if t.bf16 else "fp32"
    lines = [
        _model_line(cfg),
        _layout_line(cfg, world_size),
        f"batch      micro batch {t.micro_batch_size} × {micro} accumulation step(s) × data parallel {shape.dp} = "
        f"{shape.global_batch} samples = {shape.tokens_per_step:,} tokens per step",
        f"run        {plural(shape.total_iters, 'iteration')} = {human(shape.total_iters * shape.tokens_per_step)} "
        f"tokens (stops at {_stop_reason(cfg, shape)})",
        _lr_line(cfg, shape),
        f"precision  {precision} on {device_type}",
    ]
    lines.append(_mfu_line(t.peak_tflops, device_type))
    if device_type == "cpu":
        lines.append(_threads_line())
    if cfg.run_dir() or t.tensorboard_dir:
        lines.append(_output_line(cfg))
    replaced = getattr(explicit, "replaced", {}) if explicit is not None else {}
    if replaced:
        dropped = ", ".join(f"{name}: {value}" for name, value in replaced.items())
        lines.append(f"flags      replaced the config file's {dropped} (a flag of the same kind was given)")
    scaled = getattr(explicit, "scaled", {}) if explicit is not None else {}
    if scaled:
        lines.append(f"scaled     {describe(scaled)}")
    return "\n".join(lines)
