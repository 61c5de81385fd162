"""Each rank's random-number generator states, one small safetensors file per rank (`rng/rank_00000.safetensors`).

Layer randomness is keyed by sample and layer (`moetron.model.rng`), so it needs no saved state; these files carry
the generators' own states (torch CPU and CUDA, numpy, Python's `random`) so that anything else drawing from
them continues exactly after a resume.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from moetron.checkpoint import files


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


def save_rng(path: Path) -> None:
    files.write_tensors(path, *rng_tensors())


def load_rng(path: Path) -> None:
    set_rng(*files.read_tensors(path))
