"""ZeRO stages 1–3 (gloo) against stage 0, exact resume, and checkpoints that reshard across stage, dp and ep.

The model has two MoE layers of 8 and 2 experts (EP = 2: 4 and 1 local experts), so expert shards over edp = 2
are split on the expert dimension in layer 0 and, with one local expert, on the next dimension in layer 1.
Aux-loss-free expert biases move, two micro-batches accumulate per step, and the stage-3 run recomputes its
layers (activation checkpointing).

  4 processes (dp 4, ep 2, edp 2):  12 steps at stages 0, 1, 2, 3 — the loss and the gradient norm at every step
        within 1e-5 relative of stage 0, the same expert biases; what each rank holds (optimizer state, gradients,
        weights: 1/dp of dense and 1/edp of expert tensors where the stage shards them; `moetron plan` agrees
        within 25%); a stage-3 checkpoint at step 6 resumed at stage 3 repeats steps 7–12 exactly; bf16 at stage 2
        and fp16 with overflowing loss scales at stage 3 follow stage 0 (same skipped steps and loss scale).
  this process:  the stage-3 checkpoint continues at stage 3 on 1 process: the same validation loss and optimizer
        state, then the 4-process curve; it is saved again (unsharded).
  2 processes:  at stage 1 dp 2 (ep 2, edp 1) the stage-3 checkpoint gives the same validation loss, optimizer
        state and curve; at stage 3 dp 2, ep 1 the 1-process checkpoint does too.
"""

from __future__ import annotations

import pytest
import torch
from launch import run_distributed
from test_expert_parallel_train import ep_trainer, global_losses, validation_loss
from trainer_support import tiny_config

from moetron.checkpoint import resolve_checkpoint
from moetron.parallel.env import init_distributed
from moetron.train.trainer import Trainer

STEPS, HALF, MBS, GBS = 12, 6, 2, 16
RTOL = 1e-5


def zero_config(stage: int, ep: int = 2, **overrides):
    cfg = tiny_config(micro_batch_size=MBS, global_batch_size=GBS, train_iters=STEPS, hidden_dropout=0.0)
    m = cfg.model
    m.attention_dropout = 0.0
    m.num_experts, m.expert_interval = [8, 2], 1
    m.moe_use_rts = False  # no random draws that differ between layouts
    m.moe_top2_2nd_expert_sampling = False
    m.moe_router_bias_update_rate = 0.01
    cfg.train.lr_warmup_iters = 2
    cfg.parallel.moe_expert_parallel_size = ep
    cfg.parallel.zero_stage = stage
    for key, value in overrides.items():
        setattr(cfg.model if hasattr(cfg.model, key) else cfg.train, key, value)
    return cfg


def run(trainer: Trainer, steps: int) -> dict:
    """Per step: this rank's mean LM loss, the global gradient norm, the loss scale after the step."""
    out = {"losses": [], "norms": [], "scales": []}
    trainer.model.train()
    for _ in range(steps):
        result = trainer.train_step()
        trainer._account(result)
        out["losses"].append(float(result.sums.losses[0]))
        out["norms"].append(result.grad_norm)
        out["scales"].append(trainer.scaler.scale)
    return out


def global_optimizer_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The layout-free optimizer state (what a checkpoint holds), whole, on every rank."""
    from torch.distributed.tensor import DTensor

    state = trainer.checkpoint_view().optimizer_state(trainer.optimizer)
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in state.items()}


def biases(trainer: Trainer) -> list[torch.Tensor]:
    return [moe.router.expert_bias.clone() for moe in trainer.model.moe_layers()]


def held(trainer: Trainer) -> dict[str, dict[str, int]]:
    """Elements this rank holds per kind ("dense", "expert") in one step: weights between steps, weights whole at
    the end of the forward ("gathered": at stage 2 all, at stage 3 only the root's), gradients once reduced (at
    stage 1 the whole gradients, before the optimizer takes its slices of them) and optimizer state — what the
    rank's tensors store (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> int:
        return (t.to_local() if isinstance(t, DTensor) else t).numel()

    kind = trainer.parallel.registry
    counts = {k: {"weights": 0, "gathered": 0, "grads": 0, "optimizer": 0} for k in ("dense", "expert")}
    for name, p in trainer.model.named_parameters():
        counts[kind[name].kind]["weights"] += local(p)
    finish = trainer.parallel.finish_gradients

    def count_then_finish() -> None:
        for name, p in trainer.model.named_parameters():
            counts[kind[name].kind]["grads"] += local(p.grad)
        finish()

    def count_gathered(*_) -> None:
        for name, p in trainer.model.named_parameters():
            if not isinstance(p, DTensor):
                counts[kind[name].kind]["gathered"] += p.numel()

    trainer.parallel.finish_gradients = count_then_finish
    hook = trainer.model.register_forward_hook(count_gathered)
    try:
        trainer.num_micro = 1  # one forward, so the hook counts once
        run(trainer, 1)
    finally:
        trainer.parallel.finish_gradients = finish
        hook.remove()
    names = {id(p): n for n, p in trainer.parallel.optimizer_parameters()}
    for p, state in trainer.optimizer.state.items():
        counts[kind[names[id(p)]].kind]["optimizer"] += local(state["exp_avg"]) + local(state["exp_avg_sq"])
    return counts


