"""Index caches: `.npy` files named by the md5 of a description string, as Megatron names them.

A GPT dataset's description (prefix, split name, sample count, epochs, sequence length, seed, split string)
hashes to H; its arrays live in `H_doc_idx.npy`, `H_sample_idx.npy`, `H_shuffle_idx.npy` and the text in
`H.dsc`. They are looked for in `index-cache/` beside the data first, then in `--data-cache-path`; a missing
set is built into the last place looked (so `--data-cache-path` wins when given). Because the names and the
description match Megatron's, caches Megatron already built are found and reused.

Only the builder (rank 0) writes; every file is written to a temporary name and renamed, so a reader never
sees half a file, and gets the mode a plain `open()` would give it (0666 & ~umask, so a team shares caches).
Then `barrier()` lets the other ranks through, and everyone maps the files read-only. A cache file that does
not load (truncated by a full disk or a copy) is rebuilt by the builder with a warning; a reader that still
finds it corrupt stops with one line naming the file.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable

import numpy as np

from moetron.errors import UserError
from moetron.fileio import atomic_writer, describe_os_error, write_atomic


def describe_gpt_dataset(prefix: str, name: str, num_samples: int, num_epochs: int, seq_length: int, seed: int,
                         split: str) -> str:  # fmt: skip
    """Megatron's description string for a GPTDataset index (its md5 names the cache files)."""
    return (
        "GPT Dataset\n\n"
        f"Data prefix {prefix}\n"
        f"Dataset name {name}\n"
        f"Number of samples {num_samples}\n"
        f"Number of epochs {num_epochs}\n"
        f"Sequence length {seq_length}\n"
        f"Random seed {seed}\n"
        f"Split {split}\n"
    )


def desc_hash(description: str) -> str:
    return hashlib.md5(description.encode("utf-8")).hexdigest()


class IndexCache:
    """A set of named arrays stored as `H_<name>.npy` + `H.dsc` in the first directory that has them all."""

    def __init__(self, description: str, array_names: list[str], search_dirs: list[str]):
        self.description = description
        self.hash = desc_hash(description)
        self.array_names = list(array_names)
        self.search_dirs = list(search_dirs)
        self.directory = self._find() or self.search_dirs[-1]

    def paths(self, directory: str) -> dict[str, str]:
        files = {name: os.path.join(directory, f"{self.hash}_{name}.npy") for name in self.array_names}
        files["desc"] = os.path.join(directory, f"{self.hash}.dsc")
        return files

    def _find(self) -> str | None:
        for directory in self.search_dirs:
            if all(os.path.isfile(p) for p in self.paths(directory).values()):
                return directory
        return None

    def exists(self) -> bool:
        return self._find() is not None

    def save(self, arrays: dict[str, np.ndarray]) -> None:
        """Write every array, then the description last (its presence completes the set)."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            paths = self.paths(self.directory)
            for name in self.array_names:
                with atomic_writer(paths[name], "wb") as f:
                    np.save(f, arrays[name], allow_pickle=False)
            write_atomic(paths["desc"], self.description.encode("utf-8"))
        except OSError as err:
            reason = describe_os_error(err, self.directory)
            raise UserError(
                f"cannot write the dataset index cache in {self.directory!r} ({reason}); "
                f"give a writable directory with space with --data-cache-path"
            ) from None

    def load(self) -> dict[str, np.ndarray]:
        """Map every array read-only (raises UserError when the set is incomplete)."""
        directory = self._find()
        if directory is None:
            raise UserError(
                f"dataset index cache {self.hash} not found in {self.search_dirs}; the building rank (rank 0) "
                f"failed to write it — check its error, or give a shared writable --data-cache-path"
            )
        paths = self.paths(directory)
        return {name: _load_array(paths[name]) for name in self.array_names}


class CorruptCacheError(UserError):
    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


def _load_array(path: str) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise CorruptCacheError(
            f"dataset index cache file '{path}' is corrupt or truncated ({str(err).splitlines()[0]}); delete it "
            f"(it is rebuilt on the next run), or give another --data-cache-path",
            path,
        ) from None


def build_or_load(cache: IndexCache, build: Callable[[], dict[str, np.ndarray]], is_builder: bool,
                  barrier: Callable[[], None] | None) -> dict[str, np.ndarray]:  # fmt: skip
    """Build+save on the builder when missing, wait at `barrier`, then load everywhere: the arrays.

    The barrier is reached on every rank even when the builder fails, so the others do not hang; they then
    report the missing cache and the builder re-raises its own error.
    """
    failure = None
    if is_builder and not _usable(cache):
        try:
            cache.save(build())
        except UserError as err:
            failure = err
    if barrier is not None:
        barrier()
    if failure is not None:
        raise failure
    return cache.load()


def _usable(cache: IndexCache) -> bool:
    """The set exists and loads; a corrupt one is reported and will be rebuilt in place."""
    if not cache.exists():
        return False
    try:
        cache.load()
    except CorruptCacheError as err:
        print(f"warning: dataset index cache file '{err.path}' is corrupt or truncated; rebuilding it",
              file=sys.stderr, flush=True)  # fmt: skip
        cache.directory = cache._find() or cache.directory
        return False
    return True
