"""GPT datasets: Megatron's GPTDataset samples (same documents, epochs, shuffles, order) from indexed data.

`build_gpt_datasets(cfg, seq_length, seed, num_samples)` returns train / valid / test datasets (None where a
split is empty). Each has `len()` and `ds[i]` → int64 array of `seq_length + 1` tokens. Inputs:

- one `--data-path` prefix: its documents are cut into contiguous train/valid/test ranges by `--split`;
- a blend `W1 P1 W2 P2 ...`: every prefix is split the same way and the splits are mixed (see blend.py);
- `--train-data-path` / `--valid-data-path` / `--test-data-path`: whole (optionally blended) sets per split.

The index arrays (sample_index.py) are cached as `.npy` files (index_cache.py): rank 0 builds them when
`is_builder`, `cache_barrier()` holds the other ranks until they are written, then every rank maps them.
The indexed dataset is any object with `.sizes` (int32 tokens per document), `len()` and
`get(i, offset=0, length=None)`; by default `moetron.data.indexed.IndexedDataset(prefix)`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np

from moetron.data.blend import BlendableDataset, blend_num_samples
from moetron.data.config import DataConfig, parse_blend, prefix_exists
from moetron.data.index_cache import IndexCache, build_or_load, describe_gpt_dataset
from moetron.data.sample_index import IndexPlan, build_index_mappings, get_train_valid_test_split
from moetron.errors import UserError

SPLIT_NAMES = ("train", "valid", "test")
Opener = Callable[[str], object]


class GPTDataset:
    """Samples of `seq_length + 1` tokens from `documents` of one indexed dataset, in Megatron's order."""

    def __init__(self, name: str, prefix: str, documents: np.ndarray, indexed, split: str, num_samples: int,
                 seq_length: int, seed: int, cache_dirs: list[str] | None = None, is_builder: bool = True,
                 cache_barrier: Callable[[], None] | None = None):  # fmt: skip
        self.name, self.prefix, self.indexed = name, prefix, indexed
        sizes = np.asarray(indexed.sizes)
        tokens = int(np.sum(sizes[documents], dtype=np.int64))
        if tokens <= 1:
            raise UserError(
                f"{prefix!r}: the {name} split ({len(documents)} documents) holds {tokens} tokens, too few for "
                f"a sample; change --split or add data"
            )
        self.plan = IndexPlan.make(documents, sizes, num_samples, seq_length, seed)
        self.desc = describe_gpt_dataset(prefix, name, num_samples, self.plan.num_epochs, seq_length, seed, split)
        if cache_dirs:
            cache = IndexCache(self.desc, ["doc_idx", "sample_idx", "shuffle_idx"], cache_dirs)
            arrays = build_or_load(cache, lambda: self._build(sizes), is_builder, cache_barrier)
            self.cache_dir = cache.directory
        else:  # no cache: every rank builds in memory (tests, tiny data)
            arrays, self.cache_dir = self._build(sizes), None
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays["doc_idx"], arrays["sample_idx"], arrays["shuffle_idx"]

    def _build(self, sizes: np.ndarray) -> dict[str, np.ndarray]:
        arrays = build_index_mappings(self.plan, sizes)
        return {"doc_idx": arrays["doc"], "sample_idx": arrays["sample"], "shuffle_idx": arrays["shuffle"]}

    @property
    def seq_length(self) -> int:
        return self.plan.seq_length

    def __len__(self) -> int:
        # every sample the epochs provide (at least the requested number), as Megatron
        return self.sample_idx.shape[0] - 1

    def __getitem__(self, idx: int) -> np.ndarray:
        j = int(self.shuffle_idx[idx])  # IndexError past the end, which blending relies on
        (doc_first, offset_first), (doc_last, offset_last) = self.sample_idx[j], self.sample_idx[j + 1]
        get, doc_idx = self.indexed.get, self.doc_idx
        if doc_first == doc_last:
            tokens = get(int(doc_idx[doc_first]), offset=int(offset_first), length=int(offset_last - offset_first + 1))
            return np.asarray(tokens, dtype=np.int64)
        pieces = [get(int(doc_idx[doc_first]), offset=int(offset_first))]
        pieces += [get(int(doc_idx[d])) for d in range(doc_first + 1, doc_last)]
        pieces.append(get(int(doc_idx[doc_last]), offset=0, length=int(offset_last + 1)))
        return np.concatenate(pieces).astype(np.int64)


def open_indexed_dataset(prefix: str):
    """`moetron.data.indexed.IndexedDataset(prefix)`, with a clear error when the files are missing."""
    if not prefix_exists(prefix):
        raise UserError(f"no dataset at prefix {prefix!r}: {prefix}.bin and {prefix}.idx must both exist")
    from moetron.data.indexed import IndexedDataset

    return IndexedDataset(prefix)


