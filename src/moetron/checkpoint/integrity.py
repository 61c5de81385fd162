"""Checksums of a checkpoint's files: recorded when they are written, verified before a load reads them.

A flipped or overwritten byte in the middle of a `.distcp` shard leaves a file DCP reads without complaint (its
format has no checksum): the load would quietly bring back other weights. So every process of a save, once its
files are written, records the SHA-256 of each of them in `checksums/rank_XXXXX.json` of the staging directory:

    {"algorithm": "sha256", "files": {"__3_0.distcp": "9f2c…", "rng/rank_00003.safetensors": "41ab…"}}

(the main process also `.metadata`, `state.json`, `config.yaml`). Each process hashes only what it wrote, so the cost
of a save is spread over the ranks like its writes. Before a load, every file a manifest names must exist and match,
and every checkpoint file must be named by one; in a distributed load each rank verifies its share of the files and
all ranks agree (`load_checkpoint`), so the checkpoint is read once more in all, not once per rank. A checkpoint
saved before checksums were recorded (no `checksums/`) loads as before; `moetron inspect RUN` says which it is.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from moetron.checkpoint import files

CHECKSUM_DIR = "checksums"
ALGORITHM = "sha256"
SHARED_FILES = (".metadata", "state.json", "config.yaml")  # written by one process of the save
_CHUNK = 1 << 22


def file_checksum(path: Path) -> str:
    digest = hashlib.new(ALGORITHM)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_files(path: Path) -> list[str]:
    """The files of a checkpoint directory that its checksums cover, relative to it (sorted)."""
    names = [p.name for p in path.glob("__*_*.distcp")] + [n for n in SHARED_FILES if (path / n).is_file()]
    names += [f"rng/{p.name}" for p in (path / "rng").glob("*.safetensors")]
    return sorted(names)


def files_written_by(tmp: Path, rank: int, shared: bool) -> list[str]:
    """What one process of a save wrote into the staging directory `tmp`: its DCP shards (DCP names them by the
    rank in the saving group, `__{rank}_{n}.distcp`), its RNG file and, for the main process, the shared files."""
    names = [p.name for p in tmp.glob(f"__{rank}_*.distcp")]
    rng = f"rng/rank_{rank:05d}.safetensors"
    names += [rng] if (tmp / rng).is_file() else []
    names += [n for n in SHARED_FILES if shared and (tmp / n).is_file()]
    return sorted(names)


def record_checksums(tmp: Path, rank: int, names: Iterable[str]) -> None:
    """Write `checksums/rank_{rank}.json` with the SHA-256 of each of `names` (paths relative to `tmp`), fsynced."""
    (tmp / CHECKSUM_DIR).mkdir(exist_ok=True)
    manifest = {"algorithm": ALGORITHM, "files": {name: file_checksum(tmp / name) for name in names}}
    files.write_json(tmp / CHECKSUM_DIR / f"rank_{rank:05d}.json", manifest)


def recorded_checksums(path: Path) -> dict[str, str] | None:
    """file → checksum over every manifest of the checkpoint `path`; None where none was recorded (an older save)."""
    manifests = sorted((path / CHECKSUM_DIR).glob("rank_*.json"))
    if not manifests:
        return None
    recorded: dict[str, str] = {}
    for manifest in manifests:
        what = f"{CHECKSUM_DIR}/{manifest.name}"
        try:
            content = json.loads(manifest.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise files.corrupt(path, f"{what}: {str(err).splitlines()[0]}") from None
        if not isinstance(content, dict) or content.get("algorithm") != ALGORITHM:
            raise files.corrupt(path, f"{what}: not a {ALGORITHM} manifest")
        recorded.update(content.get("files", {}))
    return recorded


def verify_checkpoint(path: Path, part: tuple[int, int] = (0, 1)) -> int | None:
    """Check the checkpoint `path` against its recorded checksums: raise one line naming the first file that is
    missing, unrecorded or different. `part` = (i, n): hash only every n-th file from the i-th (one rank's share
    of a distributed load); every process still checks that each file is there and recorded. Returns the number of
    files hashed, or None for a checkpoint saved without checksums."""
    recorded = recorded_checksums(path)
    if recorded is None:
        return None
    present = checkpoint_files(path)
    for name in present:
        if name not in recorded:
            raise files.corrupt(path, f"{name}: no checksum was recorded for it when the checkpoint was saved")
    for name in sorted(recorded):
        if not (path / name).is_file():
            raise files.corrupt(path, f"missing {name}")
    index, count = part
    mine = sorted(recorded)[index::count]
    for name in mine:
        if _checksum_of(path / name) != recorded[name]:
            raise files.corrupt(path, f"{name}: its {ALGORITHM} differs from the one recorded when it was saved")
    return len(mine)


def _checksum_of(path: Path) -> str:
    stat = path.stat()
    return _cached_checksum(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _cached_checksum(path: str, size: int, mtime_ns: int) -> str:
    """One hash per file version per process: `open_run` and the weights' load both verify the same checkpoint."""
    return file_checksum(Path(path))


def integrity_summary(path: Path) -> str:
    """One line for `moetron inspect`: whether every file of the checkpoint matches its recorded checksum."""
    try:
        hashed = verify_checkpoint(path)
    except Exception as err:  # noqa: BLE001 - UserError (a mismatch) or an unreadable file: reported, not raised
        return f"integrity: FAILED — {err}"
    if hashed is None:
        return "integrity: not recorded (saved by a moetron without checkpoint checksums); nothing to verify"
    return f"integrity: ok — {hashed} files match the {ALGORITHM} checksums recorded when they were saved"
