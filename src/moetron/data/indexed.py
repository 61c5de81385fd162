"""Megatron's `MMapIndexedDataset` on-disk format: a headerless `.bin` of token ids and an `.idx` index.

`.idx` layout (header packed little-endian, arrays C order, little-endian):

    offset 0   9 B    magic b"MMIDIDX\\x00\\x00"
    offset 9   8 B    uint64 version (1)
    offset 17  1 B    uint8 dtype code (see DTYPE_CODES)
    offset 18  8 B    uint64 N, number of sequences
    offset 26  8 B    uint64 D, number of doc_idx entries (documents + 1)
    offset 34  4N B   int32 sizes[N]     tokens per sequence
               8N B   int64 pointers[N]  byte offset of each sequence in `.bin`
               8D B   int64 doc_idx[D]   first sequence of each document; first 0, last N

Files written here are byte-identical to Megatron's writer (one sequence per document), and the reader
accepts files written by Megatron-DeepSpeed and Megatron-LM, including the ones whose sizes leave out an
appended EOD token (NVIDIA/Megatron-LM#431): their pointers are read as stored, never recomputed.
"""

from __future__ import annotations

import os
import struct
from array import array
from functools import cached_property
from pathlib import Path

import numpy as np

from moetron.errors import UserError
from moetron.fileio import publish_mode, write_errors_named

MAGIC = b"MMIDIDX\x00\x00"
LEGACY_MAGIC = b"TNTIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}

# Megatron's rule: 65500, not 65536, leaves head-room for a few added special tokens.
UINT16_VOCAB_LIMIT = 65500


def best_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron uses for a vocabulary: uint16 below 65500 entries, else int32."""
    return np.dtype(np.uint16) if vocab_size < UINT16_VOCAB_LIMIT else np.dtype(np.int32)


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def dataset_exists(prefix: str | Path) -> bool:
    """True when both `{prefix}.idx` and `{prefix}.bin` exist (Megatron's existence check)."""
    return idx_path(prefix).is_file() and bin_path(prefix).is_file()


def _temporary(path: Path, pid: int | None = None) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid() if pid is None else pid}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def remove_stale_temporaries(prefix: str | Path) -> list[Path]:
    """Delete `.PREFIX.bin.tmp-PID` / `.PREFIX.idx.tmp-PID` files whose writer (PID) is gone; return them.

    A writer killed outright (SIGKILL, power loss) cannot clean up after itself; the next writer of the same
    prefix does. Files of a live PID are left alone (another run may be writing them right now).
    """
    removed = []
    for final in (bin_path(prefix), idx_path(prefix)):
        directory = final.parent if str(final.parent) else Path(".")
        if not directory.is_dir():
            continue
        for candidate in directory.glob(f".{final.name}.tmp-*"):
            pid = candidate.name.rsplit("-", 1)[1]
            if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                candidate.unlink(missing_ok=True)
                removed.append(candidate)
    return removed


