"""The two seams through which a device's speed work reaches the model: an experts backend and a head-loss backend.

    use_backends("cpu", experts=..., head_loss=...)   # build(), once per device type (moetron.cpu on CPU)
    experts_backend(x_TD.device).index_add_rows(out_TD, index_R, src_RD)
    head_loss_backend(x_NC.device).lookup(tokens_BT, weight_VC)

The model computes with plain ATen ops everywhere (`ATEN_EXPERTS`, `ATEN_HEAD_LOSS`, the defaults). A backend
registered for a device type replaces some of those ops with kernels that compute the same values (bit for bit, or
where noted to fp32 rounding) faster there; it never changes what the model computes. The model never imports a
backend: whoever builds the model for a device registers it (`moetron.parallel.device_backends`), so a GPU run
never loads the CPU package.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F


class ExpertsBackend:
    """The MoE layer's ops a backend may run faster: the router's top-1 pick, the experts' SwiGLU from host counts,
    the combine's row adds. These defaults are ATen's ops, the reference every backend matches bit for bit."""

    def first_max_column(self, x_TE: torch.Tensor) -> torch.Tensor | None:
        """int64 [T]: the first maximal column of each row (`max(dim=1).indices`); None: the caller's own code."""
        return None

    def index_add_rows(self, out_TD: torch.Tensor, index_R: torch.Tensor, src_RD: torch.Tensor) -> torch.Tensor:
        """`out_TD.index_add_(0, index_R, src_RD)`, in place."""
        return out_TD.index_add_(0, index_R, src_RD)

    def runs_swiglu(self, x_ND: torch.Tensor) -> bool:
        """Whether `swiglu` runs plain SwiGLU experts (no biases, SiLU) on rows like x_ND: it reads the counts on
        the host, so only where that is free."""
        return False

    def swiglu(
        self,
        x_ND: torch.Tensor,
        w1_EDF: torch.Tensor,
        w3_EDF: torch.Tensor,
        w2_EFD: torch.Tensor,
        counts_E: torch.Tensor,
        tokens_N: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`(silu(x·w1) * (x·w3))·w2` per expert on rows sorted by expert (or in token order: `tokens_N`)."""
        raise NotImplementedError("this backend runs no SwiGLU experts (`runs_swiglu` is False)")


class HeadLossBackend:
    """The fused LM head's ops a backend may run faster (`model/fused_cross_entropy.py`), and the word-embedding
    lookup whose gradient meets the head's on a tied weight. These defaults are ATen's ops and fresh memory."""

    def lookup(self, tokens_BT: torch.Tensor, weight_VC: torch.Tensor) -> torch.Tensor:
        """The word embeddings of the tokens (`F.embedding`)."""
        return F.embedding(tokens_BT, weight_VC)

    def kernel_threads(self) -> int:
        """The intra-op threads the head's chunks may be spread over."""
        return torch.get_num_threads()

    @contextlib.contextmanager
    def on_kernel_threads(self) -> Iterator[None]:
        """Around the head's forward and backward: the threads it runs on."""
        yield

    def chunk_tokens(self, num_tokens: int, hidden: int, vocab: int, threads: int) -> int | None:
        """Tokens per chunk; None: the device-neutral rule (`fused_cross_entropy.chunk_tokens`)."""
        return None

    def softmax_block_rows(self, vocab: int, threads: int) -> int:
        """Rows per element-wise block of a chunk: the whole chunk (fewer launches; no cache to stay in)."""
        return 2**62

    def weight_grad_as_rows(self, device: torch.device) -> bool:
        """Whether dW accumulates as [V, C] (Gᵀ · x) rather than [C, V] (xᵀ · G); the device's faster GEMM."""
        return False

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A scratch buffer for a chunk or dW (`give` it back when done)."""
        return torch.empty(shape, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        """A scratch buffer `take` handed out, no longer used."""

    def keep_at_least(self, count: int) -> None:
        """A hint: `count` scratch buffers will be in use at once."""

    def take_gradient(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Memory for a [V, C] weight gradient handed to autograd."""
        return torch.empty(shape, dtype=dtype, device=device)

    def softmax_gradient_rows(
        self, logits_MV: torch.Tensor, labels_M: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(label log-probability, Σ exp) with the chunk overwritten by Σ · (softmax − one-hot); None: the caller's
        log_softmax, exp_ and one-hot subtraction run."""
        return None

    def fused_head_forward(self, ctx: Any, *tensors_and_args: Any) -> torch.Tensor | None:
        """The whole fp32 chunk loop in one kernel (its loss, with the gradients left on ctx); None: the Python
        loop runs."""
        return None

    def transpose_scaled(self, dw_CV: torch.Tensor, ratio: torch.Tensor, out_VC: torch.Tensor) -> bool:
        """out_VC = dw_CVᵀ · ratio in one pass; False: not done, the caller multiplies."""
        return False

    def lookup_slot(self, weight_VC: torch.Tensor) -> Any:
        """Where a tied embedding lookup of this weight waits for the head's gradient (None: nowhere)."""
        return None

    def leave_for_lookup(self, slot: Any, grad_VC: torch.Tensor) -> None:
        """The head's weight gradient, left for the tied lookup's rows to be added into."""


ATEN_EXPERTS = ExpertsBackend()
ATEN_HEAD_LOSS = HeadLossBackend()
_REGISTERED: dict[str, tuple[ExpertsBackend, HeadLossBackend]] = {}


def use_backends(device_type: str, experts: ExpertsBackend, head_loss: HeadLossBackend) -> None:
    """Run the model's tensors on `device_type` through these backends (from now on, in this process)."""
    _REGISTERED[device_type] = (experts, head_loss)


def experts_backend(device: torch.device) -> ExpertsBackend:
    """The experts backend registered for the device's type, else ATen's."""
    return _REGISTERED.get(device.type, (ATEN_EXPERTS, ATEN_HEAD_LOSS))[0]


def head_loss_backend(device: torch.device) -> HeadLossBackend:
    """The head-loss backend registered for the device's type, else ATen's."""
    return _REGISTERED.get(device.type, (ATEN_EXPERTS, ATEN_HEAD_LOSS))[1]
