"""What `moetron eval` and the quickstart show of `evaluate_checkpoint`'s result: the summary lines and the JSON
file (here, below both, so that the quickstart does not import a command)."""

from __future__ import annotations

import json

from moetron.fileio import write_atomic


def print_result(result: dict) -> None:
    from moetron.eval.routing_report import LayerReport, format_table

    print(
        f"checkpoint {result['checkpoint']} (iteration {result['iteration']}): validation lm loss "
        f"{result['valid_loss']:.4f} | perplexity {result['valid_ppl']:.2f} | {result['micro_batches']} micro-batches"
    )
    print(format_table([LayerReport(**r) for r in result["routing"]]))


def write_json_atomic(path: str, obj: dict) -> None:
    write_atomic(path, json.dumps(obj, indent=1))
