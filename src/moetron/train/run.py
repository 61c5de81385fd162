"""From a validated `RunConfig` to a finished run: seeds, tokenizer, datasets, model, trainer, resume.

Order matters for exactness and for clear errors: the config was validated before any process group
existed (`moetron.config.check`); here the tokenizer fixes the vocabulary (unless `vocab_size` was given),
the datasets are built (rank 0 writes index caches first), the model is created from the same seed on every
rank (weights are drawn per parameter name, so they are identical everywhere), dropout/routing RNGs are
offset per rank, and finally a checkpoint is loaded when `--load` names one.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from moetron.config import RunConfig
from moetron.config_cli import to_yaml
from moetron.errors import UserError
from moetron.parallel.env import DistEnv
from moetron.parallel.parallelize import build_model
from moetron.train.checkpoint import resolve_checkpoint
from moetron.train.trainer import Trainer


def seed_everything(seed: int, rank: int) -> None:
    """Per-rank streams for dropout and routing noise (model init does not use them)."""
    torch.manual_seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    random.seed(seed + rank)


def resolve_vocab_size(cfg: RunConfig, explicit: set[str]) -> None:
    if "vocab_size" in explicit:
        return
    from moetron.data.tokenizer import build_tokenizer

    d = cfg.data
    tokenizer = build_tokenizer(d.tokenizer_type, d.vocab_file, d.merge_file, d.tokenizer_model)
    cfg.model.vocab_size = tokenizer.vocab_size


def sample_counts(cfg: RunConfig, dp: int) -> tuple[int, int, int]:
    """(train, valid, test) samples to index: the whole run, and the fixed validation batches."""
    gbs = cfg.global_batch(dp)
    eval_samples = cfg.train.eval_iters * gbs
    return cfg.total_iters(dp) * gbs, eval_samples, eval_samples


def build_loaders(cfg: RunConfig, env: DistEnv):
    """(train loader, factory of fresh validation loaders or None)."""
    from moetron.data.gpt_dataset import build_gpt_datasets
    from moetron.data.loader import DistributedBatchLoader

    dp = cfg.dims(env.world_size).dp
    train_ds, valid_ds, _ = build_gpt_datasets(
        cfg.data,
        cfg.model.seq_length,
        cfg.train.seed,
        num_samples=sample_counts(cfg, dp),
        cache_barrier=env.barrier if env.distributed else None,
        is_builder=env.is_main,
    )
    if train_ds is None or len(train_ds) == 0:
        raise UserError("the training split is empty; check --data-path and --split (e.g. --split 98,2,0)")
    mbs = cfg.train.micro_batch_size
    train_loader = DistributedBatchLoader(train_ds, mbs, env.rank, dp, num_workers=cfg.data.num_workers)
    make_valid = None
    if valid_ds is not None and len(valid_ds) > 0 and cfg.train.eval_iters > 0:

        def make_valid():
            return DistributedBatchLoader(valid_ds, mbs, env.rank, dp)

    return train_loader, make_valid


def find_checkpoint(cfg: RunConfig):
    """The checkpoint `--load` names (None: start fresh); checked before any data or model is built."""
    t = cfg.train
    if not t.load:
        return None
    path = resolve_checkpoint(t.load)
    if path is None and t.exit_on_missing_checkpoint:
        raise UserError(
            f"--load {t.load}: no checkpoint there (no 'latest' file or iter_* directory) and "
            f"--exit-on-missing-checkpoint is set; fix the path or drop the flag to start fresh"
        )
    return path


def load_into(trainer: Trainer, cfg: RunConfig, path) -> None:
    if path is None:
        if cfg.train.load:
            trainer.logger_print(f"warning: --load {cfg.train.load} holds no checkpoint; starting from scratch")
        return
    trainer.load(path)
    what = "weights (finetune)" if cfg.train.finetune else f"iteration {trainer.progress.iteration}"
    trainer.logger_print(f" loaded checkpoint {path}: {what}")


def run_training(cfg: RunConfig, explicit: set[str], env: DistEnv) -> int:
    checkpoint = find_checkpoint(cfg)
    seed_everything(cfg.train.seed, env.rank)
    resolve_vocab_size(cfg, explicit)
    train_loader, make_valid = build_loaders(cfg, env)
    model = build_model(cfg.model, env, cfg.dims(env.world_size), cfg.train.seed)
    trainer = Trainer(cfg, env, model, train_loader, make_valid, config_yaml=to_yaml(cfg))
    load_into(trainer, cfg, checkpoint)
    return trainer.train()
