"""ZeRO composed with tensor and pipeline parallelism (gloo) against one process, and checkpoints across them.

The model of the pipeline tests (4 layers: layer 0 dense, 1–3 MoE with 4 experts top-2, random token selection and
hidden dropout on; attention dropout off: head shards draw their own masks), global batch 8 in micro-batches of 2.
Every layout runs 10 steps of the same global batch and must give the one-process loss and clipped global gradient
norm at every step (1e-4 relative): the norm is summed over every shard of every dimension (dp/edp shards, TP
splits, pipeline stages), so a missed or double-counted shard shows in it.

One spawned 4-process group carries every layout:
  ZeRO-1 × TP 2 (dp 2)                         the optimizer's dp shards of TP-local tensors
  ZeRO-2 × TP 2 + SP × EP 2 (folded, dp 2)     FSDP2 over dp on TP-local shards, experts over edp = 2; saves at step 5
  ZeRO-3 × PP 2 (dp 2), 1F1B                   FSDP2 per stage module, gradients synced after the last micro-batch;
                                               saves at step 5 (tied embeddings: both copies' shards)
  ZeRO-3 × PP 2 (dp 2), zero bubble            the split backward under FSDP2
  ZeRO-1 × PP 2 (dp 2), zero bubble, --compile  the dense gradients averaged after the schedule, then sharded;
                                               compiled blocks run their backward in the schedule's two halves
  the ZeRO-3 × PP 2 checkpoint at ZeRO-1 × TP 2: the same validation loss, then steps 6–10 of the one-process curve.
Each rank's Adam state is held as ZeRO shards and weighs what `moetron plan` says (within 25%).
This process loads both checkpoints (ZeRO-3 × PP 2 and ZeRO-2 × TP 2 × EP 2) and continues the one-process curve.
"""

from __future__ import annotations

import pytest
import torch
from launch import run_distributed
from test_expert_parallel_train import global_losses
from test_pipeline_parallel_train import curve, pp_config, pp_trainer, valid_loss

from moetron.checkpoint import resolve_checkpoint
from moetron.parallel.env import init_distributed
from moetron.plan.memory import estimate_memory

STEPS, HALF = 10, 5
RTOL = 1e-4
LAYOUTS = {  # the compiled run first: its process has compiled nothing else yet (see test_tensor_parallel_train.py)
    "zero1-pp2-zb-compile": {
        "zero_stage": 1,
        "pipeline_model_parallel_size": 2,
        "pipeline_schedule": "zero-bubble",
        "compile": True,
    },
    "zero1-tp2": {"zero_stage": 1, "tensor_model_parallel_size": 2},
    "zero2-tp2-sp-ep2": {
        "zero_stage": 2,
        "tensor_model_parallel_size": 2,
        "sequence_parallel": True,
        "moe_expert_parallel_size": 2,
    },
    "zero3-pp2": {"zero_stage": 3, "pipeline_model_parallel_size": 2},
    "zero3-pp2-zb": {"zero_stage": 3, "pipeline_model_parallel_size": 2, "pipeline_schedule": "zero-bubble"},
}
SAVED = ("zero2-tp2-sp-ep2", "zero3-pp2")


def config(layout: str | None = None, save: str | None = None):
    dims = dict(LAYOUTS[layout]) if layout else {}
    pp = dims.pop("pipeline_model_parallel_size", 1)
    schedule = dims.pop("pipeline_schedule", None)
    virtual = 1 if schedule == "zero-bubble" else None
    return pp_config(pp, schedule, virtual, train_iters=STEPS, attention_dropout=0.0, save=save, **dims)


def run_layout(env, layout: str, tmp: str) -> dict:
    save = f"{tmp}/{layout}" if layout in SAVED else None
    trainer = pp_trainer(config(layout, save), env)
    first = curve(trainer, HALF)
    out = {}
    if save:
        trainer.save()
        out["valid"] = valid_loss(trainer)
    second = curve(trainer, STEPS - HALF)
    return out | {key: first[key] + second[key] for key in first} | {"optimizer": optimizer_state_bytes(trainer)}


