"""The quickstart's steps, each a function of the run directory: corpus → tokenizer → data → config → train →
evaluate (+ unigram baseline) → routing report, plots, a sample → the commands to continue.

Run directory layout (everything the run needs is inside, with absolute paths in config.yaml):

    corpus/corpus.jsonl        the built-in corpus (absent with --input)
    tokenizer/                 vocab.json, merges.txt, tokenizer.json (byte-level BPE trained here)
    data/corpus_text_document  .bin/.idx (+ index-cache/)
    config.yaml                the resolved training config (configs/quickstart.yaml + paths + overrides)
    iter_*/ latest             checkpoints
    metrics.jsonl eval.jsonl   training and validation metrics; tensorboard/ when tensorboard is installed
    eval_report.json plots/    the final evaluation with its routing report; PNGs when matplotlib is installed
"""

from __future__ import annotations

import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moetron.errors import UserError
from moetron.fileio import write_atomic
from moetron.recipes import RECIPES_DIR

SAMPLE_PROMPTS = ("Return the", "The module")


@dataclass
class QuickstartOptions:
    output_dir: Path
    inputs: list[str] | None = None  # None: the built-in corpus
    nproc: int = 2
    train_iters: int | None = None  # None: the config's
    max_corpus_mb: float | None = None
    vocab_size: int = 8192
    config: Path | None = None  # None: configs/quickstart.yaml


def default_config_path() -> Path:
    """The quickstart recipe shipped inside the package (`configs/quickstart.yaml` in the repository)."""
    return RECIPES_DIR / "quickstart.yaml"


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


# ---------------------------------------------------------------------------- data
def build_corpus(options: QuickstartOptions, run_dir: Path) -> list[Path]:
    """The built-in corpus, written into the run directory."""
    from moetron.quickstart.corpus import write_corpus

    path = run_dir / "corpus" / "corpus.jsonl"
    max_bytes = None if options.max_corpus_mb is None else int(options.max_corpus_mb * 1e6)
    documents, nbytes = write_corpus(path, max_bytes)
    print(f"built-in corpus: {documents} documents, {nbytes / 1e6:.2f} MB (Python's help topics and docstrings)")
    return [path]


def build_tokenizer_files(files: list[Path], run_dir: Path, vocab_size: int) -> Path:
    from moetron.data.tokenizer import train_bpe_tokenizer

    out = train_bpe_tokenizer(files, vocab_size, run_dir / "tokenizer")
    print(f"byte-level BPE tokenizer, vocabulary {vocab_size}: {out}")
    return out


def build_dataset(files: list[Path], tokenizer_dir: Path, run_dir: Path) -> str:
    from moetron.data.preprocess import PreprocessOptions, preprocess

    (run_dir / "data").mkdir(exist_ok=True)
    options = PreprocessOptions(
        inputs=[str(f) for f in files],
        output_prefix=str(run_dir / "data" / "corpus"),
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=str(tokenizer_dir / "vocab.json"),
        merge_file=str(tokenizer_dir / "merges.txt"),
        append_eod=True,
        log_interval=10**9,
    )
    summary = preprocess(options)
    print(f"preprocessed: {summary.documents} documents, {summary.tokens} tokens -> {summary.outputs[0]}")
    return summary.outputs[0]


def split_bounds(prefix: str, split: str) -> list[int]:
    """Document boundaries [train start, valid start, test start, end] of --split; a clear error when the
    corpus is too small to hold out any validation document."""
    from moetron.data.indexed import IndexedDataset
    from moetron.data.sample_index import get_train_valid_test_split

    documents = len(IndexedDataset(prefix))
    bounds = get_train_valid_test_split(split, documents)
    if bounds[1] <= bounds[0] or bounds[2] <= bounds[1]:
        raise UserError(
            f"--input holds {documents} document(s): too few to hold out validation documents with --split {split}; "
            f"give more documents (JSONL: one per line; text: separated by blank lines)"
        )
    return bounds