class IndexedDatasetBuilder:
    """Writes one `.bin`/`.idx` pair, one sequence per document, under temporary names until `finalize()`.

    Use as a context manager to remove the temporary files when anything fails before `finalize()`.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype | type = np.uint16):
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise UserError(f"token dtype {self.dtype} has no Megatron dtype code; use uint16 or int32")
        self.prefix = Path(prefix)
        self._bin_tmp = _temporary(bin_path(prefix))
        self._idx_tmp = _temporary(idx_path(prefix))
        self._bin_file = None
        with self._write_errors():
            self._bin_file = open(self._bin_tmp, "wb")  # noqa: SIM115 - closed in finalize()/abort()
        self._sizes = array("q")
        self.num_tokens = 0
        self._limit = np.iinfo(self.dtype).max if self.dtype.kind in "iu" else None

    def add_document(self, tokens) -> None:
        """Append one document (a sequence of token ids) as one sequence."""
        tokens_T = np.asarray(tokens)
        self.add_documents(tokens_T.reshape(-1), np.array([tokens_T.size], dtype=np.int64))

    def add_documents(self, tokens_T, lengths) -> None:
        """Append several documents at once: their tokens concatenated, and each one's length."""
        tokens_T = np.asarray(tokens_T)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != tokens_T.size:
            raise ValueError(f"lengths add up to {int(lengths.sum())} but {tokens_T.size} tokens were given")
        self._check_range(tokens_T)
        with self._write_errors():
            self._bin_file.write(tokens_T.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.extend(lengths.tolist())
        self.num_tokens += tokens_T.size

    def _check_range(self, tokens_T: np.ndarray) -> None:
        # Casting silently wraps ids that do not fit (uint16 for a vocabulary that needs int32): refuse instead.
        if self._limit is None or tokens_T.size == 0:
            return
        low, high = int(tokens_T.min()), int(tokens_T.max())
        if low < np.iinfo(self.dtype).min or high > self._limit:
            raise UserError(
                f"token id {high if high > self._limit else low} does not fit the {self.dtype} dataset "
                f"'{self.prefix}'; choose the dtype with best_dtype(vocab_size)"
            )

    @property
    def num_documents(self) -> int:
        return len(self._sizes)

    def finalize(self) -> None:
        """Write the index, then move both files to their final names (`.bin` first, so the pair appears last).

        Any OSError (a full disk, a read-only or vanished directory) becomes a one-line UserError naming the
        dataset; the temporary files are then removed and nothing appears under the final names.
        """
        try:
            with self._write_errors():
                self._finalize()
        except BaseException:
            self.abort()
            raise

    def _write_errors(self):
        return write_errors_named(f"the dataset '{self.prefix}'")

    def _finalize(self) -> None:
        self._bin_file.close()
        sizes = np.frombuffer(self._sizes, dtype=np.int64)
        if sizes.size and int(sizes.max()) > np.iinfo(np.int32).max:
            self.abort()
            raise UserError(f"a document of {int(sizes.max())} tokens does not fit Megatron's int32 sizes")
        pointers = np.zeros(sizes.size, dtype=np.int64)
        np.cumsum(sizes[:-1] * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.arange(sizes.size + 1, dtype=np.int64)
        with open(self._idx_tmp, "wb") as index:
            index.write(MAGIC)
            index.write(struct.pack("<Q", VERSION))
            index.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            index.write(struct.pack("<Q", sizes.size))
            index.write(struct.pack("<Q", doc_idx.size))
            index.write(sizes.astype("<i4").tobytes(order="C"))
            index.write(pointers.astype("<i8").tobytes(order="C"))
            index.write(doc_idx.astype("<i8").tobytes(order="C"))
        for path in (self._bin_tmp, self._idx_tmp):
            publish_mode(path)
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))

    def abort(self) -> None:
        """Close and delete the temporary files; nothing is left under the final names."""
        if self._bin_file is not None:
            try:
                self._bin_file.close()
            except OSError:  # the buffered tail cannot be flushed (a full disk): the file goes anyway
                pass
        for path in (self._bin_tmp, self._idx_tmp):
            path.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def _read_header(path: Path, idx_bytes: int) -> tuple[np.dtype, int, int]:
    if idx_bytes < HEADER_BYTES:
        with open(path, "rb") as handle:
            start = handle.read(len(MAGIC))
        if start[: len(MAGIC)] != MAGIC[: len(start)] or not start:
            raise UserError(f"'{path}' is not a Megatron .idx file (bad magic bytes {start[:9]!r})")
        raise UserError(f"'{path}' is truncated: {idx_bytes} bytes, shorter than the {HEADER_BYTES}-byte header")
    with open(path, "rb") as handle:
        header = handle.read(HEADER_BYTES)
    if header.startswith(LEGACY_MAGIC):
        raise UserError(f"'{path}' uses Megatron's legacy 'cached' format (TNTIDX); re-run `moetron preprocess`")
    if header[: len(MAGIC)] != MAGIC:
        raise UserError(f"'{path}' is not a Megatron .idx file (bad magic bytes {header[:9]!r})")
    (version,) = struct.unpack("<Q", header[9:17])
    if version != VERSION:
        raise UserError(f"'{path}' has index version {version}; only version {VERSION} is supported")
    code = header[17]
    if code not in DTYPE_CODES:
        raise UserError(f"'{path}' has unknown dtype code {code}; expected one of {sorted(DTYPE_CODES)}")
    num_sequences, num_doc_idx = struct.unpack("<QQ", header[18:34])
    return DTYPE_CODES[code], num_sequences, num_doc_idx


