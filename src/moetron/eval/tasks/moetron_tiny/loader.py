"""Reads a task's JSONL next to its YAML (lm-eval's `custom_dataset`): relocatable, and no hub is needed."""

from __future__ import annotations

import json
from pathlib import Path


def load(data_file: str, split: str = "test", **_) -> dict:
    """{split: datasets.Dataset} of the JSONL `data_file` (relative paths: next to this file)."""
    import datasets

    path = Path(data_file)
    if not path.is_absolute():
        path = Path(__file__).parent / path
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})
