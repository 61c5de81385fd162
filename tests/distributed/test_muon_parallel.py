"""Muon (`--optimizer muon`) under every layout that holds a matrix differently, against one process (gloo).

A tiny MoE GPT (layer 1: 4 experts; GQA: 4 query heads in 2 key/value groups) trains 10 steps of the same global
batch with Muon, the fused QKV weight split into Q, K and V (the default); every layout must give the one-process
loss at every step and the one-process weights at the end (1e-5 relative):

  2 processes (one spawned group): DP 2 (replicas: gradients reduced before the step), ZeRO-1 × DP 2 (optimizer
      shards: each matrix's update gathered over dp), ZeRO-3 × DP 2 (FSDP2 shards; experts sharded on dim 0 stay
      local), DP 2 × EP 2 (whole experts per rank), TP 2 (`--muon-tp-mode duplicated`: TP shards gathered; one
      key/value group per rank, so Q, K and V are split out of the gathered matrix as one process splits them),
      TP 2 under ZeRO-1 and ZeRO-3, and with expert TP 2 under ZeRO-1 (a ZeRO DTensor over dp 1 whose global
      tensor is the TP shard: the TP gather must still follow); the ZeRO-1 × DP 2 run also saves at step 5.
  this process: the one-process reference, then the ZeRO-1 checkpoint resumed on 1 process (the layout-free
      Muon state) repeats the reference's steps 6–10.
"""

from __future__ import annotations

import pytest
import torch
from launch import run_distributed
from trainer_support import parallel_trainer, run_losses, tiny_config

from moetron.checkpoint import resolve_checkpoint
from moetron.parallel.env import init_distributed

STEPS, HALF, RTOL = 10, 5, 1e-5
LAYOUTS = {
    "dp2": {},
    "zero1-dp2": {"zero_stage": 1},
    "zero3-dp2": {"zero_stage": 3},
    "dp2-ep2": {"moe_expert_parallel_size": 2},
    "tp2": {"tensor_model_parallel_size": 2},
    "tp2-zero1": {"tensor_model_parallel_size": 2, "zero_stage": 1},
    "tp2-zero3": {"tensor_model_parallel_size": 2, "zero_stage": 3},
    "tp2-etp2-zero1": {"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 2, "zero_stage": 1},
}


def muon_config(save: str | None = None, **parallel):
    cfg = tiny_config(
        optimizer="muon", micro_batch_size=2, global_batch_size=8, train_iters=STEPS, hidden_dropout=0.0, lr=0.02
    )
    m = cfg.model
    m.attention_dropout, m.moe_use_rts, m.moe_top2_2nd_expert_sampling = 0.0, False, False
    m.num_key_value_heads = 2  # GQA: Q, K and V of different row counts in the fused weight
    # no key bias: its gradient is zero but for rounding, which AdamW's normalised step turns into lr-sized moves
    # that differ between summation orders (an AdamW trait, not Muon's)
    m.add_bias_linear = False
    cfg.train.lr_warmup_iters, cfg.train.save = 2, save
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


def global_weights(trainer) -> dict[str, torch.Tensor]:
    """Every parameter as its whole global tensor (a collective under sharding: every rank calls it)."""
    out = {}
    for key, value in trainer.checkpoint_view().model_state().items():
        out[key] = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
    return out


def layouts(rank: int, world_size: int, save_dir: str) -> dict:
    env = init_distributed()
    out = {}
    for name, parallel in LAYOUTS.items():
        cfg = muon_config(save_dir if name == "zero1-dp2" else None, **parallel)
        trainer = parallel_trainer(cfg, env)
        losses = run_losses(trainer, HALF)
        if name == "zero1-dp2":
            trainer.save()
        losses += run_losses(trainer, STEPS - HALF)
        out[name] = {"losses": losses, "weights": global_weights(trainer)}
    return out


def assert_matches(results: list[dict], want: dict, what: str) -> None:
    """Each step's loss over the global batch (the mean of the ranks' local means), and every rank's weights."""
    losses = torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0)
    torch.testing.assert_close(losses, torch.tensor(want["losses"], dtype=torch.float64), rtol=RTOL, atol=0, msg=what)
    for rank, result in enumerate(results):
        assert result["weights"].keys() == want["weights"].keys()
        for key, value in want["weights"].items():
            got = result["weights"][key]
            torch.testing.assert_close(got, value, rtol=RTOL, atol=1e-6, msg=f"{what}, rank {rank}: {key}")


@pytest.mark.distributed
@pytest.mark.slow
def test_muon_under_dp_zero_ep_tp_equals_one_process(tmp_path):
    reference_trainer = parallel_trainer(muon_config())
    reference = {"losses": run_losses(reference_trainer, STEPS), "weights": global_weights(reference_trainer)}
    results = run_distributed(layouts, world_size=2, args=(str(tmp_path),), timeout=900)
    for name in LAYOUTS:
        assert_matches([result[name] for result in results], reference, name)
    resumed = parallel_trainer(muon_config())
    resumed.load(resolve_checkpoint(str(tmp_path)))
    assert resumed.progress.iteration == HALF
    tail = run_losses(resumed, STEPS - HALF)
    torch.testing.assert_close(
        torch.tensor(tail, dtype=torch.float64),
        torch.tensor(reference["losses"][HALF:], dtype=torch.float64),
        rtol=RTOL,
        atol=0,
    )
