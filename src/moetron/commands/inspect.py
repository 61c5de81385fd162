"""`moetron inspect`: what a `.bin`/`.idx` dataset holds, and whether its sizes add up; or, given a run directory or
one of its iter_* checkpoints, what the checkpoint holds and whether every file matches the checksum recorded when
it was saved (exit 1 where one does not). Arguments and printing; the descriptions are `moetron.data.inspect` and
`moetron.checkpoint.describe`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moetron.checkpoint.describe import describe_checkpoint
from moetron.checkpoint.files import resolve_checkpoint
from moetron.data.indexed import IndexedDataset
from moetron.data.inspect import describe, drift_warning
from moetron.data.tokenizer import Tokenizer, build_tokenizer

HELP = "Describe a .bin/.idx dataset (dtype, documents, tokens, first document), or a checkpoint's integrity."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "prefix",
        help="dataset prefix, e.g. data/corpus_text_document (a .bin/.idx path works too); or a run directory "
        "(its latest checkpoint) or one iter_* directory",
    )
    parser.add_argument("--tokenizer-type", help="GPT2BPETokenizer or HFTokenizer (inferred from the files given)")
    parser.add_argument("--vocab-file", help="GPT-2 vocab.json, to decode the first document")
    parser.add_argument("--merge-file", help="GPT-2 merges.txt, to decode the first document")
    parser.add_argument("--tokenizer-model", help="tokenizer.json or its directory, to decode the first document")


def _tokenizer(args: argparse.Namespace) -> Tokenizer | None:
    kind = args.tokenizer_type
    if kind is None and (args.vocab_file or args.merge_file):
        kind = "GPT2BPETokenizer"
    elif kind is None and args.tokenizer_model:
        kind = "HFTokenizer"
    if kind is None:
        return None
    return build_tokenizer(kind, args.vocab_file, args.merge_file, args.tokenizer_model)


def _strip_extension(prefix: str) -> str:
    return prefix[:-4] if prefix.endswith((".bin", ".idx")) else prefix


def run(args: argparse.Namespace) -> int:
    checkpoint = resolve_checkpoint(args.prefix) if Path(args.prefix).is_dir() else None
    if checkpoint is not None:
        lines, intact = describe_checkpoint(checkpoint)
        print("\n".join(lines))
        return 0 if intact else 1
    tokenizer = _tokenizer(args)
    dataset = IndexedDataset(_strip_extension(args.prefix))
    print("\n".join(describe(dataset, tokenizer)))
    warning = drift_warning(dataset)
    if warning:
        print(warning, file=sys.stderr)
    return 0
