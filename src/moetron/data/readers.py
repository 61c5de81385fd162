"""Input files for preprocessing and tokenizer training: JSONL, plain text, `.gz` of either, globs.

A JSONL record is one line holding a JSON object. In plain text (`.txt`, `.text`) a document is a block of
lines separated by one or more blank lines. Records travel as raw bytes with their line number, so that
decoding and JSON parsing happen in the worker processes and every problem can name its line.
"""

from __future__ import annotations

import glob
import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from moetron.errors import UserError

TEXT_SUFFIXES = (".txt", ".text")


@dataclass
class Chunk:
    """Consecutive records of one file, the unit of work sent to a worker."""

    source: str
    format: str  # "jsonl", "text", or "columns" (text_sources.py: Parquet, Arrow, the Hub)
    records: list[tuple[int, bytes | dict]] = field(default_factory=list)  # (line or row number, raw bytes or texts)
    nbytes: int = 0


def resolve_inputs(patterns: list[str]) -> list[Path]:
    """Expand `--input` values (paths or globs) into an ordered list of files; fail before any work."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise UserError(f"--input '{pattern}' matches no file")
        for match in matches:
            path = Path(match)
            if path.is_dir():
                raise UserError(f"--input '{path}' is not a file (give a file or a glob such as 'dir/*.jsonl')")
            files.append(check_readable(path))
    return files


def check_readable(path: Path) -> Path:
    """`path`, or the one-line reason it cannot be read as an input file."""
    if not path.exists():
        raise UserError(f"--input '{path}' does not exist")
    if not path.is_file():
        raise UserError(f"--input '{path}' is not a file (give a file or a glob such as 'dir/*.jsonl')")
    try:
        with open(path, "rb"):
            pass
    except OSError as err:
        raise UserError(f"--input '{path}' cannot be read ({err.strerror})") from None
    return path


def input_format(path: Path) -> str:
    """'text' for .txt/.text (optionally .gz), else 'jsonl' (Megatron's loose JSON)."""
    name = path.name[: -len(".gz")] if path.name.endswith(".gz") else path.name
    return "text" if name.lower().endswith(TEXT_SUFFIXES) else "jsonl"


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")  # noqa: SIM115


def _jsonl_records(handle) -> Iterator[tuple[int, bytes]]:
    for number, line in enumerate(handle, start=1):
        if line.strip():  # blank lines (a trailing newline, padding) are not records
            yield number, line


def _text_records(handle) -> Iterator[tuple[int, bytes]]:
    block: list[bytes] = []
    start = 0
    for number, line in enumerate(handle, start=1):
        if line.strip():
            if not block:
                start = number
            block.append(line)
        elif block:
            yield start, _join_block(block)
            block = []
    if block:
        yield start, _join_block(block)


def _join_block(lines: list[bytes]) -> bytes:
    text = b"".join(lines)
    return text[:-2] if text.endswith(b"\r\n") else text[:-1] if text.endswith(b"\n") else text


def iter_records(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, raw bytes) of every record of one file, streaming."""
    reader = _text_records if input_format(path) == "text" else _jsonl_records
    try:
        with _open_binary(path) as handle:
            yield from reader(handle)
    except (OSError, EOFError) as err:  # a corrupt or truncated .gz surfaces only while reading
        raise UserError(f"--input '{path}' cannot be read to the end ({err})") from None


def iter_chunks(paths: list[Path], chunk_bytes: int) -> Iterator[Chunk]:
    """Records of all files in order, grouped into chunks of about `chunk_bytes` (never across files)."""
    for path in paths:
        chunk = Chunk(str(path), input_format(path))
        for number, raw in iter_records(path):
            chunk.records.append((number, raw))
            chunk.nbytes += len(raw)
            if chunk.nbytes >= chunk_bytes:
                yield chunk
                chunk = Chunk(str(path), chunk.format)
        if chunk.records:
            yield chunk


def parse_record(fmt: str, raw: bytes, keys: list[str]) -> tuple[dict[str, str] | None, str | None]:
    """The texts of one record by key, or (None, the reason it cannot be used). A record of format "columns" (Parquet,
    Arrow, the Hub: text_sources.py) is already `{key: value}`, checked like a JSON object's values."""
    if fmt == "columns":
        return _string_values(raw, keys)
    try:
        decoded = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, f"invalid UTF-8 at byte {err.start}"
    if fmt == "text":
        return {key: decoded for key in keys}, None
    try:
        data = json.loads(decoded)
    except json.JSONDecodeError as err:
        return None, f"malformed JSON ({err.msg} at column {err.colno})"
    if not isinstance(data, dict):
        return None, f"not a JSON object but {type(data).__name__}"
    return _string_values(data, keys)


def _string_values(data: dict, keys: list[str]) -> tuple[dict[str, str] | None, str | None]:
    texts = {}
    for key in keys:
        if key not in data:
            return None, f"missing key '{key}' (keys: {', '.join(list(data)[:5]) or 'none'}; see --json-keys)"
        if not isinstance(data[key], str):
            return None, f"value of '{key}' is {type(data[key]).__name__}, not a string"
        texts[key] = data[key]
    return texts, None


def iter_texts(files: list[Path], json_key: str = "text") -> Iterator[str]:
    """Every usable document text of the files (bad records are skipped), for tokenizer training."""
    for path in resolve_inputs([str(f) for f in files]):
        fmt = input_format(path)
        for _, raw in iter_records(path):
            texts, _problem = parse_record(fmt, raw, [json_key])
            if texts is not None and texts[json_key]:
                yield texts[json_key]
