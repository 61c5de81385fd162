"""The one overflow check per optimizer step of `--moe-ep-dispatch static`, and its exact fallback: the re-run.

    guard = StepGuard.from_model(model)                  # None unless some layer has a static dispatcher
    loss = guard.run_exact(model, next_micro_batch, run_once, discard)

`run_once(next_micro_batch)` runs the step's micro-batches forward and backward (the gradients reduced). Then the
guard reads, ONCE for the whole step (every layer and micro-batch), the largest block each static layer needed
where it overflowed (0 where it fit), MAX-all-reduced over every rank so that all of them agree. It costs one
small all-reduce and one host read per optimizer step, placed after the backward and before the optimizer step
(on a GPU the CPU waits there for the step's kernels once, instead of once per MoE layer and forward). Where a
layer overflowed, its buffer factor grows to fit (×1.25 headroom, at most R: B = Q rows cannot overflow), the
attempt is discarded (`discard`: gradients, routing statistics; the routers' aux-free load counters are restored
here) and the same micro-batches run again (`Replay`; their random draws are keyed by sample, `model/rng.py`, so
they repeat). The applied step is therefore exactly the one the uneven dispatcher computes; an overflow costs one
extra forward and backward, and the grown buffers keep it from recurring at that load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from moetron.parallel.ep.static_all_to_all import StaticAllToAllDispatcher

GROWTH = 1.25  # headroom of a grown buffer over the block that overflowed it
T = TypeVar("T")


class Replay:
    """Records the micro-batches a step takes from `source`, then hands the same ones out again."""

    def __init__(self, source: Callable[[], object]):
        self.source, self.taken, self.position = source, [], None

    def __call__(self):
        if self.position is None:
            self.taken.append(self.source())
            return self.taken[-1]
        self.position += 1
        return self.taken[self.position - 1]

    def rewind(self) -> None:
        self.position = 0


class StepGuard:
    """Checks the static dispatchers' overflow once per step and re-runs an overflowed step with grown buffers."""

    def __init__(self, dispatchers: list[StaticAllToAllDispatcher]):
        self.dispatchers = dispatchers
        self.reruns = 0  # steps re-run so far (a diagnostic for benchmarks and tests)

    @classmethod
    def from_model(cls, model) -> StepGuard | None:
        found = [m.dispatcher for m in model.moe_layers() if isinstance(m.dispatcher, StaticAllToAllDispatcher)]
        return cls(found) if found else None

    def grew(self) -> bool:
        """The step's one check: grow every buffer that overflowed; True when one did (the step must re-run)."""
        zero = torch.zeros((), dtype=torch.float64, device=self._device())
        taken = [d.take_overflow_share() for d in self.dispatchers]
        shares = torch.stack([zero if share is None else share for share in taken])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(shares, op=dist.ReduceOp.MAX)
        grew = False
        for dispatcher, share in zip(self.dispatchers, shares.tolist(), strict=True):  # the one host read
            if share > 0:
                dispatcher.buffer_factor = min(dispatcher.ep_size, max(share, dispatcher.buffer_factor * GROWTH))
                grew = True
        return grew

    def run_exact(self, model, next_micro_batch: Callable, run_once: Callable[[Callable], T], discard: Callable) -> T:
        """`run_once` on the step's micro-batches until no static buffer overflows (at most a few times)."""
        replay = Replay(next_micro_batch)
        loads = router_loads(model)
        result = run_once(replay)
        while self.grew():
            self.reruns += 1
            discard()
            restore_router_loads(model, loads)
            replay.rewind()
            result = run_once(replay)
        return result

    def _device(self) -> torch.device:
        for dispatcher in self.dispatchers:
            if dispatcher.overflow_share is not None:
                return dispatcher.overflow_share.device
        return torch.device("cpu")


def router_loads(model) -> list[torch.Tensor]:
    """Copies of the routers' aux-free load counters (accumulated by every training forward)."""
    return [m.router.load_since_update_E.clone() for m in _bias_routers(model)]


def restore_router_loads(model, loads: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for moe, load in zip(_bias_routers(model), loads, strict=True):
            moe.router.load_since_update_E.copy_(load)


def _bias_routers(model) -> list:
    return [m for m in model.moe_layers() if hasattr(m.router, "load_since_update_E")]