def warmup_files(prefix: str, chunk_bytes: int = 100 * 2**20) -> None:
    """Read `PREFIX.idx` and `PREFIX.bin` once so the page cache holds them (Megatron's --mmap-warmup)."""
    for path in (prefix + ".idx", prefix + ".bin"):
        with open(path, "rb") as f:
            while f.read(chunk_bytes):
                pass


def build_gpt_datasets(cfg: DataConfig, seq_length: int, seed: int, num_samples: Sequence[int],
                       cache_barrier: Callable[[], None] | None = None, *, is_builder: bool = True,
                       open_dataset: Opener = open_indexed_dataset):  # fmt: skip
    """(train, valid, test) datasets for `cfg`; None for a split without documents or paths.

    `is_builder`: this rank writes missing index caches (rank 0); `cache_barrier` is then called once per
    cached index on every rank, so the others wait for the files before mapping them.
    """
    if seq_length < 2:
        raise UserError(f"--seq-length must be >= 2 to build GPT samples, got {seq_length}")
    builder = _Builder(cfg, seq_length, seed, is_builder, cache_barrier, open_dataset)
    if cfg.data_path:
        return builder.from_split_blend(cfg.data_path, list(num_samples))
    paths = cfg.split_paths()
    return tuple(
        builder.from_whole_blend(name, paths[name], n) if paths[name] else None
        for name, n in zip(SPLIT_NAMES, num_samples, strict=True)
    )


class _Builder:
    """Shared settings while building the datasets of one run; opens each prefix once."""

    def __init__(self, cfg: DataConfig, seq_length: int, seed: int, is_builder: bool, barrier, open_dataset: Opener):
        self.cfg, self.seq_length, self.seed = cfg, seq_length, seed
        self.is_builder, self.barrier, self.open_dataset = is_builder, barrier, open_dataset
        self._opened: dict[str, object] = {}

    def indexed(self, prefix: str):
        if prefix not in self._opened:
            self._opened[prefix] = self.open_dataset(prefix)
            if self.cfg.mmap_warmup:
                warmup_files(prefix)
        return self._opened[prefix]

    def gpt(self, name: str, prefix: str, documents: np.ndarray, num_samples: int) -> GPTDataset:
        cache_dirs = [os.path.join(os.path.dirname(prefix), "index-cache")]
        if self.cfg.data_cache_path:
            cache_dirs.append(self.cfg.data_cache_path)
        return GPTDataset(name, prefix, documents, self.indexed(prefix), self.cfg.split, num_samples,
                          self.seq_length, self.seed, cache_dirs, self.is_builder, self.barrier)  # fmt: skip

    def split_datasets(self, prefix: str, num_samples: Sequence[int]) -> list[GPTDataset | None]:
        """One prefix cut into train/valid/test document ranges by --split."""
        bounds = get_train_valid_test_split(self.cfg.split, len(self.indexed(prefix).sizes))
        return [
            self.gpt(name, prefix, np.arange(bounds[k], bounds[k + 1], dtype=np.int32), num_samples[k])
            if bounds[k + 1] > bounds[k]
            else None
            for k, name in enumerate(SPLIT_NAMES)
        ]

    def from_split_blend(self, paths: list[str], num_samples: list[int]) -> tuple:
        weights, prefixes = _parse("--data-path", paths)
        if len(prefixes) == 1:
            return tuple(self.split_datasets(prefixes[0], num_samples))
        per_dataset = [blend_num_samples(weights, n) for n in num_samples]  # [split][dataset]
        components = [self.split_datasets(p, [per_dataset[k][i] for k in range(3)]) for i, p in enumerate(prefixes)]
        blends = []
        for k in range(3):
            present = [(w, c[k]) for w, c in zip(weights, components, strict=True) if c[k] is not None]
            blends.append(self.blend(present, sum(per_dataset[k])) if present else None)
        return tuple(blends)

    def from_whole_blend(self, name: str, paths: list[str], num_samples: int):
        weights, prefixes = _parse(f"--{name}-data-path", paths)
        whole = [np.arange(len(self.indexed(p).sizes), dtype=np.int32) for p in prefixes]
        if len(prefixes) == 1:
            return self.gpt(name, prefixes[0], whole[0], num_samples)
        per_dataset = blend_num_samples(weights, num_samples)
        parts = [self.gpt(name, p, docs, n) for p, docs, n in zip(prefixes, whole, per_dataset, strict=True)]
        return self.blend(list(zip(weights, parts, strict=True)), sum(per_dataset))

    def blend(self, weighted: list[tuple[float, GPTDataset]], size: int) -> BlendableDataset:
        weights, datasets = [w for w, _ in weighted], [d for _, d in weighted]
        return BlendableDataset(datasets, weights, size, self.cfg.data_cache_path, self.is_builder, self.barrier)


def _parse(flag: str, paths: list[str]) -> tuple[list[float], list[str]]:
    try:
        return parse_blend(paths, flag)
    except ValueError as err:
        raise UserError(str(err)) from None
