"""`--compile`: each transformer block compiled with torch.compile (Inductor on CPU) trains a tiny MoE with the
eager loss curve, dropout and random routing included (layer streams, and Inductor's eager RNG fallback)."""

from __future__ import annotations

import pytest
import torch
from trainer_support import MemoryLoader, random_samples, run_losses, tiny_config

from moetron.parallel.env import DistEnv
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.parallelize import build
from moetron.train.trainer import Trainer

STEPS = 10


def losses(compile_blocks: bool) -> list[float]:
    cfg = tiny_config(train_iters=STEPS)  # dropout 0.1, top-2 with the sampled second expert
    cfg.train.compile = compile_blocks
    env = DistEnv()
    parallel = build(cfg, ParallelMesh.build(cfg.dims(1), env), env.device)
    loader = MemoryLoader(random_samples(512), cfg.train.micro_batch_size)
    return run_losses(Trainer(cfg, env, parallel, loader), STEPS)


@pytest.mark.slow
def test_compiled_blocks_train_like_eager():
    eager = losses(False)
    compiled = losses(True)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0)
    assert eager[-1] < eager[0]  # it really trains


def test_compile_flag_is_a_train_option():
    import argparse

    from moetron.config_cli import add_config_arguments, cli_overrides, load_config

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    cfg, explicit = load_config(None, cli_overrides(parser.parse_args(["--compile"])))
    assert cfg.train.compile and "compile" in explicit
