"""Validation loss and perplexity over a fixed number of micro-batches (shared by `train` and `eval`).

The loss is Megatron's: the mean over micro-batches of each micro-batch's masked-mean token cross-entropy
(MoE auxiliary losses excluded), averaged over data-parallel ranks when `all_reduce_mean` is given;
perplexity is `exp(min(20, loss))` as Megatron prints it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch


def eval_seed(seed: int, dp_rank: int) -> int:
    """The seed of data-parallel rank `dp_rank`'s routing draws in evaluation (a function of the run's seed only)."""
    return seed + dp_rank


@contextlib.contextmanager
def evaluation_rng(seed: int, dp_rank: int, device: torch.device | str) -> Iterator[None]:
    """Seed the routing draws of evaluation (DeepSpeed keeps random token selection and top-2's sampled second
    expert active in eval) so every evaluation of a model gives the same numbers — the trainer's and
    `moetron eval`'s alike — and restore the RNG state afterwards, so evaluating never shifts training's stream
    (exact resume stays exact)."""
    device = torch.device(device)
    accelerator = device.type != "cpu"  # the CPU generator is always forked; an accelerator's only when named
    devices = [device] if accelerator else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if accelerator else None):
        torch.manual_seed(eval_seed(seed, dp_rank))
        yield


def perplexity(loss: float) -> float:
    return math.exp(min(20.0, loss))


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loader,
    iters: int,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    all_reduce_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict:
    """Mean LM loss over `iters` micro-batches from `loader.next_micro_batch()` (tokens [B, T+1]).

    The model is put in eval mode (dropout off, eval capacity factor) and restored to its previous mode.
    Returns {"valid_loss", "valid_ppl", "micro_batches"}.
    """
    was_training = model.training
    model.eval()
    total = None
    try:
        for _ in range(iters):
            batch = loader.next_micro_batch()
            device = next(model.parameters()).device
            batch = batch.to(device, non_blocking=True)
            with autocast():
                out = model(batch[:, :-1], labels_BT=batch[:, 1:])
            loss = out.lm_loss.detach().double()
            total = loss if total is None else total + loss
    finally:
        model.train(was_training)
    if total is None:
        return {"valid_loss": float("nan"), "valid_ppl": float("nan"), "micro_batches": 0}
    mean = total / iters
    if all_reduce_mean is not None:
        mean = all_reduce_mean(mean)
    loss = float(mean)
    return {"valid_loss": loss, "valid_ppl": perplexity(loss), "micro_batches": iters}
