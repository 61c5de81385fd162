"""The run directory of checkpoints: atomic publish, `latest`, keep-last-n, crash recovery, one-line errors.

Layout of a run directory (`--save`):

    latest                          text file holding the newest complete checkpoint's name, replaced last
    .moetron.lock                   host and pid of the run training here (`train/run_lock.py`; not a checkpoint
                                    or a log: `previous_run` and `discard_previous_run` leave it alone)
    iter_0000010/
        .metadata, __*_*.distcp     the model and optimizer state (torch.distributed.checkpoint; `state.py`)
        state.json                  iteration, consumed samples/tokens, scheduler, loss scaler, data-loader
                                    position, skip counters, checkpoint format version
        rng/rank_00000.safetensors  each rank's torch CPU/CUDA generator states (+ numpy and python in metadata)
        config.yaml                 the resolved run config

Atomic publish: everything is written into `.tmp_iter_0000010/`, fsynced, the directory is renamed to
`iter_0000010/`, and only then `latest` is replaced (write-to-temp + `os.replace`). A crash at any moment leaves
the previous checkpoint and its `latest` pointer intact; stale temporaries are removed by the next save.
Re-saving an existing iteration parks the old directory as `.tmp_old_iter_*` for the swap; if a crash strands it
there (`latest` then names a missing directory), `resolve_checkpoint` loads the parked copy and the next save
puts it back before cleaning up.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from moetron.errors import UserError
from moetron.fileio import fsync_dir as _fsync_dir
from moetron.fileio import fsync_file as _fsync_file
from moetron.fileio import publish_mode, write_atomic

FORMAT_VERSION = 2  # 1: moetron 0.1's safetensors files (convert with `moetron convert-checkpoint`)
LATEST = "latest"


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


# ---------------------------------------------------------------------------- writing
def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True))
    _fsync_file(path)


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """A small safetensors file (RNG states), fsynced. Serialised in memory and written by Python, so that a full
    disk or a read-only filesystem raises an OSError with its errno, which every save turns into one line
    (safetensors' own file writer raises a SafetensorError that only names the errno in its text)."""
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    data = save(cpu, metadata=metadata)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, text, durable=True)


def staging_dir(run_dir: Path, iteration: int) -> Path:
    return run_dir / f".tmp_{iteration_dir_name(iteration)}"


def swapped_out_dir(final: Path) -> Path:
    """Where `publish` parks an existing checkpoint of the same iteration while the new one takes its name."""
    return final.parent / f".tmp_old_{final.name}"


def restore_swapped_out(run_dir: Path) -> None:
    """Undo a swap that crashed between its two renames: `latest` names a missing directory whose complete
    predecessor is still parked; put it back so the run directory is whole again."""
    target = read_latest(run_dir)
    if target is not None and not target.is_dir() and swapped_out_dir(target).is_dir():
        os.rename(swapped_out_dir(target), target)
        _fsync_dir(run_dir)


def prepare_staging(run_dir: Path, iteration: int) -> Path:
    """(rank 0, before a barrier) a fresh, empty staging directory; stale temporaries of crashed saves go."""
    run_dir.mkdir(parents=True, exist_ok=True)
    restore_swapped_out(run_dir)  # first: a parked checkpoint may be the only complete copy of `latest`
    for stale in [*run_dir.glob(".tmp_iter_*"), *run_dir.glob(".tmp_old_iter_*")]:
        shutil.rmtree(stale, ignore_errors=True)
    tmp = staging_dir(run_dir, iteration)
    (tmp / "rng").mkdir(parents=True)
    return tmp


def publish(run_dir: Path, iteration: int, keep_last_n: int) -> Path:
    """(rank 0, after every rank wrote and fsynced) rename staging → final, then move `latest`, then prune."""
    tmp, final = staging_dir(run_dir, iteration), run_dir / iteration_dir_name(iteration)
    share_like_new_files(tmp)
    _fsync_dir(tmp / "rng")
    _fsync_dir(tmp)
    if final.exists():  # the same iteration saved again (e.g. a signal right after a resume): swap it out
        old = swapped_out_dir(final)  # a crash from here to the next rename: see restore_swapped_out
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(run_dir)
    write_text_atomic(run_dir / LATEST, final.name + "\n")
    prune(run_dir, keep_last_n)
    return final


