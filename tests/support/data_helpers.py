"""Shared helpers for the data tests: a tiny trained tokenizer and an independent Megatron-format writer."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from moetron.data.tokenizer import build_tokenizer, train_bpe_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture of experts routes every token to its top-k experts.",
    "Héllo wörld, naïve café — unicode survives the round trip.",
    "Numbers 12345 and symbols #@! are bytes too.\nA second line.",
]
# Megatron's dtype codes, written out here rather than imported, so the reference stays independent.
MEGATRON_DTYPE_CODES = {
    "uint8": 1,
    "int8": 2,
    "int16": 3,
    "int32": 4,
    "int64": 5,
    "float64": 6,
    "float32": 7,
    "uint16": 8,
}


def write_jsonl(path: Path, texts: list, key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts), encoding="utf-8")
    return path


def megatron_reference(prefix: Path, documents: list[list[int]], dtype: str, sizes: list[int] | None = None) -> None:
    """Write `{prefix}.bin/.idx` straight from the published MMapIndexedDataset layout, with struct only."""
    fmt = {"uint16": "H", "int32": "i"}[dtype]
    itemsize = struct.calcsize("<" + fmt)
    tokens = [t for doc in documents for t in doc]
    Path(f"{prefix}.bin").write_bytes(struct.pack(f"<{len(tokens)}{fmt}", *tokens))
    sizes = [len(doc) for doc in documents] if sizes is None else sizes
    pointers, address = [], 0
    for size in sizes:
        pointers.append(address)
        address += size * itemsize
    doc_idx = list(range(len(sizes) + 1))
    header = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", MEGATRON_DTYPE_CODES[dtype])
    header += struct.pack("<QQ", len(sizes), len(doc_idx))
    arrays = struct.pack(f"<{len(sizes)}i", *sizes) + struct.pack(f"<{len(pointers)}q", *pointers)
    arrays += struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    Path(f"{prefix}.idx").write_bytes(header + arrays)


def make_tiny_tokenizer(root: Path) -> Path:
    """A 300-entry byte-level BPE trained on CORPUS: GPT-2-style files without the shared data."""
    corpus = write_jsonl(root / "corpus.jsonl", CORPUS * 3)
    return train_bpe_tokenizer([corpus], 300, root / "tok")


def tiny_tokenizer_flags(directory: Path) -> list[str]:
    return [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(directory / "vocab.json"),
        "--merge-file",
        str(directory / "merges.txt"),
    ]


def tiny_tokenizer(directory: Path):
    return build_tokenizer("GPT2BPETokenizer", directory / "vocab.json", directory / "merges.txt")


class FakeIndexed:
    """In-memory stand-in for IndexedDataset: `.sizes`, `len()`, `get(i, offset, length)`."""

    def __init__(self, docs):
        self.docs = [np.asarray(d, dtype=np.int32) for d in docs]
        self.sizes = np.array([len(d) for d in docs], dtype=np.int32)

    def __len__(self) -> int:
        return len(self.docs)

    def get(self, i, offset=0, length=None):
        doc = self.docs[i]
        return doc[offset:] if length is None else doc[offset : offset + length]
