"""`moetron eval`: validation loss, perplexity and the routing report of a checkpoint.

    moetron eval --load runs/quickstart
    moetron eval --load runs/quickstart/iter_0000300 --data-path data/other_text_document --json eval.json

Without `--data-path` the data is the run's own validation split (from the checkpoint's config.yaml), read
exactly as the trainer read it: the same micro-batches of every data-parallel rank of the run that saved
the checkpoint, each rank's mean loss averaged as the trainer's all-reduce does; so the numbers equal the
trainer's final evaluation of that checkpoint. With `--data-path PREFIX` the whole indexed dataset is the
validation set. Routing uses the eval capacity factor (`--dropless`: no token is dropped).

Routers that draw random numbers in evaluation (DeepSpeed's random token selection when top-1 drops
tokens, top-2's sampled second expert) draw them from a generator seeded per data-parallel rank from the
run's seed (`moetron.eval.perplexity.evaluation_rng`), exactly as the trainer's evaluation does, so the
numbers match for random routing too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
from pathlib import Path

from moetron.errors import UserError

EVAL_VOCAB_FIX = (
    "evaluate data preprocessed with the tokenizer of the checkpoint's run (the tokenizer flags in its config.yaml)"
)
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
    from moetron.commands.generate import add_tokenizer_arguments

    add_tokenizer_arguments(parser)


def _eval_config(cfg, data_path: str | None, eval_iters: int | None):
    """The checkpoint's config with the evaluation data and length asked for."""
    data = cfg.data
    if data_path:
        from moetron.data.indexed import dataset_exists

        if not dataset_exists(data_path):
            raise UserError(
                f"--data-path {data_path}: no {data_path}.bin/.idx pair; give a `moetron preprocess` prefix"
            )
        data = dataclasses.replace(data, data_path=[], train_data_path=[], valid_data_path=[data_path])
    iters = cfg.train.eval_iters if eval_iters is None else eval_iters
    if iters < 1:
        raise UserError(f"--eval-iters must be >= 1, got {iters}")
    return dataclasses.replace(cfg, data=data, train=dataclasses.replace(cfg.train, eval_iters=iters))


def _valid_dataset(cfg, dp: int):
    from moetron.data.gpt_dataset import build_gpt_datasets
    from moetron.train.run import sample_counts

    counts = sample_counts(cfg, dp)
    if not cfg.data.data_path:
        counts = (0, counts[1], 0)  # a separate valid set: nothing else to index
    _, valid, _ = build_gpt_datasets(cfg.data, cfg.model.seq_length, cfg.train.seed, num_samples=counts)
    if valid is None or len(valid) == 0:
        where = " ".join(cfg.data.data_path or cfg.data.valid_data_path)
        raise UserError(f"{where}: the --split {cfg.data.split!r} leaves no validation documents; evaluate another")
    return valid


def evaluate_checkpoint(load: str, data_path: str | None = None, eval_iters: int | None = None,
                        dropless: bool = False, tokenizer_overrides: dict | None = None) -> dict:  # fmt: skip
    """{"checkpoint", "iteration", "valid_loss", "valid_ppl", "micro_batches", "routing": [LayerReport dicts]}."""
    from moetron.data.loader import DistributedBatchLoader
    from moetron.eval.generate import load_model
    from moetron.eval.perplexity import evaluate, evaluation_rng, perplexity
    from moetron.eval.routing_report import RoutingRecorder
    from moetron.train.checkpoint import read_json
    from moetron.train.precision import autocast_context
    from moetron.train.run import check_token_ids

    model, cfg, path = load_model(load, tokenizer_overrides=tokenizer_overrides)
    state = read_json(path / "state.json")
    cfg = _eval_config(cfg, data_path, eval_iters)
    check_token_ids(cfg.data, cfg.model.vocab_size, EVAL_VOCAB_FIX)
    dp = cfg.dims(int(state.get("world_size", 1))).dp
    valid = _valid_dataset(cfg, dp)
    recorder = RoutingRecorder(model)
    device = next(model.parameters()).device
    autocast = functools.partial(autocast_context, device, cfg.train.fp16, cfg.train.bf16)  # as the trainer
    iters = cfg.train.eval_iters * cfg.num_micro_batches(dp)
    losses = []
    with model.inference_routing(dropless=True) if dropless else contextlib.nullcontext():
        for rank in range(dp):  # the trainer's ranks, one after the other
            loader = DistributedBatchLoader(valid, cfg.train.micro_batch_size, rank, dp)
            with evaluation_rng(cfg.train.seed, rank, device):  # the draws the trainer's rank `rank` made
                losses.append(evaluate(recorder, loader, iters, autocast)["valid_loss"])
    loss = sum(losses) / dp
    report = [r.to_dict() for r in recorder.report()]
    return {
        "checkpoint": str(path),
        "iteration": int(state.get("iteration", 0)),
        "valid_loss": loss,
        "valid_ppl": perplexity(loss),
        "micro_batches": iters * dp,
        "routing": report,
    }


def run_directory(checkpoint: str) -> Path:
    """The run directory of an iter_* checkpoint (where metrics.jsonl and eval.jsonl are)."""
    path = Path(checkpoint)
    return path.parent if path.name.startswith("iter_") else path


def write_plots(result: dict, plots_dir: str) -> list[Path]:
    from moetron.eval.plots import expert_load_heatmap, loss_curves, matplotlib_missing

    missing = matplotlib_missing()
    if missing:
        print(f"note: no plots written: {missing}")
        return []
    out = Path(plots_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [expert_load_heatmap(result["routing"], out / "expert_load.png")]
    curves = loss_curves(run_directory(result["checkpoint"]), out / "loss_curves.png")
    return written + ([curves] if curves else [])


def print_result(result: dict) -> None:
    from moetron.eval.routing_report import LayerReport, format_table

    print(
        f"checkpoint {result['checkpoint']} (iteration {result['iteration']}): validation lm loss "
        f"{result['valid_loss']:.4f} | perplexity {result['valid_ppl']:.2f} | {result['micro_batches']} micro-batches"
    )
    print(format_table([LayerReport(**r) for r in result["routing"]]))


def _check_outputs(args: argparse.Namespace) -> None:
    """Fail before the (slow) evaluation when an output cannot be written."""
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise UserError(f"--json {args.json}: the directory {Path(args.json).parent} does not exist; create it first")
    if args.plots_dir and Path(args.plots_dir).exists() and not Path(args.plots_dir).is_dir():
        raise UserError(f"--plots-dir {args.plots_dir} exists and is not a directory; give a directory")


def write_json_atomic(path: str, obj: dict) -> None:
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def run(args: argparse.Namespace) -> int:
    _check_outputs(args)
    from moetron.commands.generate import tokenizer_overrides

    result = evaluate_checkpoint(args.load, args.data_path, args.eval_iters, args.dropless, tokenizer_overrides(args))
    print_result(result)
    if args.json:
        write_json_atomic(args.json, result)
        print(f"wrote {args.json}")
    if args.plots_dir:
        for path in write_plots(result, args.plots_dir):
            print(f"wrote {path}")
    return 0