# ---------------------------------------------------------------------------- config and training
def write_run_config(options: QuickstartOptions, run_dir: Path, prefix: str, tokenizer_dir: Path) -> Path:
    """configs/quickstart.yaml + this run's paths and overrides, validated, written as run_dir/config.yaml."""
    from moetron.config_cli import load_config, to_yaml
    from moetron.data.tokenizer import build_tokenizer
    from moetron.validate import check

    vocab, merges = str(tokenizer_dir / "vocab.json"), str(tokenizer_dir / "merges.txt")
    overrides = {
        "data_path": [prefix],
        "vocab_file": vocab,
        "merge_file": merges,
        "vocab_size": build_tokenizer("GPT2BPETokenizer", vocab, merges).vocab_size,
        "save": str(run_dir),
        "moe_expert_parallel_size": options.nproc,
    }
    if options.train_iters is not None:
        overrides["train_iters"] = options.train_iters
    if tensorboard_installed():
        overrides["tensorboard_dir"] = str(run_dir / "tensorboard")
    else:
        print(missing_output_note("tensorboard", "tensorboard", "tensorboard"))
    cfg, _ = load_config(str(options.config or default_config_path()), overrides)
    check(cfg, options.nproc)
    path = run_dir / "config.yaml"
    write_atomic(path, to_yaml(cfg))
    return path


def missing_output_note(directory: str, package: str, extra: str) -> str:
    """One line saying which output is left out and the install that brings it (quoted: brackets are shell globs)."""
    return f'note: no {directory}/ in the run directory: {package} is not installed; pip install "moetron[{extra}]"'


def tensorboard_installed() -> bool:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def train_command(nproc: int, *args: str) -> list[str]:
    """`moetron train ARGS` in one process, or under torchrun with `nproc` processes."""
    if nproc == 1:
        return [sys.executable, "-m", "moetron", "train", *args]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*launcher, "-m", "moetron", "train", *args]


