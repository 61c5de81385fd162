"""`moetron eval`: validation loss, perplexity and the routing report of a checkpoint.

    moetron eval --load runs/quickstart
    moetron eval --load runs/quickstart/iter_0000300 --data-path data/other_text_document --json eval.json

Arguments and printing only; the evaluation itself is `moetron.eval.evaluate.evaluate_checkpoint`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moetron.errors import UserError
from moetron.eval.result import print_result, write_json_atomic

HELP = "Validation loss, perplexity and the routing report of a checkpoint."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load", required=True, help="a run directory (its latest checkpoint) or an iter_* directory")
    parser.add_argument("--data-path", help="an indexed dataset prefix to evaluate on (default: the run's valid split)")
    parser.add_argument("--eval-iters", type=int, help="global batches to evaluate (default: the run's --eval-iters)")
    parser.add_argument("--dropless", action="store_true", help="route without capacity limits (drop no token)")
    parser.add_argument("--json", metavar="FILE", help="also write the numbers and the routing report as JSON")
    parser.add_argument(
        "--plots-dir", metavar="DIR", help="write expert_load.png and loss_curves.png (needs matplotlib)"
    )
    from moetron.commands.tokenizer_flags import add_tokenizer_arguments

    add_tokenizer_arguments(parser)


def _check_outputs(args: argparse.Namespace) -> None:
    """Fail before the (slow) evaluation when an output cannot be written."""
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise UserError(f"--json {args.json}: the directory {Path(args.json).parent} does not exist; create it first")
    if args.plots_dir and Path(args.plots_dir).exists() and not Path(args.plots_dir).is_dir():
        raise UserError(f"--plots-dir {args.plots_dir} exists and is not a directory; give a directory")


def run(args: argparse.Namespace) -> int:
    _check_outputs(args)
    from moetron.commands.tokenizer_flags import tokenizer_overrides
    from moetron.eval.evaluate import evaluate_checkpoint

    result = evaluate_checkpoint(args.load, args.data_path, args.eval_iters, args.dropless, tokenizer_overrides(args))
    print_result(result)
    if args.json:
        write_json_atomic(args.json, result)
        print(f"wrote {args.json}")
    if args.plots_dir:
        from moetron.eval.evaluate import write_plots

        for path in write_plots(result, args.plots_dir):
            print(f"wrote {path}")
    return 0
