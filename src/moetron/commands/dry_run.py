"""`moetron dry-run`: the run's real training step on fake CUDA devices, one simulated rank per process, on a CPU.

    moetron dry-run --config gpt-1.3B-moe128 --gpus 64 --num-layers 4 --gpu-memory 80GB
    moetron dry-run --config seed-2x4090-moe128 --gpus 2 --gpu-memory 24GB --json dry.json
    moetron dry-run --config my.yaml --gpus 8 --ranks all --steps 3
    moetron dry-run --config my.yaml --gpus 8 --routing-from runs/my-run    # the hottest EP rank of that routing

Every `moetron train` flag works here too. Each simulated rank is a child process that builds the model with
moetron's own recipe on fake `cuda` tensors (no memory, no values) under torch's fake process group, and runs
`--steps` training steps (default 2: step 2 holds the optimizer's state). It prints the measured peak by category
and where it occurs beside `moetron plan`'s, the host reads per step and per MoE layer with file:line, the
collectives per step, the attention kernel each SDPA call would take, and a verdict.

Exit status: 0 the step runs (and fits --gpu-memory), 1 it does not fit --gpu-memory, 2 a config error or a
GPU-path defect (a CPU tensor on the GPU path, a dtype or kernel-argument error), as one line naming the op and
where in moetron. Needs a C++ compiler (a small shim is built once per torch version). See moetron/dryrun/.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

from moetron.config import RunConfig
from moetron.config_cli import add_config_arguments, cli_overrides, load_config
from moetron.errors import ConfigError, UserError

HELP = "The real training step on fake CUDA devices on a CPU: memory, host reads, collectives, GPU-path defects."
RANK_TIMEOUT_S = 3600  # a full-scale rank takes minutes per step on a CPU


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "Exit status: 0 the step runs (and fits --gpu-memory), 1 it does not fit --gpu-memory, 2 a config error or "
        "a GPU-path defect (one line naming the op and where)."
    )
    group = parser.add_argument_group("dry run")
    group.add_argument(
        "--config", metavar="FILE.yaml", help="the YAML config (or recipe name) `moetron train` would use"
    )
    group.add_argument("--gpus", type=int, help="the run's world size; default: the fewest the parallel sizes need")
    group.add_argument(
        "--ranks",
        default="heaviest",
        help="the ranks to simulate: a list (0,5,7), `all`, or by default one rank of each pipeline stage (ranks "
        "within a stage hold the same shapes under balanced routing)",
    )
    group.add_argument("--gpu-memory", metavar="SIZE", help="memory per GPU for the verdict, e.g. 80GB")
    group.add_argument("--steps", type=int, default=2, help="training steps per rank (default 2)")
    group.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    group.add_argument(
        "--routing-from",
        metavar="RUN_DIR",
        help="size the expert-parallel splits and expert buffers with the routes per expert a training run measured "
        "(its routing_counts.json, as `plan --routing-from`) instead of balanced routing; the default ranks are then "
        "the EP rank whose experts take the most routes",
    )
    add_config_arguments(parser)


def fewest_gpus(cfg: RunConfig) -> int:
    import math

    p = cfg.parallel
    return math.lcm(p.moe_expert_parallel_size, p.tensor_model_parallel_size * p.pipeline_model_parallel_size
                    * p.context_parallel_size)  # fmt: skip


def chosen_ranks(text: str, cfg: RunConfig, world_size: int, hot_ep_rank: int = 0) -> list[int]:
    """`--ranks`: all, a list, or by default the first rank of each pipeline stage whose EP coordinate is
    `hot_ep_rank` (the rank owning the most-routed experts; any one under balanced routing)."""
    if text == "all":
        return list(range(world_size))
    if text == "heaviest":
        dims, first = cfg.dims(world_size), {}
        for rank in range(world_size):
            coords = dims.coordinates(rank)
            if coords.ep == hot_ep_rank % dims.ep:
                first.setdefault(coords.pp, rank)
        return sorted(first.values())
    try:
        ranks = sorted({int(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise UserError(f"--ranks {text!r}: give `all` or a comma-separated list of ranks, e.g. 0,5") from None
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad or not ranks:
        raise UserError(f"--ranks {text!r}: ranks run from 0 to {world_size - 1} on --gpus {world_size}")
    return ranks


def checked_config(args: argparse.Namespace) -> tuple[RunConfig, int]:
    """The run's config and world size; a ConfigError naming every problem `moetron train` would refuse (apart from
    this machine's files: a dry run reads no data and writes nothing)."""
    from moetron.commands.tokenizer_flags import tokenizer_given
    from moetron.plan.estimate import layout_problems
    from moetron.train.run import resolve_vocab_size

    cfg, explicit = load_config(args.config, cli_overrides(args))
    if tokenizer_given(cfg):
        resolve_vocab_size(cfg, explicit)
    world_size = args.gpus if args.gpus is not None else fewest_gpus(cfg)
    if world_size < 1:
        raise UserError(f"--gpus must be >= 1, got {world_size}")
    if args.steps < 1:
        raise UserError(f"--steps must be >= 1, got {args.steps}")
    problems = layout_problems(cfg, world_size)
    if problems:
        raise ConfigError(problems)
    return cfg, world_size


