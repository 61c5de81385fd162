"""Validation loss and perplexity over a fixed number of micro-batches (shared by `train` and `eval`).

The loss is Megatron's: the mean over micro-batches of each micro-batch's masked-mean token cross-entropy
(MoE auxiliary losses excluded), averaged over data-parallel ranks when `all_reduce_mean` is given;
perplexity is `exp(min(20, loss))` as Megatron prints it.

Routers that draw random numbers in evaluation (DeepSpeed keeps random token selection and top-2's sampled
second expert on in eval) draw from each layer's stream keyed by the micro-batch's first sample
(`moetron.model.rng`, phase "valid"): every evaluation of a model gives the same numbers — the trainer's and
`moetron eval`'s alike, on any layout — and evaluating never shifts any other random stream.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch

from moetron.model.loss import HeadLoss
from moetron.model.rng import STREAMS
from moetron.train.micro_batch import local_chunks


def perplexity(loss: float) -> float:
    return math.exp(min(20.0, loss))


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loader,
    iters: int,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    all_reduce_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
    head_loss: HeadLoss | None = None,
    on_micro_batch: Callable[[], None] | None = None,
) -> dict:
    """Mean LM loss over `iters` micro-batches from `loader.next_micro_batch()` (tokens [B, T+1]).

    The model is put in eval mode (dropout off, eval capacity factor) and restored to its previous mode.
    `head_loss`: the LM head + loss the run trains with (`ParallelModel.head_loss`); None: the model's fused head.
    `on_micro_batch`: called after each micro-batch (`moetron eval`'s progress line).
    Returns {"valid_loss", "valid_ppl", "micro_batches"}.
    """
    was_training = model.training
    model.eval()
    total = None
    try:
        device = next(model.parameters()).device
        for _ in range(iters):
            first_sample = loader.next_first_sample
            batch = loader.next_micro_batch().to(device, non_blocking=True)
            with STREAMS.micro_batch("valid", first_sample), autocast():
                tokens_BT, labels_BT = local_chunks(loader, batch[:, :-1]), local_chunks(loader, batch[:, 1:])
                out = model(tokens_BT, labels_BT=labels_BT, return_logits=False, head_loss=head_loss)
            loss = out.lm_loss.detach().double()
            total = loss if total is None else total + loss
            if on_micro_batch is not None:
                on_micro_batch()
    finally:
        model.train(was_training)
    if total is None:
        return {"valid_loss": float("nan"), "valid_ppl": float("nan"), "micro_batches": 0}
    mean = total / iters
    if all_reduce_mean is not None:
        mean = all_reduce_mean(mean)
    loss = float(mean)
    return {"valid_loss": loss, "valid_ppl": perplexity(loss), "micro_batches": iters}
