"""Learning-rate schedule: Megatron's `OptimizerParamScheduler`, token-based or step-based.

Megatron counts "steps" in samples: every successful optimizer step adds `global_batch_size` samples, so
`--lr-warmup-iters 10` means 10·GBS samples. Token-based warmup/decay (`--lr-warmup-tokens`,
`--lr-decay-tokens`, the MoE scripts' choice) override the step-based ones. The rules, in order:

1. warmup: `lr = max_lr · progress / warmup` while `progress <= warmup` (progress in tokens or samples);
2. `constant` style: `max_lr`;
3. after the decay horizon: `min_lr`;
4. `inverse-square-root`: `max(min_lr, max_lr · sqrt(warmup / progress))`;
5. otherwise `ratio = (progress − warmup) / (decay − warmup)`, `coeff = 1 − ratio` (linear) or
   `0.5·(cos(π·ratio) + 1)` (cosine), `lr = min_lr + coeff·(max_lr − min_lr)`.

One difference from Megatron-DeepSpeed, on purpose: `step()` receives the tokens consumed *including* the
iteration just finished (Megatron reads a counter that lags one iteration behind), so the LR of an iteration is
a function of everything the model has seen before it, for tokens exactly as for samples.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


@dataclass
class ScheduleSpec:
    """The resolved schedule: horizons in samples (`*_steps`) and/or tokens (`*_tokens`, None = step-based)."""

    max_lr: float
    min_lr: float
    decay_style: str
    warmup_steps: int
    decay_steps: int
    warmup_tokens: int | None = None
    decay_tokens: int | None = None


class LRScheduler:
    """Sets `lr` on every param group of an optimizer from consumed samples and tokens."""

    def __init__(self, optimizer, spec: ScheduleSpec):
        if spec.decay_style not in DECAY_STYLES:
            raise ValueError(f"unknown lr decay style {spec.decay_style!r}")
        self.optimizer = optimizer
        self.spec = spec
        self.num_steps = 0  # samples consumed by successful optimizer steps
        self.num_tokens = 0
        self.step(0, 0)

    def get_lr(self) -> float:
        return lr_at(self.spec, self.num_steps, self.num_tokens)

    def step(self, increment_samples: int, consumed_tokens: int) -> float:
        """Advance by one optimizer step of `increment_samples` samples; `consumed_tokens` is the running total."""
        self.num_steps += increment_samples
        self.num_tokens = consumed_tokens
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        return lr

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "num_tokens": self.num_tokens, "spec": asdict(self.spec)}

    def load_state_dict(self, state: dict, override: bool = False) -> str | None:
        """Restore progress, and the checkpoint's schedule unless `override` (Megatron's
        `--override-opt_param-scheduler`: this run's LR flags). Returns a note when the two schedules differ
        (saying which one is used), None when they agree."""
        self.num_steps = int(state["num_steps"])
        self.num_tokens = int(state["num_tokens"])
        saved = ScheduleSpec(**state["spec"]) if "spec" in state else self.spec
        note = None
        if saved != self.spec:
            if override:
                note = f"LR schedule: this run's flags ({describe(self.spec)}; the checkpoint had {describe(saved)})"
            else:
                note = (
                    f"LR schedule: the checkpoint's ({describe(saved)}), not this run's flags ({describe(self.spec)}); "
                    f"pass --override-opt-param-scheduler to use the flags"
                )
                self.spec = saved
        self.step(0, self.num_tokens)
        return note


def lr_at(s: ScheduleSpec, num_steps: int, num_tokens: int) -> float:
    """The LR of schedule `s` after `num_steps` samples and `num_tokens` tokens (the rules of the module docstring)."""
    if s.warmup_tokens is None:
        if s.warmup_steps > 0 and num_steps <= s.warmup_steps:
            return s.max_lr * num_steps / s.warmup_steps
    elif s.warmup_tokens > 0 and num_tokens <= s.warmup_tokens:
        return s.max_lr * num_tokens / s.warmup_tokens
    if s.decay_style == "constant":
        return s.max_lr
    progress, warmup, decay = _decay_progress(s, num_steps, num_tokens)
    if progress > decay:
        return s.min_lr
    if s.decay_style == "inverse-square-root":
        lr = s.max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(progress, 1))
        return max(s.min_lr, lr)
    ratio = (progress - warmup) / max(decay - warmup, 1)
    ratio = min(max(ratio, 0.0), 1.0)
    if s.decay_style == "linear":
        coeff = 1.0 - ratio
    else:
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return s.min_lr + coeff * (s.max_lr - s.min_lr)


def _decay_progress(s: ScheduleSpec, num_steps: int, num_tokens: int) -> tuple[int, int, int]:
    """(progress, warmup, decay horizon) in the decay's unit: tokens when token-based, else samples."""
    if s.decay_tokens is None:
        return num_steps, s.warmup_steps, s.decay_steps
    return num_tokens, s.warmup_tokens or 0, s.decay_tokens


