"""The language-model loss, kept outside the model so another implementation (vocab-parallel or chunked
cross-entropy) can replace it without touching `GPTModel`.

Shapes: B batch, T tokens, V padded vocabulary, N = B·T.

Megatron's loss: the masked mean of fp32 token cross-entropies, `Σ(CE · loss_mask) / Σ loss_mask` (0, not NaN,
when the mask is all zero). A `LossFunction` takes the logits and the labels (and an optional mask) and returns
that fp32 scalar; the trainer's executors call it on the last pipeline stage's output.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class LossFunction(Protocol):
    def __call__(
        self, logits_BTV: torch.Tensor, labels_BT: torch.Tensor, loss_mask_BT: torch.Tensor | None = None
    ) -> torch.Tensor: ...


def language_model_loss(
    logits_BTV: torch.Tensor, labels_BT: torch.Tensor, loss_mask_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """Megatron's masked mean of fp32 token cross-entropies."""
    losses_N = F.cross_entropy(logits_BTV.float().flatten(0, 1), labels_BT.flatten(), reduction="none")
    return masked_mean(losses_N, loss_mask_BT)


def masked_mean(losses_N: torch.Tensor, loss_mask_BT: torch.Tensor | None) -> torch.Tensor:
    """Mean of per-token losses, weighted by the mask when there is one (0 for an all-zero mask)."""
    if loss_mask_BT is None:
        return losses_N.mean()
    mask_N = loss_mask_BT.flatten().float()
    return (losses_N * mask_N).sum() / mask_N.sum().clamp(min=1.0)
