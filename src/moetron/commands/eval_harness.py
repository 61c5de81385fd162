"""`moetron eval-harness`: lm-evaluation-harness tasks on a checkpoint (the `moetron` lm-eval model).

    moetron eval-harness --load runs/moe --tasks moetron_tiny                      # the small task shipped with moetron
    moetron eval-harness --load runs/moe --tasks my_task --include-path my_tasks/ --num-fewshot 5 --limit 100
    torchrun --nproc-per-node 2 -m moetron eval-harness --load runs/moe --tasks moetron_tiny   # experts over 2 ranks

Tasks are read from local YAML + JSONL (`--include-path`; HF_HUB_OFFLINE / HF_DATASETS_OFFLINE default to 1):
lm-eval's own tasks (hellaswag, lambada_openai, …) need their data in the HF datasets cache, or network with
HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0. Needs lm_eval (`pip install "moetron[eval]"`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moetron.commands.tokenizer_flags import add_tokenizer_arguments, tokenizer_overrides
from moetron.errors import ConfigError, UserError
from moetron.fileio import write_atomic

HELP = "Run lm-evaluation-harness tasks on a checkpoint (also under torchrun with experts spread)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load", required=True, help="a run directory (its latest checkpoint) or an iter_* directory")
    parser.add_argument("--tasks", required=True, help="comma-separated task or group names (e.g. moetron_tiny)")
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt (default: the task's)")
    parser.add_argument("--limit", type=float, help="documents per task (an int), or a fraction below 1")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass (default 8)")
    parser.add_argument("--include-path", action="append", default=[], metavar="DIR", help="a directory of task YAML")
    parser.add_argument("--output", metavar="FILE.json", help="write the results (and samples with --log-samples)")
    parser.add_argument("--log-samples", action="store_true", help="keep every request and response in --output")
    parser.add_argument(
        "--capacity-factor", type=float, help="route MoE layers at this capacity factor (default: dropless)"
    )
    parser.add_argument("--expert-parallel-size", type=int, help="under torchrun (default: as many ranks as divide E)")
    parser.add_argument("--max-gen-toks", type=int, default=256, help="generation limit when a task sets none")
    parser.add_argument("--seed", type=int, default=1234, help="few-shot sampling and generation seed")
    add_tokenizer_arguments(parser)


def flag_problems(args: argparse.Namespace) -> list[str]:
    """The flags' values, checked before anything is loaded (lm-eval would fail deep inside, or take -2 shots)."""
    problems = []
    if args.limit is not None and not (0 < args.limit < 1 or (args.limit >= 1 and args.limit == int(args.limit))):
        problems.append(
            f"--limit {args.limit:g}: give a number of documents per task (1 or more) or a fraction of them "
            f"between 0 and 1 (e.g. 0.1)"
        )
    for flag, value in (("--batch-size", args.batch_size), ("--max-gen-toks", args.max_gen_toks)):
        if value < 1:
            problems.append(f"{flag} {value}: must be 1 or more")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        problems.append(f"--num-fewshot {args.num_fewshot}: must be 0 or more (or leave it out: the task's own)")
    return problems


def run(args: argparse.Namespace) -> int:
    problems = flag_problems(args)
    if problems:
        raise ConfigError(problems)
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError('moetron eval-harness needs lm-evaluation-harness: pip install "moetron[eval]"') from None
    if args.output and not Path(args.output).resolve().parent.is_dir():
        raise UserError(f"--output {args.output}: the directory {Path(args.output).parent} does not exist")
    from lm_eval.utils import make_table

    from moetron.eval.harness import evaluate_harness
    from moetron.train.failures import own_errors

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    with own_errors():  # under torchrun: an error of one rank alone is said by that rank
        results, lm = evaluate_harness(
            args.load,
            tasks,
            args.num_fewshot,
            limit,
            args.include_path,
            args.log_samples,
            args.seed,
            batch_size=args.batch_size,
            capacity_factor=args.capacity_factor,
            expert_parallel_size=args.expert_parallel_size,
            max_gen_toks=args.max_gen_toks,
            tokenizer_overrides=tokenizer_overrides(args),
        )
    if results is not None:  # global rank 0
        print(make_table(results))
        if args.output:
            write_atomic(args.output, json.dumps(results, indent=1, default=str))
            print(f"wrote {args.output}")
    return lm.env.finish(0)
