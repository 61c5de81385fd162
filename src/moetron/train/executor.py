"""Executors: who runs one optimizer step's micro-batches forward and backward.

    executor = LocalExecutor(parallel, head_loss(fused=True), autocast)   # a `moetron.model.loss.HeadLoss`
    lm_loss_sum = executor.forward_backward(next_micro_batch, num_micro, loss_scale)

The trainer owns everything around it (gradient unscaling, clipping, the optimizer, the schedule); an executor
owns the micro-batch loop. `LocalExecutor` runs every micro-batch through the whole model on this rank; a
pipeline executor runs the same contract as a schedule over pipeline stages. Contract:
  - each micro-batch's LM loss is multiplied by `loss_scale / num_micro` before its backward, and the MoE aux
    losses' attached gradients by the same factor (`AUX_LOSS_SCALE`), so the gradients are those of the mean
    over micro-batches of (lm_loss + moe_loss), times the fp16 loss scale;
  - gradients are reduced across data parallelism in the last micro-batch only (`parallel.micro_batch`);
  - every micro-batch runs inside `STREAMS.micro_batch("train", first sample index)` (layout-free randomness);
  - the LM loss is `head_loss(model, hidden, labels)` on the last layer's output: the head loss applies the LM
    head itself (fused with the cross-entropy by default, so the logits are never materialised);
  - the return value is Σ lm_loss / num_micro (fp64, on device: no host sync).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moetron.model.loss import HeadLoss
from moetron.model.moe.aux_loss import AUX_LOSS_SCALE
from moetron.model.rng import STREAMS
from moetron.parallel.parallelize import ParallelModel


@dataclass
class MicroBatch:
    tokens_BT: torch.Tensor
    labels_BT: torch.Tensor
    first_sample: int  # dataset index of the batch's first sample: keys the layers' random streams

    @classmethod
    def from_loader(cls, loader, device: torch.device) -> MicroBatch:
        """The loader's next `[mbs, seq + 1]` batch, split into inputs and next-token labels."""
        first = loader.next_first_sample
        batch = loader.next_micro_batch().to(device, non_blocking=True)
        return cls(batch[:, :-1], batch[:, 1:], first)


class LocalExecutor:
    """Forward and backward of every micro-batch through the whole model held by this rank."""

    def __init__(
        self,
        parallel: ParallelModel,
        head_loss: HeadLoss,
        autocast: Callable[[], contextlib.AbstractContextManager],
    ):
        self.parallel, self.head_loss, self.autocast = parallel, head_loss, autocast

    def forward_backward(
        self, next_micro_batch: Callable[[], MicroBatch], num_micro: int, loss_scale: float
    ) -> torch.Tensor:
        factor = loss_scale / num_micro
        total = None
        with AUX_LOSS_SCALE.scaled(factor):
            for i in range(num_micro):
                mb = next_micro_batch()
                last = i == num_micro - 1
                with self.parallel.micro_batch(last), STREAMS.micro_batch("train", mb.first_sample):
                    with self.autocast():
                        hidden = self.parallel.module(mb.tokens_BT, return_logits=False).hidden
                        lm_loss = self.head_loss(self.parallel.model, hidden, mb.labels_BT)
                    (lm_loss * factor).backward()
                value = lm_loss.detach().double() / num_micro
                total = value if total is None else total + value
        return total
