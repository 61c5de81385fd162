"""`--async-save` over 2 gloo processes with expert parallelism (experts saved as DTensor shards, DCP's collectives
on the save's own gloo group from the writer thread): the files are the synchronous save's, and a run resumed from
the asynchronous checkpoint continues exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import run_distributed
from test_async_save import checkpoint_contents
from trainer_support import build_trainer, run_losses, tiny_config

from moetron.parallel.env import init_distributed


def ep_config(save: str, async_save: bool):
    cfg = tiny_config(save=save, async_save=async_save, train_iters=4)
    cfg.parallel.moe_expert_parallel_size = 2
    return cfg


def save_both_ways(rank: int, world_size: int, root: str) -> dict:
    env = init_distributed()
    out = {}
    for name, async_save in (("sync", False), ("async", True)):
        trainer = build_trainer(ep_config(f"{root}/{name}", async_save), env)
        out[name] = run_losses(trainer, 2)
        trainer.save()
        if async_save:
            run_losses(trainer, 1)  # a step of every rank while the writer threads run DCP's collectives
            trainer.async_saver.wait()
    resumed = build_trainer(ep_config(f"{root}/async", True), env)
    resumed.load(Path(root) / "async" / "iter_0000002")
    straight = build_trainer(ep_config(f"{root}/straight", False), env)
    out["straight"], out["resumed"] = run_losses(straight, 4)[2:], run_losses(resumed, 2)
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_async_save_with_expert_parallelism_writes_the_synchronous_files(tmp_path):
    results = run_distributed(save_both_ways, world_size=2, args=(str(tmp_path),))
    for r in results:
        assert r["sync"] == r["async"] and r["straight"] == r["resumed"]
    sync = checkpoint_contents(tmp_path / "sync" / "iter_0000002")
    assert "__1_0.distcp" in sync and "rng/rank_00001.safetensors" in sync
    assert checkpoint_contents(tmp_path / "async" / "iter_0000002") == sync
