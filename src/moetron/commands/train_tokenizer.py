"""`moetron train-tokenizer`: a byte-level BPE (GPT-2 style) trained on your JSONL/text files."""

from __future__ import annotations

import argparse
from pathlib import Path

from moetron.data.readers import resolve_inputs
from moetron.data.tokenizer import train_bpe_tokenizer

HELP = "Train a byte-level BPE tokenizer (vocab.json + merges.txt + tokenizer.json)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", nargs="+", required=True, help="JSONL (key 'text'), .txt, .gz of either, or globs")
    parser.add_argument("--vocab-size", type=int, required=True, help="target vocabulary size, <|endoftext|> included")
    parser.add_argument("--output-dir", type=Path, required=True, help="folder for the tokenizer files")


def run(args: argparse.Namespace) -> int:
    files = resolve_inputs(args.input)
    output = train_bpe_tokenizer(files, args.vocab_size, args.output_dir)
    print(f"wrote {output / 'vocab.json'}, {output / 'merges.txt'} and {output / 'tokenizer.json'}")
    print(
        f"use with: --tokenizer-type GPT2BPETokenizer --vocab-file {output / 'vocab.json'} "
        f"--merge-file {output / 'merges.txt'}"
    )
    return 0
