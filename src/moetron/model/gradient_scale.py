"""The factor every loss computed inside the forward gives its own gradient: the one the executor multiplies each
micro-batch's LM loss by before its backward (`loss_scale / num_micro_batches`).

Two losses compute their gradients where the caller's multiplication cannot reach them: the MoE aux losses
(attached at their layer, `moe/aux_loss.py`) and the fused LM head (gradients computed in its forward,
`fused_cross_entropy.py`). Both read `LOSS_GRADIENT_SCALE.value`; the executors announce it for the step with
`LOSS_GRADIENT_SCALE.scaled(factor)`. It is 1.0 outside a step, so `lm_loss.backward()` on a plain forward gives the
gradient of lm_loss + moe_loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class LossGradientScale:
    """The factor the in-forward losses' gradients are multiplied by: what the caller scales its LM loss by."""

    def __init__(self) -> None:
        self.value = 1.0

    def set(self, value: float) -> None:
        self.value = float(value)

    @contextlib.contextmanager
    def scaled(self, value: float) -> Iterator[None]:
        """`value` within the block (around a step's backward passes), the previous value after it."""
        previous, self.value = self.value, float(value)
        try:
            yield
        finally:
            self.value = previous


LOSS_GRADIENT_SCALE = LossGradientScale()