def planned_peak(cfg: RunConfig, world_size: int, routing_from: str | None = None) -> float | None:
    """`moetron plan`'s peak for the layout (with `--routing-from`: for its hottest EP rank, as plan says it)."""
    from moetron.plan.memory import planned_peak_bytes

    if not routing_from:
        return planned_peak_bytes(cfg, world_size, "cuda")
    from moetron.plan.estimate import make_plan
    from moetron.plan.hardware import accelerator
    from moetron.plan.routing_from import hottest_rank_plan, read_routing

    plan = make_plan(cfg, world_size, accelerator(None))
    return hottest_rank_plan(plan, read_routing(routing_from))[0].memory.peak


def measured_routing(run_dir: str, cfg: RunConfig) -> dict[int, list[float]]:
    """Routes per expert by MoE layer index from a run's routing_counts.json (one line when it does not fit)."""
    from moetron.plan.routing_from import read_routing

    layers = cfg.model.routed_layer_indices()
    routes = read_routing(run_dir).routes_per_layer
    experts = cfg.model.experts_per_layer()
    mismatched = [i for r, i in zip(routes, layers, strict=False) if i < len(experts) and len(r) != experts[i]]
    if len(routes) != len(layers) or mismatched:
        raise UserError(
            f"--routing-from {run_dir}: its routing counts are of {len(routes)} MoE layer(s) of "
            f"{sorted({len(r) for r in routes})} experts; this model has {len(layers)} of {sorted(set(experts))}"
        )
    return dict(zip(layers, routes, strict=True))


def hottest_ep_rank(routing: dict[int, list[float]], cfg: RunConfig, world_size: int) -> int:
    """The EP rank whose experts take the most routes, summed over the MoE layers (0 under balanced routing)."""
    from moetron.dryrun.stand_ins import rank_shares

    ep = cfg.dims(world_size).ep
    if not routing or ep == 1:
        return 0
    totals = [sum(shares) for shares in zip(*(rank_shares(r, ep) for r in routing.values()), strict=True)]
    return max(range(ep), key=totals.__getitem__)


def run_ranks(
    cfg: RunConfig, ranks: list[int], world_size: int, steps: int, routing: dict[int, list[float]] | None = None
) -> list[dict]:
    """One child process per rank, one after another (each uses every core it is given); their records."""
    from moetron.dryrun.shim import SHIM_ENV, built_shim

    shim = built_shim()
    records = []
    with tempfile.TemporaryDirectory(prefix="moetron-dry-run-") as tmp:
        config = Path(tmp) / "config.pkl"
        config.write_bytes(pickle.dumps(cfg))
        extra = []
        if routing:
            extra = [str(Path(tmp) / "routing.json")]
            Path(extra[0]).write_text(json.dumps(routing))
        env = {**os.environ, SHIM_ENV: str(shim or ""), "PYTHONUNBUFFERED": "1"}
        for rank in ranks:
            out = Path(tmp) / f"rank{rank}.json"
            command = [sys.executable, "-m", "moetron.dryrun.worker", str(config), str(rank), str(world_size)]
            proc = subprocess.run([*command, str(steps), str(out), *extra], env=env, capture_output=True, text=True,
                                  timeout=RANK_TIMEOUT_S)  # fmt: skip
            if not out.is_file():
                tail = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()][-1:]
                raise UserError(f"dry-run: rank {rank} ended without a report (exit {proc.returncode}): {tail}")
            record = json.loads(out.read_text())
            if "error" in record:
                raise UserError(error_line(rank, record))
            records.append(record)
    return records


def error_line(rank: int, record: dict) -> str:
    """One line for a rank that failed: a GPU-path defect (naming the op and where), or the harness's own check (a
    torch-side patch that no longer applies: `moetron/dryrun/patches.py`)."""
    if record["error"].startswith("AssertionError: dry run:"):
        return f"dry-run: rank {rank}: {record['error'].removeprefix('AssertionError: ')}"
    if record["error"].startswith(("ConfigError: ", "UserError: ")):
        return f"dry-run: rank {rank}: {record['error'].split(': ', 1)[1]}"
    op = f" in {record['op']}" if record.get("op") else ""
    return f"dry-run: rank {rank}: GPU-path defect{op} at {record['where']}: {record['error']}"


def measured_report(
    cfg: RunConfig,
    world_size: int,
    ranks: str = "heaviest",
    steps: int = 2,
    routing_from: str | None = None,
    memory: int | None = None,
) -> dict:
    """The dry run's report (the JSON contract of `moetron/dryrun/report.py`) of `cfg` on `world_size` GPUs; also
    `moetron plan --dry-run`'s."""
    from moetron.dryrun import report
    from moetron.plan.hardware import GIB

    routing = measured_routing(routing_from, cfg) if routing_from else None
    chosen = chosen_ranks(ranks, cfg, world_size, hottest_ep_rank(routing or {}, cfg, world_size))
    records = run_ranks(cfg, chosen, world_size, steps, routing)
    context = GIB  # the plan's CUDA context and workspaces (plan/hardware.py)
    return report.merge(records, world_size, planned_peak(cfg, world_size, routing_from), memory, context)


def run(args: argparse.Namespace) -> int:
    from moetron.dryrun import report
    from moetron.plan.hardware import GIB, parse_memory

    cfg, world_size = checked_config(args)
    memory = parse_memory(args.gpu_memory) if args.gpu_memory else None
    merged = measured_report(cfg, world_size, args.ranks, args.steps, args.routing_from, memory)
    print(report.format_report(merged, GIB), flush=True)
    if args.json:
        from moetron.fileio import write_atomic

        write_atomic(args.json, json.dumps(merged, indent=2) + "\n")
    return report.exit_status(merged)
