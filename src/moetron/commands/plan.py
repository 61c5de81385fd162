"""`moetron plan`: will this config fit, how big is it, how long is a step — without running anything.

    moetron plan --config configs/seed-2x4090-moe128.yaml --gpus 2 --gpu-type 4090
    moetron plan --config configs/gpt-1.3B-moe128.yaml --gpus 64 --gpu-type A100-80GB --micro-batch-size 4
    moetron plan --config my.yaml --gpus 8 --gpu-memory 48GB --peak-tflops 150 --json
    moetron plan --config gpt-1.3B-moe128 --scale-down --gpu-type cpu --gpu-memory 8GB    # what --scale-down trains

Every `moetron train` flag works here too and changes what is planned (`--moe-expert-parallel-size 4`).
When the config file's expert-parallel size cannot run on `--gpus` (a recipe's EP 64 on 2 GPUs), the plan uses
the largest size that divides the GPUs and every expert count, at most the config's, and says so; an explicit
`--moe-expert-parallel-size` is planned as given.

The config is checked as `moetron train` checks it (`validate`, every problem at once, the same words), so a
layout train refuses — expert replicas with PP, say — is an error here too; only the checks of this machine's files
(datasets, tokenizer files, output directories: plan reads and writes none) are left to train.

Exit status (scriptable): 0 the config fits, 1 it does not fit (the changes that would are listed), 2 an error
(a config `moetron train` refuses included).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from moetron.commands.plan_search import add_search_arguments, run_search
from moetron.commands.tokenizer_flags import tokenizer_given
from moetron.config import RunConfig
from moetron.config_cli import add_config_arguments, cli_names, cli_overrides, load_config
from moetron.errors import UserError
from moetron.plan.advice import largest_micro_batch, suggestions
from moetron.plan.cost_model import network, priced
from moetron.plan.estimate import Plan, adapted_expert_parallel, make_plan
from moetron.plan.hardware import DEFAULT_GPU, KNOWN, accelerator, with_article
from moetron.plan.peak_parts import held_at_peak
from moetron.plan.report import format_plan, plan_dict
from moetron.plan.routing_from import hottest_rank_plan, read_routing
from moetron.recipes.scale_down import describe, scale_down
from moetron.train.run import resolve_vocab_size

HELP = "Parameters, FLOPs, per-GPU memory and a fits/doesn't-fit verdict, without running."
EXIT_FITS, EXIT_DOES_NOT_FIT = 0, 1  # errors exit 2, as everywhere


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "Exit status: 0 the config fits, 1 it does not fit (the changes that would fit are listed), 2 an error "
        "(also a config `moetron train` refuses; its data, tokenizer and output paths need not exist here). "
        "A config file's --moe-expert-parallel-size that cannot run on --gpus is lowered to the largest that can "
        "(said on stderr); one given as a flag is planned as given."
    )
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
    group.add_argument("--json", action="store_true", help="print the plan as JSON")
    group.add_argument(
        "--scale-down",
        action="store_true",
        help="plan the config as `moetron train --scale-down` shrinks it (fp32 with --gpu-type cpu); what changed "
        "is said on stderr",
    )
    group.add_argument(
        "--routing-from",
        metavar="RUN_DIR",
        help="size the hottest expert-parallel rank's expert activations and time with the routes per expert a "
        "training run measured (its routing_counts.json; with --moe-expert-replicas if given) instead of "
        "assuming balanced routing",
    )
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="also run the step on fake CUDA devices on this CPU (`moetron dry-run`: the heaviest rank of each "
        "pipeline stage, 2 steps) and print its measured peak beside the plan's; the verdict is then the dry run's",
    )
    add_search_arguments(parser)
    add_config_arguments(parser)


def adapt_expert_parallel(cfg: RunConfig, gpus: int, explicit: set[str]) -> str | None:
    """Lower the config file's expert-parallel size to one these GPUs can run; the note saying so, or None."""
    if "moe_expert_parallel_size" in cli_names(explicit):
        return None
    ep = adapted_expert_parallel(cfg, gpus)
    if ep is None:
        return None
    old = cfg.parallel.moe_expert_parallel_size
    cfg.parallel.moe_expert_parallel_size = ep
    experts = "/".join(map(str, sorted({e for e in cfg.model.experts_per_layer() if e > 1}))) or "no"
    return (
        f"note: the config's --moe-expert-parallel-size {old} cannot run on {gpus} GPU(s); planning with {ep}, the "
        f"largest that divides the data-parallel size {cfg.dims(gpus).dp} and the {experts} experts per MoE layer "
        f"(pass --moe-expert-parallel-size to plan another)"
    )


