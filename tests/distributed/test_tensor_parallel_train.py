"""Tensor parallelism (gloo) against one process: losses, gradients, exact resume and checkpoints across TP sizes.

A tiny MoE GPT (layer 0 dense, layer 1 with 4 experts) under two routers — top-1 with capacity dropping and random
token selection, and top-2 dropless — with hidden dropout 0.1 on (attention dropout off: on head shards it draws
per-rank masks, see model/attention.py). Every layout trains 12 steps of the same global batch and must give the
one-process loss at every step (1e-4 relative) and the one-process gradients of the first step (1e-5); every
rank holds the parameter count `moetron plan` gives it.

Two spawned groups carry every check (spawning is the expensive part):
  2 processes: TP = 2; TP = 2 with sequence parallelism; TP = 2 × EP = 2 folded (the experts over the TP ranks);
               exact resume at TP = 2 (6 steps + checkpoint + 6 steps = 12 straight, bit for bit); the TP = 1
               checkpoint of this process loads at TP = 2 (validation loss, then 6 more steps on the loaded
               optimizer state follow the one-process curve); 3 steps of TP = 2 + SP × EP = 2 with --compile, and
               of a model built whole and split by `parallelize`; 4 steps of a GQA / RoPE / SwiGLU / RMSNorm model with
               an untied head and a shared expert at TP = 2 + SP × EP = 2; the same model with Qwen3's per-head
               QK RMSNorm (--qk-layernorm) at TP = 2 and TP = 2 + SP, their 12 steps and first gradients (the norm
               weights' summed over the head shards) against one process; two DeepSeek-V3 MTP modules
               (--mtp-num-layers 2, loss factor 0.5) at TP = 2 and TP = 2 + SP (each depth's input a sequence
               shard): 12 steps of LM and MTP loss and first gradients (the MTP weights' too) against one process.
  4 processes: DP = 2 × TP = 2 × EP = 2 (folded), and with expert tensor parallelism (ETP = 2), sequence
               parallelism and activation checkpointing; the TP = 2 checkpoint loads at TP = 4.
Between and after the groups this process loads the TP = 2 checkpoint at TP = 1 (the round trip).
"""

from __future__ import annotations

import pytest
import torch
from launch import run_distributed
from trainer_support import (
    MemoryLoader,
    parallel_trainer,
    random_samples,
    run_losses,
    tiny_config,
)

from moetron.checkpoint import resolve_checkpoint
from moetron.model.rng import STREAMS
from moetron.parallel.env import DistEnv, init_distributed
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.parallelize import build
from moetron.plan.memory import local_parameters
from moetron.train.trainer import Trainer

STEPS, HALF, MBS, GLOBAL_BATCH = 12, 6, 2, 4
ROUTERS = {
    "top1-capacity-rts": {"topk": 1, "moe_token_dropping": True, "moe_use_rts": True},
    "top2-dropless": {"topk": 2, "moe_token_dropping": False},
}
TWO = {"tp2": {"tp": 2}, "tp2-sp": {"tp": 2, "sp": True}, "tp2-ep2": {"tp": 2, "ep": 2}}
FOUR = {  # the second also with sequence parallelism and activation checkpointing (recomputed TP collectives)
    "dp2-tp2-ep2": {"tp": 2, "ep": 2},
    "dp2-tp2-ep2-etp2-sp-ac": {"tp": 2, "ep": 2, "etp": 2, "sp": True, "ac": True},
}


MODERN = {  # a Mixtral/Qwen-style model: GQA, RoPE, SwiGLU without biases, RMSNorm, untied head, a shared expert
    "num_key_value_heads": 2,
    "position_embedding_type": "rope",
    "swiglu": True,
    "add_bias_linear": False,
    "normalization": "rmsnorm",
    "untie_embeddings_and_output_weights": True,
    "num_shared_experts": 1,
    "ffn_hidden_size": 64,
}


def tp_config(
    router: str, tp: int = 1, ep: int = 1, sp: bool = False, etp: int = 1, ac: bool = False, save: str | None = None
):
    cfg = tiny_config(micro_batch_size=MBS, global_batch_size=GLOBAL_BATCH, train_iters=STEPS, hidden_dropout=0.1)
    m, p = cfg.model, cfg.parallel
    m.attention_dropout, m.checkpoint_activations = 0.0, ac
    for key, value in ROUTERS[router].items():
        setattr(m, key, value)
    p.tensor_model_parallel_size, p.moe_expert_parallel_size = tp, ep
    p.sequence_parallel, p.expert_tensor_parallel_size = sp, etp
    cfg.train.lr_warmup_iters, cfg.train.save = 2, save
    return cfg


def first_step_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The global gradient of every parameter after the first step's backward (before clipping); then rewinds, so
    the trainer starts its run from the first batch with no gradient left over."""
    trainer.executor.forward_backward(trainer.next_micro_batch, trainer.num_micro, 1.0)
    trainer.parallel.finish_gradients()
    view = trainer.checkpoint_view()
    grads = {}
    for name, param in trainer.model.named_parameters():
        grad = view.tensor(name, param.grad)
        grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.train_loader.consumed_samples = 0
    trainer.executor.moe_record.reset()
    return grads


def modern(cfg):
    for key, value in MODERN.items():
        setattr(cfg.model, key, value)
    return cfg


def qk_norm(cfg):
    """The modern model with Qwen3-MoE's per-head QK RMSNorm (the norm weights are shared by the heads)."""
    cfg = modern(cfg)
    cfg.model.qk_layernorm = True
    return cfg


