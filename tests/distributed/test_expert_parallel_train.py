"""Training with expert parallelism (gloo) against one process, and checkpoints that reshard across EP sizes.

Two spawned groups carry every check (spawning is the expensive part):
  2 processes, EP = 2:  20 steps follow the 1-process loss curve (same global batch, dropout off, no routing
                        noise); the validation loss of a fixed batch; a checkpoint; the seed's 128-expert model
                        (4 layers, hidden 256, 4 heads; seq 16 on CPU) runs a few steps with 64 experts per rank.
                        Aux-loss-free expert biases stay identical on every rank and equal the 1-process ones.
                        DeepSeek-V3's MoE MTP block (--mtp-num-layers 1) under EP = 2, at ZeRO 0 and 2 (its own
                        FSDP2 block, experts over edp): 10 steps follow the 1-process curve.
  4 processes, EP = 2 × DP = 2: 20 steps follow the 1-process curve. EP = 4: each rank holds a quarter of every
                        MoE layer's expert parameters and optimizer state; the EP = 1 checkpoint (itself loaded
                        from the EP = 2 one) loads with the same validation loss and optimizer state, and saves.
Between and after the groups, this process loads EP = 2 → EP = 1 and EP = 4 → EP = 1 (the round trip).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from launch import run_distributed
from trainer_support import parallel_trainer as ep_trainer
from trainer_support import random_samples, run_losses, tiny_config

from moetron.checkpoint import resolve_checkpoint
from moetron.parallel.env import DistEnv, init_distributed
from moetron.plan.memory import local_parameters
from moetron.train.trainer import Trainer

STEPS, MBS = 20, 2
EXPERTS = 8


def ep_config(ep: int, global_batch: int, **overrides):
    cfg = tiny_config(micro_batch_size=MBS, global_batch_size=global_batch, train_iters=STEPS, hidden_dropout=0.0)
    cfg.model.attention_dropout = 0.0
    cfg.model.num_experts = [EXPERTS]
    cfg.model.moe_use_rts = False  # no random draws that differ between layouts
    cfg.model.moe_top2_2nd_expert_sampling = False
    cfg.train.lr_warmup_iters = 2
    cfg.parallel.moe_expert_parallel_size = ep
    for key, value in overrides.items():
        setattr(cfg.model if hasattr(cfg.model, key) else cfg.train, key, value)
    return cfg


@torch.no_grad()
def validation_loss(trainer: Trainer) -> float:
    """LM loss of one fixed batch, the same on every rank (each rank runs all of it through its EP group)."""
    batch = random_samples(8, seed=7)
    trainer.model.eval()
    try:
        return float(trainer.model(batch[:, :-1], labels_BT=batch[:, 1:]).lm_loss)
    finally:
        trainer.model.train()


def global_losses(per_rank: list[list[float]]) -> torch.Tensor:
    """Each step's loss over the global batch: the mean of the ranks' local means."""
    return torch.tensor(per_rank, dtype=torch.float64).mean(0)


def expert_optimizer_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """exp_avg of every local expert tensor, by parameter name."""
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return {
        names[id(p)]: s["exp_avg"].clone() for p, s in trainer.optimizer.state.items() if ".experts." in names[id(p)]
    }


def expert_counts(trainer: Trainer) -> tuple[int, int]:
    """(expert parameters held, expert optimizer-state elements held) by this rank."""
    params = [p for n, p in trainer.model.named_parameters() if ".experts." in n]
    state = sum(
        s["exp_avg"].numel() + s["exp_avg_sq"].numel()
        for p, s in trainer.optimizer.state.items()
        if any(p is q for q in params)
    )
    return sum(p.numel() for p in params), state


# ---------------------------------------------------------------- 2 processes
def seed_model_steps(env: DistEnv) -> tuple[list[float], int]:
    cfg = ep_config(2, global_batch=2, micro_batch_size=1, train_iters=2, topk=1)
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 4, 256, 4, 16
    m.num_experts = [128]
    trainer = ep_trainer(cfg, env)
    local_experts = {moe.experts.num_experts for moe in trainer.model.moe_layers()}
    return run_losses(trainer, 2), local_experts.pop()


def expert_biases(ep: int, global_batch: int, env: DistEnv | None = None) -> list[torch.Tensor]:
    """Aux-loss-free balancing: every router's expert bias after 3 steps."""
    trainer = ep_trainer(ep_config(ep, global_batch, moe_router_bias_update_rate=0.01), env)
    run_losses(trainer, 3)
    return [moe.router.expert_bias.clone() for moe in trainer.model.moe_layers()]