class IndexedDataset:
    """Memory-mapped reader: `ds[i]` is sequence i's token ids (a read-only view of the `.bin`)."""

    def __init__(self, prefix: str | Path):
        self.prefix = Path(prefix)
        self.idx_file, self.bin_file = idx_path(prefix), bin_path(prefix)
        for path in (self.idx_file, self.bin_file):
            if not path.is_file():
                raise UserError(f"dataset file '{path}' does not exist (expected {self.prefix}.idx and .bin)")
        idx_bytes = self.idx_file.stat().st_size
        self.dtype, count, doc_count = _read_header(self.idx_file, idx_bytes)
        arrays_bytes = 12 * count + 8 * doc_count
        # Megatron-LM's multimodal files append one int8 mode per sequence; those bytes are allowed and ignored.
        if idx_bytes - HEADER_BYTES not in (arrays_bytes, arrays_bytes + count):
            raise UserError(
                f"'{self.idx_file}' is truncated or corrupt: its header announces {count} sequences and "
                f"{doc_count} doc_idx entries ({HEADER_BYTES + arrays_bytes} bytes) but the file has {idx_bytes}"
            )
        index = np.memmap(self.idx_file, mode="r", dtype=np.uint8)
        self.sizes = np.frombuffer(index, dtype="<i4", count=count, offset=HEADER_BYTES)
        self.pointers = np.frombuffer(index, dtype="<i8", count=count, offset=HEADER_BYTES + 4 * count)
        self.doc_idx = np.frombuffer(index, dtype="<i8", count=doc_count, offset=HEADER_BYTES + 12 * count)
        self._bin_bytes = self.bin_file.stat().st_size
        # np.memmap refuses empty files, and an empty dataset is legitimate.
        self._bin = np.memmap(self.bin_file, mode="r", dtype=np.uint8) if self._bin_bytes else np.empty(0, np.uint8)
        self._check_consistency()

    def _check_consistency(self) -> None:
        if self._bin_bytes % self.dtype.itemsize:
            raise UserError(
                f"'{self.bin_file}' has {self._bin_bytes} bytes, not a whole number of {self.dtype} tokens; "
                "it does not belong to this .idx or is truncated"
            )
        if self.doc_idx.size == 0 or self.doc_idx[0] != 0 or self.doc_idx[-1] != len(self.sizes):
            raise UserError(f"'{self.idx_file}' is corrupt: doc_idx must start at 0 and end at {len(self.sizes)}")
        end = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if len(self.sizes) else 0
        if end > self._bin_bytes:
            raise UserError(
                f"'{self.bin_file}' is too short for its index: the last sequence ends at byte {end} but the "
                f"file has {self._bin_bytes} bytes (truncated, or the .bin and .idx come from different runs)"
            )
        # Tokens past the last indexed one: 0, or up to one per document for Megatron's --append-eod drift
        # (its sizes leave out each document's EOD, NVIDIA/Megatron-LM#431). More cannot be one dataset.
        extra = (self._bin_bytes - end) // self.dtype.itemsize
        allowed = self.num_documents if len(self.sizes) else 0
        if extra > allowed:
            raise UserError(
                f"'{self.bin_file}' holds {self.bin_length_tokens} tokens but '{self.idx_file}' indexes "
                f"{end // self.dtype.itemsize} in {self.num_documents} documents: {extra} tokens more than "
                f"Megatron's --append-eod drift (at most one uncounted EOD per document) can explain, so the .bin "
                f"and .idx come from different datasets; use the pair one `moetron preprocess` run wrote, or rerun it"
            )

    def __getstate__(self) -> dict:
        # Pickled (e.g. into spawned DataLoader workers) as its prefix: the copy maps the files again.
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.get(i) for i in range(*index.indices(len(self)))]
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset : offset + length` of sequence `index` (the rest of the sequence when length is None)."""
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} out of range for {len(self)} sequences in '{self.prefix}'")
        size = int(self.sizes[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {index} of {size}")
        start = int(self.pointers[index]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    @cached_property
    def num_tokens(self) -> int:
        """Tokens the index accounts for (the sum of sizes)."""
        return int(self.sizes.sum(dtype=np.int64))

    @property
    def bin_length_tokens(self) -> int:
        """Tokens actually stored in the `.bin`."""
        return self._bin_bytes // self.dtype.itemsize

    @property
    def sizes_consistent(self) -> bool:
        """False when the sizes do not add up to the `.bin` (e.g. Megatron's --append-eod drift)."""
        return self.num_tokens == self.bin_length_tokens
