"""Evaluating a checkpoint: validation loss, perplexity and the routing report (`moetron eval`'s work).

Without a data path the data is the run's own validation split (from the checkpoint's config.yaml), read
exactly as the trainer read it: the same micro-batches of every data-parallel rank of the run that saved the
checkpoint, each rank's mean loss averaged as the trainer's all-reduce does; so the numbers equal the trainer's
final evaluation of that checkpoint. With a data path the whole indexed dataset is the validation set. Routing
uses the eval capacity factor (`dropless`: no token is dropped). Routers that draw random numbers in evaluation
draw them from each layer's stream keyed by the micro-batch's samples (`moetron.model.rng`), as in the
trainer, so the numbers match for random routing too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from pathlib import Path

from moetron.errors import UserError
from moetron.progress import Progress
from moetron.train.validation import evaluate, perplexity

EVAL_VOCAB_FIX = (
    "evaluate data preprocessed with the tokenizer of the checkpoint's run (the tokenizer flags in its config.yaml)"
)


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
    from moetron.checkpoint.open import open_run
    from moetron.data.loader import DistributedBatchLoader
    from moetron.eval.routing_report import RoutingRecorder
    from moetron.model.loss import fuses_head, make_head_loss
    from moetron.model.rng import STREAMS
    from moetron.train.precision import autocast_context
    from moetron.train.run import check_token_ids

    run = open_run(load, tokenizer_overrides=tokenizer_overrides)
    model, cfg, path, state = run.model(), run.cfg, run.path, run.state
    cfg = _eval_config(cfg, data_path, eval_iters)
    check_token_ids(cfg.data, cfg.model.vocab_size, EVAL_VOCAB_FIX)
    dp = cfg.dims(int(state.get("world_size", 1))).dp
    valid = _valid_dataset(cfg, dp)
    recorder = RoutingRecorder(model, cfg.parallel.moe_expert_parallel_size, cfg.parallel.moe_expert_replicas)
    device = next(model.parameters()).device
    autocast = functools.partial(autocast_context, device, cfg.train.fp16, cfg.train.bf16)  # as the trainer
    iters = cfg.train.eval_iters * cfg.num_micro_batches(dp)
    # the run's head + loss (one process: no vocabulary shards, no pipeline), as its trainer evaluated
    head = make_head_loss(fuses_head(cfg.train.fused_cross_entropy, vocab_parallel=False, splits_backward=False))
    losses = []
    progress = Progress("eval", iters * dp, "micro-batches")
    STREAMS.configure(cfg.train.seed)  # random routing draws keyed by sample, exactly as in the trainer
    with model.inference_routing(dropless=True) if dropless else contextlib.nullcontext():
        for rank in range(dp):  # the trainer's data-parallel ranks, one after the other
            loader = DistributedBatchLoader(valid, cfg.train.micro_batch_size, rank, dp)
            result = evaluate(recorder, loader, iters, autocast, head_loss=head, on_micro_batch=progress.advance)
            losses.append(result["valid_loss"])
    progress.close()
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
