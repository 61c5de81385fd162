"""`moetron quickstart`: from nothing to a trained, evaluated MoE GPT in one command, on a CPU.

    moetron quickstart                                  # built-in corpus, 2 processes, expert parallel 2
    moetron quickstart --input my_docs.jsonl --nproc 1 --output-dir runs/mine

Steps (see `moetron.quickstart.pipeline`): build a corpus (Python's help topics and the standard library's
docstrings, about 2 MB of English) or take `--input`; train a byte-level BPE tokenizer; preprocess; train the
model of configs/quickstart.yaml; evaluate it against a unigram baseline; print the routing report and a
sample; print the commands to continue. Everything goes into `--output-dir`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moetron.errors import UserError
from moetron.fileio import output_dir_problem

HELP = "Build a corpus, tokenizer and data, train a small MoE GPT, evaluate and generate."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input", nargs="+", help="your JSONL (key 'text') or .txt files instead of the built-in corpus"
    )
    parser.add_argument("--output-dir", type=Path, default=Path("runs/quickstart"), help="the run directory")
    parser.add_argument("--nproc", type=int, default=2, help="training processes = expert-parallel size: 2 or 1")
    parser.add_argument("--train-iters", type=int, help="training iterations (default: the config's)")
    parser.add_argument(
        "--max-corpus-mb", type=float, help="cut the built-in corpus at this many MB (quick trials and tests)"
    )
    parser.add_argument("--vocab-size", type=int, default=8192, help="tokenizer vocabulary (default 8192)")
    parser.add_argument("--config", type=Path, help="model/training YAML (default: configs/quickstart.yaml)")


def _problems(args: argparse.Namespace) -> list[str]:
    p = []
    if args.nproc not in (1, 2):
        p.append(f"--nproc {args.nproc}: use 1 or 2 (a global batch of 8 = 2 processes × micro-batch 4)")
    if args.train_iters is not None and args.train_iters < 1:
        p.append(f"--train-iters must be >= 1, got {args.train_iters}")
    if args.max_corpus_mb is not None and args.max_corpus_mb <= 0:
        p.append(f"--max-corpus-mb must be > 0, got {args.max_corpus_mb}")
    if args.max_corpus_mb is not None and args.input:
        p.append("--max-corpus-mb only cuts the built-in corpus; drop it when giving --input")
    if args.config is not None and not args.config.is_file():
        p.append(f"--config {args.config}: no such file")
    problem = output_dir_problem("--output-dir", str(args.output_dir))
    if problem:
        p.append(problem)
    if args.vocab_size < 257:
        p.append(f"--vocab-size {args.vocab_size} is too small; use at least 257 (256 byte symbols + <|endoftext|>)")
    return p


def run(args: argparse.Namespace) -> int:
    from moetron.errors import ConfigError
    from moetron.quickstart.pipeline import QuickstartOptions, run_quickstart

    problems = _problems(args)
    if problems:
        raise ConfigError(problems) if len(problems) > 1 else UserError(problems[0])
    options = QuickstartOptions(
        output_dir=args.output_dir,
        inputs=args.input,
        nproc=args.nproc,
        train_iters=args.train_iters,
        max_corpus_mb=args.max_corpus_mb,
        vocab_size=args.vocab_size,
        config=args.config,
    )
    run_quickstart(options)
    return 0
