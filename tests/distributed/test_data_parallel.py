"""2-process data parallelism (gloo) against a single-process reference, and exact resume across 2 processes.

One spawned group runs every check (spawning is the expensive part):
1. DP gradients: 2 ranks × micro batch 2 give the gradients of 1 process × micro batch 2 × 2 accumulation steps
   (same global batch, same samples, dropout off), every rank ends the step with identical weights, and the
   aux-loss-free expert biases are updated from all ranks' routing (equal to the single-process update);
2. the same with every random draw on (dropout, top-2's sampled second expert, and capacity drops):
   each layer draws from a stream keyed by the micro-batch's samples, so the two ranks draw exactly what the one
   process draws for the same samples;
3. multi-token prediction (--mtp-num-layers 2, every draw on): the MTP modules' gradients, reduced like any dense
   parameter's, and the trunk's (which their loss reaches) equal the single process's;
4. exact resume: 2N steps straight and N steps + checkpoint + N steps give bit-identical losses on every rank
   (dropout and MoE random token selection on), with rank-specific RNG files saved.
"""

from __future__ import annotations

import pytest
import torch
from launch import run_distributed
from trainer_support import build_trainer, run_losses, tiny_config

from moetron.parallel.env import DistEnv, init_distributed

N = 2


def first_step_grads(
    env: DistEnv | None, micro: int, global_batch: int, random: bool = False, mtp: int = 0
) -> tuple[dict, dict]:
    cfg = tiny_config(moe=True, micro_batch_size=micro, global_batch_size=global_batch, hidden_dropout=0.0)
    cfg.model.mtp_num_layers, cfg.model.mtp_loss_scaling_factor = mtp, 0.5
    cfg.model.attention_dropout = 0.0
    cfg.model.moe_use_rts = False  # positional dropping,
    cfg.model.moe_top2_2nd_expert_sampling = False  # argmax second expert
    cfg.model.moe_router_bias_update_rate = 1e-3  # aux-loss-free balancing: biases from all ranks' loads
    if random:  # every draw on: dropout everywhere, the Gumbel second expert, capacity that drops routes
        cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.2
        cfg.model.moe_top2_2nd_expert_sampling = True
        cfg.model.moe_use_rts, cfg.model.moe_train_capacity_factor, cfg.model.moe_min_capacity = True, 0.5, 1
    trainer = build_trainer(cfg, env)
    grads, step = {}, trainer.optimizer.step

    def capture(*args, **kwargs):
        grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    assert trainer.train_step().ok
    return grads, {n: t.detach().clone() for n, t in trainer.model.state_dict().items()}


def resume_losses(env: DistEnv, save_dir: str) -> tuple[list[float], list[float]]:
    cfg = tiny_config(train_iters=2 * N, save=save_dir, lr_warmup_iters=1)
    straight = run_losses(build_trainer(cfg, env), 2 * N)
    first = build_trainer(cfg, env)
    head = run_losses(first, N)
    path = first.save()
    resumed = build_trainer(cfg, env)
    resumed.load(path)
    return straight, head + run_losses(resumed, N)


def all_checks(rank: int, world_size: int, save_dir: str) -> dict:
    env = init_distributed()
    assert (env.rank, env.world_size) == (rank, world_size)
    grads, params = first_step_grads(env, micro=2, global_batch=4)
    random_grads, _ = first_step_grads(env, micro=2, global_batch=4, random=True)
    mtp_grads, _ = first_step_grads(env, micro=2, global_batch=4, random=True, mtp=2)
    straight, resumed = resume_losses(env, save_dir)
    out = {"grads": grads, "params": params, "random": random_grads, "straight": straight, "resumed": resumed}
    return {**out, "mtp": mtp_grads}


@pytest.mark.distributed
def test_two_process_data_parallel(tmp_path):
    results = run_distributed(all_checks, world_size=2, args=(str(tmp_path),))
    torch.set_num_threads(1)
    reference, reference_state = first_step_grads(None, micro=2, global_batch=4)  # 1 process, 2 accumulations
    for name, grad in reference.items():
        for r in results:
            torch.testing.assert_close(r["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    random_reference, _ = first_step_grads(None, micro=2, global_batch=4, random=True)
    for name, grad in random_reference.items():  # layout-free randomness: the same draws for the same samples
        for r in results:
            torch.testing.assert_close(r["random"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert any(not torch.equal(random_reference[n], reference[n]) for n in reference)  # the draws changed things
    mtp_reference, _ = first_step_grads(None, micro=2, global_batch=4, random=True, mtp=2)
    assert any(name.startswith("mtp.layers.1.") for name in mtp_reference)
    for name, grad in mtp_reference.items():
        for r in results:
            torch.testing.assert_close(r["mtp"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    for name, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][name]), name  # replicas (and expert biases) stay identical
    biases = [n for n in reference_state if n.endswith("expert_bias")]
    assert biases and any(reference_state[n].abs().sum() > 0 for n in biases)
    for name in biases:  # the bias update saw every rank's routing, as the single process saw all tokens
        torch.testing.assert_close(results[0]["params"][name], reference_state[name], rtol=0, atol=1e-7)
    for r in results:
        assert r["straight"] == r["resumed"]  # bit-identical exact resume on every rank
    assert results[0]["straight"] != results[1]["straight"]  # ranks really saw different data
    assert sorted(p.name for p in (tmp_path / f"iter_{N:07d}" / "rng").iterdir()) == [
        "rank_00000.safetensors",
        "rank_00001.safetensors",
    ]
