"""`moetron train`: train a GPT / MoE GPT from a YAML config and Megatron-named flags.

    moetron train --config configs/seed-2x4090-moe128.yaml --train-iters 200 --save runs/tiny
    torchrun --nproc-per-node 2 -m moetron train --config configs/seed-2x4090-moe128.yaml   # data parallel
    moetron train --config gpt-1.3B-moe128 --scale-down --data-path ... --vocab-file ... --merge-file ...  # on a CPU

The config is parsed and validated (every problem at once) before any process group or data is touched: the
tokenizer's vocabulary first (the tensor-parallel rules need it), then every section, then `--load`'s checkpoint
against the model (its saved config.yaml).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from moetron.config import RunConfig
from moetron.config_cli import add_config_arguments, cli_overrides, load_config
from moetron.errors import ConfigError, UserError
from moetron.progress import on_rank_zero
from moetron.recipes.scale_down import scale_down
from moetron.train.tensorboard_dir import tensorboard_follows_the_run
from moetron.validate import validate

HELP = "Train a GPT / MoE GPT (single process or under torchrun)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="YAML mapping of flag names (num_layers: 4 ...), flat or in model/data/parallel/train sections; "
        "flags given on the command line override it",
    )
    parser.add_argument(
        "--scale-down",
        action="store_true",
        help="shrink the config to a tiny model of the same kind that trains on a CPU in seconds (width, depth, "
        "experts, batch, 20 iterations, schedule, fp32 on a CPU); flags given here still win",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as YAML and exit without training"
    )
    add_config_arguments(parser)


def vocab_problems(cfg: RunConfig, explicit: set[str]) -> list[str]:
    """Size the vocabulary from the tokenizer (or check the size given against it); its problem, or []. Missing
    tokenizer files are the data section's problems."""
    from moetron.train.run import resolve_vocab_size

    if cfg.data.tokenizer_file_problems():
        return []
    try:
        resolve_vocab_size(cfg, explicit)
    except UserError as err:
        return [str(err)]
    return []


def startup_problems(cfg: RunConfig, explicit: set[str], world_size: int) -> list[str]:
    """Every problem of the run, before any process group: the vocabulary, the config, the checkpoint to load."""
    from moetron.checkpoint.architecture import checkpoint_model_problems

    problems = vocab_problems(cfg, explicit)
    vocab_known = not problems and not cfg.data.tokenizer_file_problems()
    problems += validate(cfg, world_size)
    if vocab_known:  # else the model's vocabulary is not the one the run would have: no comparison
        problems += checkpoint_model_problems(cfg)
    return problems


def checked_config(args: argparse.Namespace, world_size: int) -> tuple[RunConfig, set[str]]:
    """The run's config and the fields given explicitly, or a `ConfigError` naming every startup problem."""
    cfg, explicit = load_config(args.config, cli_overrides(args))
    if args.scale_down:
        import torch

        scale_down(cfg, explicit, on_gpu=torch.cuda.is_available(), world_size=world_size)
    tensorboard_follows_the_run(cfg, explicit)  # a recipe's tensorboard/NAME, with --save given: inside that run
    problems = startup_problems(cfg, explicit, world_size)
    if not problems and not args.print_config:  # "nothing to train": only for a run that could start and trains
        from moetron.checkpoint.continuation import continuation_problems

        problems = continuation_problems(cfg, cfg.dims(world_size).dp)
    if problems:
        raise ConfigError(problems)
    return cfg, explicit


def check_before_launch(args: argparse.Namespace, world_size: int) -> None:
    """`moetron launch` runs this before torchrun starts a worker (see `commands/launch.py`)."""
    checked_config(args, world_size)


def run(args: argparse.Namespace, on_step: Callable | None = None) -> int:
    """`on_step`: called with each optimizer step's `StepResult` (`plan --measure`'s worker: `moetron.cli.main`)."""
    from moetron.parallel.env import init_distributed, world_size_from_env

    world_size = world_size_from_env()
    cfg, explicit = checked_config(args, world_size)
    if args.print_config:
        from moetron.config_cli import to_yaml

        print(to_yaml(cfg, with_intentions=True), end="")
        return 0
    from moetron.checkpoint.continuation import finished_run_note

    note = finished_run_note(cfg, world_size)
    if note is not None:  # a finished run resumed as it was (a requeue): Megatron's zero iterations and exit 0
        if on_rank_zero():  # every rank knows it; rank 0 says it
            print(note, file=sys.stderr)
        return 0
    from moetron.plan.memory import planned_peak_bytes
    from moetron.train.failures import own_errors
    from moetron.train.run import run_training

    env = init_distributed(cfg.parallel.distributed_backend, cfg.parallel.distributed_timeout_minutes)
    try:
        with own_errors():  # from here on an error may be one rank's alone: that rank says it
            returncode = run_training(cfg, explicit, env, planned_peak_bytes, on_step)
    except BaseException:
        env.close()
        raise
    return env.finish(returncode)
