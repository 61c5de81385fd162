"""Executors: who runs one optimizer step's micro-batches forward and backward.

    executor = build_executor(parallel, autocast, cfg)   # LocalExecutor(parallel, autocast), or PP's
    lm_loss_sum = executor.forward_backward(next_micro_batch, num_micro, loss_scale)
    executor.moe_step_stats(), executor.evaluate(valid_loader, micro_batches, all_reduce_mean)

The trainer owns everything around it (gradient unscaling, clipping, the optimizer, the schedule); an executor
owns the micro-batch loop. `LocalExecutor` runs every micro-batch through the whole model on this rank;
`PipelineExecutor` (pipeline_executor.py) runs the same contract as a schedule over pipeline stages. Contract:
  - each micro-batch's LM loss is multiplied by `loss_scale / num_micro` before its backward, the fused head is
    told that factor (`HeadLoss.with_grad_scale`) and the MoE aux losses' attached gradients are that factor
    (`aux_loss_grad_scale`), so the gradients are those of the mean over micro-batches of (lm_loss + moe_loss),
    times the fp16 loss scale;
  - gradients are reduced across data parallelism in the last micro-batch only (`parallel.micro_batch`);
  - every micro-batch runs inside `STREAMS.micro_batch("train", first sample index)` (layout-free randomness);
  - the LM loss is `parallel.head_loss(model, hidden, labels)` on the last layer's output: the head loss applies
    the LM head itself (fused with the cross-entropy by default, so the logits are never materialised); evaluation
    uses the same head loss;
  - the return value is Σ lm_loss / num_micro (fp64, on device: no host sync), the same on every rank;
    with --mtp-num-layers the MTP loss (× --mtp-loss-scaling-factor) joins each backward and `last_mtp_loss` holds
    its Σ / num_micro (under pipeline parallelism `pipeline_executor.py` does the same on the last stage);
  - the MoE layers report each training forward to the executor's `moe_record` (`MoEStepRecord`, reset when a step
    starts); `moe_step_stats()` then gives every MoE layer's statistics of the step (all layers, on every rank).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from moetron.config import RunConfig
from moetron.model.loss import HeadLoss
from moetron.model.moe.aux_loss import aux_loss_grad_scale
from moetron.model.moe.stats import MoEStats, MoEStepRecord
from moetron.model.rng import STREAMS
from moetron.parallel.parallelize import ParallelModel
from moetron.train.micro_batch import MicroBatch
from moetron.train.precision import compute_dtype
from moetron.train.validation import evaluate

__all__ = ["LocalExecutor", "MicroBatch", "build_executor"]


class LocalExecutor:
    """Forward and backward of every micro-batch through the whole model held by this rank."""

    def __init__(self, parallel: ParallelModel, autocast: Callable[[], contextlib.AbstractContextManager]):
        self.parallel, self.autocast = parallel, autocast
        self.last_mtp_loss: torch.Tensor | None = None  # the last step's mean MTP loss (--mtp-num-layers), on device
        self.moe_record = MoEStepRecord.attached_to(parallel.model.moe_layers())  # the step's routing reports

    def forward_backward(
        self, next_micro_batch: Callable[[], MicroBatch], num_micro: int, loss_scale: float
    ) -> torch.Tensor:
        factor = loss_scale / num_micro
        head_loss = self.parallel.head_loss.with_grad_scale(factor)
        self.moe_record.reset()
        total = mtp_total = None
        with aux_loss_grad_scale(self.parallel.model.moe_layers(), factor):
            for i in range(num_micro):
                mb = next_micro_batch()
                last = i == num_micro - 1
                with self.parallel.micro_batch(last), STREAMS.micro_batch("train", mb.first_sample):
                    with self.autocast():
                        mtp_inputs = self._mtp_inputs(mb, head_loss)
                        out = self.parallel.module(mb.tokens_BT, return_logits=False, **mtp_inputs)
                        lm_loss = head_loss(self.parallel.model, out.hidden, mb.labels_BT)
                    loss = lm_loss
                    if out.mtp_loss is not None:  # DeepSeek-V3 / Megatron-Core: LM loss + factor × mean MTP loss
                        loss = lm_loss + self.parallel.model.cfg.mtp_loss_scaling_factor * out.mtp_loss
                        value = out.mtp_loss.detach().double() / num_micro
                        mtp_total = value if mtp_total is None else mtp_total + value
                    (loss * factor).backward()
                value = lm_loss.detach().double() / num_micro
                total = value if total is None else total + value
        self.last_mtp_loss = mtp_total
        return total

    def _mtp_inputs(self, mb: MicroBatch, head_loss: HeadLoss) -> dict:
        """The labels the MTP modules need, and the step's head loss for their shared head (vocab-parallel under
        TP); none without --mtp-num-layers: the model's call stays as it was."""
        if self.parallel.model.mtp is None:
            return {}
        return {"mtp_labels_BT": mb.labels_BT, "head_loss": head_loss}

    def moe_step_stats(self) -> MoEStats | None:
        """[L_moe] of the last step's MoE layers: each one's mean over the step's forwards (`MoEStepRecord`)."""
        return self.moe_record.step_stats(self.parallel.model.moe_layers())

    def evaluate(self, loader, micro_batches: int, all_reduce_mean: Callable[[torch.Tensor], torch.Tensor]) -> dict:
        """Validation loss over `micro_batches` micro-batches (`train.validation.evaluate`), the training head loss."""
        model, head_loss = self.parallel.model, self.parallel.head_loss
        return evaluate(model, loader, micro_batches, self.autocast, all_reduce_mean, head_loss=head_loss)


def build_executor(parallel: ParallelModel, autocast: Callable[[], contextlib.AbstractContextManager], cfg: RunConfig):
    """`LocalExecutor`, or the `PipelineExecutor` when the model is split into pipeline stages. Both run
    `parallel.head_loss`, the LM head + loss `build` chose for the layout (`model.loss.fuses_head`)."""
    if parallel.pipeline is None:
        return LocalExecutor(parallel, autocast)
    from moetron.train.pipeline_executor import PipelineExecutor  # torch's pipelining: imported only when used

    t = cfg.train
    num_micro = cfg.num_micro_batches(parallel.mesh.size("dp"))
    dtype = compute_dtype(t.fp16, t.bf16)
    return PipelineExecutor(parallel, autocast, t.micro_batch_size, cfg.model.seq_length, num_micro, dtype)
