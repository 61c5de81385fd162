"""Checkpoints that resume exactly, publish atomically and reshard: layout-free safetensors files.

Layout of a run directory (`--save`):

    latest                          text file holding the newest complete checkpoint's name, replaced last
    iter_0000010/
        model.safetensors           parameters and persistent buffers (expert biases) by full-model name
        optim.safetensors           AdamW state keyed "<parameter name>/<state>" (exp_avg, exp_avg_sq, step)
        state.json                  iteration, consumed samples/tokens, scheduler, loss scaler, data-loader
                                    position, skip counters, checkpoint format version
        rng/rank_00000.safetensors  each rank's torch CPU/CUDA generator states (+ numpy and python in metadata)
        config.yaml                 the resolved run config

Layout-free keys: expert tensors live in the model as `[E_local, ...]` stacks; in the files every expert is
its own entry `<name>/expert_<global id>` (for weights and optimizer state alike), so a checkpoint written with
one expert-parallel size loads with another. `split_experts` / `join_experts` are that seam: they map between
local stacks and global ids using each expert container's `expert_offset`.

Expert parallelism (ep > 1): the first replica of every expert shard (EDP rank 0, i.e. ranks 0 … ep−1 in the
E+D layout) writes its own experts' entries; rank 0's go into `model.safetensors` / `optim.safetensors` with
the dense tensors, EP rank r's into `model-ep0000r.safetensors` / `optim-ep0000r.safetensors` (expert entries
only). With ep = 1 a checkpoint is exactly the two files above. Readers see the union of a kind's files
(`ShardedTensors`) and load lazily only the entries their own experts need, so a checkpoint saved with EP = 2
loads with EP = 1 or EP = 4, optimizer state included.

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
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from moetron.errors import UserError

FORMAT_VERSION = 1
LATEST = "latest"
EXPERT_SEP = "/expert_"


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


# ---------------------------------------------------------------------------- expert keys (the EP seam)
def expert_tensor_names(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Stacked `[E_local, ...]` expert tensors of the model's state dict → (E_local, global id of local expert 0).

    Expert containers are the `experts` submodules of MoE layers (`GroupedExperts`, which know their
    `expert_offset`); shared experts and PR-MoE's dense MLP are one-expert containers too, but dense.
    """
    out = {}
    for prefix, module in model.named_modules():
        count, offset = getattr(module, "num_experts", None), getattr(module, "expert_offset", None)
        if count is None or offset is None or prefix.rsplit(".", 1)[-1] != "experts":
            continue
        for name, tensor in module.state_dict().items():
            if tensor.ndim >= 1 and tensor.shape[0] == count:
                out[f"{prefix}.{name}" if prefix else name] = (count, offset)
    return out


def split_experts(tensors: dict, expert_names: dict[str, tuple[int, int]], key=lambda n: n) -> dict:
    """Replace each `[E_local, ...]` stack by one entry per expert under its GLOBAL id (`key` maps an entry's
    name to its parameter's name, for optimizer-state entries)."""
    out = {}
    for name, tensor in tensors.items():
        count, offset = expert_names.get(key(name), (0, 0))
        if count and tensor.ndim >= 1 and tensor.shape[0] == count:
            for i in range(count):
                out[f"{name}{EXPERT_SEP}{offset + i}"] = tensor[i].contiguous()
        else:
            out[name] = tensor
    return out


def join_experts(flat: dict, name: str, count: int, offset: int) -> torch.Tensor:
    """Stack the entries of global experts offset … offset+count−1 back into this rank's `[E_local, ...]`."""
    return torch.stack([flat[f"{name}{EXPERT_SEP}{offset + i}"] for i in range(count)])


# ---------------------------------------------------------------------------- expert-parallel shards
def shard_file_name(kind: str, ep_rank: int) -> str:
    """The `kind` ("model" or "optim") file written by EP rank `ep_rank` (rank 0's also holds the dense tensors)."""
    return f"{kind}.safetensors" if ep_rank == 0 else f"{kind}-ep{ep_rank:05d}.safetensors"


def expert_layout(model: torch.nn.Module) -> tuple[int, int]:
    """(ep_size, ep_rank) read off the model's expert containers; (1, 0) when every expert is local."""
    for prefix, module in model.named_modules():
        local, total = getattr(module, "num_experts", None), getattr(module, "num_global_experts", None)
        if prefix.rsplit(".", 1)[-1] == "experts" and local and total and local < total:
            return total // local, module.expert_offset // local
    return 1, 0


def written_shard(model: torch.nn.Module, rank: int) -> int | None:
    """The EP rank whose files this rank writes, or None: only the first expert-data-parallel replica of each
    expert shard writes (ranks 0 … ep−1, whose experts together are all of them)."""
    ep_size, ep_rank = expert_layout(model)
    return ep_rank if rank < ep_size else None


def shard_entries(flat: dict, model: torch.nn.Module, shard: int, key=lambda n: n) -> dict:
    """All of `flat` for shard 0; only the expert entries (and their optimizer step) for the other shards."""
    if shard == 0:
        return flat
    experts = expert_tensor_names(model)
    return {name: t for name, t in flat.items() if key(name.split(EXPERT_SEP)[0]) in experts}


class ShardedTensors(Mapping):
    """The entries of every `<kind>*.safetensors` file of a checkpoint, read lazily (headers only up front)."""

    def __init__(self, where: Path, kind: str):
        files = [where / f"{kind}.safetensors"] + sorted(where.glob(f"{kind}-ep*.safetensors"))
        self.where, self._handles, self._index = where, [], {}
        for path in files:
            if not path.is_file():
                raise corrupt(where, f"missing {path.name}")
            handle = self._open(path)
            self._handles.append((path, handle))
            for name in handle.keys():
                self._index.setdefault(name, len(self._handles) - 1)  # duplicates (expert "step") are equal

    def _open(self, path: Path):
        try:
            return safe_open(str(path), framework="pt")
        except (SafetensorError, OSError, ValueError, RuntimeError) as err:
            raise corrupt(self.where, f"{path.name}: {str(err).splitlines()[0]}") from None

    def __getitem__(self, name: str) -> torch.Tensor:
        path, handle = self._handles[self._index[name]]
        try:
            return handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as err:
            raise corrupt(self.where, f"{path.name}: {str(err).splitlines()[0]}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


# ---------------------------------------------------------------------------- writing
def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True))
    _fsync_file(path)


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(cpu, str(path), metadata=metadata)
    _fsync_file(path)


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    _fsync_file(tmp)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


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
    return run_dir / pointer.read_text().strip()


def resolve_checkpoint(load: str) -> Path | None:
    """`--load` may name a run directory (follow `latest`) or one `iter_*` directory; None when nothing is there."""
    path = Path(load)
    if (path / "state.json").exists() or (path / "model.safetensors").exists():
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
