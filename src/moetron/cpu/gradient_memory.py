"""CPU memory for the vocabulary-sized weight gradients autograd hands to `.grad` — the LM head's and the word
embeddings', [V, C] — reused from one step to the next, and a tied embedding's gradient added into the head's.

    dw_VC = GRADIENT_MEMORY.take(shape, dtype, device)     # a fresh tensor, on memory nobody else holds
    x_BTC = embedding_lookup(tokens_BT, weight_VC)          # F.embedding, its gradient on reused memory

Why: at V = 50304, C = 128 each of these is 25 MB, freshly allocated every step (`torch.empty` for the head's
[V, C] write-back, `at::zeros` in embedding_dense_backward), and glibc hands such blocks back to the kernel when they
are freed, so every step page-faults them in again: at two threads 20–48 ms per buffer per step, on a 0.6–0.8 s
step (benchmarks/RESULTS.md, issue 28). The CUDA caching allocator already reuses device memory: elsewhere than
on CPU `take` allocates.

Why it is safe: `take` returns a new tensor over memory of which the pool keeps only an alias (a tensor of its own
over the same storage — autograd steals a gradient into `.grad` by its tensor's use count, so the alias does not
make it copy), and hands memory out again only when the storage's use count is back to the pool's alone: `.grad`
was set to None (`zero_grad(set_to_none=True)`) or the gradient was added into an existing `.grad` and dropped.
Memory anyone still holds — `.grad`, a view of it, a checkpoint being written — is never handed out twice.

Tied embeddings: autograd sums the head's and the embedding's gradients of the one weight, and since the pool's
alias keeps either from being added into in place, it would allocate the sum afresh. So the head's backward, which
runs first (the embedding's gradient flows through the head), leaves its [V, C] gradient pending on the lookup's
slot, and the lookup's backward adds its rows into it — Σ over each row's tokens, in token order, then added to
the head's row: the bits of `embedding_dense_backward` + the head's gradient — and returns no gradient of its own.
Autograd accumulates a weight only once every use has delivered its part, so the rows arrive before `.grad` is
written.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
import torch.nn.functional as F

_SLOT_ATTRIBUTE = "_moetron_lookup_slot"


_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # None: this torch does not tell; no reuse then


def _storage_users(t: torch.Tensor) -> int:
    """References to t's storage other than the query's own."""
    return _STORAGE_USE_COUNT(t.untyped_storage()._cdata) - 1


def alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor of its own over t's memory (t's shape and strides): a second user of the storage, not of t."""
    empty = torch.empty(0, dtype=t.dtype, device=t.device)
    return empty.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


class ReusedGradientMemory:
    """Gradient-sized CPU memory kept across steps, handed out only when nobody else holds it (module docstring).
    At most `keep` blocks of each shape and dtype — an untied head and the embeddings share a shape, and gradient
    accumulation holds each one in `.grad` while the next micro-batch's is written: four —; the oldest goes beyond
    that."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._held: OrderedDict[tuple, list[torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu" or _STORAGE_USE_COUNT is None:
            return torch.empty(shape, dtype=dtype, device=device)
        key = (tuple(shape), dtype)
        with self._lock:
            held = self._held.setdefault(key, [])
            self._held.move_to_end(key)
            for kept in held:
                if _storage_users(kept) == 1:  # the pool's alias alone
                    return alias(kept)
            fresh = torch.empty(shape, dtype=dtype)
            held.append(alias(fresh))
            if len(held) > self.keep:
                held.pop(0)
            return fresh


GRADIENT_MEMORY = ReusedGradientMemory()


class _LookupSlot:
    """One embedding lookup's meeting point with the heads that read the same weight after it (module docstring):
    the [V, C] gradients (aliases) their backward left for the lookup's rows."""

    def __init__(self):
        self.pending: list[torch.Tensor] = []


def lookup_slot(weight: torch.Tensor) -> _LookupSlot | None:
    """The slot of the latest `embedding_lookup` of `weight` (None: none, or under torch.compile, whose graphs look
    their embeddings up with F.embedding: a slot left by an eager lookup would keep the head's gradient pending)."""
    return None if torch.compiler.is_compiling() else getattr(weight, _SLOT_ATTRIBUTE, None)


def leave_for_lookup(slot: _LookupSlot | None, grad_VC: torch.Tensor) -> None:
    """A head's backward: leave its weight gradient (from GRADIENT_MEMORY) for the lookup's rows."""
    if slot is not None and grad_VC.device.type == "cpu":
        slot.pending.append(alias(grad_VC))


def _handles(weight: torch.Tensor) -> bool:
    return (
        type(weight) is torch.nn.Parameter
        and weight.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and _STORAGE_USE_COUNT is not None
    )


class _EmbeddingLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, weight):
        ctx.save_for_backward(tokens)
        ctx.slot = _LookupSlot()
        setattr(weight, _SLOT_ATTRIBUTE, ctx.slot)
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        return F.embedding(tokens, weight)

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[1]:
            return None, None
        (tokens,) = ctx.saved_tensors
        ids_N = tokens.reshape(-1)
        grad_NC = grad_out.reshape(-1, grad_out.shape[-1]).to(ctx.weight_dtype)
        while ctx.slot.pending:
            target_VC = ctx.slot.pending.pop()
            # the head's gradient must still be on its way to `.grad` (autograd's buffer holds it besides the pool's
            # alias and this one); a head whose backward ran in another graph, since released, is skipped
            if _storage_users(target_VC) > 2:
                rows_U, inverse_N = torch.unique(ids_N, return_inverse=True)
                sums_UC = torch.zeros(rows_U.shape[0], grad_NC.shape[1], dtype=grad_NC.dtype)
                target_VC.index_add_(0, rows_U, sums_UC.index_add_(0, inverse_N, grad_NC))
                return None, None
        grad_VC = GRADIENT_MEMORY.take(ctx.weight_shape, ctx.weight_dtype, grad_NC.device).zero_()
        return None, grad_VC.index_add_(0, ids_N, grad_NC)  # embedding_dense_backward's bits


def embedding_lookup(tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding(tokens, weight), whose weight gradient goes to reused memory (or into a tied head's) on CPU."""
    if not _handles(weight):
        return F.embedding(tokens, weight)
    return _EmbeddingLookup.apply(tokens, weight)