# ---------------------------------------------------------------- 4 processes
def four_process_checks(rank: int, world_size: int, save_dir: str) -> dict:
    env = init_distributed()
    out: dict = {"stages": {}, "held": {}}
    for stage in (0, 1, 2, 3):
        extra = {"save": save_dir, "checkpoint_activations": True} if stage == 3 else {}
        trainer = ep_trainer(zero_config(stage, **extra), env)
        first = run(trainer, HALF)
        if stage == 3:
            trainer.save()
            out["valid_half"] = validation_loss(trainer)
            out["state_half"] = global_optimizer_state(trainer)
        second = run(trainer, STEPS - HALF)
        out["stages"][stage] = {k: first[k] + second[k] for k in first} | {"biases": biases(trainer)}
        out["held"][stage] = held(trainer)
    resumed = ep_trainer(zero_config(3, checkpoint_activations=True), env)
    resumed.load(resolve_checkpoint(save_dir))
    out["resumed"] = run(resumed, STEPS - HALF)
    out["bf16"] = {stage: run(ep_trainer(zero_config(stage, bf16=True), env), 4) for stage in (0, 2)}
    fp16 = {"fp16": True, "initial_loss_scale": 2.0**20, "hysteresis": 1}
    out["fp16"] = {stage: run(ep_trainer(zero_config(stage, **fp16), env), 10) for stage in (0, 3)}
    return out


# ---------------------------------------------------------------- 2 processes
def two_process_checks(rank: int, world_size: int, stage3_dir: str, single_dir: str) -> dict:
    env = init_distributed()
    out = {}
    for name, cfg, path in (
        ("stage1", zero_config(1), stage3_dir),
        ("stage3_ep1", zero_config(3, ep=1), single_dir),
    ):
        trainer = ep_trainer(cfg, env)
        trainer.load(resolve_checkpoint(path))
        out[name] = {"valid": validation_loss(trainer), "state": global_optimizer_state(trainer)}
        out[name] |= run(trainer, STEPS - HALF)
    return out


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