MTP_STEPS = 10


def mtp_config(ep: int, global_batch: int, zero_stage: int = 0):
    """A MoE multi-token-prediction module (DeepSeek-V3's MTP block: a MoE layer like the last main layer)."""
    cfg = ep_config(ep, global_batch, train_iters=MTP_STEPS, mtp_num_layers=1, mtp_loss_scaling_factor=0.5)
    cfg.parallel.zero_stage = zero_stage
    return cfg


def mtp_losses(env: DistEnv, world_size: int, zero_stage: int) -> tuple[list[float], int, int]:
    """(the losses, the MTP layer's local experts, this rank's parameters) of a MoE MTP run at EP = 2."""
    trainer = ep_trainer(mtp_config(2, MBS * world_size, zero_stage), env)
    (mtp_moe,) = [moe for moe in trainer.model.moe_layers() if moe.layer_index == trainer.model.cfg.num_layers]
    params = sum(p.numel() for p in trainer.model.parameters())
    return run_losses(trainer, MTP_STEPS), mtp_moe.experts.num_experts, params


def two_process_checks(rank: int, world_size: int, save_dir: str) -> dict:
    env = init_distributed()
    trainer = ep_trainer(ep_config(2, global_batch=MBS * world_size, save=save_dir), env)
    losses = run_losses(trainer, STEPS)
    trainer.save()
    seed_losses, seed_local = seed_model_steps(env)
    out = {"losses": losses, "valid": validation_loss(trainer), "seed": seed_losses, "seed_local": seed_local}
    out["mtp"] = {stage: mtp_losses(env, world_size, stage) for stage in (0, 2)}
    return {**out, "biases": expert_biases(2, MBS * world_size, env)}


# ---------------------------------------------------------------- 4 processes
def four_process_checks(rank: int, world_size: int, ep1_dir: str, ep4_dir: str) -> dict:
    env = init_distributed()
    losses = run_losses(ep_trainer(ep_config(2, global_batch=MBS * world_size), env), STEPS)
    trainer = ep_trainer(ep_config(4, global_batch=MBS * world_size, save=ep4_dir), env)
    fresh_counts = expert_counts(trainer)
    trainer.load(resolve_checkpoint(ep1_dir))
    loaded = {"valid": validation_loss(trainer), "state": expert_optimizer_state(trainer)}
    loaded["iteration"] = trainer.progress.iteration
    trainer.save()
    run_losses(trainer, 1)
    return {"losses": losses, "counts": expert_counts(trainer), "fresh_counts": fresh_counts, **loaded}


def reference_losses(global_batch: int) -> torch.Tensor:
    return torch.tensor(run_losses(ep_trainer(ep_config(1, global_batch=global_batch)), STEPS), dtype=torch.float64)


