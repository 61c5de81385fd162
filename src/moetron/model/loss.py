"""The language-model loss, kept outside the model so another implementation (vocab-parallel or chunked
cross-entropy) can replace it without touching `GPTModel`.

Shapes: B batch, T tokens, C hidden size, V padded vocabulary, N = B·T.

Megatron's loss: the masked mean of fp32 token cross-entropies, `Σ(CE · loss_mask) / Σ loss_mask` (0, not NaN,
when the mask is all zero). Two seams:
  - a `LossFunction` takes the logits and the labels (and an optional mask) and returns that fp32 scalar
    (`language_model_loss`; a vocab-parallel loss is one too);
  - a `HeadLoss` takes the model, the last layer's hidden states and the labels, and applies the LM head itself
    (`model.logits`, or `model.final_layernorm` + `model.head_weight()`), so it may never build the logits:
    `FusedHeadLoss` (the trainer's default, `--fused-cross-entropy`) runs head and cross-entropy chunk by chunk
    (`fused_cross_entropy.py`); `LogitsHeadLoss(loss_fn)` materialises the logits and calls any `LossFunction`.
The trainer's executors call a `HeadLoss` on the last pipeline stage's output, the one `with_grad_scale(factor)` gives
for the factor they multiply the loss by before its backward. Which one is one rule,
`fuses_head(fused flag, vocab-parallel, schedule splits the backward)`, read by the model's own `forward`, the
parallel recipe (which builds the `HeadLoss` every executor and evaluation then uses) and the memory planner.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moetron.model.fused_cross_entropy import fused_linear_cross_entropy


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


def token_weights(loss_mask_BT: torch.Tensor | None, num_tokens: int, device: torch.device) -> torch.Tensor:
    """fp32 [N]: each token's weight in the masked mean (mask / Σ mask; 1 / N without a mask)."""
    if loss_mask_BT is None:
        return torch.full((num_tokens,), 1.0 / num_tokens, dtype=torch.float32, device=device)
    mask_N = loss_mask_BT.flatten().float()
    return mask_N / mask_N.sum().clamp(min=1.0)


def fuses_head(fused_flag: bool, vocab_parallel: bool, splits_backward: bool) -> bool:
    """Whether the LM head runs fused with the cross-entropy: `--fused-cross-entropy`, unless the logits are
    vocabulary shards (tensor parallelism: the vocab-parallel loss reads them) or the pipeline schedule splits each
    backward in two (zero bubble: the fused kernel's gradients, computed once in its forward, cannot be handed out
    twice)."""
    return fused_flag and not vocab_parallel and not splits_backward


class HeadLoss(Protocol):
    fused: ClassVar[bool]  # reads the last layer's hidden states (True), or the logits through `loss_fn` (False)

    def __call__(
        self,
        model: nn.Module,
        hidden_BTC: torch.Tensor,
        labels_BT: torch.Tensor,
        loss_mask_BT: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def with_grad_scale(self, grad_scale: float) -> HeadLoss:
        """This head loss, for a caller that multiplies the loss by `grad_scale` before its backward."""
        ...


class LogitsHeadLoss:
    """`loss_fn(model.logits(hidden), labels, mask)`: the head as the model applies it, then any `LossFunction`."""

    fused: ClassVar[bool] = False

    def __init__(self, loss_fn: LossFunction = language_model_loss):
        self.loss_fn = loss_fn

    def __call__(self, model, hidden_BTC, labels_BT, loss_mask_BT=None) -> torch.Tensor:
        return self.loss_fn(model.logits(hidden_BTC), labels_BT, loss_mask_BT)

    def with_grad_scale(self, grad_scale: float) -> LogitsHeadLoss:
        return self  # autograd multiplies the gradients by the caller's factor


class FusedHeadLoss:
    """Final norm, then head + cross-entropy fused over token chunks: the [B, T, V] logits never exist. The
    gradients are computed in the forward, for `grad_scale`, the factor the caller will multiply the loss by before
    its backward (fp16 scales them before their cast; another factor is corrected in the backward)."""

    fused: ClassVar[bool] = True

    def __init__(self, grad_scale: float = 1.0):
        self.grad_scale = grad_scale

    def with_grad_scale(self, grad_scale: float) -> FusedHeadLoss:
        return FusedHeadLoss(grad_scale)

    def __call__(self, model, hidden_BTC, labels_BT, loss_mask_BT=None) -> torch.Tensor:
        x_NC = model.final_layernorm(hidden_BTC).flatten(0, 1)
        weight_N = token_weights(loss_mask_BT, x_NC.shape[0], x_NC.device)
        return fused_linear_cross_entropy(
            x_NC, model.head_weight(), labels_BT.flatten(), weight_N, grad_scale=self.grad_scale
        )


def make_head_loss(fused: bool, loss_fn: LossFunction = language_model_loss) -> HeadLoss:
    """The LM head + loss `fuses_head` chose: fused (chunked, the plain cross-entropy) or `loss_fn` on materialised
    logits."""
    return FusedHeadLoss() if fused else LogitsHeadLoss(loss_fn)
