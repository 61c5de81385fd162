"""The LM head and its cross-entropy in one pass over token chunks: the `[N, V]` logits are never materialised.

    loss = fused_linear_cross_entropy(x_NC, weight_VC, labels_N, weight_N)   # Σ_n weight_N[n] · CE(x_n · Wᵀ, label_n)

A plain head writes the fp32 logits `[N, V]`, log-softmax writes as much again, and the backward a gradient of
the same size (plus a zero-filled one for the NLL): at GPT-2's 50k vocabulary that is 4 × 155 MB per 768 tokens,
fresh memory every step, and on CPU a quarter of a small model's step. Here each chunk of M tokens goes through
`logits_MV = x_MC · Wᵀ → softmax (one exp) → softmax − one-hot` in one reused buffer that stays in cache, and the two
gradient GEMMs run right away: `dx_MC = g_MV · W` and `dW += g_MVᵀ · x_MC` (Liger-Kernel's fused linear
cross-entropy, written for CPU and GPU alike with plain torch ops). The forward therefore already holds both
gradients, for the upstream gradient the caller announces (`grad_scale`: the factor it will multiply the loss by
before its backward, e.g. the fp16 loss scale / micro-batches); the backward only rescales them by the upstream
scalar over that announcement (× 1.0 exactly when it came true). Announcing the scale matters in fp16: the softmax
gradient `(softmax − one-hot) · weight` is multiplied by the scale in fp32 BEFORE its cast to fp16 — where the
logits path's backward multiplies it too — so it neither underflows unscaled nor overflows where the logits path
would not. Under `torch.no_grad()` (evaluation) only the loss is computed (no gradient GEMMs).

Numerics: logits and softmax are fp32 (as `language_model_loss` casts them); the GEMMs run in the autocast dtype
when autocast is on (bf16/fp16 inputs, fp32 accumulation of dW across chunks), else in the inputs' dtype. The
result equals `Σ weight · F.cross_entropy(x · Wᵀ)` to fp32 rounding (summation order differs).

Shape legend: N tokens, C hidden size, V (padded) vocabulary, M tokens per chunk.
"""

from __future__ import annotations

import torch

from moetron.model.autocast_dtype import autocast_dtype

# CPU: one chunk's fp32 logits are ~8 MiB, so that they stay in cache between the GEMM, the softmax and the two
# gradient GEMMs, but at least 256 rows: every chunk re-reads the whole [C, V] head weight three times, and at
# V = 50k a 64-row floor (12 chunks for 768 tokens) made the GEMMs memory-bound — at two threads the logits GEMM
# cost 45% more CPU than at one, and a training step was 24% slower than with 256 rows (benchmarks/e2e.py, RESULTS).
# GPU: the chunk's logits are about as large as the whole input x_NC (Liger-Kernel's rule: ⌈V / C⌉ chunks), at
# least 1024 rows, so the GEMMs stay large while the memory stays O(N·C).
CPU_CHUNK_BYTES = 8 * 2**20
MIN_CPU_ROWS, MIN_GPU_ROWS = 256, 1024


