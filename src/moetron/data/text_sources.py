"""Where `moetron preprocess --input` reads documents from: JSONL/text files, Parquet files, Arrow datasets written by
`datasets.save_to_disk`, and Hugging Face Hub datasets (`hf://datasets/NAME`), each streamed in chunks.

Every source yields `Chunk`s (readers.py), the unit of work the worker pool tokenizes; the output depends only on
the sequence of texts, so the same texts give the same `.bin/.idx` bytes from any source and any worker count.
JSONL and text chunks carry raw bytes that the workers decode and parse; the columnar sources carry texts already
decoded (format `COLUMNS`: a record is `{key: value}`), read batch by batch — `pyarrow`'s `iter_batches` for
Parquet, a memory-mapped IPC reader for Arrow, `datasets`' streaming mode for the Hub — so memory stays at a few
batches however large the corpus. A record number is the line for JSONL/text and the 1-based row for the others.

`pyarrow` (extra `[parquet]`) and `datasets` (extra `[datasets]`) are optional: an input that needs one which is
not installed fails with one line naming the extra.
"""

from __future__ import annotations

import glob
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from moetron.data.readers import Chunk, check_readable, iter_chunks
from moetron.errors import UserError

COLUMNS = "columns"  # Chunk.format of records whose texts are already decoded
HUB_PREFIX = "hf://datasets/"
BATCH_ROWS = 1024  # rows per Arrow record batch read: a few MB of text at most, however the file was written
TEXT_TYPES = ("string", "large_string", "string_view")


def resolve_sources(patterns: list[str], keys: list[str], split: str = "train") -> list:
    """Every `--input` value as an ordered list of sources whose columns have been checked; fails before any work."""
    sources = []
    for pattern in patterns:
        if pattern.startswith(HUB_PREFIX):
            sources.append(HubDataset.open(pattern, split))
            continue
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise UserError(f"--input '{pattern}' matches no file")
        for match in matches:
            sources.extend(_sources_at(Path(match), split))
    for source in sources:
        source.check_columns(keys)
    return sources


def _sources_at(path: Path, split: str) -> list:
    if path.is_dir():
        return _directory_sources(path, split)
    check_readable(path)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return [ParquetSource(path)]
    if suffix == ".arrow":
        return [ArrowSource(path)]
    return [LineSource(path)]


def _directory_sources(path: Path, split: str) -> list:
    """A `save_to_disk` Dataset (state.json lists its Arrow files), a DatasetDict (one folder per split), or a folder
    of Parquet files (every `*.parquet` below it, in name order)."""
    if (path / "dataset_dict.json").is_file():
        splits = _json(path / "dataset_dict.json").get("splits", [])
        if split not in splits:
            raise UserError(f"--split '{split}' is not in the dataset at '{path}' (splits: {', '.join(splits)})")
        return _directory_sources(path / split, split)
    if (path / "state.json").is_file():
        names = [entry["filename"] for entry in _json(path / "state.json").get("_data_files", [])]
        for name in names:
            check_readable(path / name)
        return [ArrowSource(path / name, label=f"{path}/{name}") for name in names]
    parquet = sorted(p for p in path.rglob("*.parquet") if p.is_file())
    if not parquet:
        raise UserError(
            f"--input '{path}' is a directory with no .parquet file and no datasets.save_to_disk dataset "
            f"(state.json or dataset_dict.json); give files, a glob such as '{path}/*.jsonl', or such a directory"
        )
    for file in parquet:
        check_readable(file)
    return [ParquetSource(file) for file in parquet]


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"--input '{path.parent}': {path.name} cannot be read ({err})") from None


def chunks_of(sources: list, keys: list[str], chunk_bytes: int) -> Iterator[Chunk]:
    """The records of all sources in order, in chunks of about `chunk_bytes` (never across sources)."""
    for source in sources:
        yield from source.chunks(keys, chunk_bytes)


