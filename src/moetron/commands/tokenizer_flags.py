"""--vocab-file/--merge-file/--tokenizer-model: the flags of every command that reads a checkpoint's tokenizer
(eval, generate, eval-harness, export), and the overrides they give `moetron.checkpoint.open_run`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from moetron.config import RunConfig


def add_tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    """--vocab-file/--merge-file/--tokenizer-model: the tokenizer when the checkpoint's config names files that
    moved."""
    group = parser.add_argument_group("tokenizer (default: the files the checkpoint's config.yaml names)")
    group.add_argument("--vocab-file", help="GPT-2 vocab.json the run was trained with")
    group.add_argument("--merge-file", help="GPT-2 merges.txt the run was trained with")
    group.add_argument("--tokenizer-model", help="tokenizer.json (or its directory) the run was trained with")


def tokenizer_overrides(args: argparse.Namespace) -> dict:
    """The tokenizer flags given, as `load_model(tokenizer_overrides=...)` takes them."""
    names = ("vocab_file", "merge_file", "tokenizer_model")
    given = {name: str(Path(getattr(args, name)).resolve()) for name in names if getattr(args, name, None)}
    if "tokenizer_model" in given and not ({"vocab_file", "merge_file"} & set(given)):
        given["tokenizer_type"] = "HFTokenizer"
    elif {"vocab_file", "merge_file"} & set(given):
        given["tokenizer_type"] = "GPT2BPETokenizer"
    return given


def tokenizer_given(cfg: RunConfig) -> bool:
    """Tokenizer files that exist are named (a recipe's example paths that do not exist are ignored here)."""
    d = cfg.data
    files = [d.vocab_file] if d.tokenizer_type == "GPT2BPETokenizer" else [d.tokenizer_model]
    return all(files) and all(os.path.exists(f) for f in files)