def check_stages(four: list[dict]) -> torch.Tensor:
    """Stages 1–3 follow stage 0 step by step; returns stage 0's global losses."""
    reference = global_losses([r["stages"][0]["losses"] for r in four])
    for stage in (1, 2, 3):
        losses = global_losses([r["stages"][stage]["losses"] for r in four])
        torch.testing.assert_close(losses, reference, rtol=RTOL, atol=0, msg=f"stage {stage} losses")
        norms = torch.tensor(four[0]["stages"][stage]["norms"])
        torch.testing.assert_close(norms, torch.tensor(four[0]["stages"][0]["norms"]), rtol=RTOL, atol=0)
        for got, want in zip(four[0]["stages"][stage]["biases"], four[0]["stages"][0]["biases"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert any(b.abs().sum() > 0 for b in four[0]["stages"][0]["biases"])  # the biases really moved
    assert all(r["stages"][3]["norms"] == four[0]["stages"][3]["norms"] for r in four)  # one norm everywhere
    return reference


ROOT_ELEMENTS = (96 + 16) * 32 + 2 * 32  # word and position embeddings, final norm (tiny_config)
SHARDED_FROM = {"optimizer": 1, "grads": 2, "weights": 2, "gathered": 3}  # the first ZeRO stage sharding each


def check_held(four: list[dict]) -> None:
    """Stage 0 holds everything on every rank (experts: its EP shard); a sharded kind is held once per group
    (dense: one dp group of 4; experts: one edp group of 2 per EP shard), about 1/4 and 1/2 on each rank."""
    world, groups = len(four), {"dense": 4, "expert": 2}
    full = four[0]["held"][0]
    for stage in (1, 2, 3):
        for kind, group in groups.items():
            for what, first_stage in SHARDED_FROM.items():
                sharded = stage >= first_stage
                if what == "gathered" and sharded:  # stage 3: only the root (embeddings, final norm) is whole
                    root = ROOT_ELEMENTS if kind == "dense" else 0
                    assert all(r["held"][stage][kind][what] == root for r in four), (stage, kind)
                    continue
                total = sum(r["held"][stage][kind][what] for r in four)
                assert total == full[kind][what] * (world // group if sharded else world), (stage, kind, what)
                mine = max(r["held"][stage][kind][what] for r in four)
                bound = full[kind][what] / group * 1.25 if sharded else full[kind][what]
                assert mine <= bound, (stage, kind, what, mine, full[kind][what])


def check_plan(four: list[dict]) -> None:
    """`moetron plan`'s weights + gradients + Adam per rank at each stage within 25% of what the ranks held."""
    from moetron.plan.memory import estimate_memory

    for stage in (0, 1, 2, 3):
        cfg = zero_config(stage)
        planned = estimate_memory(cfg, cfg.dims(len(four)), "cpu")
        kinds = ("weights", "grads", "optimizer")
        measured = max(4 * sum(r["held"][stage][k][w] for k in ("dense", "expert") for w in kinds) for r in four)
        ratio = (planned.weights + planned.gradients + planned.optimizer) / measured
        assert 0.75 <= ratio <= 1.25, (stage, ratio)


@pytest.mark.distributed
@pytest.mark.slow
def test_zero_stages_match_stage_0_and_checkpoints_reshard(tmp_path):
    stage3_dir, single_dir = str(tmp_path / "stage3"), str(tmp_path / "single")
    four = run_distributed(four_process_checks, world_size=4, args=(stage3_dir,), timeout=600)
    torch.set_num_threads(1)
    reference = check_stages(four)
    check_held(four)
    check_plan(four)

    # exact resume at stage 3: steps 7–12 again, bit for bit
    for r in four:
        assert r["resumed"]["losses"] == r["stages"][3]["losses"][HALF:]
        assert r["resumed"]["norms"] == r["stages"][3]["norms"][HALF:]

    # mixed precision under sharding: bf16 at stage 2 and fp16 with overflowing scales at stage 3 follow stage 0
    bf16 = {s: global_losses([r["bf16"][s]["losses"] for r in four]) for s in (0, 2)}
    torch.testing.assert_close(bf16[2], bf16[0], rtol=2e-2, atol=0)
    fp16 = {s: four[0]["fp16"][s] for s in (0, 3)}
    assert fp16[3]["scales"] == fp16[0]["scales"] and fp16[0]["scales"][0] < 2.0**20  # the same skips
    finite = [i for i, n in enumerate(fp16[0]["norms"]) if n == n and n != float("inf")]
    assert finite and [i for i, n in enumerate(fp16[3]["norms"]) if n == n and n != float("inf")] == finite
    fp16_losses = {s: global_losses([r["fp16"][s]["losses"] for r in four]) for s in (0, 3)}
    torch.testing.assert_close(fp16_losses[3], fp16_losses[0], rtol=2e-2, atol=0)

    # the stage-3 dp-4 checkpoint continues on 1 process
    single = ep_trainer(zero_config(3, ep=1, save=single_dir))
    single.load(resolve_checkpoint(stage3_dir))
    assert single.progress.iteration == HALF
    assert validation_loss(single) == pytest.approx(four[0]["valid_half"], rel=RTOL)
    assert_same_state(global_optimizer_state(single), four[0]["state_half"])
    single.save()
    continued = torch.tensor(run(single, STEPS - HALF)["losses"], dtype=torch.float64)
    torch.testing.assert_close(continued, reference[HALF:], rtol=1e-4, atol=0)

    # ... and at stage 1 dp 2; the unsharded checkpoint at stage 3 dp 2 with ep 1
    two = run_distributed(two_process_checks, world_size=2, args=(stage3_dir, single_dir), timeout=600)
    for name in ("stage1", "stage3_ep1"):
        assert all(r[name]["valid"] == pytest.approx(four[0]["valid_half"], rel=RTOL) for r in two)
        assert_same_state(two[0][name]["state"], four[0]["state_half"])
        losses = global_losses([r[name]["losses"] for r in two])
        torch.testing.assert_close(losses, reference[HALF:], rtol=1e-4, atol=0, msg=name)
