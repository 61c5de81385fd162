"""`moetron export`: a moetron checkpoint → a Hugging Face model directory.

    result = export_hf("runs/moe", "hf/moe", dtype="bf16")     # native class when one fits, else remote code
    AutoModelForCausalLM.from_pretrained("hf/moe")             # (+ trust_remote_code=True for remote code)

Written into the directory: `model-0000x-of-0000N.safetensors` + `model.safetensors.index.json` (the hub's
per-expert tensor names, as transformers' `save_pretrained` writes them), `config.json`, `generation_config.json`
and the tokenizer files. The checkpoint is read one tensor at a time (DCP's global tensors, whatever layout saved
them) and every shard is streamed to disk as its tensors are produced: the peak is a few times the largest tensor
(`benchmarks/export_memory.py`), not the model.

Everything is written into a hidden sibling directory (`.<name>.partial-*`) that is renamed to `output` only when
complete, so a failure (a truncated checkpoint shard, a full disk, Ctrl-C) leaves no half-written model behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from moetron.data.config import DataConfig
from moetron.data.tokenizer import load_tokenizer
from moetron.errors import UserError
from moetron.fileio import describe_os_error, publish_mode, writable_dir_problem
from moetron.interchange.hf_architectures import (
    Architecture,
    Tokens,
    architectures,
    by_name,
    experts_of,
    find_architecture,
)
from moetron.interchange.hf_tensor_rules import Rule, same
from moetron.interchange.moetron_checkpoint import MoetronCheckpoint
from moetron.interchange.remote_code import write_remote_code
from moetron.interchange.safetensors_stream import plan_shards, write_shards
from moetron.interchange.tokenizer_files import check_tokenizer_files, export_tokenizer
from moetron.model.config import ModelConfig
from moetron.progress import Progress

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DEFAULT_SHARD_BYTES = 5 << 30  # the hub's usual 5 GB shards


@dataclass
class ExportResult:
    output: Path
    hf_class: str  # e.g. "MixtralForCausalLM", or "MoetronForCausalLM" (remote code)
    remote_code: bool
    why_remote: list[str]  # when remote: why the closest native class did not fit
    num_tensors: int
    num_shards: int


def _closest(cfg: ModelConfig) -> tuple[Architecture, list[str]]:
    """The class with the fewest problems, MoE classes first for a MoE config (and dense ones for a dense one)."""
    moe = experts_of(cfg) != 0

    def rank(pair: tuple[Architecture, list[str]]) -> tuple[bool, int]:
        arch, problems = pair
        return (getattr(arch, "placement", None) is None) == moe, len(problems)

    return min(((a, a.problems(cfg)) for a in architectures()), key=rank)


def choose(cfg: ModelConfig, arch: str | None, remote: bool) -> tuple[Architecture | None, list[str]]:
    """(native architecture or None for remote code, why not native)."""
    if remote:
        return None, ["--remote-code was asked for"]
    if arch is not None:
        chosen = by_name(arch)
        if chosen is None:
            names = ", ".join(a.name for a in architectures())
            raise UserError(f"--arch {arch} is not one of {names}")
        problems = chosen.problems(cfg)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise UserError(f"--arch {arch}: {problems[0]}{more}; drop --arch to export with remote code")
        return chosen, []
    found = find_architecture(cfg)
    if found is not None:
        return found, []
    closest, problems = _closest(cfg)
    return None, [f"closest {closest.hf_class}: " + "; ".join(problems)]


def _check_output(output: Path) -> None:
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise UserError(f"--output {output} exists and is not an empty directory; give a new directory")
    parent = output.parent
    if not parent.exists():
        raise UserError(f"--output {output}: the directory {parent} does not exist; create it first")
    problem = writable_dir_problem(parent)  # a file in the way, a read-only disk: before any work
    if problem is not None:
        raise UserError(f"--output {output}: {problem}; give a directory you can write to")


@contextlib.contextmanager
def _staged(output: Path) -> Iterator[Path]:
    """A new hidden sibling of `output` to write into; renamed to `output` when the block succeeds, removed when it
    fails (an OSError — a full disk — becomes one line naming --output)."""
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    except OSError as err:
        raise UserError(f"cannot write --output {output}: {describe_os_error(err, output.parent)}") from None
    try:
        yield staging
        publish_mode(staging, 0o777)  # mkdtemp makes it 0700; a published directory gets the usual mode
        os.replace(staging, output)  # onto an empty `output` too: rename(2) replaces an empty directory
    except OSError as err:
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"cannot write --output {output}: {describe_os_error(err, output.parent)}") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _identity_rules(ckpt: MoetronCheckpoint) -> list[Rule]:
    """Remote code loads moetron's own parameter names under `model.`."""
    return [same(name, f"model.{name}") for name in ckpt.shapes]


