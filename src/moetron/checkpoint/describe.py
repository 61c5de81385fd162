"""What `moetron inspect RUN` says of a checkpoint: which one, what it holds, and whether its files are intact."""

from __future__ import annotations

from pathlib import Path

from moetron.checkpoint import files
from moetron.checkpoint.integrity import checkpoint_files, integrity_summary


def describe_checkpoint(path: Path) -> tuple[list[str], bool]:
    """(lines to print, intact) for the checkpoint directory `path` (an iter_* directory)."""
    state = files.read_json(path / "state.json")
    names = checkpoint_files(path)
    size = sum((path / name).stat().st_size for name in names)
    shards = sum(name.endswith(".distcp") for name in names)
    ranks = sum(name.startswith("rng/") for name in names)
    integrity = integrity_summary(path)
    lines = [
        f"checkpoint: {path}",
        f"iteration: {state.get('iteration')}  consumed tokens: {state.get('consumed_tokens')}  "
        f"format version: {state.get('format_version')}",
        f"files: {len(names)} ({size / 2**20:.1f} MiB): {shards} tensor shards, RNG states of {ranks} ranks",
        integrity,
    ]
    return lines, not integrity.startswith("integrity: FAILED")
