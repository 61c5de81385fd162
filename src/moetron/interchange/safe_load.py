"""`torch.load(weights_only=True)` for Megatron-DeepSpeed checkpoints, with the few data-only types they need.

A Megatron-DeepSpeed `mp_rank_XX_model_states.pt` pickles, besides tensors: the run's `args` (an
`argparse.Namespace`, holding enums of Megatron's own such as `megatron.core.enums.ModelType`) and the RNG states
(`rng_state`: numpy arrays). weights_only refuses all of these. What is allowed here, and why it is safe:
  * `argparse.Namespace`: a plain attribute bag (built with setattr, runs no code);
  * numpy's array reconstruction (`_reconstruct`, `ndarray`, `dtype` and the dtype classes): data only;
  * any `megatron.*` class: NOT imported — a stand-in records its constructor arguments instead (an enum member
    pickles as `EnumClass(value)`), so no Megatron code runs and Megatron need not be installed.
Anything else stops the load with the offending name; `--allow-pickle` (trusted files only) falls back to a full
unpickle, which needs the classes importable.
"""

from __future__ import annotations

import argparse
import importlib
import zipfile
from pathlib import Path

import numpy as np
import torch

from moetron.errors import UserError

NUMPY_GLOBALS = {
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
    "numpy.ndarray",
    "numpy.dtype",
}


class Opaque:
    """Stands in for a Megatron class inside a pickle: keeps what it was built from, runs nothing."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        self.state = state

    @property
    def value(self):
        """An enum member's value (enums pickle as `Class(value)`)."""
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"Opaque{self.args!r}"


def _resolve(name: str):
    module, _, attribute = name.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def allowed_globals(path: Path) -> list:
    """The safe globals this file needs, or a UserError naming the first one that is not safe."""
    allowed: list = [argparse.Namespace, *(getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType"))]
    for name in torch.serialization.get_unsafe_globals_in_checkpoint(str(path)):
        if name.split(".")[0] == "megatron":
            allowed.append((Opaque, name))
        elif name in NUMPY_GLOBALS or name == "argparse.Namespace":
            allowed.append(_resolve(name))
        else:
            raise UserError(
                f"{path}: the pickle needs {name}, which weights_only loading does not allow; if you trust the file, "
                f"add --allow-pickle (a full unpickle: it can run code)"
            )
    return allowed


def load_pt(path: Path, allow_pickle: bool = False):
    """A `.pt` file's content: weights_only with the allowances above (or a full unpickle when asked for)."""
    try:
        if allow_pickle:
            return torch.load(path, map_location="cpu", weights_only=False)
        allowed = allowed_globals(path)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - a truncated or damaged file: torch's zip reader or pickle fails
        raise UserError(
            f"{path}: cannot be read ({_damage(path, err)}); the file is truncated or damaged, copy it again"
        ) from None
    with torch.serialization.safe_globals(allowed):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - a type found only while unpickling, or a corrupt file
            first = str(err).strip().splitlines()
            detail = next((line for line in first if "got <class" in line or "Unsupported" in line), first[0])
            raise UserError(
                f"{path}: cannot load with weights_only ({detail.strip()[:200]}); --allow-pickle "
                f"loads trusted files fully"
            ) from None


def _damage(path: Path, err: Exception) -> str:
    """What is wrong with a file torch cannot open (its reader says only "Invalid argument" for a truncated zip)."""
    if not zipfile.is_zipfile(path):
        return "not a complete zip archive, the format torch.save writes"
    return (str(err).strip().splitlines() or [type(err).__name__])[0].split(". ")[0][:200]
