"""LR schedule values against hand-computed ones, and the fp16 loss scaler's dynamics."""

import math
from types import SimpleNamespace

import pytest
import torch

from moetron.train.precision import DynamicLossScaler
from moetron.train.schedule import LRScheduler, ScheduleSpec, build_schedule_spec


def scheduler(style="cosine", warmup_tokens=100, decay_tokens=1100, max_lr=1.0, min_lr=0.1, **kw):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=123.0)
    spec = ScheduleSpec(max_lr, min_lr, style, kw.get("warmup_steps", 0), kw.get("decay_steps", 0))
    spec.warmup_tokens, spec.decay_tokens = warmup_tokens, decay_tokens
    return LRScheduler(opt, spec), opt


def lr_at_tokens(sched, tokens):
    sched.num_tokens = tokens
    return sched.get_lr()


def test_token_warmup_is_linear_from_zero():
    sched, opt = scheduler()
    assert opt.param_groups[0]["lr"] == 0.0  # Megatron: the first iteration of a warmup runs at lr 0
    assert lr_at_tokens(sched, 25) == pytest.approx(0.25)
    assert lr_at_tokens(sched, 100) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "style, tokens, expected",
    [
        ("cosine", 600, 0.1 + 0.5 * (math.cos(math.pi * 0.5) + 1) * 0.9),  # halfway: 0.55
        ("cosine", 350, 0.1 + 0.5 * (math.cos(math.pi * 0.25) + 1) * 0.9),
        ("linear", 600, 0.1 + 0.5 * 0.9),
        ("linear", 1100, 0.1),
        ("constant", 5000, 1.0),
        ("inverse-square-root", 400, max(0.1, math.sqrt(100 / 400))),
        ("inverse-square-root", 100000, 0.1),  # past the decay horizon: min_lr
    ],
)
def test_decay_styles(style, tokens, expected):
    sched, _ = scheduler(style)
    assert lr_at_tokens(sched, tokens) == pytest.approx(expected)


@pytest.mark.parametrize("style", ["cosine", "linear", "inverse-square-root"])
def test_min_lr_after_decay(style):
    sched, _ = scheduler(style)
    assert lr_at_tokens(sched, 1101) == 0.1
    assert lr_at_tokens(sched, 10**9) == 0.1


def test_step_based_schedule_counts_samples_and_sets_groups():
    train = SimpleNamespace(
        lr=2.0,
        min_lr=0.0,
        lr_decay_style="linear",
        lr_warmup_tokens=None,
        lr_decay_tokens=None,
        lr_warmup_iters=2,
        lr_warmup_samples=0,
        lr_warmup_fraction=None,
        lr_decay_iters=None,
        lr_decay_samples=None,
    )
    spec = build_schedule_spec(train, global_batch_size=8, seq_length=4, total_iters=10)
    assert (spec.warmup_steps, spec.decay_steps) == (16, 80)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    opt.param_groups[0]["lr_mult"] = 0.5
    sched = LRScheduler(opt, spec)
    lrs = [sched.step(8, 32 * (i + 1)) for i in range(10)]
    assert lrs[0] == pytest.approx(1.0)  # 8/16 of warmup
    assert lrs[1] == pytest.approx(2.0)
    assert lrs[5] == pytest.approx(2.0 * (1 - (48 - 16) / 64))
    assert lrs[9] == pytest.approx(0.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * lrs[9])


def test_warmup_fraction_and_state_roundtrip():
    train = SimpleNamespace(
        lr=1.0,
        min_lr=0.0,
        lr_decay_style="cosine",
        lr_warmup_tokens=None,
        lr_decay_tokens=None,
        lr_warmup_iters=0,
        lr_warmup_samples=0,
        lr_warmup_fraction=0.1,
        lr_decay_iters=None,
        lr_decay_samples=1000,
    )
    spec = build_schedule_spec(train, global_batch_size=10, seq_length=4, total_iters=100)
    assert (spec.warmup_steps, spec.decay_steps) == (100, 1000)
    sched, _ = scheduler()
    sched.step(7, 70)
    other, _ = scheduler()
    other.load_state_dict(sched.state_dict())
    assert (other.num_steps, other.num_tokens, other.get_lr()) == (7, 70, sched.get_lr())


def test_loss_scaler_backoff_with_hysteresis_and_growth():
    s = DynamicLossScaler(initial_scale=2.0**11, window=3, hysteresis=2, min_scale=1.0)
    s.update(found_overflow=True)
    assert s.scale == 2.0**11  # first overflow only spends hysteresis
    s.update(found_overflow=True)
    assert s.scale == 2.0**10
    s.update(found_overflow=True)  # hysteresis stays exhausted until a growth refills it
    assert s.scale == 2.0**9
    for _ in range(3):
        s.update(found_overflow=False)
    assert s.scale == 2.0**10 and s.hysteresis_left == 2
    s.update(found_overflow=False)
    s.update(found_overflow=True)  # the overflow resets the clean-step counter
    s.update(found_overflow=False)
    s.update(found_overflow=False)
    assert s.scale == 2.0**10
    state = s.state_dict()
    fresh = DynamicLossScaler()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


def test_loss_scaler_never_below_min():
    s = DynamicLossScaler(initial_scale=4.0, window=500, hysteresis=1, min_scale=1.0)
    for _ in range(5):
        s.update(found_overflow=True)
    assert s.scale == 1.0 and s.at_minimum


def test_a_longer_resume_on_a_finished_schedule_says_what_stretches_it():
    from moetron.train.schedule import ScheduleSpec, finished_schedule_warning

    kept = ScheduleSpec(max_lr=1e-3, min_lr=1e-5, decay_style="cosine", warmup_steps=0, decay_steps=8)
    longer = ScheduleSpec(max_lr=1e-3, min_lr=1e-5, decay_style="cosine", warmup_steps=0, decay_steps=16)
    warning = finished_schedule_warning(kept, longer, num_steps=8, num_tokens=0, iteration=4, total_iters=8)
    assert "iterations 5-8 train at the minimum LR 1e-05" in warning and "add --override-opt-param-scheduler" in warning
    assert "back up to 0.000505" in warning  # the 16-sample cosine halfway through
    fixed = finished_schedule_warning(kept, kept, num_steps=8, num_tokens=0, iteration=4, total_iters=8)
    assert "leave --lr-decay-iters" in fixed  # a fixed horizon the flags repeat: override alone would not help
    assert finished_schedule_warning(longer, kept, num_steps=8, num_tokens=0, iteration=4, total_iters=8) is None
    assert finished_schedule_warning(kept, longer, num_steps=8, num_tokens=0, iteration=8, total_iters=8) is None