def train(config: Path, nproc: int) -> None:
    """Run training in child processes (torchrun for nproc > 1), their output going straight to the console."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))  # no oversubscription
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.run(train_command(nproc, "--config", str(config)), env=env)
    if proc.returncode != 0:
        raise UserError(f"training exited with status {proc.returncode} (its messages are above); fix and rerun")


# ---------------------------------------------------------------------------- baseline
def unigram_perplexity(prefix: str, split: str) -> float:
    """Perplexity of the valid split's tokens under the train split's token frequencies (add-one smoothed):
    what a model that ignores context entirely would score."""
    from moetron.data.indexed import IndexedDataset

    data = IndexedDataset(prefix)
    bounds = split_bounds(prefix, split)
    train_tokens = np.concatenate([data.get(i) for i in range(bounds[0], bounds[1])]).astype(np.int64)
    valid_tokens = np.concatenate([data.get(i) for i in range(bounds[1], bounds[2])]).astype(np.int64)
    vocab = int(max(train_tokens.max(), valid_tokens.max())) + 1
    counts = np.bincount(train_tokens, minlength=vocab).astype(np.float64) + 1.0
    log_probs = np.log(counts / counts.sum())
    return math.exp(-float(log_probs[valid_tokens].mean()))


# ---------------------------------------------------------------------------- report
def evaluate_run(run_dir: Path, prefix: str, split: str) -> dict:
    from moetron.eval.evaluate import evaluate_checkpoint
    from moetron.eval.result import print_result, write_json_atomic

    result = evaluate_checkpoint(str(run_dir))
    print_result(result)
    result["unigram_ppl"] = unigram_perplexity(prefix, split)
    print(
        f"\nvalidation perplexity {result['valid_ppl']:.1f} vs unigram baseline {result['unigram_ppl']:.1f} "
        f"(train-split token frequencies): {baseline_comparison(result['valid_ppl'], result['unigram_ppl'])}"
    )
    write_json_atomic(str(run_dir / "eval_report.json"), result)
    write_run_plots(result, run_dir)
    return result


def baseline_comparison(valid_ppl: float, unigram_ppl: float) -> str:
    """'3.7x lower' when the model beats the baseline; a model worse than it must not read as '0.5x lower'."""
    ratio = unigram_ppl / valid_ppl
    if f"{ratio:.1f}" == "1.0" or f"{1 / ratio:.1f}" == "1.0":
        return "about the same as the baseline (train longer: --train-iters)"
    if ratio > 1:
        return f"{ratio:.1f}x lower"
    return f"{1 / ratio:.1f}x higher: worse than the baseline (train longer: --train-iters)"


def write_run_plots(result: dict, run_dir: Path) -> None:
    from moetron.eval.evaluate import write_plots
    from moetron.eval.plots import matplotlib_missing

    if matplotlib_missing():  # our own note: write_plots' generic one does not name the run directory's plots/
        print(missing_output_note("plots", "matplotlib", "plot"))
        return
    for path in write_plots(result, str(run_dir / "plots")):
        print(f"wrote {path}")


def print_samples(run_dir: Path) -> None:
    from moetron.eval.generate import GenerationOptions, generate_texts, load_model, load_tokenizer

    model, cfg, _ = load_model(str(run_dir))
    options = GenerationOptions(max_new_tokens=40, temperature=0.8, top_k=40)
    texts = generate_texts(model, load_tokenizer(cfg), list(SAMPLE_PROMPTS), options)
    for prompt, text in zip(SAMPLE_PROMPTS, texts, strict=True):
        print(f"--- {prompt!r} ->\n{prompt}{text}")


def continuation_commands(run_dir: Path, config: Path, nproc: int, train_iters: int) -> list[str]:
    """The exact shell commands to train on, evaluate and generate from what the quickstart wrote."""
    run, cfg = shlex.quote(str(run_dir)), shlex.quote(str(config))
    launcher = "moetron train" if nproc == 1 else f"torchrun --nproc-per-node {nproc} -m moetron train"
    return [
        f"{launcher} --config {cfg} --load {run} --train-iters {2 * train_iters} --override-opt-param-scheduler",
        f"moetron eval --load {run} --plots-dir {shlex.quote(str(run_dir / 'plots'))}",
        f"moetron generate --load {run} --prompt {shlex.quote(SAMPLE_PROMPTS[0])} --max-new-tokens 60",
    ]


# ---------------------------------------------------------------------------- the whole thing
def prepare_run_dir(output_dir: Path) -> Path:
    run_dir = Path(output_dir).resolve()
    if (run_dir / "latest").exists() or (run_dir / "config.yaml").exists():
        raise UserError(
            f"--output-dir {output_dir} already holds a quickstart run; continue it with the commands it printed, "
            f"or give another --output-dir (or delete it)"
        )
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--output-dir {output_dir} exists and is not a directory")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def run_quickstart(options: QuickstartOptions) -> dict:
    from moetron.config_cli import load_config
    from moetron.data.readers import resolve_inputs

    start = time.perf_counter()
    options.config = options.config or default_config_path()  # a missing config or --input fails before any output
    files = resolve_inputs(options.inputs) if options.inputs else None
    run_dir = prepare_run_dir(options.output_dir)
    step("1/6 corpus")
    if files:
        print(f"your corpus: {' '.join(map(str, files))}")
    else:
        files = build_corpus(options, run_dir)
    step("2/6 tokenizer")
    tokenizer_dir = build_tokenizer_files(files, run_dir, options.vocab_size)
    step("3/6 preprocess")
    prefix = build_dataset(files, tokenizer_dir, run_dir)
    split = load_config(str(options.config), {})[0].data.split
    split_bounds(prefix, split)  # enough documents for a validation split? (before config.yaml marks a run)
    config = write_run_config(options, run_dir, prefix, tokenizer_dir)
    cfg, _ = load_config(str(config), {})
    step(f"4/6 train ({options.nproc} process{'es' if options.nproc > 1 else ''}, expert parallel {options.nproc})")
    train(config, options.nproc)
    step("5/6 evaluate")
    result = evaluate_run(run_dir, prefix, cfg.data.split)
    step("6/6 generate")
    print_samples(run_dir)
    print(f"\ndone in {time.perf_counter() - start:.0f} s; everything is in {run_dir}. Continue with:")
    for command in continuation_commands(run_dir, config, options.nproc, cfg.train.train_iters):
        print(f"  {command}")
    return result
