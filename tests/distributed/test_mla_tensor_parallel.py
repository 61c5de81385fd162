"""Multi-head latent attention under tensor parallelism (gloo, 2 processes) against one process.

A tiny MLA MoE GPT (layer 0 dense, layer 1 with 4 experts, top-2 dropless, hidden dropout 0.1) trains 10 steps of
the same global batch at TP = 2 (the up projections column-parallel by heads, `dense` row-parallel, the down
projections and latent norms replicated, the shared rotary key's gradient summed over the head shards): with
sequence parallelism, and without a query latent (`linear_q_proj` column-parallel) and without SP. Each layout
must give the one-process loss at every step (1e-4 relative) and the one-process gradients of the first step
(1e-5) — which are wrong without the sum over the shards — and each rank the parameter count `moetron plan` gives
it. One spawned group carries every check.
"""

from __future__ import annotations

import pytest
import torch
from launch import run_distributed
from test_tensor_parallel_train import check_curve, first_step_grads
from trainer_support import parallel_trainer, run_losses, tiny_config

from moetron.parallel.env import init_distributed
from moetron.plan.memory import local_parameters

STEPS = 10
MLA = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
           v_head_dim=6, position_embedding_type="rope", normalization="rmsnorm", swiglu=True, add_bias_linear=False,
           moe_token_dropping=False, hidden_dropout=0.1, attention_dropout=0.0)  # fmt: skip
LAYOUTS = {"tp2-sp": {"tp": 2, "sp": True}, "tp2-no-q-latent": {"tp": 2, "q_lora_rank": None}}


def mla_config(tp: int = 1, sp: bool = False, **model):
    cfg = tiny_config(micro_batch_size=2, global_batch_size=4, train_iters=STEPS, lr_warmup_iters=2)
    for key, value in {**MLA, **model}.items():
        setattr(cfg.model, key, value)
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.sequence_parallel = tp, sp
    return cfg


def curve(cfg, env=None) -> dict:
    trainer = parallel_trainer(cfg, env)
    grads = first_step_grads(trainer)
    params = sum(p.numel() for p in trainer.model.parameters())
    return {"grads": grads, "losses": run_losses(trainer, STEPS), "params": params}


def two_process_checks(rank: int, world_size: int) -> dict:
    env = init_distributed()
    return {name: curve(mla_config(**dims), env) for name, dims in LAYOUTS.items()}


@pytest.mark.distributed
@pytest.mark.slow
def test_mla_tensor_parallel_follows_one_process():
    torch.set_num_threads(1)
    reference = {q: curve(mla_config(q_lora_rank=q)) for q in (24, None)}
    two = run_distributed(two_process_checks, world_size=2, timeout=900)
    for name, dims in LAYOUTS.items():
        want = reference[dims.get("q_lora_rank", 24)]
        check_curve(two[0][name], want, name)
        assert two[0][name]["losses"] == two[1][name]["losses"]  # TP peers agree
        cfg = mla_config(**dims)
        planned = local_parameters(cfg.model, cfg.dims(2)).total
        assert [r[name]["params"] for r in two] == [planned, planned], name
