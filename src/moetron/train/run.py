"""From a validated `RunConfig` to a finished run: seeds, tokenizer, datasets, model, trainer, resume.

Order matters for exactness and for clear errors: the config was validated before any process group
existed (`moetron.validate.check`); here rank 0 first takes the run directory's lock (`run_lock`: one run at a
time writes there), the mesh gives this rank its coordinates, the tokenizer fixes the
vocabulary (unless `vocab_size` was given), the datasets are built (rank 0 writes index caches first), this
rank's part of the model is built from the same seed on every rank (weights are drawn per parameter name and
global expert id, so they are identical everywhere), a checkpoint is loaded when `--load` names one, and only
then does `--overwrite` delete the previous run's output.
Dropout and routing draws are keyed by sample and layer (`moetron.model.rng`), not by rank.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import torch

from moetron.checkpoint import resolve_checkpoint
from moetron.config import RunConfig
from moetron.config_cli import to_yaml
from moetron.data.config import DataConfig, parse_blend
from moetron.errors import UserError
from moetron.parallel.env import DistEnv
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.parallelize import build
from moetron.train.peak_memory import planned_line, startup_baseline
from moetron.train.run_lock import run_directory_lock
from moetron.train.startup import startup_banner, startup_warnings
from moetron.train.trainer import Trainer


def seed_everything(seed: int, dp_rank: int) -> None:
    """The global generators, one stream per data-parallel replica (tensor- and pipeline-parallel peers share it,
    as Megatron's default stream is shared). The model's own draws do not use them while training: each layer
    runs on a stream keyed by sample and layer (`moetron.model.rng`); model init uses neither."""
    torch.manual_seed(seed + dp_rank)
    np.random.seed((seed + dp_rank) % 2**32)
    random.seed(seed + dp_rank)


def resolve_vocab_size(cfg: RunConfig, explicit: set[str]) -> None:
    """Set `cfg.model.vocab_size` from the tokenizer, or check the value given against it.

    No tokenizer files named: the configured value stands. Otherwise, with T the tokenizer's size:
    `--vocab-size V` on the command line must be >= T (larger pads the embedding on purpose); a config file's
    `vocab_size` must equal T (a recipe's GPT-2 50257 must not silently size the model of another tokenizer);
    not given at all: T. Raises a one-line UserError naming both sizes and the fix.
    """
    from moetron.config_cli import cli_names, yaml_names

    d = cfg.data
    if not (d.vocab_file or d.tokenizer_model):
        return
    from moetron.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(d.tokenizer_type, d.vocab_file, d.merge_file, d.tokenizer_model)
    size, given, files = tokenizer.vocab_size, cfg.model.vocab_size, _tokenizer_files(d)
    if "vocab_size" in cli_names(explicit):
        if given < size:
            raise UserError(
                f"--vocab-size {given} is smaller than the tokenizer's {size} tokens ({files}): ids >= {given} "
                f"would fall outside the embedding; drop --vocab-size (the tokenizer's size is used) or give >= {size}"
            )
        return
    if "vocab_size" in yaml_names(explicit) and given != size:
        source = getattr(explicit, "config_path", None) or "the config file"
        raise UserError(
            f"--config {source}: vocab_size {given} differs from the tokenizer's {size} tokens ({files}); pass "
            f"--vocab-size {size} (a flag wins over the config file; a larger value pads the embedding on purpose), "
            f"or delete vocab_size from the config file"
        )
    cfg.model.vocab_size = size


def _tokenizer_files(d: DataConfig) -> str:
    if d.tokenizer_type == "GPT2BPETokenizer" or not d.tokenizer_model:
        return f"--vocab-file {d.vocab_file}"
    return f"--tokenizer-model {d.tokenizer_model}"


SCAN_BYTES = 8 << 20  # per dataset: enough to catch a wrong tokenizer (its ids are everywhere), cheap to read


def dataset_prefixes(data: DataConfig) -> list[str]:
    """Every indexed-dataset prefix the data flags name (blend weights dropped, each once)."""
    prefixes: list[str] = []
    for paths in (data.data_path, data.train_data_path, data.valid_data_path, data.test_data_path):
        if paths:
            prefixes += parse_blend(paths)[1]
    return list(dict.fromkeys(prefixes))


def max_token_id(prefix: str, scan_bytes: int = SCAN_BYTES) -> int | None:
    """The largest token id in the first `scan_bytes` of `prefix.bin` (None when empty): a bounded memmap read."""
    from moetron.data.indexed import IndexedDataset, bin_path

    dtype = IndexedDataset(prefix).dtype  # validates the .idx header and the .bin size on the way
    count = min(bin_path(prefix).stat().st_size, scan_bytes) // dtype.itemsize
    if count == 0:
        return None
    return int(np.memmap(bin_path(prefix), dtype=dtype, mode="r", shape=(count,)).max())


def check_token_ids(data: DataConfig, vocab_size: int, fix: str) -> None:
    """Fail with the dataset, the id and `fix` before an embedding lookup crashes on an id >= `vocab_size`."""
    for prefix in dataset_prefixes(data):
        high = max_token_id(prefix)
        if high is not None and high >= vocab_size:
            raise UserError(
                f"{prefix}: token id {high} is out of range for the vocabulary of {vocab_size} tokens, so the data "
                f"was preprocessed with another tokenizer; {fix}"
            )


TRAIN_VOCAB_FIX = (
    "train with the tokenizer the data was made with (--tokenizer-type with --vocab-file/--merge-file or "
    "--tokenizer-model), preprocess the data again with this one, or raise --vocab-size above the largest id"
)


def sample_counts(cfg: RunConfig, dp: int) -> tuple[int, int, int]:
    """(train, valid, test) samples to index: the whole run, and the fixed validation batches."""
    gbs = cfg.global_batch(dp)
    eval_samples = cfg.train.eval_iters * gbs
    return cfg.total_iters(dp) * gbs, eval_samples, eval_samples


def no_validation_warning(cfg: RunConfig) -> str:
    d = cfg.data
    why = f"--split {d.split!r} leaves no validation documents" if d.data_path else "no --valid-data-path"
    return (
        f"warning: {why}; --eval-iters {cfg.train.eval_iters} is ignored and no evaluation runs "
        f"(give the split a validation part, e.g. --split 98,2,0, or pass --eval-iters 0)"
    )


def build_loaders(cfg: RunConfig, env: DistEnv, mesh: ParallelMesh):
    """(train loader, factory of fresh validation loaders or None) for this rank's data-parallel replica."""
    from moetron.data.gpt_dataset import build_gpt_datasets
    from moetron.data.loader import DistributedBatchLoader

    dp, dp_rank = mesh.size("dp"), mesh.coords.dp
    cp = {"cp_rank": mesh.coords.cp, "cp_size": mesh.size("cp")}  # CP peers: the same samples, their own chunks
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
    train_loader = DistributedBatchLoader(train_ds, mbs, dp_rank, dp, num_workers=cfg.data.num_workers, **cp)
    make_valid = None
    has_valid = valid_ds is not None and len(valid_ds) > 0
    if not has_valid and cfg.train.eval_iters > 0 and env.is_main:
        # Not an error (training without validation is legitimate), but not silent: eval.jsonl stays empty.
        print(no_validation_warning(cfg), flush=True)
    if has_valid and cfg.train.eval_iters > 0:

        def make_valid():
            return DistributedBatchLoader(valid_ds, mbs, dp_rank, dp, **cp)

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


def discard_if_overwriting(cfg: RunConfig, env: DistEnv) -> None:
    """--overwrite: rank 0 deletes the previous run's checkpoints and logs in the run directory, then all go on.

    Called once everything the new run needs has been read and checked (tokenizer, data, model, the checkpoint
    of a --load elsewhere): a run that fails before it has not deleted anything. A --load inside the run
    directory is refused with --overwrite (`moetron.checkpoint.run_directory.run_directory_problems`)."""
    from moetron.checkpoint.files import discard_previous_run, previous_run

    run_dir = cfg.run_dir()
    if not (cfg.train.overwrite and run_dir):
        return
    if env.is_main and (found := previous_run(run_dir)):
        print(f"--overwrite: deleting the previous run's {found} and logs in {run_dir}", flush=True)
        discard_previous_run(run_dir)
    env.barrier()


def run_training(
    cfg: RunConfig,
    explicit: set[str],
    env: DistEnv,
    plan_memory: Callable | None = None,
    on_step: Callable | None = None,
) -> int:
    """`plan_memory(cfg, world_size, device_type)`: the planner's peak bytes for this layout (the command passes
    `moetron plan`'s: `train` sits below `plan`), for the banner and the log lines. `on_step`: the trainer's (called
    with each optimizer step's `StepResult`)."""
    checkpoint = find_checkpoint(cfg)
    with run_directory_lock(cfg, env):  # before anything in the run directory is written or deleted
        return _build_and_train(cfg, explicit, env, checkpoint, plan_memory, on_step)


def _build_and_train(
    cfg: RunConfig, explicit: set[str], env: DistEnv, checkpoint, plan_memory=None, on_step=None
) -> int:
    mesh = ParallelMesh.build(cfg.dims(env.world_size), env)
    seed_everything(cfg.train.seed, mesh.coords.dp)
    resolve_vocab_size(cfg, explicit)
    check_token_ids(cfg.data, cfg.model.vocab_size, TRAIN_VOCAB_FIX)
    planned = None  # the planner's peak for this layout, once the vocabulary is known
    if plan_memory is not None:
        planned = plan_memory(cfg, env.world_size, env.device.type)
    baseline = startup_baseline(env.device)  # before the loaders and the model: what the plan does not model
    if env.is_main:  # what is about to happen, before the first slow step (index building, model init)
        for line in [*startup_warnings(cfg, env.device.type, env.world_size), startup_banner(cfg, env.world_size,
                     env.device.type, explicit), planned_line(planned, env.device.type, baseline)]:  # fmt: skip
            print(line, flush=True)
    train_loader, make_valid = build_loaders(cfg, env, mesh)
    parallel = build(cfg, mesh, env.device)  # the one recipe: this rank's part, initialised and wrapped
    trainer = Trainer(cfg, env, parallel, train_loader, make_valid, config_yaml=to_yaml(cfg), on_step=on_step)
    trainer.planned_memory_bytes, trainer.baseline_memory_bytes = planned, baseline
    load_into(trainer, cfg, checkpoint)
    discard_if_overwriting(cfg, env)
    return trainer.train()
