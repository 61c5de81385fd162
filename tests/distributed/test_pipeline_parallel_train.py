"""Pipeline parallelism (gloo) against one process: every schedule, PP × EP, checkpoints across PP sizes.

The model: 4 layers, layer 0 dense and layers 1–3 MoE (4 experts, top-2), dropout 0.1, random token selection and
the sampled second expert ON — every random draw of the one-process run is reproduced, because each layer draws
from a stream keyed by the micro-batch's first sample, on whatever stage and in whatever order it runs. With
1F1B the stages are {0, 1} and {2, 3}; interleaved (2 virtual stages per rank) rank 0 runs layers 0 and 2, rank 1
layers 1 and 3: MoE and dense layers on both ranks either way. Global batch 8 = 4 micro-batches of 2.

Two spawned groups carry every check (spawning is the expensive part):
  2 processes, PP = 2:  12 steps each of 1F1B, interleaved 1F1B, GPipe and zero bubble follow the one-process
                        curve (lm loss, logged moe_loss, clipped global gradient norm); the tied embedding's two
                        copies stay equal; validation loss; a checkpoint at step 6 resumes exactly (bit-identical);
                        fp16 with overflowing loss scales (skipped steps) and an untied, uneven (1 + 3 layers),
                        RoPE model with aux-loss-free expert biases follow their one-process runs; SIGTERM on one
                        stage stops both after the same step with one checkpoint; two DeepSeek-V3 MTP modules
                        on the last stage (tied head, learned positions: both ends' copies summed) under 1F1B, and
                        one under zero bubble with an untied head and RoPE, follow their one-process curves (lm
                        loss, logged mtp_loss, gradient norm).
  4 processes:          PP = 2 × EP = 2 (DP = 2) follows the one-process curve of the same global batch and saves;
                        so does zero bubble × DP = 2 (EP = 1: experts reduced over EDP = 2); PP = 4 loads the
                        PP = 2 checkpoint (validation loss) and continues like the one-process run; PP = 2 ×
                        EP = 2 with two MoE MTP modules on the last stage (their experts over EP too) follows its
                        one-process curve for 6 steps (lm, moe and mtp loss, gradient norm); PP = 2 ×
                        TP = 2 with sequence parallelism follows the one-process curve (attention dropout off:
                        head shards draw their own masks) and saves; so does PP = 2 × TP = 2 with two MTP
                        modules on the last stage (4 steps), with and without sequence parallelism.
This process loads the PP = 2, PP = 2 × EP = 2 and PP = 2 × TP = 2 checkpoints at PP = 1: the same validation loss,
and training from step 6 continues on the one-process curve (optimizer state included).
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp
from launch import run_distributed
from trainer_support import MemoryLoader, parallel_model, random_samples, tiny_config

from moetron.checkpoint import resolve_checkpoint
from moetron.parallel.env import DistEnv, init_distributed
from moetron.plan.stages import plan_stages
from moetron.train.trainer import Trainer

STEPS, SAVE_AT, MBS, GBS = 12, 6, 2, 8
SCHEDULES = {"1f1b": None, "interleaved-1f1b": 1, "gpipe": None, "zero-bubble": 1}  # → layers per virtual stage


def pp_config(pp: int, schedule: str | None = None, virtual: int | None = None, **overrides):
    cfg = tiny_config(micro_batch_size=MBS, global_batch_size=GBS, train_iters=STEPS)
    m = cfg.model
    m.num_layers, m.expert_interval, m.moe_first_dense_layers = 4, 1, 1
    cfg.train.lr_warmup_iters = 2
    p = cfg.parallel
    p.pipeline_model_parallel_size, p.pipeline_schedule, p.num_layers_per_virtual_pipeline_stage = pp, schedule, virtual
    for key, value in overrides.items():
        section = next(s for s in (cfg.model, cfg.parallel, cfg.train) if hasattr(s, key))
        setattr(section, key, value)
    return cfg


def pp_trainer(cfg, env: DistEnv | None = None) -> Trainer:
    """The model from the meta-device recipe (this rank's stages and experts), an in-memory loader."""
    env = env or DistEnv()
    parallel = parallel_model(cfg, env)
    mesh = parallel.mesh
    mbs, dp_rank, dp = cfg.train.micro_batch_size, mesh.coords.dp, mesh.size("dp")
    loader = MemoryLoader(random_samples(512), mbs, dp_rank, dp)

    def valid():
        return MemoryLoader(random_samples(64, seed=1), mbs, dp_rank, dp)

    return Trainer(cfg, env, parallel, loader, valid, config_yaml="# test\n")


def curve(trainer: Trainer, steps: int, save_at: int | None = None) -> dict[str, list[float]]:
    """Per step: lm loss, moe loss (what metrics.jsonl logs), global gradient norm, and whether it was applied."""
    out: dict[str, list[float]] = {"lm": [], "moe": [], "norm": [], "ok": []}
    trainer.model.train()
    for _ in range(steps):
        result = trainer.train_step()
        trainer._account(result)
        lm, moe = result.sums.losses.tolist()
        for key, value in zip(("lm", "moe", "norm", "ok"), (lm, moe, result.grad_norm, float(result.ok)), strict=True):
            out[key].append(value)
        if result.sums.mtp_loss is not None:  # --mtp-num-layers: the logged mtp_loss
            out.setdefault("mtp", []).append(float(result.sums.mtp_loss))
        if trainer.progress.iteration == save_at:
            trainer.save()
    return out


def valid_loss(trainer: Trainer) -> float:
    return trainer.executor.evaluate(trainer.make_valid_loader(), 2 * trainer.num_micro, trainer.reduce_mean)[
        "valid_loss"
    ]


def biases(trainer: Trainer) -> dict[int, torch.Tensor]:
    return {moe.layer_index: moe.router.expert_bias.clone() for moe in trainer.model.moe_layers()}


def resumed(cfg, checkpoint: str, steps: int, env: DistEnv | None = None) -> tuple[dict, float]:
    """(the curve after loading `checkpoint`, the validation loss right after loading)."""
    trainer = pp_trainer(cfg, env)
    trainer.load(resolve_checkpoint(checkpoint))
    loaded = valid_loss(trainer)
    return curve(trainer, steps), loaded


# ---------------------------------------------------------------- 2 processes
FP16 = {"fp16": True, "initial_loss_scale": 2.0**20, "hysteresis": 1}  # overflows first: skipped steps
ODD = {
    "untie_embeddings_and_output_weights": True,
    "position_embedding_type": "rope",
    "decoder_first_pipeline_num_layers": 1,
    "decoder_last_pipeline_num_layers": 3,
    "moe_router_bias_update_rate": 0.01,
}
MTP = {"mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.5}  # multi-token prediction on the last stage
MTP_ODD = {"mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.5, "untie_embeddings_and_output_weights": True}
MTP_ODD["position_embedding_type"] = "rope"


def sigterm_run(env: DistEnv, save_dir: str) -> int:
    """trainer.train() where rank 1 gets SIGTERM during step 4: every rank stops after the same step and saves."""
    trainer = pp_trainer(pp_config(2, save=save_dir, log_interval=100), env)
    step = trainer.train_step

    def step_with_signal():
        if env.rank == 1 and trainer.progress.iteration == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return step()

    trainer.train_step = step_with_signal
    assert trainer.train() == 0
    return trainer.progress.iteration


def two_process_checks(rank: int, world_size: int, tmp: str) -> dict:
    env = init_distributed()
    out: dict = {}
    trainer = pp_trainer(pp_config(2, save=f"{tmp}/pp2"), env)
    out["1f1b"] = curve(trainer, STEPS, save_at=SAVE_AT)
    trainer.save()
    out["valid"] = valid_loss(trainer)
    if trainer.parallel.pipeline.tied_embedding is not None:
        out["tied"] = trainer.parallel.pipeline.tied_embedding.detach().clone()
    out["resumed"] = resumed(pp_config(2), f"{tmp}/pp2/iter_{SAVE_AT:07d}", STEPS - SAVE_AT, env)[0]
    for schedule in ("interleaved-1f1b", "gpipe", "zero-bubble"):
        out[schedule] = curve(pp_trainer(pp_config(2, schedule, SCHEDULES[schedule]), env), STEPS)
    out["fp16"] = curve(pp_trainer(pp_config(2, **FP16), env), 8)
    odd = pp_trainer(pp_config(2, **ODD), env)
    out["odd"], out["odd_biases"] = curve(odd, 6), biases(odd)
    out["odd_layers"] = [i for i, _ in odd.model.layer_items()]
    mtp = pp_trainer(pp_config(2, **MTP), env)
    out["mtp"], out["mtp_params"] = curve(mtp, 10), sum(p.numel() for p in mtp.model.parameters())
    out["mtp_odd"] = curve(pp_trainer(pp_config(2, "zero-bubble", 1, **MTP_ODD), env), 6)
    out["sigterm_iteration"] = sigterm_run(env, f"{tmp}/sigterm")
    return out


# ---------------------------------------------------------------- 4 processes
PP_TP = {"tensor_model_parallel_size": 2, "sequence_parallel": True, "attention_dropout": 0.0}
PP_TP_MTP = {"tensor_model_parallel_size": 2, "attention_dropout": 0.0, **MTP}  # the vocab-parallel shared head
PP_EP_MTP, MTP_STEPS_EP = {"moe_expert_parallel_size": 2, **MTP}, 6


def four_process_checks(rank: int, world_size: int, tmp: str) -> dict:
    env = init_distributed()
    trainer = pp_trainer(pp_config(2, global_batch_size=2 * GBS, moe_expert_parallel_size=2, save=f"{tmp}/pp2ep2"), env)
    out = {"pp2ep2": curve(trainer, STEPS), "dp_rank": trainer.mesh.coords.dp}
    trainer.save()
    out["pp2ep2_valid"] = valid_loss(trainer)
    # MoE MTP modules (DeepSeek-V3's: a MoE layer like the last one) on the last stage, their experts over EP = 2
    mtp_ep = pp_trainer(pp_config(2, global_batch_size=2 * GBS, **PP_EP_MTP), env)
    out["pp2ep2_mtp_params"] = (mtp_ep.mesh.coords.pp, sum(p.numel() for p in mtp_ep.model.parameters()))
    out["pp2ep2_mtp"] = curve(mtp_ep, MTP_STEPS_EP)
    # zero bubble × DP = 2: its split backward bypasses DDP, the dense gradients are averaged after the schedule
    out["zb_dp2"] = curve(pp_trainer(pp_config(2, "zero-bubble", 1, global_batch_size=2 * GBS), env), STEPS)
    tp = pp_trainer(pp_config(2, save=f"{tmp}/pp2tp2", **PP_TP), env)
    out["pp2tp2"] = curve(tp, STEPS)
    tp.save()
    out["pp2tp2_valid"] = valid_loss(tp)
    out["pp2tp2_mtp"] = curve(pp_trainer(pp_config(2, **PP_TP_MTP), env), 4)
    out["pp2tp2sp_mtp"] = curve(pp_trainer(pp_config(2, sequence_parallel=True, **PP_TP_MTP), env), 4)
    pp4 = pp_trainer(pp_config(4), env)
    out["pp4_layers"] = [i for i, _ in pp4.model.layer_items()]
    pp4.load(resolve_checkpoint(f"{tmp}/pp2"))
    out["pp4_valid"] = valid_loss(pp4)
    out["pp4_resumed"] = resumed(pp_config(4), f"{tmp}/pp2/iter_{SAVE_AT:07d}", STEPS - SAVE_AT, env)[0]
    return out


# ---------------------------------------------------------------- the test
def close(got: list[float], want: list[float], rtol: float = 1e-4) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=rtol, atol=0)  # fmt: skip


def assert_same_curve(got: dict, want: dict) -> None:
    for key in ("lm", "moe", "norm", *(["mtp"] if "mtp" in want else [])):
        close(got[key], want[key])
    assert got["ok"] == want["ok"]


@pytest.mark.distributed
@pytest.mark.slow
def test_pipeline_parallel_training_and_checkpoints(tmp_path):
    tmp = str(tmp_path)
    two = run_distributed(two_process_checks, world_size=2, args=(tmp,), timeout=900)
    torch.set_num_threads(1)
    reference = pp_trainer(pp_config(1))
    ref = curve(reference, STEPS)
    ref_valid = valid_loss(reference)
    for r in two:  # the lm loss and the logged moe loss reach every stage
        for schedule in SCHEDULES:
            assert_same_curve(r[schedule], ref)
        assert r["1f1b"]["lm"] == two[0]["1f1b"]["lm"] and r["1f1b"]["moe"] == two[0]["1f1b"]["moe"]
        assert r["valid"] == pytest.approx(ref_valid, rel=1e-5)
        assert r["resumed"] == {k: v[SAVE_AT:] for k, v in two[0]["1f1b"].items()}  # exact resume at PP = 2
    torch.testing.assert_close(two[0]["tied"], two[1]["tied"], rtol=0, atol=0)  # one gradient, two equal copies
    assert min(ref["norm"]) > 1.0  # clipping was active: the norm compared is the true global one

    fp16 = curve(pp_trainer(pp_config(1, **FP16)), 8)
    assert_same_curve(two[1]["fp16"], fp16)
    assert 0.0 in fp16["ok"]  # some steps overflowed and were skipped, on both layouts alike
    odd = pp_trainer(pp_config(1, **{k: v for k, v in ODD.items() if not k.startswith("decoder_")}))
    assert_same_curve(two[1]["odd"], curve(odd, 6))
    assert two[0]["odd_layers"] == [0] and two[1]["odd_layers"] == [1, 2, 3]  # first stage: 1 layer, last: 3
    for layer, bias in {**two[0]["odd_biases"], **two[1]["odd_biases"]}.items():
        torch.testing.assert_close(bias, biases(odd)[layer])
    assert any(b.abs().sum() > 0 for b in two[1]["odd_biases"].values())  # the biases really moved
    for run, overrides, steps in (("mtp", MTP, 10), ("mtp_odd", MTP_ODD, 6)):
        want = curve(pp_trainer(pp_config(1, **overrides)), steps)
        for r in two:
            assert_same_curve(r[run], want)  # on every stage: the MTP loss is all-reduced like the LM loss
    assert two[0]["mtp"]["lm"] != ref["lm"][:10] and min(two[0]["mtp"]["mtp"]) > 0  # MTP trained and was logged
    mtp_cfg = pp_config(2, **MTP)  # the plan: the MTP modules and the embedding tables on the last stage
    assert [r["mtp_params"] for r in two] == [s.memory.weights // 4 for s in plan_stages(mtp_cfg, mtp_cfg.dims(2))]
    stopped = two[0]["sigterm_iteration"]
    assert stopped == two[1]["sigterm_iteration"] and 4 <= stopped < STEPS
    assert (tmp_path / "sigterm" / "latest").read_text().strip() == f"iter_{stopped:07d}"

    # the tied embedding: saved by both ends under one name, written once (DCP de-duplicates equal replicas)
    saved = dcp.FileSystemReader(f"{tmp}/pp2/iter_{STEPS:07d}").read_metadata().state_dict_metadata
    assert len(saved["model.word_embeddings.weight"].chunks) == 1 and "model.layers.3.mlp.router.weight" in saved

    # PP = 2 → PP = 1: the same validation loss; from step 6 the one-process curve, optimizer state included
    continued, loaded_valid = resumed(pp_config(1), f"{tmp}/pp2/iter_{SAVE_AT:07d}", STEPS - SAVE_AT)
    assert_same_curve(continued, {k: v[SAVE_AT:] for k, v in ref.items()})
    assert resumed(pp_config(1), f"{tmp}/pp2", 0)[1] == pytest.approx(ref_valid, rel=1e-5)
    assert loaded_valid == pytest.approx(valid_loss(resumed_reference(SAVE_AT)), rel=1e-5)

    four = run_distributed(four_process_checks, world_size=4, args=(tmp,), timeout=900)
    wide = curve(pp_trainer(pp_config(1, global_batch_size=2 * GBS)), STEPS)
    for run in ("pp2ep2", "zb_dp2"):
        per_dp = {r["dp_rank"]: r[run] for r in four}
        for key in ("lm", "moe"):  # each data-parallel rank's mean; the step's value is their mean
            close([(a + b) / 2 for a, b in zip(per_dp[0][key], per_dp[1][key], strict=True)], wide[key])
        close(four[0][run]["norm"], wide["norm"])
    wide_mtp = curve(pp_trainer(pp_config(1, global_batch_size=2 * GBS, **MTP)), MTP_STEPS_EP)
    per_dp = {r["dp_rank"]: r["pp2ep2_mtp"] for r in four}
    for key in ("lm", "moe", "mtp"):
        close([(a + b) / 2 for a, b in zip(per_dp[0][key], per_dp[1][key], strict=True)], wide_mtp[key])
    close(four[0]["pp2ep2_mtp"]["norm"], wide_mtp["norm"])
    ep_cfg = pp_config(2, global_batch_size=2 * GBS, **PP_EP_MTP)  # the plan: the MTP modules' experts over EP too
    planned = [s.memory.weights // 4 for s in plan_stages(ep_cfg, ep_cfg.dims(4))]
    assert all(params == planned[stage] for stage, params in (r["pp2ep2_mtp_params"] for r in four))
    for rank, r in enumerate(four):
        assert r["pp4_layers"] == [rank]
        assert r["pp4_valid"] == pytest.approx(ref_valid, rel=1e-5)
        assert_same_curve(r["pp4_resumed"], {k: v[SAVE_AT:] for k, v in ref.items()})
    no_attention_dropout = curve(pp_trainer(pp_config(1, attention_dropout=0.0)), STEPS)
    mtp_tp = curve(pp_trainer(pp_config(1, attention_dropout=0.0, **MTP)), 4)
    for r in four:
        assert_same_curve(r["pp2tp2"], no_attention_dropout)
        assert_same_curve(r["pp2tp2_mtp"], mtp_tp)
        assert_same_curve(r["pp2tp2sp_mtp"], mtp_tp)  # each MTP depth's input a sequence shard on the last stage
    back = pp_trainer(pp_config(1, attention_dropout=0.0))
    back.load(resolve_checkpoint(f"{tmp}/pp2tp2"))
    assert valid_loss(back) == pytest.approx(four[0]["pp2tp2_valid"], rel=1e-5)
    back = pp_trainer(pp_config(1, global_batch_size=2 * GBS))
    back.load(resolve_checkpoint(f"{tmp}/pp2ep2"))
    assert valid_loss(back) == pytest.approx(four[0]["pp2ep2_valid"], rel=1e-5)


def resumed_reference(steps: int) -> Trainer:
    """The one-process run after `steps` steps (its validation loss is what a checkpoint of step `steps` has)."""
    trainer = pp_trainer(pp_config(1))
    curve(trainer, steps)
    return trainer