def share_like_new_files(tree: Path) -> None:
    """Files and directories of `tree` get the modes `open()`/`mkdir` give under the umask: some writers
    (safetensors, temp files) create 0600 files, and teammates on a shared cluster could not read the checkpoint."""
    publish_mode(tree, 0o777)
    for path in tree.rglob("*"):
        publish_mode(path, 0o777 if path.is_dir() else 0o666)


RUN_FILES = ("metrics.jsonl", "eval.jsonl", "config.yaml")  # what a run writes beside its checkpoints


def previous_run(run_dir: str | Path) -> str | None:
    """A short description of the run output `run_dir` already holds (None when it holds none): its newest
    checkpoint, or its log files."""
    path = Path(run_dir)
    if not path.is_dir():
        return None
    found = list_checkpoints(path)
    if found or (path / LATEST).exists():
        return f"checkpoints up to {found[-1].name}" if found else "a 'latest' pointer"
    logs = [name for name in RUN_FILES[:2] if (path / name).is_file()]
    return " and ".join(logs) if logs else None


def discard_previous_run(run_dir: str | Path) -> None:
    """`--overwrite`: remove a previous run's checkpoints, temporaries and log files from `run_dir` (only those)."""
    path = Path(run_dir)
    for old in [*list_checkpoints(path), *path.glob(".tmp_iter_*"), *path.glob(".tmp_old_iter_*")]:
        shutil.rmtree(old, ignore_errors=True)
    for name in (LATEST, *RUN_FILES):
        (path / name).unlink(missing_ok=True)


def list_checkpoints(run_dir: Path) -> list[Path]:
    found = [p for p in run_dir.glob("iter_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def prune(run_dir: Path, keep_last_n: int) -> None:
    """Delete all but the newest `keep_last_n` checkpoints (never the one `latest` names)."""
    latest = read_latest(run_dir)
    for old in list_checkpoints(run_dir)[:-keep_last_n]:
        if latest is None or old.resolve() != latest.resolve():
            shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------- reading
def read_latest(run_dir: Path) -> Path | None:
    pointer = run_dir / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_text().strip()
    except UnicodeDecodeError:
        name = None
    if not name or not name.startswith(("iter_", ".tmp_old_iter_")) or "/" in name or "\x00" in name:
        raise UserError(
            f"checkpoint pointer {pointer} does not name a checkpoint (it should hold e.g. 'iter_0000100'); "
            f"fix or delete it, or --load one iter_* directory of {run_dir}"
        )
    return run_dir / name


def resolve_checkpoint(load: str) -> Path | None:
    """`--load` may name a run directory (follow `latest`) or one `iter_*` directory; None when nothing is there."""
    path = Path(load)
    if (path / "state.json").exists():
        return path
    if not path.is_dir():
        return None
    target = read_latest(path)
    if target is None:  # a first save that crashed before writing `latest`: its iter_* directory is complete
        found = list_checkpoints(path)
        return found[-1] if found else None
    if not target.is_dir() and swapped_out_dir(target).is_dir():
        return swapped_out_dir(target)  # a re-save of the same iteration crashed mid-swap: the parked copy
    if not target.is_dir():
        raise UserError(
            f"checkpoint {path}/{LATEST} points to {target.name}, which does not exist; "
            f"fix the pointer or --load an existing iter_* directory"
        )
    return target


def corrupt(path: Path, why: str) -> UserError:
    return UserError(
        f"checkpoint {path} is corrupt or truncated ({why}); --load an older iter_* directory or start fresh"
    )


def read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if not path.is_file():
        raise corrupt(path.parent, f"missing {path.name}")
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        return load_file(str(path)), metadata
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise corrupt(path.parent, f"{path.name}: {str(err).splitlines()[0]}") from None


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise corrupt(path.parent, f"missing {path.name}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise corrupt(path.parent, f"{path.name}: {err}") from None