def run(args: argparse.Namespace) -> int:
    cfg, explicit = load_config(args.config, cli_overrides(args))
    if args.scale_down:
        changed = scale_down(cfg, explicit, on_gpu=(args.gpu_type or "").lower() != "cpu", world_size=args.gpus or 1)
        print(f"note: {describe(changed)}", file=sys.stderr, flush=True)
    if tokenizer_given(cfg):
        # the vocabulary `moetron train` would use: the tokenizer's, unless --vocab-size is set (same rule as train)
        resolve_vocab_size(cfg, explicit)
    p = cfg.parallel  # default: the fewest GPUs the parallel degrees need (EP may span the TP ranks)
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    fewest = math.lcm(p.moe_expert_parallel_size, model_parallel)
    gpus = args.gpus if args.gpus is not None else fewest
    if gpus < 1:
        raise UserError(f"--gpus must be >= 1, got {gpus}")
    if not 0 < args.efficiency <= 1:
        raise UserError(f"--efficiency is a fraction in (0, 1], got {args.efficiency}; e.g. 0.5")
    device = accelerator(args.gpu_type, args.gpu_memory, cfg.train.peak_tflops)
    if args.routing_from and (args.search or args.measure):
        raise UserError("--routing-from sizes one layout's hottest EP rank; drop --search/--measure or it")
    if args.dry_run and (args.search or args.measure):
        raise UserError("--dry-run measures one layout; drop --search/--measure or it")
    if args.dry_run and device.kind != "cuda":
        raise UserError(f"--dry-run runs the CUDA step; --gpu-type {args.gpu_type} plans a CPU: drop one of them")
    if args.search or args.measure:
        return run_search(args, cfg, gpus, device, explicit)
    note = adapt_expert_parallel(cfg, gpus, explicit)
    if note:
        print(note, file=sys.stderr, flush=True)
    net = network(gpus, args.nodes, device.name, args.interconnect, args.intra_node_bandwidth,
                  args.inter_node_bandwidth)  # fmt: skip
    plan = priced(make_plan(cfg, gpus, device), net, args.efficiency)  # the step time `plan --search` gives it
    hot = None
    if args.routing_from:  # the hottest EP rank under a run's measured routing (plan/routing_from.py)
        plan, hot = hottest_rank_plan(plan, read_routing(args.routing_from))
    fixes, larger = suggestions(plan), largest_micro_batch(plan)
    measured = measured_beside(plan, args.routing_from) if args.dry_run else None
    if args.json:
        routing = {"routing_from": hot.to_dict()} if hot else {}
        dry = {"dry_run": measured} if measured else {}
        print(json.dumps({**plan_dict(plan, fixes, args.config, larger), **routing, **dry}, indent=2))
    else:
        print((hot.line() + "\n" if hot else "") + format_plan(plan, fixes, args.config, larger))
        if measured:
            print(dry_run_lines(plan, measured))
    if measured:  # the measured peak decides
        return EXIT_FITS if measured["fits"] else EXIT_DOES_NOT_FIT
    return EXIT_FITS if plan.fits else EXIT_DOES_NOT_FIT


def measured_beside(plan: Plan, routing_from: str | None) -> dict:
    """`--dry-run`: the dry run's report for the planned layout, its fit judged as the plan's (same context)."""
    from moetron.commands.dry_run import measured_report

    dry = measured_report(plan.cfg, plan.dims.world_size, routing_from=routing_from)
    dry["gpu_memory_bytes"] = plan.device.memory_bytes
    dry["fits"] = dry["peak_bytes"] + plan.device.context_bytes <= plan.device.memory_bytes
    return dry


def dry_run_lines(plan: Plan, measured: dict) -> str:
    from moetron.dryrun.report import format_beside_plan, gib

    word = "fits" if measured["fits"] else "does NOT fit"
    needed = measured["peak_bytes"] + plan.device.context_bytes
    return (
        format_beside_plan(held_at_peak(plan.memory), measured)
        + f"\nverdict (dry run): {word} {with_article(plan.device.name)} ({gib(needed)} with the CUDA context; "
        f"{gib(plan.device.memory_bytes)} available)"
    )
