"""`moetron train`: train a GPT / MoE GPT from a YAML config and Megatron-named flags.

    moetron train --config configs/seed-2x4090-moe128.yaml --train-iters 200 --save runs/tiny
    torchrun --nproc-per-node 2 -m moetron train --config configs/seed-2x4090-moe128.yaml   # data parallel

The config is parsed and validated (every problem at once) before any process group or data is touched.
"""

from __future__ import annotations

import argparse

from moetron.config import check
from moetron.config_cli import add_config_arguments, cli_overrides, load_config

HELP = "Train a GPT / MoE GPT (single process or under torchrun)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="YAML mapping of flag names (num_layers: 4 ...), flat or in model/data/parallel/train sections; "
        "flags given on the command line override it",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as YAML and exit without training"
    )
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from moetron.parallel.env import init_distributed, world_size_from_env
    from moetron.train.run import resolve_vocab_size

    cfg, explicit = load_config(args.config, cli_overrides(args))
    check(cfg, world_size_from_env())
    resolve_vocab_size(cfg, explicit)  # the tokenizer fixes (or checks) the vocabulary before any process group
    if args.print_config:
        from moetron.config_cli import to_yaml

        print(to_yaml(cfg), end="")
        return 0
    from moetron.train.failures import own_errors
    from moetron.train.run import run_training

    env = init_distributed(cfg.parallel.distributed_backend, cfg.parallel.distributed_timeout_minutes)
    try:
        with own_errors():  # from here on an error may be one rank's alone: that rank says it
            returncode = run_training(cfg, explicit, env)
    except BaseException:
        env.close()
        raise
    return env.finish(returncode)
