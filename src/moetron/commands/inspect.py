"""`moetron inspect`: what a `.bin`/`.idx` dataset holds, and whether its sizes add up."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from moetron.data.indexed import IndexedDataset
from moetron.data.tokenizer import Tokenizer, build_tokenizer

HELP = "Describe a .bin/.idx dataset: dtype, documents, tokens, sizes, first document."
BAR_WIDTH = 40
SHOWN_CHARS = 1000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prefix", help="dataset prefix, e.g. data/corpus_text_document (a .bin/.idx path works too)")
    parser.add_argument("--tokenizer-type", help="GPT2BPETokenizer or HFTokenizer (inferred from the files given)")
    parser.add_argument("--vocab-file", help="GPT-2 vocab.json, to decode the first document")
    parser.add_argument("--merge-file", help="GPT-2 merges.txt, to decode the first document")
    parser.add_argument("--tokenizer-model", help="tokenizer.json or its directory, to decode the first document")


def size_histogram(sizes: np.ndarray) -> list[str]:
    """Text histogram of sequence sizes in power-of-two buckets [2^k, 2^(k+1))."""
    if sizes.size == 0:
        return []
    buckets = np.zeros(int(sizes.max()).bit_length() + 1, dtype=np.int64)
    np.add.at(buckets, np.where(sizes > 0, np.floor(np.log2(np.maximum(sizes, 1))).astype(np.int64) + 1, 0), 1)
    peak = int(buckets.max())
    lines = []
    for bucket, count in enumerate(buckets.tolist()):
        if count == 0:
            continue
        low, high = (0, 0) if bucket == 0 else (1 << (bucket - 1), (1 << bucket) - 1)
        bar = "#" * max(1, round(BAR_WIDTH * count / peak))
        lines.append(f"  {low:>9} - {high:<9} {bar:<{BAR_WIDTH}} {count}")
    return lines


def first_document_tokens(dataset: IndexedDataset) -> np.ndarray:
    first, last = int(dataset.doc_idx[0]), int(dataset.doc_idx[1])
    parts = [dataset[i] for i in range(first, last)]
    return np.concatenate(parts) if parts else np.empty(0, dtype=dataset.dtype)


def describe(dataset: IndexedDataset, tokenizer: Tokenizer | None = None) -> list[str]:
    """The lines `moetron inspect` prints."""
    sizes = dataset.sizes
    lines = [
        f"dataset    {dataset.prefix}",
        f"dtype      {dataset.dtype}",
        f"documents  {dataset.num_documents}",
        f"sequences  {len(dataset)}",
        f"tokens     {dataset.num_tokens} in sizes, {dataset.bin_length_tokens} in the .bin",
    ]
    if sizes.size:
        lines.append(
            f"sizes      min {int(sizes.min())}, median {int(np.median(sizes))}, "
            f"mean {float(sizes.mean()):.1f}, max {int(sizes.max())}"
        )
        lines += ["histogram of sequence sizes (tokens):", *size_histogram(sizes)]
    if tokenizer is not None and dataset.num_documents:
        tokens = first_document_tokens(dataset)
        text = tokenizer.decode(tokens.tolist())
        cut = f" (first {SHOWN_CHARS} of {len(text)} characters)" if len(text) > SHOWN_CHARS else ""
        lines += [f"first document ({tokens.size} tokens){cut}:", text[:SHOWN_CHARS]]
    return lines


def drift_warning(dataset: IndexedDataset) -> str | None:
    if dataset.sizes_consistent:
        return None
    gap = dataset.bin_length_tokens - dataset.num_tokens
    return (
        f"warning: the sizes add up to {dataset.num_tokens} tokens but '{dataset.bin_file}' holds "
        f"{dataset.bin_length_tokens} ({gap:+d}); written by Megatron with --append-eod, whose sizes leave out "
        "the EOD token (NVIDIA/Megatron-LM#431): sequences are read where the index points, so EOD tokens and "
        "document ends are misplaced. Re-run `moetron preprocess` to fix it"
    )


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
    tokenizer = _tokenizer(args)
    dataset = IndexedDataset(_strip_extension(args.prefix))
    print("\n".join(describe(dataset, tokenizer)))
    warning = drift_warning(dataset)
    if warning:
        print(warning, file=sys.stderr)
    return 0
