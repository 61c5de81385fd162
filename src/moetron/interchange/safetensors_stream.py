"""Safetensors shards written one tensor at a time, and Hugging Face weight files read one tensor at a time.

A safetensors file is an 8-byte header length, a JSON header (every tensor's dtype, shape and byte range) and the
raw bytes. The header needs only shapes and dtypes, which the exporter knows before reading any weight (it
plans on meta tensors), so a shard is written as: header, then each tensor's bytes as soon as it is produced.
Only the tensor being written (and its converted copy) is in memory; `save_pretrained` needs the whole state dict.

    plan = plan_shards([("model.embed_tokens.weight", (V, C)), ...], torch.bfloat16, max_shard_bytes=5 << 30)
    write_shards(out_dir, plan, tensors)        # tensors: an iterator of (name, tensor) in plan order
    weights = HFWeights(hf_dir); weights.get("model.norm.weight")
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moetron.errors import UserError

SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.bool: "BOOL",
}
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class Shard:
    file_name: str = ""
    entries: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    num_bytes: int = 0


def plan_shards(
    entries: Iterable[tuple[str, tuple[int, ...]]], dtype: torch.dtype, max_shard_bytes: int
) -> list[Shard]:
    """Consecutive entries packed into shards of at most `max_shard_bytes` (a larger tensor gets its own)."""
    item = torch.empty((), dtype=dtype).element_size()
    shards = [Shard()]
    for name, shape in entries:
        size = math.prod(shape) * item
        if shards[-1].entries and shards[-1].num_bytes + size > max_shard_bytes:
            shards.append(Shard())
        shards[-1].entries.append((name, tuple(shape)))
        shards[-1].num_bytes += size
    for i, shard in enumerate(shards):
        shard.file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    return shards


def _header(shard: Shard, dtype: torch.dtype) -> bytes:
    item = torch.empty((), dtype=dtype).element_size()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shard.entries:
        size = math.prod(shape) * item
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)  # the data starts 8-byte aligned
    return len(text).to_bytes(8, "little") + text


def write_shards(out_dir: Path, shards: list[Shard], dtype: torch.dtype, tensors: Iterator[tuple[str, torch.Tensor]]):
    """Write every shard and the index; `tensors` must yield exactly the planned names, in plan order."""
    weight_map = {}
    for shard in shards:
        with open(out_dir / shard.file_name, "wb") as f:
            f.write(_header(shard, dtype))
            for name, shape in shard.entries:
                got_name, tensor = next(tensors)
                if got_name != name or tuple(tensor.shape) != shape:
                    raise AssertionError(
                        f"export plan mismatch: planned {name} {shape}, got {got_name} {tuple(tensor.shape)}"
                    )
                f.write(tensor.detach().to("cpu", dtype).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                weight_map[name] = shard.file_name
    total = sum(shard.num_bytes for shard in shards)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


class HFWeights:
    """The tensors of a Hugging Face model directory (sharded or single safetensors, or PyTorch .bin files)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}  # from the headers: checked against config.json before reading
        for pattern in ("*.safetensors", "pytorch_model*.bin"):
            for path in sorted(self.directory.glob(pattern)):
                for name, shape in self._shapes(path).items():
                    self.where.setdefault(name, path)
                    self.shapes.setdefault(name, shape)
            if self.where:
                break
        if not self.where:
            raise UserError(f"--hf {directory}: no *.safetensors or pytorch_model*.bin weights there")
        self._bin_cache: tuple[Path, dict] | None = None

    def _shapes(self, path: Path) -> dict[str, tuple[int, ...]]:
        """Each tensor's name and shape in one file (a safetensors header; a .bin file's memory-mapped tensors)."""
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with self._readable(path), safe_open(str(path), framework="pt") as f:
                return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        return {name: tuple(t.shape) for name, t in _load_bin(path).items()}

    @contextlib.contextmanager
    def _readable(self, path: Path) -> Iterator[None]:
        """A damaged safetensors file (truncated, garbage header) as one line naming it."""
        try:
            yield
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - safetensors' SafetensorError, or an OSError from its mmap
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise UserError(
                f"--hf {self.directory}: {path.name} is not a readable safetensors file ({reason}); it is truncated "
                f"or damaged, download it again"
            ) from None

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return list(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def file_of(self, name: str) -> str:
        return self.where[name].name

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise UserError(f"--hf {self.directory}: the weights lack {name}; is config.json from this checkpoint?")
        path = self.where[name]
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with self._readable(path), safe_open(str(path), framework="pt") as f:
                return f.get_tensor(name)
        if self._bin_cache is None or self._bin_cache[0] != path:
            self._bin_cache = (path, _load_bin(path))
        return self._bin_cache[1][name]


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    """A PyTorch `.bin` state dict with `weights_only=True`: tensors only, no code runs."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 - a pickle needing more than tensors, or a corrupt file
        raise UserError(f"{path}: not a plain tensor state dict ({str(err).splitlines()[0][:200]})") from None