def finished(s: ScheduleSpec, num_steps: int, num_tokens: int) -> bool:
    """Whether a decaying schedule has reached its horizon: every later step runs at `min_lr`."""
    progress, _, decay = _decay_progress(s, num_steps, num_tokens)
    return s.decay_style in ("linear", "cosine") and progress >= decay


def finished_schedule_warning(
    used: ScheduleSpec, flags: ScheduleSpec, num_steps: int, num_tokens: int, iteration: int, total_iters: int
) -> str | None:
    """A resume that trains on (`iteration` < `total_iters`) with a schedule already at its horizon would spend
    every remaining iteration at the minimum LR (the quickstart's `--train-iters 1200` on a 600-iteration run):
    what to pass instead, or None when the schedule in use still decays."""
    if iteration >= total_iters or not finished(used, num_steps, num_tokens):
        return None
    head = (
        f"warning: the LR schedule in use ({describe(used)}) is finished at iteration {iteration}: iterations "
        f"{iteration + 1}-{total_iters} train at the minimum LR {used.min_lr:g}; "
    )
    if used != flags and not finished(flags, num_steps, num_tokens):
        restart = lr_at(flags, num_steps, num_tokens)
        return head + (
            f"add --override-opt-param-scheduler to stretch it to this run's flags ({describe(flags)}; Megatron's "
            f"--override-opt_param-scheduler: the LR goes back up to {restart:.3g} and decays to {flags.min_lr:g} by "
            f"iteration {total_iters})"
        )
    return head + (
        "leave --lr-decay-iters / --lr-decay-samples / --lr-decay-tokens unset (the decay then spans --train-iters) "
        "or give a longer one, with --override-opt-param-scheduler"
    )


def describe(spec: ScheduleSpec) -> str:
    """One line: peak → min LR, style, warmup and decay horizons in their units."""
    unit = "tokens" if spec.decay_tokens is not None else "samples"
    warmup = spec.warmup_tokens if spec.warmup_tokens is not None else spec.warmup_steps
    decay = spec.decay_tokens if spec.decay_tokens is not None else spec.decay_steps
    return f"lr {spec.max_lr:g} → {spec.min_lr:g} {spec.decay_style}, warmup {warmup}, decay {decay} {unit}"


def build_schedule_spec(train, global_batch_size: int, seq_length: int, total_iters: int) -> ScheduleSpec:
    """Resolve `TrainConfig` LR flags into horizons, the way Megatron's `get_optimizer_param_scheduler` does."""
    if train.lr_decay_iters is not None:
        decay_steps = train.lr_decay_iters * global_batch_size
    elif train.lr_decay_samples is not None:
        decay_steps = train.lr_decay_samples
    else:
        decay_steps = total_iters * global_batch_size
    if train.lr_warmup_fraction is not None:
        warmup_steps = int(train.lr_warmup_fraction * decay_steps)
    elif train.lr_warmup_samples:
        warmup_steps = train.lr_warmup_samples
    else:
        warmup_steps = train.lr_warmup_iters * global_batch_size
    return ScheduleSpec(
        max_lr=train.lr,
        min_lr=train.min_lr,
        decay_style=train.lr_decay_style,
        warmup_steps=warmup_steps,
        decay_steps=decay_steps,
        warmup_tokens=train.lr_warmup_tokens,
        decay_tokens=train.lr_decay_tokens,
    )
