"""What a `.bin`/`.idx` dataset holds, as lines for a person (`moetron inspect`), and whether its sizes add up."""

from __future__ import annotations

import numpy as np

from moetron.data.indexed import IndexedDataset
from moetron.data.tokenizer import Tokenizer

BAR_WIDTH = 40
SHOWN_CHARS = 1000


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
