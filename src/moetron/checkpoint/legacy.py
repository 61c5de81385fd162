"""moetron 0.1's checkpoint format (format 1), read only to convert it (`moetron convert-checkpoint`).

Format 1 stored safetensors files keyed by parameter name: `model.safetensors` + `optim.safetensors` (dense
tensors and EP rank 0's experts) and `model-ep0000r.safetensors` / `optim-ep0000r.safetensors` (EP rank r's
experts), each routed expert as its own entry `<name>/expert_<global id>`, optimizer entries
`<name>/<state key>[/expert_<id>]`. Two tensors had other layouts then:
  - `query_key_value` was `[Q | K | V]` thirds; now rows are grouped by key/value head (`attention.py`);
  - a dense SwiGLU MLP's `dense_h_to_4h` was `[gate | up]`; now `dense_h_to_4h` (gate) and `dense_h_to_4h_up`.
`convert` maps every tensor (weights and optimizer moments alike: both are laid out like the weight) to today's
names and layouts and writes a format-2 checkpoint, in one process: it holds the converted model and optimizer
state in memory once (about 12 bytes per parameter with AdamW), which a one-off conversion can afford.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moetron.checkpoint import files
from moetron.checkpoint.integrity import checkpoint_files, record_checksums
from moetron.checkpoint.state import single_process_quiet
from moetron.config_cli import load_config
from moetron.errors import UserError
from moetron.model.attention import fuse_qkv
from moetron.model.gpt import GPTModel
from moetron.progress import Progress

EXPERT_SEP = "/expert_"
OPTIM_SEP = "/"


class LegacyTensors:
    """Every entry of a format-1 checkpoint's `<kind>*.safetensors` files, read lazily."""

    def __init__(self, where: Path, kind: str):
        self.where = where
        paths = [where / f"{kind}.safetensors", *sorted(where.glob(f"{kind}-ep*.safetensors"))]
        self.index: dict[str, Path] = {}
        for path in paths:
            if not path.is_file():
                raise files.corrupt(where, f"missing {path.name}")
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():
                        self.index.setdefault(name, path)
            except (SafetensorError, OSError) as err:
                raise files.corrupt(where, f"{path.name}: {str(err).splitlines()[0]}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def get(self, name: str) -> torch.Tensor:
        if name not in self.index:
            raise files.corrupt(self.where, f"it lacks {name}; is it a moetron 0.1 checkpoint of this config?")
        with safe_open(str(self.index[name]), framework="pt") as f:
            return f.get_tensor(name)

    def stacked(self, name: str, count: int) -> torch.Tensor:
        """Global experts 0 … count−1 of `name` as one `[E, …]` tensor."""
        return torch.stack([self.get(f"{name}{EXPERT_SEP}{e}") for e in range(count)])


def _experts_of(model: GPTModel) -> dict[str, int]:
    """Routed-expert parameter name → the layer's global expert count."""
    out = {}
    for moe in model.moe_layers():
        prefix = f"layers.{moe.layer_index}.mlp.experts."
        for leaf, _ in moe.experts.named_parameters():
            out[prefix + leaf] = moe.experts.num_global_experts
    return out


def _old_name(name: str) -> str:
    """The format-1 parameter a tensor of today's model comes from."""
    return name.replace("dense_h_to_4h_up", "dense_h_to_4h")


Reader = Callable[[str], torch.Tensor]


def _rules(model: GPTModel) -> dict[str, Callable[[Reader], torch.Tensor]]:
    """Today's tensor name → how to build it from `read(old entry name)` (weights, or one optimizer moment: the
    moments are laid out like their weight)."""
    cfg, experts = model.cfg, _experts_of(model)
    heads, kv = cfg.num_attention_heads, cfg.kv_heads
    rules: dict[str, Callable[[Reader], torch.Tensor]] = {}
    for name in model.state_dict():
        if name in experts:
            count = experts[name]
            rules[name] = lambda read, n=name, e=count: torch.stack([read(f"{n}{EXPERT_SEP}{i}") for i in range(e)])
        elif re.search(r"query_key_value\.(weight|bias)$", name):
            rules[name] = lambda read, n=name: fuse_qkv(*_thirds(read(n), heads, kv), heads, kv)
        elif cfg.swiglu and re.search(r"mlp\.dense_h_to_4h\.(weight|bias)$", name):
            rules[name] = lambda read, n=name: read(n).chunk(2)[0].contiguous()
        elif re.search(r"mlp\.dense_h_to_4h_up\.(weight|bias)$", name):
            rules[name] = lambda read, n=name: read(_old_name(n)).chunk(2)[1].contiguous()
        else:
            rules[name] = lambda read, n=name: read(n)
    return rules


def _thirds(fused: torch.Tensor, heads: int, kv: int) -> list[torch.Tensor]:
    head_dim = fused.shape[0] // (heads + 2 * kv)
    return list(fused.split([heads * head_dim, kv * head_dim, kv * head_dim]))


def _moment_reader(optim: LegacyTensors, key: str) -> Reader:
    """Reads optimizer moment `key` under a weight's old entry name (`name` or `name/expert_i`)."""

    def read(entry: str) -> torch.Tensor:
        name, sep, expert = entry.partition(EXPERT_SEP)
        return optim.get(f"{name}{OPTIM_SEP}{key}{sep}{expert}")

    return read


def _state_keys(optim: LegacyTensors, old_name: str) -> list[str]:
    prefix = old_name + OPTIM_SEP
    return sorted({entry[len(prefix) :].split(OPTIM_SEP)[0] for entry in optim.index if entry.startswith(prefix)})


def converted_tensors(path: Path, model: GPTModel) -> Iterator[tuple[str, torch.Tensor]]:
    """(key in today's checkpoint, tensor) for the model and optimizer state of a format-1 checkpoint."""
    weights, optim = LegacyTensors(path, "model"), LegacyTensors(path, "optim")
    rules = _rules(model)
    for name, rule in rules.items():
        yield f"model.{name}", rule(weights.get)
    for name, param in model.named_parameters():
        for key in _state_keys(optim, _old_name(name)):
            scalar = optim.get(f"{_old_name(name)}{OPTIM_SEP}{key}") if f"{_old_name(name)}/{key}" in optim else None
            if scalar is not None and scalar.shape != param.shape and scalar.numel() <= 1:
                yield f"optim.{name}.{key}", scalar  # e.g. AdamW's step: one value per parameter
            else:
                yield f"optim.{name}.{key}", rules[name](_moment_reader(optim, key))


def convert(load: str, save: str) -> Path:
    """Convert the format-1 checkpoint `load` (a run directory or iter_* directory) into run directory `save`."""
    import torch.distributed.checkpoint as dcp

    source = files.resolve_checkpoint(load)
    if source is None:
        raise UserError(f"--load {load}: no checkpoint there; give a moetron 0.1 run directory or iter_* directory")
    state = files.read_json(source / "state.json")
    if state.get("format_version") != 1:
        raise UserError(f"--load {load}: {source} is not in moetron 0.1's format (format_version "
                        f"{state.get('format_version')!r}); it needs no conversion")  # fmt: skip
    target = Path(save)
    if target.exists() and any(target.iterdir()):
        raise UserError(f"--save {save} exists and is not empty; give a new directory (nothing is overwritten)")
    cfg, _ = load_config(str(source / "config.yaml"), {})
    with torch.device("meta"):
        model = GPTModel(cfg.model)
    iteration = int(state.get("iteration", 0))
    files.prepare_staging(target, iteration)
    tmp = files.staging_dir(target, iteration)
    tensors = dict(Progress("convert-checkpoint: read", unit="tensors").track(converted_tensors(source, model)))
    with single_process_quiet() as no_dist:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True), no_dist=no_dist)
    files.write_json(tmp / "state.json", {**state, "format_version": files.FORMAT_VERSION})
    shutil.copy(source / "config.yaml", tmp / "config.yaml")
    for rng in sorted((source / "rng").glob("rank_*.safetensors")):
        shutil.copy(rng, tmp / "rng" / rng.name)
    record_checksums(tmp, 0, checkpoint_files(tmp))  # one process wrote them all
    return files.publish(target, iteration, keep_last_n=1)
