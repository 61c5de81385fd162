"""Helpers for the trainer tests: a tiny run config and an in-memory, resumable micro-batch loader.

The loader follows Megatron's sequential sampler (and `DistributedBatchLoader`'s interface): every call takes
the next block of `mbs · dp` samples and hands rank r the slice `[r·mbs, (r+1)·mbs)`.
"""

from __future__ import annotations

import torch

from moetron.config import RunConfig
from moetron.parallel.env import DistEnv
from moetron.train.trainer import Trainer

VOCAB = 96
SEQ = 16


class MemoryLoader:
    def __init__(self, samples: torch.Tensor, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1):
        self.samples, self.mbs, self.rank, self.dp = samples, micro_batch_size, dp_rank, dp_size
        self.consumed_samples = 0

    @property
    def next_first_sample(self) -> int:
        return self.consumed_samples + self.rank * self.mbs

    def next_micro_batch(self) -> torch.Tensor:
        start = (self.consumed_samples + self.rank * self.mbs) % len(self.samples)
        idx = torch.arange(start, start + self.mbs) % len(self.samples)
        self.consumed_samples += self.mbs * self.dp
        return self.samples[idx]

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = state["consumed_samples"]


def random_samples(n: int, seed: int = 0) -> torch.Tensor:
    """Token sequences with a learnable pattern (next = current + 1 mod VOCAB, from a random start)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (n, 1), generator=g)
    return (starts + torch.arange(SEQ + 1)) % VOCAB


def tiny_config(moe: bool = True, **train) -> RunConfig:
    cfg = RunConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 2, 32, 4, SEQ, VOCAB
    m.make_vocab_size_divisible_by = 32
    m.num_experts = [4] if moe else [1]
    m.topk = 2 if moe else 1
    m.hidden_dropout = m.attention_dropout = 0.1
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.train_iters, t.lr, t.log_interval = 2, 4, 6, 3e-3, 2
    t.eval_interval, t.eval_iters = 0, 0
    for key, value in train.items():
        section = "model" if hasattr(m, key) else "train"
        setattr(getattr(cfg, section), key, value)
    return cfg


def build_trainer(cfg: RunConfig, env: DistEnv | None = None, samples: torch.Tensor | None = None) -> Trainer:
    env = env or DistEnv()
    dims = cfg.dims(env.world_size)
    torch.manual_seed(cfg.train.seed + env.rank)
    parallel = parallel_model(cfg, env)
    samples = random_samples(512) if samples is None else samples
    dp_rank = dims.coordinates(env.rank).dp  # tensor-parallel peers read the same samples
    loader = MemoryLoader(samples, cfg.train.micro_batch_size, dp_rank, dims.dp)

    def valid():
        return MemoryLoader(random_samples(64, seed=1), cfg.train.micro_batch_size, dp_rank, dims.dp)

    return Trainer(cfg, env, parallel, loader, valid, config_yaml="# test\n")


def run_losses(trainer: Trainer, steps: int) -> list[float]:
    """Run `steps` optimizer steps by hand; the per-step mean LM loss of each (exact floats)."""
    out = []
    trainer.model.train()
    for _ in range(steps):
        result = trainer.train_step()
        trainer._account(result)
        out.append(float(result.sums.losses[0]))
    return out


def parallel_model(cfg: RunConfig, env: DistEnv):
    """This rank's `ParallelModel` as `moetron train` builds it (`parallelize.build`: meta device, this rank's
    stages and shards, initialised, wrapped)."""
    from moetron.parallel.mesh import ParallelMesh
    from moetron.parallel.parallelize import build

    return build(cfg, ParallelMesh.build(cfg.dims(env.world_size), env), env.device)


def parallel_trainer(cfg: RunConfig, env: DistEnv | None = None) -> Trainer:
    """`build_trainer`, but the model comes from the meta-device recipe (`parallel_model`: this rank's shards only)
    and the loader reads this rank's data-parallel slice."""
    env = env or DistEnv()
    parallel = parallel_model(cfg, env)
    mesh = parallel.mesh
    loader = MemoryLoader(random_samples(512), cfg.train.micro_batch_size, mesh.coords.dp, mesh.size("dp"))
    return Trainer(cfg, env, parallel, loader, None, config_yaml="# test\n")
