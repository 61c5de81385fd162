"""Preprocessing speed from Parquet vs from JSONL: the same texts, the same tokenizer, interleaved runs.

Writes tinyshakespeare's blank-line blocks (repeated `--copies` times) as a JSONL file and as a Parquet file (row
groups of 10k rows, snappy) in a temporary directory, then alternates `moetron.data.preprocess.preprocess` on the
two (`--repeats` pairs; the order within each pair alternates too, so a drift of the shared machine's load hits both
sides alike). Checks that both outputs are byte-identical, and prints each side's median wall and CPU seconds and
the Parquet/JSONL ratio (below 1: Parquet is faster; the issue asks for at most 1.2).

    python benchmarks/preprocess_parquet.py [--copies 8] [--repeats 5] [--workers 1]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from moetron.data.preprocess import PreprocessOptions, preprocess

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
VOCAB, MERGES = SHARED / "gpt2" / "gpt2-vocab.json", SHARED / "gpt2" / "gpt2-merges.txt"


def shakespeare_texts(copies: int) -> list[str]:
    text = (SHARED / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
    blocks = [block for block in text.split("\n\n") if block.strip()]
    return blocks * copies


def write_inputs(directory: Path, texts: list[str]) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl, parquet = directory / "corpus.jsonl", directory / "corpus.parquet"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    pq.write_table(pa.table({"text": texts}), parquet, row_group_size=10_000)
    return jsonl, parquet


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def one_run(source: Path, prefix: Path, workers: int) -> tuple[float, float]:
    for suffix in (".bin", ".idx"):
        Path(f"{prefix}_text_document{suffix}").unlink(missing_ok=True)
    options = PreprocessOptions(
        [str(source)], str(prefix), "GPT2BPETokenizer", str(VOCAB), str(MERGES), workers=workers, log_interval=0
    )
    wall, cpu = time.perf_counter(), cpu_seconds()
    preprocess(options)
    return time.perf_counter() - wall, cpu_seconds() - cpu


def output_bytes(prefix: Path) -> bytes:
    return b"".join(Path(f"{prefix}_text_document{suffix}").read_bytes() for suffix in (".bin", ".idx"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=8, help="tinyshakespeare repeated this many times (~1.1 MB each)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved pairs of runs")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    if not VOCAB.exists():
        print(f"needs {SHARED} (the ../shared checkout beside the repository)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        texts = shakespeare_texts(args.copies)
        jsonl, parquet = write_inputs(tmp, texts)
        times: dict[str, list[tuple[float, float]]] = {"jsonl": [], "parquet": []}
        sides = {"jsonl": jsonl, "parquet": parquet}
        for repeat in range(args.repeats):
            order = ("jsonl", "parquet") if repeat % 2 == 0 else ("parquet", "jsonl")
            for side in order:
                times[side].append(one_run(sides[side], tmp / side, args.workers))
        identical = output_bytes(tmp / "jsonl") == output_bytes(tmp / "parquet")
        megabytes = jsonl.stat().st_size / 1e6
        sizes = f"JSONL {megabytes:.1f} MB, Parquet {parquet.stat().st_size / 1e6:.1f} MB"
        runs = f"workers {args.workers}; {args.repeats} interleaved pairs; outputs byte-identical: {identical}"
        print(f"{len(texts)} documents, {sizes}; {runs}")
        print("| input | median wall s | median CPU s | MB/s (wall) |")
        print("|---|---|---|---|")
        medians = {}
        for side, runs in times.items():
            wall, cpu = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
            medians[side] = (wall, cpu)
            print(f"| {side} | {wall:.2f} | {cpu:.2f} | {megabytes / wall:.2f} |")
        wall_ratio = medians["parquet"][0] / medians["jsonl"][0]
        cpu_ratio = medians["parquet"][1] / medians["jsonl"][1]
        print(f"Parquet / JSONL: wall {wall_ratio:.2f}, CPU {cpu_ratio:.2f} (target <= 1.2)")
        return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