def mtp(cfg):
    """Two multi-token-prediction modules (model/mtp.py) whose loss weighs enough to move the LM curve."""
    cfg.model.mtp_num_layers, cfg.model.mtp_loss_scaling_factor = 2, 0.5
    return cfg


def curve(cfg, env: DistEnv | None = None) -> dict:
    """First gradients, STEPS LM losses (and, with MTP modules, their mean loss of each step) and this rank's
    parameter count."""
    trainer = parallel_trainer(cfg, env)
    grads = first_step_grads(trainer)
    params = sum(p.numel() for p in trainer.model.parameters())  # this rank's share, to check the plan's
    if not cfg.model.mtp_num_layers:
        return {"grads": grads, "losses": run_losses(trainer, STEPS), "params": params}
    losses, mtp_losses = [], []
    for _ in range(STEPS):
        losses += run_losses(trainer, 1)
        mtp_losses.append(float(trainer.executor.last_mtp_loss))
    return {"grads": grads, "losses": losses, "mtp_losses": mtp_losses, "params": params}


def compiled_losses(env: DistEnv, steps: int = 3) -> list[float]:
    """`--compile` (per-block torch.compile) composes with TP, SP and EP: a few steps of the compiled model."""
    cfg = tp_config("top2-dropless", tp=2, sp=True, ep=2)
    cfg.train.compile = True
    parallel = build(cfg, ParallelMesh.build(cfg.dims(env.world_size), env), env.device)
    loader = MemoryLoader(random_samples(512), MBS, parallel.mesh.coords.dp, parallel.mesh.size("dp"))
    return run_losses(Trainer(cfg, env, parallel, loader, None, config_yaml="# test\n"), steps)


@torch.no_grad()
def validation_loss(trainer: Trainer) -> float:
    """LM loss of one fixed batch (the same on every rank: every rank holds the whole batch). Random token selection
    stays on in eval (DeepSpeed's rule): its draws come from the layers' streams of this batch, as in `evaluate`."""
    batch = random_samples(8, seed=7)
    trainer.model.eval()
    try:
        with STREAMS.micro_batch("valid", 0):
            head_loss = trainer.parallel.head_loss  # the vocab-parallel cross-entropy on vocabulary-sharded logits
            return float(trainer.model(batch[:, :-1], labels_BT=batch[:, 1:], head_loss=head_loss).lm_loss)
    finally:
        trainer.model.train()


def resumed(cfg, path: str, env: DistEnv | None = None) -> dict:
    """Load `path` (weights, optimizer, progress) into a fresh trainer, then train to the end."""
    trainer = parallel_trainer(cfg, env)
    trainer.load(resolve_checkpoint(path))
    return {"valid": validation_loss(trainer), "losses": run_losses(trainer, STEPS - trainer.progress.iteration)}


ROUTER = "top1-capacity-rts"  # the checkpoint checks: random token selection on, so resume must restore the draws


# ---------------------------------------------------------------- the spawned groups
def two_process_checks(rank: int, world_size: int, tp1_dir: str, tp2_dir: str) -> dict:
    env = init_distributed()
    # first, as `moetron train --compile` does in a fresh process (compiling after a non-SP and an SP TP model ran
    # in the same process trips an assertion in torch 2.13's AOTAutograd partitioner)
    compiled = compiled_losses(env)
    out = {
        (layout, router): curve(tp_config(router, **dims), env) for layout, dims in TWO.items() for router in ROUTERS
    }
    first = parallel_trainer(tp_config(ROUTER, tp=2, save=tp2_dir), env)
    head = run_losses(first, HALF)
    first.save()
    out["resume"] = {"head": head, "valid": validation_loss(first), **resumed(tp_config(ROUTER, tp=2), tp2_dir, env)}
    out["from_tp1"] = resumed(tp_config(ROUTER, tp=2), tp1_dir, env)
    out["compiled"] = compiled
    out["modern"] = run_losses(parallel_trainer(modern(tp_config("top2-dropless", tp=2, sp=True, ep=2)), env), 4)
    out["qk_norm"] = curve(qk_norm(tp_config("top2-dropless", tp=2, sp=True)), env)
    out["qk_norm_tp2"] = curve(qk_norm(tp_config("top2-dropless", tp=2)), env)  # whole-sequence norms around it
    out["mtp"] = curve(mtp(tp_config("top2-dropless", tp=2)), env)
    out["mtp_sp"] = curve(mtp(tp_config("top2-dropless", tp=2, sp=True)), env)  # each depth's input a shard
    return out


def four_process_checks(rank: int, world_size: int, tp2_dir: str) -> dict:
    env = init_distributed()
    out = {
        (layout, router): curve(tp_config(router, **dims), env) for layout, dims in FOUR.items() for router in ROUTERS
    }
    out["from_tp2"] = resumed(tp_config(ROUTER, tp=4), tp2_dir, env)
    return out