def chunk_tokens(num_tokens: int, hidden: int, vocab: int, device: torch.device) -> int:
    """Tokens per chunk for N tokens of width C against a V-word vocabulary on `device`."""
    if device.type == "cpu":
        return max(MIN_CPU_ROWS, CPU_CHUNK_BYTES // (4 * vocab))
    return max(MIN_GPU_ROWS, -(-num_tokens // -(-vocab // hidden)))


def _softmax_and_label_logp(
    logits_MV: torch.Tensor, labels_M1: torch.Tensor, out_MV: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax [M, V] written into `out_MV`, log-probability of each row's label [M, 1]), fp32.

    One pass of exp over the chunk, not two: `log_softmax` then `exp_` (the old way) evaluates exp twice, and exp
    is the chunk's largest cost after its GEMMs (~20% less for that part at V = 50k on CPU). The label's
    log-probability is `log_softmax`'s formula, logit − max − log Σ exp(logit − max), with Σ exp(logit − max) read
    back from the softmax itself: at the row's maximum exp(0) = 1, so its probability is 1 / Σ (never below 1 / V,
    so its log is finite). Equal to log_softmax's value to fp32 rounding."""
    probs_MV = torch.softmax(logits_MV, dim=1, out=out_MV)
    max_M1 = logits_MV.amax(dim=1, keepdim=True)
    log_sum_M1 = -torch.log(probs_MV.amax(dim=1, keepdim=True))
    return probs_MV, logits_MV.gather(1, labels_M1) - max_M1 - log_sum_M1


def _logits_grad(probs_MV: torch.Tensor, labels_M1: torch.Tensor, weight_M1: torch.Tensor) -> torch.Tensor:
    """d(Σ weight · CE)/d logits = weight · (softmax − one-hot), in place of the probabilities."""
    grad_MV = probs_MV
    grad_MV.scatter_add_(1, labels_M1, torch.full_like(weight_M1, -1.0))
    return grad_MV.mul_(weight_M1)


def _accumulate_weight_grad(dw_VC: torch.Tensor, grad_MV: torch.Tensor, x_MC: torch.Tensor, first: bool) -> None:
    """dW (fp32) += grad_MVᵀ · x_MC; the first chunk writes it (no zero-fill of a [V, C] buffer)."""
    if grad_MV.dtype == dw_VC.dtype:
        if first:
            torch.mm(grad_MV.T, x_MC, out=dw_VC)
        else:
            dw_VC.addmm_(grad_MV.T, x_MC)
        return
    part_VC = (grad_MV.T @ x_MC).float()  # bf16/fp16 GEMM, fp32 accumulation across chunks
    if first:
        dw_VC.copy_(part_VC)
    else:
        dw_VC.add_(part_VC)


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Σ_n weight_N[n] · CE(x_NC[n] · weight_VCᵀ, labels_N[n]), gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, x_NC, w_VC, labels_N, weight_N, chunk: int, grad_scale: float):
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = autocast_dtype(x_NC)
        with torch.autocast(x_NC.device.type, enabled=False):
            xc_NC, wc_VC = x_NC.to(dtype), w_VC.to(dtype)
            dx_NC = torch.empty_like(xc_NC) if needs_dx else None
            dw_VC = torch.empty(w_VC.shape, dtype=torch.float32, device=w_VC.device) if needs_dw else None
            loss = torch.zeros((), dtype=torch.float32, device=x_NC.device)
            # two chunk buffers, reused: fresh [M, V] allocations would be page-faulted in on every chunk (CPU)
            rows, vocab = min(chunk, x_NC.shape[0]), w_VC.shape[0]
            logits_buf = torch.empty(rows, vocab, dtype=dtype, device=x_NC.device)
            probs_buf = torch.empty(rows, vocab, dtype=torch.float32, device=x_NC.device)
            for start in range(0, x_NC.shape[0], chunk):
                end = min(start + chunk, x_NC.shape[0])
                x_MC = xc_NC[start:end]
                logits_MV = torch.mm(x_MC, wc_VC.T, out=logits_buf[: end - start])
                labels_M1, weight_M1 = labels_N[start:end, None], weight_N[start:end, None]
                probs_MV, logp_M1 = _softmax_and_label_logp(logits_MV.float(), labels_M1, probs_buf[: end - start])
                loss -= (logp_M1 * weight_M1).sum()
                if needs_dx or needs_dw:
                    grad_MV = _logits_grad(probs_MV, labels_M1, weight_M1)
                    if grad_scale != 1.0:
                        grad_MV.mul_(grad_scale)  # fp32, before the cast (see the module docstring)
                    grad_MV = grad_MV.to(dtype)
                    if needs_dx:
                        torch.mm(grad_MV, wc_VC, out=dx_NC[start:end])
                    if needs_dw:
                        _accumulate_weight_grad(dw_VC, grad_MV, x_MC, first=start == 0)
        ctx.grads = (dx_NC, dw_VC)  # not save_for_backward: these are scaled in place, once
        ctx.input_dtypes, ctx.grad_scale = (x_NC.dtype, w_VC.dtype), grad_scale
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("the fused LM-head cross-entropy supports one backward per forward (no retain_graph)")
        (dx_NC, dw_VC), ctx.grads = ctx.grads, None
        x_dtype, w_dtype = ctx.input_dtypes
        # in place: a [V, C] buffer fewer (and no fresh pages) per step; exactly 1.0 when the announced scale held
        ratio = grad_loss / ctx.grad_scale
        dx = None if dx_NC is None else dx_NC.mul_(ratio.to(dx_NC.dtype)).to(x_dtype)
        dw = None if dw_VC is None else dw_VC.mul_(ratio).to(w_dtype)
        return dx, dw, None, None, None, None


def fused_linear_cross_entropy(
    x_NC: torch.Tensor,
    w_VC: torch.Tensor,
    labels_N: torch.Tensor,
    weight_N: torch.Tensor,
    chunk: int | None = None,
    grad_scale: float = 1.0,
) -> torch.Tensor:
    """fp32 scalar Σ_n weight_N[n] · CE(x_NC[n] · w_VCᵀ, labels_N[n]) (weight_N: fp32, e.g. mask / Σ mask);
    `grad_scale`: what the caller will multiply the loss by before its backward (see the module docstring)."""
    if not grad_scale > 0:
        raise ValueError(f"grad_scale must be positive, got {grad_scale}")
    chunk = chunk or chunk_tokens(x_NC.shape[0], x_NC.shape[1], w_VC.shape[0], x_NC.device)
    return FusedLinearCrossEntropy.apply(x_NC, w_VC, labels_N.long(), weight_N.float(), chunk, float(grad_scale))
