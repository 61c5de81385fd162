"""What goes into a checkpoint and back: model, optimizer (by parameter name), RNG of every rank.

The file layout and the atomic publish live in `checkpoint.py`; this module turns live objects into flat
name → tensor dicts and restores them. `save_checkpoint` / `load_checkpoint` are the trainer's entry points.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from moetron.errors import UserError
from moetron.train import checkpoint as ckpt

OPTIM_SEP = "/"


# ---------------------------------------------------------------------------- model and optimizer
def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return ckpt.split_experts(model.state_dict(), ckpt.expert_tensor_names(model))


def load_model_tensors(model: torch.nn.Module, flat: dict[str, torch.Tensor], where: Path) -> None:
    experts = ckpt.expert_tensor_names(model)
    state = {}
    for name, current in model.state_dict().items():
        try:
            tensor = ckpt.join_experts(flat, name, *experts[name]) if name in experts else flat[name]
        except KeyError as err:
            raise ckpt.corrupt(where, f"model.safetensors lacks {err.args[0]}; saved from another model?") from None
        if tensor.shape != current.shape:
            raise UserError(
                f"checkpoint {where}: {name} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(current.shape)}; the model flags differ from the run that saved it (see its config.yaml)"
            )
        state[name] = tensor
    model.load_state_dict(state)


def optimizer_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    flat = {}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            flat[f"{names[id(param)]}{OPTIM_SEP}{key}"] = torch.as_tensor(value)
    return ckpt.split_experts(flat, ckpt.expert_tensor_names(model), key=_param_of)


def _param_of(entry: str) -> str:
    """The parameter an optimizer entry "<parameter>/<state>" belongs to."""
    return entry.rsplit(OPTIM_SEP, 1)[0]


def load_optimizer_tensors(model, optimizer: torch.optim.Optimizer, flat: dict, where: Path) -> None:
    """Rebuild `optimizer.state_dict()` from name-keyed tensors and load it (torch puts steps on the right device)."""
    experts = ckpt.expert_tensor_names(model)
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    state = {}
    for name, param in model.named_parameters():
        if id(param) not in index:
            continue
        entry = {}
        for key in ("step", "exp_avg", "exp_avg_sq"):
            full = f"{name}{OPTIM_SEP}{key}"
            if name in experts and key != "step":
                if f"{full}{ckpt.EXPERT_SEP}{experts[name][1]}" in flat:
                    entry[key] = ckpt.join_experts(flat, full, *experts[name])
            elif full in flat:
                entry[key] = flat[full]
        if entry:
            state[index[id(param)]] = entry
    target = optimizer.state_dict()
    target["state"] = state
    try:
        optimizer.load_state_dict(target)
    except (ValueError, RuntimeError, KeyError) as err:
        raise ckpt.corrupt(where, f"optimizer state does not fit the model: {err}") from None


# ---------------------------------------------------------------------------- RNG of this rank
def rng_tensors() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.uint32).view(np.int32).copy())
    version, internal, gauss_next = random.getstate()
    metadata = {
        "numpy": json.dumps([kind, int(pos), int(has_gauss), float(cached)]),
        "python": json.dumps([version, list(internal), gauss_next]),
    }
    return tensors, metadata


def set_rng(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if f"torch_cuda_{i}" in tensors:
                torch.cuda.set_rng_state(tensors[f"torch_cuda_{i}"], i)
    kind, pos, has_gauss, cached = json.loads(metadata["numpy"])
    keys = tensors["numpy_keys"].numpy().view(np.uint32)
    np.random.set_state((kind, keys, pos, has_gauss, cached))
    version, internal, gauss_next = json.loads(metadata["python"])
    random.setstate((version, tuple(internal), gauss_next))


# ---------------------------------------------------------------------------- entry points
def save_checkpoint(run_dir, iteration: int, model, optimizer, state: dict, config_yaml: str, env, keep_last_n: int):
    """Every rank calls this; rank 0 writes the shared files, every rank its RNG. Returns the published path."""
    run_dir = Path(run_dir)
    if env.is_main:
        tmp = ckpt.prepare_staging(run_dir, iteration)
    env.barrier()
    tmp = ckpt.staging_dir(run_dir, iteration)
    rng, rng_meta = rng_tensors()
    ckpt.write_tensors(tmp / "rng" / f"rank_{env.rank:05d}.safetensors", rng, rng_meta)
    shard = ckpt.written_shard(model, env.rank)  # expert parallelism: one writer per expert shard
    if shard is not None:
        model_flat = ckpt.shard_entries(model_tensors(model), model, shard)
        ckpt.write_tensors(tmp / ckpt.shard_file_name("model", shard), model_flat)
        optim_flat = ckpt.shard_entries(optimizer_tensors(model, optimizer), model, shard, key=_param_of)
        ckpt.write_tensors(tmp / ckpt.shard_file_name("optim", shard), optim_flat)
    if env.is_main:
        ckpt.write_json(tmp / "state.json", {"format_version": ckpt.FORMAT_VERSION, **state})
        (tmp / "config.yaml").write_text(config_yaml)
        ckpt._fsync_file(tmp / "config.yaml")
    env.barrier()
    final = ckpt.publish(run_dir, iteration, keep_last_n) if env.is_main else None
    env.barrier()
    return final or run_dir / ckpt.iteration_dir_name(iteration)


def load_checkpoint(path: Path, model, optimizer=None, load_rng: bool = True, rank: int = 0) -> dict:
    """Restore into `model` (and `optimizer`, RNG when asked); returns the trainer state from state.json."""
    state = ckpt.read_json(path / "state.json")
    if state.get("format_version") != ckpt.FORMAT_VERSION:
        raise ckpt.corrupt(path, f"unknown format_version {state.get('format_version')!r}")
    flat = ckpt.ShardedTensors(path, "model")  # every expert shard's file; reads only this rank's entries
    load_model_tensors(model, flat, path)
    if optimizer is not None:
        optim_flat = ckpt.ShardedTensors(path, "optim")
        load_optimizer_tensors(model, optimizer, optim_flat, path)
    if load_rng:
        rng_file = path / "rng" / f"rank_{rank:05d}.safetensors"
        if rng_file.is_file():
            set_rng(*ckpt.read_tensors(rng_file))
        else:
            print(f"warning: {rng_file} not found (different process count?); RNG continues from the seed")
    return state