# ---------------------------------------------------------------- the test
def check_params(results: list[dict], layouts: dict, world_size: int) -> None:
    """Every rank holds the parameters `moetron plan` says it holds."""
    for name, dims in layouts.items():
        cfg = tp_config(ROUTER, **dims)
        planned = local_parameters(cfg.model, cfg.dims(world_size)).total
        assert [r[(name, ROUTER)]["params"] for r in results] == [planned] * world_size, name


def check_curve(got: dict, want: dict, what: str) -> None:
    for key in ("losses", "mtp_losses"):
        if key in want:
            losses = torch.tensor(got[key], dtype=torch.float64)
            wanted = torch.tensor(want[key], dtype=torch.float64)
            torch.testing.assert_close(losses, wanted, rtol=1e-4, atol=0, msg=f"{what}: {key}")
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-5, msg=f"{what}: {name}")


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_parallel_training_and_checkpoints(tmp_path):
    torch.set_num_threads(1)
    tp1_dir, tp2_dir = str(tmp_path / "tp1"), str(tmp_path / "tp2")
    reference = {router: curve(tp_config(router)) for router in ROUTERS}
    single = parallel_trainer(tp_config(ROUTER, save=tp1_dir))
    run_losses(single, HALF)
    single.save()
    tp1_valid = validation_loss(single)
    straight = reference[ROUTER]["losses"]
    modern_losses = run_losses(parallel_trainer(modern(tp_config("top2-dropless"))), 4)
    qk_norm_reference = curve(qk_norm(tp_config("top2-dropless")))
    mtp_reference = curve(mtp(tp_config("top2-dropless")))
    assert mtp_reference["losses"] != reference["top2-dropless"]["losses"]  # the MTP gradient reached the trunk

    two = run_distributed(two_process_checks, world_size=2, args=(tp1_dir, tp2_dir), timeout=1200)
    for layout in TWO:
        for router in ROUTERS:
            check_curve(two[0][(layout, router)], reference[router], f"{layout} {router}")
            assert two[0][(layout, router)]["losses"] == two[1][(layout, router)]["losses"]  # TP peers agree
    check_params(two, TWO, 2)
    for r in two:
        compiled = reference["top2-dropless"]["losses"][: len(r["compiled"])]
        torch.testing.assert_close(r["compiled"], compiled, rtol=1e-4, atol=0)
        torch.testing.assert_close(r["modern"], modern_losses, rtol=1e-4, atol=0)
        check_curve(r["qk_norm"], qk_norm_reference, "qk-layernorm tp2-sp")
        check_curve(r["qk_norm_tp2"], qk_norm_reference, "qk-layernorm tp2")
        for key, sp in (("mtp", False), ("mtp_sp", True)):
            check_curve(r[key], mtp_reference, key)
            mtp_cfg = mtp(tp_config("top2-dropless", tp=2, sp=sp))
            assert r[key]["params"] == local_parameters(mtp_cfg.model, mtp_cfg.dims(2)).total  # the plan counts them
    for r in two:  # exact resume at TP = 2: bit-identical to the uninterrupted TP = 2 run
        assert r["resume"]["head"] + r["resume"]["losses"] == r[("tp2", ROUTER)]["losses"]
        # TP = 1 → 2: the same validation loss, and the loaded optimizer state continues the one-process curve
        assert r["from_tp1"]["valid"] == pytest.approx(tp1_valid, rel=1e-5)
        torch.testing.assert_close(r["from_tp1"]["losses"], straight[HALF:], rtol=1e-4, atol=0)

    # TP = 2 → 1: the same validation loss and the same continuation
    back = resumed(tp_config(ROUTER), tp2_dir)
    assert back["valid"] == pytest.approx(two[0]["resume"]["valid"], rel=1e-5)
    torch.testing.assert_close(back["losses"], straight[HALF:], rtol=1e-4, atol=0)

    four = run_distributed(four_process_checks, world_size=4, args=(tp2_dir,), timeout=1200)
    for layout in FOUR:
        for router in ROUTERS:
            key = (layout, router)
            dp_ranks = [four[0][key], four[2][key]]  # ranks 0, 1 are data-parallel rank 0; ranks 2, 3 rank 1
            mean = torch.tensor([r["losses"] for r in dp_ranks], dtype=torch.float64).mean(0).tolist()
            check_curve({"grads": four[0][key]["grads"], "losses": mean}, reference[router], f"{layout} {router}")
            assert four[0][key]["losses"] != four[2][key]["losses"]  # the replicas really saw different samples
            assert four[0][key]["losses"] == four[1][key]["losses"] and four[2][key]["losses"] == four[3][key]["losses"]
    check_params(four, FOUR, 4)
    for r in four:  # TP = 2 → 4
        assert r["from_tp2"]["valid"] == pytest.approx(two[0]["resume"]["valid"], rel=1e-5)
        torch.testing.assert_close(r["from_tp2"]["losses"], straight[HALF:], rtol=1e-4, atol=0)
