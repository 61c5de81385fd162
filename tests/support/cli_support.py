"""Helpers for the end-to-end CLI tests: a tiny tokenized corpus and `moetron train` under torchrun (or not)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from moetron.data.indexed import IndexedDatasetBuilder
from moetron.data.tokenizer import build_tokenizer

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def shakespeare_corpus_flags(directory: Path, shakespeare: Path, gpt2_files: tuple[Path, Path], chars: int) -> list:
    """The first `chars` characters of tinyshakespeare as an indexed dataset (GPT-2 BPE), and the data flags."""
    vocab, merges = gpt2_files
    tokenizer = build_tokenizer("GPT2BPETokenizer", str(vocab), str(merges))
    prefix = directory / "corpus" / "shakespeare_text_document"
    prefix.parent.mkdir()
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    for paragraph in shakespeare.read_text()[:chars].split("\n\n"):
        builder.add_document(tokenizer.encode(paragraph) + [tokenizer.eod])
    builder.finalize()
    flags = ["--data-path", str(prefix), "--split", "90,10,0", "--tokenizer-type", "GPT2BPETokenizer"]
    return flags + ["--vocab-file", str(vocab), "--merge-file", str(merges)]


def moetron_train(*args: str, nproc: int = 1, env: dict | None = None, timeout: int = 240):
    """`moetron train ARGS` in a subprocess: under `torchrun --nproc-per-node N` when N > 1."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command = [*launcher, "-m", "moetron"] if nproc > 1 else [sys.executable, "-m", "moetron"]
    return subprocess.run([*command, "train", *args], capture_output=True, text=True, env=env or ENV, timeout=timeout)