@pytest.mark.distributed
@pytest.mark.slow
def test_expert_parallel_training_and_resharding(tmp_path):
    ep2_dir, ep1_dir, ep4_dir = (str(tmp_path / name) for name in ("ep2", "ep1", "ep4"))
    two = run_distributed(two_process_checks, world_size=2, args=(ep2_dir,), timeout=240)
    torch.set_num_threads(1)

    # EP = 2 on 2 processes follows the 1-process curve of the same global batch
    reference = reference_losses(2 * MBS)
    torch.testing.assert_close(global_losses([r["losses"] for r in two]), reference, rtol=1e-4, atol=0)
    assert two[0]["losses"] != two[1]["losses"]  # the ranks really trained on different tokens
    assert all(r["seed_local"] == 64 for r in two) and all(len(r["seed"]) == 2 for r in two)
    assert all(torch.isfinite(torch.tensor(r["seed"])).all() for r in two)
    # expert biases: loads all-reduced over DP before the update, so every rank's equal the 1-process ones
    for got, want in zip(two[1]["biases"], expert_biases(1, 2 * MBS), strict=True):
        torch.testing.assert_close(got, want)
    assert all(torch.equal(a, b) for a, b in zip(two[0]["biases"], two[1]["biases"], strict=True))
    assert any(b.abs().sum() > 0 for b in two[0]["biases"])  # the biases really moved
    # a MoE MTP block under EP = 2 (DDP, and ZeRO-2 with the experts over edp) follows the 1-process curve
    mtp_reference = torch.tensor(run_losses(ep_trainer(mtp_config(1, 2 * MBS)), MTP_STEPS), dtype=torch.float64)
    assert mtp_reference.tolist() != reference[:MTP_STEPS].tolist()  # the MTP loss moved the trunk
    planned = local_parameters(mtp_config(2, 2 * MBS).model, mtp_config(2, 2 * MBS).dims(2)).total
    assert all(r["mtp"][0][2] == planned for r in two)  # the plan counts half the MTP layer's experts per rank
    for stage in (0, 2):
        assert all(r["mtp"][stage][1] == EXPERTS // 2 for r in two)  # the MTP layer holds half its experts
        got = global_losses([r["mtp"][stage][0] for r in two])
        torch.testing.assert_close(got, mtp_reference, rtol=1e-4, atol=0, msg=f"MoE MTP, EP 2, ZeRO {stage}")

    # EP = 2 → EP = 1: same validation loss, optimizer state complete; saved again for the EP = 4 group
    single = ep_trainer(ep_config(1, global_batch=2 * MBS, save=ep1_dir))
    single.load(resolve_checkpoint(ep2_dir))
    assert single.progress.iteration == STEPS
    assert validation_loss(single) == pytest.approx(two[0]["valid"], rel=1e-5)
    assert two[0]["valid"] == two[1]["valid"]
    full_state = expert_optimizer_state(single)
    single.save()

    four = run_distributed(four_process_checks, world_size=4, args=(ep1_dir, ep4_dir), timeout=240)
    torch.testing.assert_close(global_losses([r["losses"] for r in four]), reference_losses(4 * MBS), rtol=1e-4, atol=0)
    for rank, r in enumerate(four):
        assert r["iteration"] == STEPS
        assert r["valid"] == pytest.approx(two[0]["valid"], rel=1e-5)
        for name, exp_avg in r["state"].items():  # each rank's slice of the global experts' Adam moments
            quarter = EXPERTS // 4
            torch.testing.assert_close(exp_avg, full_state[name][rank * quarter : (rank + 1) * quarter])
        full_params, full_state_numel = expert_counts(single)
        assert r["counts"] == (full_params // 4, full_state_numel // 4)  # a quarter of params and state
        assert r["fresh_counts"][0] == full_params // 4

    # EP = 4 → EP = 1: the round trip keeps the validation loss
    back = ep_trainer(ep_config(1, global_batch=2 * MBS))
    back.load(resolve_checkpoint(ep4_dir))
    assert validation_loss(back) == pytest.approx(two[0]["valid"], rel=1e-5)
    for name, exp_avg in expert_optimizer_state(back).items():
        torch.testing.assert_close(exp_avg, full_state[name])
    # layout-free files: every expert tensor under its global name and shape, whatever EP wrote it
    saved = dcp.FileSystemReader(str(Path(ep4_dir) / f"iter_{STEPS:07d}")).read_metadata().state_dict_metadata
    for moe in back.model.moe_layers():
        name = f"model.layers.{moe.layer_index}.mlp.experts.w1_EDF"
        assert saved[name].size[0] == EXPERTS and len(saved[name].chunks) == 4  # 4 EP shards, 1 writer each
