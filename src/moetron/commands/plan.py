"""`moetron plan`: will this config fit, how big is it, how long is a step — without running anything.

    moetron plan --config configs/seed-2x4090-moe128.yaml --gpus 2 --gpu-type 4090
    moetron plan --config configs/gpt-1.3B-moe128.yaml --gpus 64 --gpu-type A100-80GB --micro-batch-size 4
    moetron plan --config my.yaml --gpus 8 --gpu-memory 48GB --peak-tflops 150 --json

Every `moetron train` flag works here too and changes what is planned (`--moe-expert-parallel-size 4`).
"""

from __future__ import annotations

import argparse
import json
import math

from moetron.config import RunConfig
from moetron.config_cli import add_config_arguments, cli_overrides, load_config
from moetron.errors import UserError
from moetron.plan.advice import largest_micro_batch, suggestions
from moetron.plan.estimate import DEFAULT_MFU, make_plan
from moetron.plan.hardware import DEFAULT_GPU, KNOWN, accelerator
from moetron.plan.report import format_plan, plan_dict
from moetron.train.run import resolve_vocab_size

HELP = "Parameters, FLOPs, per-GPU memory and a fits/doesn't-fit verdict, without running."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("plan")
    group.add_argument("--config", metavar="FILE.yaml", required=True, help="the YAML config `moetron train` would use")
    group.add_argument(
        "--gpus", type=int, help="number of GPUs (processes) of the run; default: the fewest the parallel sizes need"
    )
    group.add_argument(
        "--gpu-type",
        help=f"one of {', '.join(KNOWN)}; default: with --gpu-memory a GPU of that size "
        f"({DEFAULT_GPU} peak unless --peak-tflops), else an {DEFAULT_GPU}",
    )
    group.add_argument(
        "--gpu-memory", metavar="SIZE", help="memory per GPU, e.g. 24GB (GB = GiB); overrides the type's"
    )
    group.add_argument(
        "--mfu", type=float, default=DEFAULT_MFU, help=f"assumed model FLOPs utilisation for step time ({DEFAULT_MFU})"
    )
    group.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_config_arguments(parser)


def tokenizer_given(cfg: RunConfig) -> bool:
    return bool(cfg.data.vocab_file if cfg.data.tokenizer_type == "GPT2BPETokenizer" else cfg.data.tokenizer_model)


def run(args: argparse.Namespace) -> int:
    cfg, explicit = load_config(args.config, cli_overrides(args))
    if tokenizer_given(cfg):
        # the vocabulary `moetron train` would use: the tokenizer's, unless --vocab-size is set (same rule as train)
        resolve_vocab_size(cfg, explicit)
    p = cfg.parallel  # default: the fewest GPUs the parallel degrees need (EP may span the TP ranks)
    fewest = math.lcm(p.moe_expert_parallel_size, p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
    gpus = args.gpus if args.gpus is not None else fewest
    if gpus < 1:
        raise UserError(f"--gpus must be >= 1, got {gpus}")
    if not 0 < args.mfu <= 1:
        raise UserError(f"--mfu is a fraction in (0, 1], got {args.mfu}; e.g. 0.3 for 30 %")
    device = accelerator(args.gpu_type, args.gpu_memory, cfg.train.peak_tflops)
    plan = make_plan(cfg, gpus, device, args.mfu)
    fixes, larger = suggestions(plan), largest_micro_batch(plan)
    if args.json:
        print(json.dumps(plan_dict(plan, fixes, args.config, larger), indent=2))
    else:
        print(format_plan(plan, fixes, args.config, larger))
    return 0