def total_bytes(sources: list) -> int | None:
    """Bytes the progress bar counts to: only plain-text inputs know them in advance (a Parquet file is compressed)."""
    sizes = [source.size_bytes() for source in sources]
    return None if None in sizes else sum(sizes)


# ---------------------------------------------------------------------------- JSONL and text
@dataclass
class LineSource:
    path: Path

    def check_columns(self, keys: list[str]) -> None:
        """Each JSONL record is checked for its keys as it is parsed (a bad record is skipped and counted)."""

    def size_bytes(self) -> int | None:
        return None if self.path.name.endswith(".gz") else self.path.stat().st_size

    def chunks(self, keys: list[str], chunk_bytes: int) -> Iterator[Chunk]:
        return iter_chunks([self.path], chunk_bytes)


# ---------------------------------------------------------------------------- Arrow: Parquet and IPC files
def require_pyarrow(label: str):
    try:
        import pyarrow  # noqa: F401
        import pyarrow.compute
        import pyarrow.parquet
    except ImportError:
        raise UserError(f"--input '{label}' needs pyarrow (not installed): pip install 'moetron[parquet]'") from None
    return pyarrow


def _check_schema(label: str, schema, keys: list[str]) -> None:
    for key in keys:
        if key not in schema.names:
            shown = ", ".join(schema.names[:8]) or "none"
            raise UserError(f"--input '{label}' has no column '{key}' (columns: {shown}); see --json-keys/--text-key")
        kind = str(schema.field(key).type)
        if kind not in TEXT_TYPES:
            raise UserError(f"--input '{label}': column '{key}' holds {kind}, not strings; choose a text column")


def batch_chunks(label: str, batches, keys: list[str], chunk_bytes: int) -> Iterator[Chunk]:
    """Arrow record batches as chunks of `{key: text}` records; a record's size is its texts' UTF-8 bytes."""
    import pyarrow.compute as pc

    chunk, row = Chunk(label, COLUMNS), 0
    for batch in batches:
        columns = [batch.column(key) for key in keys]
        texts = [column.to_pylist() for column in columns]
        sizes = sum(pc.fill_null(pc.binary_length(column), 0).to_numpy(zero_copy_only=False) for column in columns)
        records = [dict(zip(keys, values, strict=True)) for values in zip(*texts, strict=True)]
        for record, size in zip(records, sizes.tolist(), strict=True):
            row += 1
            chunk.records.append((row, record))
            chunk.nbytes += size
            if chunk.nbytes >= chunk_bytes:
                yield chunk
                chunk = Chunk(label, COLUMNS)
    if chunk.records:
        yield chunk


@dataclass
class ParquetSource:
    path: Path

    def _file(self):
        require_pyarrow(str(self.path))
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as err:
            raise UserError(f"--input '{self.path}' is not a readable Parquet file ({_first_line(err)})") from None

    def check_columns(self, keys: list[str]) -> None:
        _check_schema(str(self.path), self._file().schema_arrow, keys)

    def size_bytes(self) -> int | None:
        return None

    def chunks(self, keys: list[str], chunk_bytes: int) -> Iterator[Chunk]:
        import pyarrow as pa

        batches = self._file().iter_batches(batch_size=BATCH_ROWS, columns=keys)
        try:
            yield from batch_chunks(str(self.path), batches, keys, chunk_bytes)
        except (pa.ArrowException, OSError) as err:  # a truncated or corrupt row group surfaces only while reading
            raise UserError(f"--input '{self.path}' cannot be read to the end ({_first_line(err)})") from None