def optimizer_state_bytes(trainer) -> int | None:
    """Bytes of Adam's moments this rank holds (a DTensor's local shard); None unless every tensor the optimizer
    steps is a ZeRO shard (DTensor)."""
    from torch.distributed.tensor import DTensor

    if not all(isinstance(p, DTensor) for _, p in trainer.parallel.optimizer_parameters()):
        return None
    moments = [s[k] for s in trainer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return sum(4 * m.to_local().numel() for m in moments)


def continued(layout: str | None, checkpoint: str, env=None) -> dict:
    """Load `checkpoint` into a fresh trainer at `layout`: its validation loss, then steps HALF+1…STEPS."""
    trainer = pp_trainer(config(layout), env)
    trainer.load(resolve_checkpoint(checkpoint))
    assert trainer.progress.iteration == HALF
    return {"valid": valid_loss(trainer)} | curve(trainer, STEPS - HALF)


def four_process_checks(rank: int, world_size: int, tmp: str) -> dict:
    env = init_distributed()
    out = {layout: run_layout(env, layout, tmp) for layout in LAYOUTS}
    out["pp-to-tp"] = continued("zero1-tp2", f"{tmp}/zero3-pp2", env)
    return out


def assert_curve(per_rank: list[dict], want: dict, what: str, rtol: float = RTOL) -> None:
    """The global loss (the mean of the ranks' data-parallel means) and every rank's norm follow `want`."""
    got = global_losses([r["lm"] for r in per_rank])
    torch.testing.assert_close(got, torch.tensor(want["lm"], dtype=torch.float64), rtol=rtol, atol=0, msg=what)
    for r in per_rank:
        torch.testing.assert_close(torch.tensor(r["norm"]), torch.tensor(want["norm"]), rtol=rtol, atol=0, msg=what)
        assert r["ok"] == want["ok"]


@pytest.mark.distributed
@pytest.mark.slow
def test_zero_composes_with_tensor_and_pipeline_parallelism(tmp_path):
    tmp = str(tmp_path)
    four = run_distributed(four_process_checks, world_size=4, args=(tmp,), timeout=900)
    torch.set_num_threads(1)
    reference = pp_trainer(config())
    head = curve(reference, HALF)
    ref_valid = valid_loss(reference)
    ref = {key: head[key] + value for key, value in curve(reference, STEPS - HALF).items()}
    tail = {key: value[HALF:] for key, value in ref.items()}

    for layout in LAYOUTS:
        assert_curve([r[layout] for r in four], ref, layout)
        # sharded state: held as ZeRO shards, and its size on the heaviest rank is what `moetron plan` prices
        held = [r[layout]["optimizer"] for r in four]
        assert None not in held, layout
        planned = estimate_memory(config(layout), config(layout).dims(4), "cpu").optimizer
        assert 0.8 <= planned / max(held) <= 1.25, (layout, planned, held)
    for layout in SAVED:  # the saving runs' validation loss at step HALF is the one-process run's
        assert all(r[layout]["valid"] == pytest.approx(ref_valid, rel=1e-5) for r in four), layout

    # ZeRO-3 × PP 2 → ZeRO-1 × TP 2 (4 processes), and both checkpoints → 1 process
    assert all(r["pp-to-tp"]["valid"] == pytest.approx(ref_valid, rel=1e-5) for r in four)
    assert_curve([r["pp-to-tp"] for r in four], tail, "zero3-pp2 → zero1-tp2")
    for layout in SAVED:
        single = continued(None, f"{tmp}/{layout}")
        assert single["valid"] == pytest.approx(ref_valid, rel=1e-5), layout
        assert_curve([single], tail, f"{layout} → 1 process")
