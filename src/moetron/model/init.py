"""Layout-free, deterministic weight initialisation.

Every parameter is drawn from its own CPU generator seeded by `(seed, fully qualified name)`, then
copied to the parameter's device. The same seed therefore gives bit-identical weights whether the
model was built on CPU, on a GPU or on the meta device, and however it is later split: a layer that
another pipeline stage owns, or an extra layer, does not shift any other parameter's random stream.

Megatron's rules (reference §4.1): weights and embeddings ~ N(0, std); the two output projections
of every block (attention `dense`, MLP `dense_4h_to_h`) ~ N(0, std / sqrt(2·num_layers)); biases 0;
norm weights 1. A submodule with its own `init_weights(std, out_std, seed)` (the MoE layer) is handed
a seed derived from its name and initialises its whole subtree itself.

A parameter that holds only a slice of its tensor (tensor parallelism: a column or row shard) is described by
its module's `param_slices[name]` (a `TensorSlice`, set by `moetron.parallel` when it splits the module): it is
drawn at the full shape from the same generator and this slice is copied, so a shard holds exactly the values
the one-process model has there.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn

# Linear layers whose output is added to the residual stream; Megatron scales their std down.
OUTPUT_PROJECTIONS = ("self_attention.dense", "dense_4h_to_h")
NORM_TYPES = (nn.LayerNorm, nn.RMSNorm)


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, name) that is identical in every process and Python run."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class TensorSlice:
    """The part of a larger tensor that a parameter holds: `full[index]` has the parameter's shape."""

    full_shape: tuple[int, ...]
    index: tuple[slice, ...]


def param_slice(module: nn.Module, name: str) -> TensorSlice | None:
    """The slice parameter `name` of `module` holds (None: the whole tensor)."""
    return getattr(module, "param_slices", {}).get(name)


def seeded_generator(seed: int, name: str) -> torch.Generator:
    """The CPU generator of (seed, name): every parameter's own random stream."""
    return torch.Generator(device="cpu").manual_seed(stable_seed(seed, name))


def seeded_draw(
    shape: tuple[int, ...] | torch.Size,
    generator: torch.Generator,
    *,
    std: float | None = None,
    low: float | None = None,
    part: TensorSlice | None = None,
) -> torch.Tensor:
    """fp32 CPU values N(0, std) (or uniform(-low, low)) of `shape`, or of a `part` of a larger tensor: drawn at the
    full shape from `generator` and sliced, so the part holds exactly the values the whole tensor has there."""
    values = torch.empty(part.full_shape if part else shape, dtype=torch.float32)
    values = (
        values.normal_(0.0, std, generator=generator)
        if low is None
        else values.uniform_(-low, low, generator=generator)
    )
    return values[part.index] if part else values


@torch.no_grad()
def normal_(param: torch.Tensor, std: float, seed: int, name: str, part: TensorSlice | None = None) -> None:
    """Fill `param` with N(0, std) drawn on CPU from the generator of (seed, name); a `part` of a larger tensor
    is drawn at the full shape and sliced."""
    generator = seeded_generator(seed, name)
    if part is None and param.device.type == "cpu" and param.dtype == torch.float32 and param.is_contiguous():
        param.normal_(0.0, std, generator=generator)  # the same draw as below, without a temporary
        return
    param.copy_(seeded_draw(param.shape, generator, std=std, part=part))


def output_std(std: float, num_layers: int) -> float:
    """Megatron's `scaled_init_method_normal`: std / sqrt(2·num_layers)."""
    return std / math.sqrt(2.0 * num_layers)


@torch.no_grad()
def init_module_params(module: nn.Module, prefix: str, std: float, out_std: float, seed: int) -> None:
    """Initialise the parameters owned directly by `module` (not its children)."""
    for param_name, param in module.named_parameters(recurse=False):
        full_name = f"{prefix}.{param_name}" if prefix else param_name
        if isinstance(module, NORM_TYPES):
            param.fill_(1.0 if param_name == "weight" else 0.0)
        elif param_name == "bias":
            param.zero_()
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            is_output = isinstance(module, nn.Linear) and prefix.endswith(OUTPUT_PROJECTIONS)
            normal_(param, out_std if is_output else std, seed, full_name, param_slice(module, param_name))
        else:
            raise TypeError(f"no initialisation rule for parameter {full_name} of {type(module).__name__}")


def init_tree(root: nn.Module, seed: int, std: float, out_std: float, prefix: str = "") -> None:
    """Initialise every parameter under `root`; `prefix` is root's name inside the full model."""
    delegated: list[str] = []
    for name, module in root.named_modules(prefix=prefix):
        if any(name.startswith(d + ".") for d in delegated):
            continue
        if module is not root and callable(getattr(module, "init_weights", None)):
            module.init_weights(std, out_std, stable_seed(seed, name))
            delegated.append(name)
            continue
        init_module_params(module, name, std, out_std, seed)
