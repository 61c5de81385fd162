"""`moetron upcycle`: a dense checkpoint → a MoE checkpoint whose experts start as copies of the dense MLP
(arguments and printing; the conversion is `moetron.interchange.upcycle`, the same concept one level down).

    moetron upcycle --load runs/dense --save runs/moe --num-experts 8 --topk 2 --expert-interval 1
    moetron upcycle --hf hf/llama --save runs/llama-moe --num-experts 8 --topk 2 --disable-moe-token-dropping
    moetron train --config runs/moe/config.yaml --load runs/moe --finetune --data-path ...

Every model flag (`--num-experts`, `--topk`, `--moe-router-topk-renorm`, `--mlp-type residual`, …) sets the MoE
model's config on top of the dense one's (Megatron-Core's `--moe-use-upcycling`, as a conversion step).
"""

from __future__ import annotations

import argparse

from moetron.errors import UserError

HELP = "Turn a dense checkpoint into a MoE one whose experts start as copies of the dense MLP."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moetron.config_cli import add_config_arguments

    parser.add_argument("--hf", metavar="DIR", help="the dense model as a Hugging Face directory (instead of --load)")
    parser.add_argument("--config", metavar="FILE.yaml", help="MoE flags as YAML (flags given here override it)")
    add_config_arguments(parser)  # --load and --save are the config's own flags


def run(args: argparse.Namespace) -> int:
    from moetron.config_cli import cli_overrides, read_yaml
    from moetron.interchange.upcycle import upcycle

    overrides = {**(read_yaml(args.config) if args.config else {}), **cli_overrides(args)}
    load, save = overrides.pop("load", None), overrides.pop("save", None)
    if not save:
        raise UserError("--save DIR is required: the new run directory for the MoE checkpoint")
    result = upcycle(save, overrides, load=load, hf=args.hf)
    print(f"wrote {result.path}: MoE layers {result.moe_layers} (experts = copies of each dense MLP)")
    for note in result.notes[1:]:
        print(f"note: {note}")
    from moetron.interchange.next_command import train_command_lines

    print("\n".join(train_command_lines(save, resume=False)))
    return 0
