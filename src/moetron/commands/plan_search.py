"""`moetron plan --search` (and `--measure`): the flags and the run, hooked into `moetron plan` (commands/plan.py).

    moetron plan --config configs/gpt-1.3B-moe128.yaml --gpus 64 --gpu-type A100-80GB --search
    moetron plan --config my.yaml --gpus 16 --nodes 2 --gpu-type H100 --interconnect nvlink4,ib-ndr --search --json
    moetron plan --config tiny.yaml --gpus 4 --gpu-type cpu --gpu-memory 8GB --search --measure --top 3

Exit status: 0 layouts fit (the table lists them), 1 none fits the memory (the reason is printed), 2 an error —
including flags that fix dimensions to values no layout of --gpus combines, and a GPU count no layout divides.
"""

from __future__ import annotations

import argparse
import json
import sys

from moetron.config import RunConfig
from moetron.config_cli import cli_names, load_config
from moetron.errors import UserError
from moetron.plan.cost_model import DEFAULT_EFFICIENCY, INTERCONNECTS, network
from moetron.plan.hardware import Accelerator
from moetron.plan.search import fixed_dimensions, given_flags, nothing_fits, search
from moetron.plan.search_report import format_search, search_dict

DEFAULT_TOP = 10


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("search (--search)")
    group.add_argument(
        "--search",
        action="store_true",
        help="rank every parallel layout that fits (tp, sp, pp, virtual stages, ep, etp, ZeRO, micro batch, "
        "checkpointing) by predicted step time; layout flags given on the command line stay fixed",
    )
    group.add_argument("--top", type=int, default=DEFAULT_TOP, help=f"rows to show ({DEFAULT_TOP})")
    group.add_argument(
        "--nodes", type=int, help="nodes the GPUs are spread over (default: 1 up to 8 GPUs, else nodes of 8)"
    )
    group.add_argument(
        "--interconnect",
        metavar="INTRA[,INTER]",
        help=f"links within / between nodes, from {', '.join(INTERCONNECTS)} (default: the --gpu-type's; "
        "plan/cost_model.py lists them with their sources)",
    )
    group.add_argument("--intra-node-bandwidth", type=float, metavar="GB/s", help="override: GB/s one way per GPU")
    group.add_argument("--inter-node-bandwidth", type=float, metavar="GB/s", help="override: GB/s one way per GPU")
    group.add_argument(
        "--efficiency",
        type=float,
        default=DEFAULT_EFFICIENCY,
        help=f"share of the peak TFLOP/s the matmuls reach ({DEFAULT_EFFICIENCY}); communication is added on top",
    )
    group.add_argument(
        "--measure",
        action="store_true",
        help="run each shown layout for a few steps (torchrun; gloo on CPU, NCCL on GPUs) and re-rank by measured "
        "step time",
    )
    group.add_argument("--measure-steps", type=int, default=6, help="training steps per measured layout (6)")


def check_search_arguments(args: argparse.Namespace) -> None:
    if args.top < 1:
        raise UserError(f"--top {args.top} must be >= 1 (the number of layouts to show)")
    if not 0 < args.efficiency <= 1:
        raise UserError(f"--efficiency is a fraction in (0, 1], got {args.efficiency}; e.g. 0.5")
    if args.measure and args.measure_steps < 3:
        raise UserError(f"--measure-steps {args.measure_steps} must be >= 3 (the first steps warm up and are skipped)")
    if args.measure and not args.search:
        raise UserError("--measure needs --search (it measures the layouts the search ranks first)")


def run_search(args: argparse.Namespace, cfg: RunConfig, gpus: int, device: Accelerator, explicit: set[str]) -> int:
    check_search_arguments(args)
    net = network(gpus, args.nodes, device.name, args.interconnect, args.intra_node_bandwidth,
                  args.inter_node_bandwidth)  # fmt: skip
    nodes = gpus // net.gpus_per_node
    if args.measure and nodes > 1:
        raise UserError(
            f"--measure runs the layouts on this machine, but --gpus {gpus} spans {nodes} nodes; measure on one node "
            "(--nodes 1 with the GPUs it has) and plan the cluster without --measure"
        )
    flags = cli_names(explicit)
    file_only, _ = load_config(args.config, {})  # what each printed command's `--config FILE` starts from
    result = search(cfg, gpus, device, net, args.efficiency, fixed_dimensions(cfg, flags), file_only,
                    given_flags(cfg, flags))  # fmt: skip
    if not result.rows:
        message = nothing_fits(result, gpus, device)
        if args.json:
            print(json.dumps({"config": args.config, "gpus": gpus, "rows": [], "reason": message}, indent=2))
        print(f"error: {message}", file=sys.stderr)
        return 1 if result.valid else 2  # valid layouts too big: "does not fit"; none valid: the flags' error
    rows = result.rows[: args.top]
    if args.measure:
        from moetron.plan.measure import measure_rows

        rows = measure_rows(rows, args.config, gpus, args.measure_steps)
    output = search_dict if args.json else format_search
    text = output(result, rows, args.config, gpus, nodes, net, args.efficiency)
    print(json.dumps(text, indent=2) if args.json else text)
    return 0