@dataclass
class ArrowSource:
    """An Arrow IPC file: `datasets.save_to_disk` writes the streaming format; the random-access one is read too."""

    path: Path
    label: str = ""

    def __post_init__(self):
        self.label = self.label or str(self.path)

    def _reader(self):
        require_pyarrow(self.label)
        import pyarrow as pa

        source = pa.memory_map(str(self.path))  # pages come from the OS cache as batches are read: no copy
        try:
            return pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            try:
                return pa.ipc.open_file(source)
            except (pa.ArrowException, OSError) as err:
                raise UserError(f"--input '{self.label}' is not a readable Arrow file ({_first_line(err)})") from None

    def check_columns(self, keys: list[str]) -> None:
        _check_schema(self.label, self._reader().schema, keys)

    def size_bytes(self) -> int | None:
        return None

    def chunks(self, keys: list[str], chunk_bytes: int) -> Iterator[Chunk]:
        import pyarrow as pa

        reader = self._reader()
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = iter(reader)
        selected = (batch.select(keys) for batch in batches)
        try:
            yield from batch_chunks(self.label, selected, keys, chunk_bytes)
        except (pa.ArrowException, OSError) as err:
            raise UserError(f"--input '{self.label}' cannot be read to the end ({_first_line(err)})") from None


# ---------------------------------------------------------------------------- the Hugging Face Hub
def parse_hub_url(url: str) -> str:
    """`hf://datasets/NAME` → NAME (`owner/name`; an absolute path after the prefix is a local dataset folder, which
    `datasets.load_dataset` reads the same way)."""
    name = url[len(HUB_PREFIX) :].rstrip("/") if url.startswith(HUB_PREFIX) else ""
    if not name.strip("/"):
        raise UserError(f"--input '{url}' names no dataset; write hf://datasets/OWNER/NAME")
    return name


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hub's host answers a TCP connection: `datasets` would otherwise retry for half a minute."""
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def _offline() -> bool:
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    return any(os.environ.get(name, "").lower() in ("1", "true", "yes") for name in names)


@dataclass
class HubDataset:
    url: str
    split: str
    dataset: object  # a streaming `datasets.IterableDataset`

    @classmethod
    def open(cls, url: str, split: str) -> HubDataset:
        name = parse_hub_url(url)
        try:
            import datasets
        except ImportError:
            missing = f"--input '{url}' needs datasets (not installed)"
            raise UserError(f"{missing}: pip install 'moetron[datasets]'") from None
        if not Path(name).is_dir() and not _offline() and not _hub_reachable():
            raise UserError(
                f"--input '{url}': the Hugging Face Hub cannot be reached (no network); set HF_HUB_OFFLINE=1 to "
                f"read it from the local cache, or give Parquet files or a datasets.save_to_disk directory"
            )
        try:
            dataset = datasets.load_dataset(name, split=split, streaming=True)
        except Exception as err:  # noqa: BLE001 - datasets raises many kinds (network, missing split, bad name)
            raise UserError(f"--input '{url}' --split '{split}' cannot be opened ({_first_line(err)})") from None
        return cls(url, split, dataset)

    def check_columns(self, keys: list[str]) -> None:
        names = self.dataset.column_names  # None when the dataset's card declares no features: checked per batch
        if names is not None:
            for key in keys:
                if key not in names:
                    raise UserError(
                        f"--input '{self.url}' has no column '{key}' (columns: {', '.join(names[:8])}); "
                        f"see --json-keys/--text-key"
                    )

    def size_bytes(self) -> int | None:
        return None

    def chunks(self, keys: list[str], chunk_bytes: int) -> Iterator[Chunk]:
        chunk, row = Chunk(self.url, COLUMNS), 0
        for batch in self.dataset.iter(batch_size=BATCH_ROWS):
            missing = [key for key in keys if key not in batch]
            if missing:
                raise UserError(f"--input '{self.url}' has no column '{missing[0]}'; see --json-keys/--text-key")
            for i in range(len(batch[keys[0]])):
                row += 1
                record = {key: batch[key][i] for key in keys}
                chunk.records.append((row, record))
                chunk.nbytes += sum(len(v.encode("utf-8")) for v in record.values() if isinstance(v, str))
                if chunk.nbytes >= chunk_bytes:
                    yield chunk
                    chunk = Chunk(self.url, COLUMNS)
        if chunk.records:
            yield chunk


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
