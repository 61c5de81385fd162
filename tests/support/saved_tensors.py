"""What autograd saves for the backward: the measure `moetron plan`'s activation terms are checked against.

    saved = saved_tensor_bytes(model, lambda: model(tokens_BT, return_logits=False))

`saved_tensors_hooks` see every tensor a forward keeps for its backward. Parameters are left out (the plan counts
them as weights), and each storage is counted once, at its size (views of one buffer share it), so the sum is the
memory the saved activations hold.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def saved_tensor_bytes(model: nn.Module, forward: Callable[[], object]) -> int:
    """Bytes of the non-parameter tensors autograd saves while `forward()` runs `model` (each storage once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())
