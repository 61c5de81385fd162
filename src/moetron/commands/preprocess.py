"""`moetron preprocess`: JSONL/text/Parquet/Arrow/Hub datasets -> Megatron `.bin`/`.idx`, with
`tools/preprocess_data.py`'s flags (arguments and printing; the work is `moetron.data.preprocess`, the same concept
one level down)."""

from __future__ import annotations

import argparse
import sys

from moetron.data.preprocess import PreprocessOptions, PreprocessSummary, preprocess
from moetron.data.tokenizer import TOKENIZER_TYPES

HELP = "Tokenize JSONL/text into Megatron-compatible .bin/.idx files."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("input data")
    data.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="JSONL (one JSON object a line), .txt (documents separated by blank lines), .gz of either, .parquet, "
        "a directory of .parquet files or from datasets.save_to_disk, hf://datasets/OWNER/NAME, or a glob",
    )
    data.add_argument(
        "--json-keys",
        "--text-key",
        dest="json_keys",
        nargs="+",
        default=["text"],
        help="keys (JSONL) or columns (Parquet, Arrow, Hub) to tokenize; one output pair per key",
    )
    data.add_argument("--split", default="train", help="split of an hf:// dataset or a save_to_disk DatasetDict")
    tok = parser.add_argument_group("tokenizer")
    tok.add_argument("--tokenizer-type", required=True, help=f"one of {', '.join(TOKENIZER_TYPES)}")
    tok.add_argument("--vocab-file", help="GPT-2 vocab.json (GPT2BPETokenizer)")
    tok.add_argument("--merge-file", help="GPT-2 merges.txt (GPT2BPETokenizer)")
    tok.add_argument("--tokenizer-model", help="tokenizer.json or its directory (HFTokenizer)")
    tok.add_argument("--append-eod", action="store_true", help="append EOD to every document (counted in its size)")
    out = parser.add_argument_group("output data")
    out.add_argument(
        "--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx; the directory must exist"
    )
    run = parser.add_argument_group("runtime")
    run.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1: in-process)")
    run.add_argument("--log-interval", type=int, default=1000, help="progress line every N documents (no terminal)")
    run.add_argument("--strict", action="store_true", help="stop at the first bad record instead of skipping it")


def _report(summary: PreprocessSummary) -> None:
    if summary.stale_removed:
        names = ", ".join(str(path) for path in summary.stale_removed)
        print(f"note: removed {len(summary.stale_removed)} temporary file(s) of a killed earlier run: {names}",
              file=sys.stderr)  # fmt: skip
    skipped = summary.skipped_records + summary.empty_documents
    if skipped:
        shown = "; ".join(f"{source}:{line}: {message}" for source, line, message in summary.problems)
        more = f" (first {len(summary.problems)}: {shown})" if shown else ""
        print(
            f"warning: skipped {summary.skipped_records} bad record(s) and {summary.empty_documents} empty "
            f"document(s){more}; use --strict to stop at the first",
            file=sys.stderr,
        )
    for output in summary.outputs:
        print(f"wrote {output}.bin and {output}.idx")
    print(
        f"{summary.documents} documents, {summary.tokens} tokens, {skipped} skipped; "
        f"{summary.nbytes / 1e6:.2f} MB in {summary.seconds:.2f} s ({summary.mb_per_s:.2f} MB/s)"
    )


def run(args: argparse.Namespace) -> int:
    options = PreprocessOptions(
        inputs=args.input,
        output_prefix=args.output_prefix,
        tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        json_keys=args.json_keys,
        split=args.split,
        append_eod=args.append_eod,
        workers=args.workers,
        log_interval=args.log_interval,
        strict=args.strict,
    )
    _report(preprocess(options))
    return 0