def _check_coverage(ckpt: MoetronCheckpoint, rules: list[Rule]) -> None:
    covered = {r.moetron for r in rules}
    left = [n for n in ckpt.shapes if n not in covered and not n.endswith("router.expert_bias")]
    if left:  # the architecture's rules and the model disagree: a bug, not a user error
        raise AssertionError(f"export rules do not cover {left[:5]}")


def _tensors(ckpt: MoetronCheckpoint, rules: list[Rule]) -> Iterator[tuple[str, torch.Tensor]]:
    for rule in rules:
        yield from zip(rule.hf, rule.to_hf(ckpt.read(rule.moetron)), strict=True)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def export_hf(
    load: str,
    output: str,
    dtype: str = "fp32",
    arch: str | None = None,
    remote: bool = False,
    dropless: bool = False,
    tokenizer: bool = True,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    tokenizer_overrides: dict | None = None,
) -> ExportResult:
    """Export checkpoint `load` into the new directory `output` (see the module docstring)."""
    out = Path(output)
    if max_shard_bytes <= 0:
        raise UserError(f"--max-shard-size must be more than 0 bytes, got {max_shard_bytes}; e.g. 5GB")
    _check_output(out)
    ckpt = MoetronCheckpoint.open(load)
    cfg = dataclasses.replace(ckpt.cfg.model, moe_token_dropping=False) if dropless else ckpt.cfg.model
    native, why = choose(cfg, arch, remote)
    data = dataclasses.replace(ckpt.cfg.data, **(tokenizer_overrides or {}))
    if tokenizer:  # before anything is written: the files exist, and their ids fit the model (eval's own check)
        check_tokenizer_files(data)
        load_tokenizer(dataclasses.replace(ckpt.cfg, data=data))
    with _staged(out) as staging:
        written = _write(staging, ckpt, cfg, native, data if tokenizer else None, dtype, max_shard_bytes)
    hf_class, num_tensors, num_shards = written
    return ExportResult(out, hf_class, native is None, why, num_tensors, num_shards)


def _write(
    out: Path,
    ckpt: MoetronCheckpoint,
    cfg: ModelConfig,
    native: Architecture | None,
    data: DataConfig | None,
    dtype: str,
    max_shard_bytes: int,
) -> tuple[str, int, int]:
    """Every file of the export into `out` (the tokenizer's when `data` is given); returns (HF class, tensors,
    shards)."""
    tokens = export_tokenizer(data, out, cfg.max_positions) if data is not None else Tokens()
    torch_dtype = DTYPES[dtype]
    if native is not None:
        rules, config = native.rules(cfg), native.hf_config(cfg, tokens)
        _check_coverage(ckpt, rules)
    else:
        rules = _identity_rules(ckpt)
        hf_fields = {"bos_token_id": tokens.bos, "eos_token_id": tokens.eos}
        config = write_remote_code(out, cfg, hf_fields, seed=ckpt.cfg.train.seed)  # random routing: eval's streams
    entries = [
        (name, tuple(t.shape)) for r in rules for name, t in zip(r.hf, r.to_hf(ckpt.meta(r.moetron)), strict=True)
    ]
    shards = plan_shards(entries, torch_dtype, max_shard_bytes)
    progress = Progress("export", len(entries), "tensors")
    write_shards(out, shards, torch_dtype, progress.track(_tensors(ckpt, rules)))
    config.update(dtype=DTYPE_NAMES[dtype], torch_dtype=DTYPE_NAMES[dtype])
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {"bos_token_id": tokens.bos, "eos_token_id": tokens.eos})
    hf_class = native.hf_class if native is not None else "MoetronForCausalLM"
    return hf_class, len(entries), len(shards)
