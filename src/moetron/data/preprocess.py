"""Tokenize JSONL/text, Parquet, Arrow and Hub datasets into Megatron `.bin`/`.idx` pairs: streaming, ordered,
parallel, all-or-nothing.

The main process reads records in chunks (text_sources.py, readers.py) and hands them to `workers` processes, keeping
at most two chunks per worker in flight so memory stays flat however large the input; results are written in input
order, so the output is byte-identical for any worker count. Each worker decodes, parses and batch-encodes
its chunk with the Rust tokenizer and returns flat token arrays.

One deliberate difference from Megatron: with `append_eod` the EOD token is counted in the document's size
(the NVIDIA/Megatron-LM#431 fix), so sizes add up to the `.bin`. Empty documents are skipped and counted;
Megatron-DeepSpeed's writer would record them as zero-sequence documents in doc_idx.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import multiprocessing.pool
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moetron.data.indexed import IndexedDatasetBuilder, best_dtype, bin_path, idx_path, remove_stale_temporaries
from moetron.data.readers import Chunk, parse_record
from moetron.data.text_sources import chunks_of, resolve_sources, total_bytes
from moetron.data.tokenizer import Tokenizer, build_tokenizer
from moetron.errors import UserError, sigterm_raises
from moetron.fileio import output_file_problem

SHOWN_PROBLEMS = 5


@dataclass
class PreprocessOptions:
    """The `moetron preprocess` flags (Megatron's `tools/preprocess_data.py` names)."""

    inputs: list[str]
    output_prefix: str
    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    json_keys: list[str] = field(default_factory=lambda: ["text"])  # JSON keys, or columns of Parquet/Arrow/Hub
    split: str = "train"  # the split of a Hub dataset or a save_to_disk DatasetDict
    append_eod: bool = False
    workers: int = 1
    log_interval: int = 1000
    strict: bool = False
    chunk_bytes: int = 256 << 10  # work unit; small enough to keep workers busy, big enough to amortize pickling

    def tokenizer_args(self) -> tuple:
        return (self.tokenizer_type, self.vocab_file, self.merge_file, self.tokenizer_model)

    def output_path(self, key: str) -> str:
        return f"{self.output_prefix}_{key}_document"


@dataclass
class EncodedChunk:
    """A worker's result: per key the concatenated tokens and each document's length; the records it skipped."""

    tokens: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    problems: list[tuple[str, int, str]]  # (file, line, what is wrong)
    bad_records: int
    nbytes: int


@dataclass
class PreprocessSummary:
    outputs: list[str]
    documents: int
    tokens: int
    skipped_records: int
    empty_documents: int
    problems: list[tuple[str, int, str]]  # the first few, for the report
    nbytes: int
    seconds: float
    stale_removed: list[Path] = field(default_factory=list)  # temporaries of killed earlier runs, deleted

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / 1e6 / max(self.seconds, 1e-9)


_worker_tokenizer: Tokenizer | None = None
_worker_error: Exception | None = None


def _init_worker(tokenizer_args: tuple, single_threaded: bool) -> None:
    global _worker_tokenizer, _worker_error
    if single_threaded:  # one Rust thread per worker process: the processes are the parallelism
        os.environ["RAYON_NUM_THREADS"] = "1"
    try:
        _worker_tokenizer = build_tokenizer(*tokenizer_args)
    except Exception as err:  # a failing initializer makes Pool respawn workers forever: report it per task
        _worker_error = err


def _parse_chunk(chunk: Chunk, keys: list[str]) -> tuple[list[tuple[int, dict[str, str]]], list]:
    """(line, texts by key) of the usable records, and the problems of the others."""
    good, problems = [], []
    for number, raw in chunk.records:
        texts, problem = parse_record(chunk.format, raw, keys)
        if texts is None:
            problems.append((chunk.source, number, problem))
        else:
            good.append((number, texts))
    return good, problems


def _encode_key(good: list, key: str, append_eod: bool, source: str, note: str) -> tuple[np.ndarray, np.ndarray, list]:
    """Tokens (flat) and document lengths of one key; empty documents become problems."""
    flat: list[int] = []
    sizes: list[int] = []
    problems = []
    encoded = _worker_tokenizer.encode_batch([texts[key] for _, texts in good])
    for (number, _), ids in zip(good, encoded, strict=True):
        if not ids:
            problems.append((source, number, "empty document" + note))
            continue
        flat.extend(ids)
        if append_eod:
            flat.append(_worker_tokenizer.eod)
        sizes.append(len(ids) + append_eod)  # the EOD counts in the size (Megatron-LM#431)
    return np.array(flat, dtype=np.int64), np.array(sizes, dtype=np.int64), problems


def encode_chunk(chunk: Chunk, keys: list[str], append_eod: bool) -> EncodedChunk:
    """Parse and tokenize one chunk in the current (worker) process."""
    if _worker_error is not None:
        raise _worker_error
    good, problems = _parse_chunk(chunk, keys)
    bad_records = len(problems)
    tokens, lengths = {}, {}
    for key in keys:
        note = f" for key '{key}'" if len(keys) > 1 else ""
        tokens[key], lengths[key], empty = _encode_key(good, key, append_eod, chunk.source, note)
        problems.extend(empty)
    problems.sort(key=lambda problem: problem[1])
    return EncodedChunk(tokens, lengths, problems, bad_records, chunk.nbytes)


def _missing_directories(prefix: str) -> list[Path]:
    """The output prefix's directories that do not exist yet, outermost first (`data/x` in a fresh clone: `data`)."""
    missing, parent = [], Path(prefix).parent
    while not parent.exists() and parent != parent.parent:
        missing.insert(0, parent)
        parent = parent.parent
    return missing


def _check_before_work(options: PreprocessOptions) -> tuple[list, Tokenizer]:
    if options.workers < 1:
        raise UserError(f"--workers {options.workers} must be at least 1")
    if not options.json_keys:
        raise UserError("--json-keys needs at least one key")
    missing = _missing_directories(options.output_prefix)
    for key in options.json_keys:
        for path in (bin_path(options.output_path(key)), idx_path(options.output_path(key))):
            if missing:  # made once everything is checked: then its nearest existing directory must be writable
                path = missing[0]
            problem = output_file_problem(f"--output-prefix '{options.output_prefix}'", path)
            if problem:
                raise UserError(problem)
    sources = resolve_sources(options.inputs, options.json_keys, options.split)
    tokenizer = build_tokenizer(*options.tokenizer_args())
    if options.append_eod:
        tokenizer.eod  # noqa: B018 - raises the one-line error now rather than inside a worker
    return sources, tokenizer


class _Progress:
    """A tqdm bar on a terminal; otherwise a line every `log_interval` documents (Megatron's log)."""

    def __init__(self, log_interval: int, total_bytes: int | None):
        self.log_interval, self.start = log_interval, time.perf_counter()
        self.documents, self.nbytes, self.next_log = 0, 0, log_interval
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", file=sys.stderr)

    def update(self, documents: int, nbytes: int) -> None:
        self.documents += documents
        self.nbytes += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
        elif self.log_interval > 0 and self.documents >= self.next_log:
            elapsed = time.perf_counter() - self.start
            print(
                f"processed {self.documents} documents ({self.documents / elapsed:.0f} docs/s, "
                f"{self.nbytes / 1e6 / elapsed:.2f} MB/s)",
                file=sys.stderr,
            )
            self.next_log = (self.documents // self.log_interval + 1) * self.log_interval

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _worker_pool(workers: int, tokenizer_args: tuple) -> multiprocessing.pool.Pool:
    """Workers started by a fork server on Linux, spawned elsewhere; each loads the tokenizer in its initializer.

    Not a plain fork: the parent has already run the Rust tokenizer (and, inside a larger program, torch's thread
    pools), and a child forked while another thread holds one of their locks deadlocks on it forever (seen in the
    test suite: a worker asleep on a futex). A fork server is a fresh single-threaded process, so its children start
    clean, in a fraction of a spawn's time."""
    method = "forkserver" if sys.platform == "linux" else "spawn"
    return multiprocessing.get_context(method).Pool(workers, _init_worker, (tokenizer_args, True))


def _encoded_chunks(options: PreprocessOptions, sources: list, tokenizer: Tokenizer):
    """EncodedChunks in input order, computed in-process (1 worker) or by a bounded, ordered process pool."""
    global _worker_tokenizer
    _worker_tokenizer = tokenizer
    chunks = chunks_of(sources, options.json_keys, options.chunk_bytes)
    job = (options.json_keys, options.append_eod)
    # The first chunk is encoded here, before any pool starts: an input of one chunk never starts a pool at all.
    first = next(chunks, None)
    if first is None:
        return
    yield encode_chunk(first, *job)
    second = next(chunks, None)
    if second is None:
        return
    if options.workers == 1:
        for chunk in itertools.chain([second], chunks):
            yield encode_chunk(chunk, *job)
        return
    with _worker_pool(options.workers, options.tokenizer_args()) as pool:
        pending: deque = deque()
        for chunk in itertools.chain([second], chunks):
            pending.append(pool.apply_async(encode_chunk, (chunk, *job)))
            if len(pending) >= 2 * options.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _strict_error(problem: tuple[str, int, str]) -> UserError:
    source, line, message = problem
    return UserError(f"{source}:{line}: {message} (--strict stops at the first bad record; without it, it is skipped)")


class Terminated(UserError):
    """SIGTERM arrived while preprocessing: the partial output was removed."""


def _sigterm_as_error(output_prefix: str) -> contextlib.AbstractContextManager[None]:
    """Turn SIGTERM into `Terminated` in this (main) process, so the cleanup below runs; workers just exit."""
    main_pid = os.getpid()

    def handler(signum: int) -> None:
        if os.getpid() != main_pid:  # a worker process that got the handler: die quietly, the parent cleans up
            os._exit(128 + signum)
        raise Terminated(
            f"preprocess of --output-prefix '{output_prefix}' stopped by SIGTERM; its partial files were removed "
            f"and nothing was written — run it again"
        )

    return sigterm_raises(handler)


def _empty_output_error(options: PreprocessOptions, key: str, bad: int, empty: int, problems: list) -> UserError:
    first = f"; first: {problems[0][0]}:{problems[0][1]}: {problems[0][2]}" if problems else ""
    keys = " ".join(options.json_keys)
    return UserError(
        f"--input {' '.join(options.inputs)} gave no document for key '{key}' ({bad} bad record(s), {empty} empty "
        f"document(s) skipped{first}); check --json-keys {keys} and the input; nothing was written"
    )


def preprocess(options: PreprocessOptions) -> PreprocessSummary:
    """Run the whole conversion; on any error (or SIGTERM) no output file is left behind.

    An output without a single document is an error too: an empty input, or `--json-keys` that match no record.
    """
    sources, tokenizer = _check_before_work(options)
    made = _missing_directories(options.output_prefix)
    for directory in made:
        directory.mkdir()
    stale = [p for key in options.json_keys for p in remove_stale_temporaries(options.output_path(key))]
    dtype = best_dtype(tokenizer.vocab_size)
    start = time.perf_counter()
    builders: dict[str, IndexedDatasetBuilder] = {}
    progress = _Progress(options.log_interval, total_bytes(sources))
    problems, bad_records, empty, nbytes = [], 0, 0, 0
    results = _encoded_chunks(options, sources, tokenizer)
    try:
        with _sigterm_as_error(options.output_prefix):
            for key in options.json_keys:
                builders[key] = IndexedDatasetBuilder(options.output_path(key), dtype)
            for result in results:
                if result.problems and options.strict:
                    raise _strict_error(result.problems[0])
                for key, builder in builders.items():
                    builder.add_documents(result.tokens[key], result.lengths[key])
                problems.extend(result.problems[: SHOWN_PROBLEMS - len(problems)])
                bad_records += result.bad_records
                empty += len(result.problems) - result.bad_records
                nbytes += result.nbytes
                progress.update(len(result.lengths[options.json_keys[0]]), result.nbytes)
            for key, builder in builders.items():
                if builder.num_documents == 0:
                    raise _empty_output_error(options, key, bad_records, empty, problems)
            for builder in builders.values():
                builder.finalize()
    except BaseException:
        for builder in builders.values():
            builder.abort()
        for directory in reversed(made):  # the directories made for this output: nothing of it is left
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
    finally:
        results.close()  # stops the worker pool at once when we leave early
        progress.close()
    first = builders[options.json_keys[0]]
    return PreprocessSummary(
        outputs=[options.output_path(key) for key in options.json_keys],
        documents=first.num_documents,
        tokens=sum(builder.num_tokens for builder in builders.values()),
        skipped_records=bad_records,
        empty_documents=empty,
        problems=problems,
        nbytes=nbytes,
        seconds=time.perf_counter() - start,
        stale_removed=stale,
    )
