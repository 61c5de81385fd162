"""The LM head and its cross-entropy in one pass over token chunks: the `[N, V]` logits are never materialised.

    loss = fused_linear_cross_entropy(x_NC, weight_VC, labels_N, weight_N)   # Σ_n weight_N[n] · CE(x_n · Wᵀ, label_n)

A plain head writes the fp32 logits `[N, V]`, log-softmax writes as much again, and the backward a gradient of the
same size (plus a zero-filled one for the NLL): at GPT-2's 50k vocabulary that is 4 × 155 MB per 768 tokens, fresh
memory every step, and on CPU a quarter of a small model's step. Here each chunk of M tokens goes through `logits_MV
= x_MC · Wᵀ → log_softmax → exp → softmax − one-hot` in one reused buffer, in place, and the two gradient GEMMs run
right away: `dx_MC = g_MV · W` and `dW += g_MVᵀ · x_MC` (the order of the factors and where the per-row weight
enters: FusedLinearCrossEntropy) — Liger-Kernel's fused linear cross-entropy, written for CPU and GPU alike with
plain torch ops. The forward therefore already holds both gradients, for the upstream gradient the caller announces
(`grad_scale`: the factor it will multiply the loss by before its backward, e.g. the fp16 loss scale /
micro-batches); the backward only rescales them by the upstream scalar over that announcement (× 1.0 exactly when it
came true). Announcing the scale matters in fp16: the softmax gradient `(softmax − one-hot) · weight` is multiplied
by the scale in fp32 BEFORE its cast to fp16 — where the logits path's backward multiplies it too — so it neither
underflows unscaled nor overflows where the logits path would not. Under `torch.no_grad()` (evaluation) only the
loss is computed (no gradient GEMMs).

Numerics: logits and softmax are fp32 (as `language_model_loss` casts them); the GEMMs run in the autocast dtype
when autocast is on (bf16/fp16 inputs, fp32 accumulation of dW across chunks), else in the inputs' dtype. The
result equals `Σ weight · F.cross_entropy(x · Wᵀ)` to fp32 rounding (summation order differs).

A device's backend (`model/backends.py`, `head_loss_backend`) may run parts of this faster, to fp32 rounding the same:
its chunk size, scratch memory reused across steps, a one-exp softmax, dW in the layout its GEMM prefers, or the
whole fp32 chunk loop in one kernel (on CPU: `moetron/cpu/head_loss.py`); ATen's ops and fresh memory otherwise.

Shape legend: N tokens, C hidden size, V (padded) vocabulary, M tokens per chunk.
"""

from __future__ import annotations

import torch

from moetron.model.autocast_dtype import autocast_dtype
from moetron.model.backends import HeadLossBackend, head_loss_backend

# The chunk's logits are about as large as the whole input x_NC (Liger-Kernel's rule: ⌈V / C⌉ chunks), at least 1024
# rows, so the GEMMs stay large while the memory stays O(N·C); a backend may choose its own (CPU: cache-sized).
MIN_GPU_ROWS = 1024


def chunk_tokens(num_tokens: int, hidden: int, vocab: int, device: torch.device, threads: int = 1) -> int:
    """Tokens per chunk for N tokens of width C against a V-word vocabulary on `device` (with `threads` intra-op
    threads: the device's head-loss backend may spread chunks over them)."""
    rows = head_loss_backend(device).chunk_tokens(num_tokens, hidden, vocab, threads)
    if rows is not None:
        return rows
    return max(MIN_GPU_ROWS, -(-num_tokens // -(-vocab // hidden)))


def _softmax_in_place_and_label_logp(logits_MV: torch.Tensor, labels_M1: torch.Tensor, rows: int) -> torch.Tensor:
    """Overwrite the fp32 logits with their softmax; return the log-probability of each row's label [M, 1].

    Block by block (`rows` rows, cache-sized): log_softmax in place, its value at the labels, then exp_ in place —
    the label's log-probability is bitwise log_softmax's (what `F.cross_entropy` computes) and the probabilities
    are exp(log_softmax), what the logits path's backward uses. Two exps per element, and still cheaper than one
    softmax plus the two row maxima that log Σ exp needs from it (a max of the logits before, of the probabilities
    after): 9.9 vs 11.4 ms per 256 × 50304 chunk at one thread, 10.7 vs 13.3 at two (`exp_` vectorises; `amax`
    runs at a fraction of the memory speed)."""
    logp_M1 = torch.empty(labels_M1.shape, dtype=logits_MV.dtype, device=logits_MV.device)
    for start in range(0, logits_MV.shape[0], rows):
        block = logits_MV[start : start + rows]
        torch.log_softmax(block, dim=1, out=block)
        torch.gather(block, 1, labels_M1[start : start + rows], out=logp_M1[start : start + rows])
        block.exp_()
    return logp_M1


def _logits_grad_in_place(probs_MV: torch.Tensor, labels_M1: torch.Tensor) -> torch.Tensor:
    """softmax − one-hot, in place of the probabilities (M elements touched: the per-row weight and the loss scale
    are applied to the [M, C] side of the GEMMs, not to the [M, V] chunk)."""
    return probs_MV.scatter_add_(1, labels_M1, torch.full(labels_M1.shape, -1.0, device=probs_MV.device))


# A bf16/fp16 chunk's dW product is formed and copied to fp32 this many bytes of it at a time (its compute-dtype
# product and fp32 copy together): in one piece it would be a [V, C] transient of 6 bytes per entry beside the chunk,
# 1.9 GB at Qwen3's vocabulary (measured by `moetron dry-run`).
DW_PRODUCT_BLOCK_BYTES = 128 * 2**20


def _accumulate_weight_grad(
    dw: torch.Tensor, x_MC: torch.Tensor, grad_MV: torch.Tensor, first: bool, as_rows: bool
) -> None:
    """dW (fp32) += grad_MVᵀ · x_MC into dw_VC (`as_rows`), else x_MCᵀ · grad_MV into dw_CV; the first chunk writes
    it (no zero-fill of a vocabulary-sized buffer)."""
    if grad_MV.dtype == dw.dtype:
        left, right = (grad_MV.T, x_MC) if as_rows else (x_MC.T, grad_MV)
        if first:
            torch.mm(left, right, out=dw)
        else:
            dw.addmm_(left, right)
        return
    # bf16/fp16 GEMM, fp32 accumulation across chunks: block by block of the vocabulary (each entry is the same
    # dot product whatever the block)
    vocab, hidden = grad_MV.shape[1], x_MC.shape[1]
    block = max(1, DW_PRODUCT_BLOCK_BYTES // (hidden * (grad_MV.element_size() + 4)))
    for start in range(0, vocab, block):
        grad_block = grad_MV[:, start : start + block]
        if as_rows:
            part, target = (grad_block.T @ x_MC).float(), dw[start : start + block]
        else:
            part, target = (x_MC.T @ grad_block).float(), dw[:, start : start + block]
        if first:
            target.copy_(part)
        else:
            target.add_(part)


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Σ_n weight_N[n] · CE(x_NC[n] · weight_VCᵀ, labels_N[n]), gradients computed chunk by chunk in forward.

    Per chunk, with G = softmax − one-hot ([M, V]) and s_M1 = weight_M1 · grad_scale (the row factor):
      fp32:       dx_MC = s_M1 ⊙ (G · W)      dW_VC += Gᵀ · (s_M1 ⊙ x_MC)   (or dW_CV += (s_M1 ⊙ x_MC)ᵀ · G)
                  — the factor scales [M, C] tensors, so no pass over the [M, V] chunk multiplies it;
      bf16/fp16:  G_low = s_M1 ⊙ G, cast in the same pass (the scale before the cast: see the module docstring),
                  dx_MC = G_low · W, dW_VC += G_lowᵀ · x_MC (or its transpose; fp32 accumulation).
    dW's layout is the backend's (`weight_grad_as_rows`): [V, C] is the gradient itself; [C, V] is written back as
    [V, C] once, in the backward."""

    @staticmethod
    def forward(ctx, x_NC, w_VC, labels_N, weight_N, chunk: int, grad_scale: float, backend: HeadLossBackend):
        ctx.backend = backend
        with backend.on_kernel_threads():
            return _forward(ctx, x_NC, w_VC, labels_N, weight_N, chunk, grad_scale, backend)

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("the fused LM-head cross-entropy supports one backward per forward (no retain_graph)")
        with ctx.backend.on_kernel_threads():
            (dx_NC, dw_buffer), ctx.grads = ctx.grads, None
            x_dtype, w_dtype = ctx.input_dtypes
            ratio = grad_loss / ctx.grad_scale  # exactly 1.0 when the announced scale held
            dx = None if dx_NC is None else dx_NC.mul_(ratio.to(dx_NC.dtype)).to(x_dtype)
            dw = None
            if dw_buffer is not None:
                dw = _weight_grad_out_of(ctx, dw_buffer, ratio, w_dtype)
                ctx.backend.leave_for_lookup(ctx.lookup_slot, dw)
        return dx, dw, None, None, None, None, None


def _forward(ctx, x_NC, w_VC, labels_N, weight_N, chunk: int, grad_scale: float, backend: HeadLossBackend):
    needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dtype = autocast_dtype(x_NC)
    low = dtype != torch.float32
    ctx.input_dtypes, ctx.grad_scale = (x_NC.dtype, w_VC.dtype), grad_scale
    ctx.lookup_slot = backend.lookup_slot(w_VC) if needs_dw else None  # tied: the embedding adds its rows into dW
    if not low:
        loss = backend.fused_head_forward(ctx, x_NC, w_VC, labels_N, weight_N, chunk, grad_scale)
        if loss is not None:
            return loss
    with torch.autocast(x_NC.device.type, enabled=False):
        xc_NC, wc_VC = x_NC.to(dtype), w_VC.to(dtype)
        dx_NC = torch.empty_like(xc_NC) if needs_dx else None
        dw = weight_grad_buffer(ctx, w_VC, backend) if needs_dw else None
        loss = torch.zeros((), dtype=torch.float32, device=x_NC.device)
        # one chunk buffer, reused across chunks (and, where the backend keeps them, steps); the low-precision path
        # adds an fp32 one for the softmax and writes its gradient over its logits
        rows, vocab = min(chunk, x_NC.shape[0]), w_VC.shape[0]
        logits_buf = backend.take((rows, vocab), dtype, x_NC.device)
        probs_buf = backend.take((rows, vocab), torch.float32, x_NC.device) if low else logits_buf
        block_rows = backend.softmax_block_rows(vocab, torch.get_num_threads())
        for start in range(0, x_NC.shape[0], chunk):
            end = min(start + chunk, x_NC.shape[0])
            x_MC = xc_NC[start:end]
            logits_MV = torch.mm(x_MC, wc_VC.T, out=logits_buf[: end - start])
            labels_M1, weight_M1 = labels_N[start:end, None], weight_N[start:end, None]
            probs_MV = probs_buf[: end - start].copy_(logits_MV) if low else logits_MV
            # a backend's kernel: the chunk becomes sum · (softmax − one-hot) in one exp per logit, and 1 / sum joins
            # the row factor below; else log_softmax, exp_ and the one-hot subtraction, in place
            folded = backend.softmax_gradient_rows(probs_MV, labels_N[start:end])
            if folded is not None:
                logp_M1, sum_M1 = folded[0][:, None], folded[1][:, None]
            else:
                logp_M1 = _softmax_in_place_and_label_logp(probs_MV, labels_M1, block_rows)
            loss -= (logp_M1 * weight_M1).sum()
            if not (needs_dx or needs_dw):
                continue
            grad_MV = probs_MV if folded is not None else _logits_grad_in_place(probs_MV, labels_M1)
            scale_M1 = weight_M1 * grad_scale if grad_scale != 1.0 else weight_M1
            if folded is not None:
                scale_M1 = scale_M1 / sum_M1
            if low:  # fp32 product, one cast, over the consumed logits
                grad_MV = torch.mul(grad_MV, scale_M1, out=logits_MV)
            if needs_dx:
                dx_MC = torch.mm(grad_MV, wc_VC, out=dx_NC[start:end])
                if not low:
                    dx_MC.mul_(scale_M1)
            if needs_dw:
                x_in_MC = x_MC if low else x_MC * scale_M1
                _accumulate_weight_grad(dw, x_in_MC, grad_MV, first=start == 0, as_rows=ctx.dw_as_rows)
        backend.give(logits_buf)
        if low:
            backend.give(probs_buf)
    # not save_for_backward: these are scaled once, in the backward
    ctx.grads = (dx_NC, dw)
    return loss


def weight_grad_buffer(ctx, w_VC: torch.Tensor, backend: HeadLossBackend) -> torch.Tensor:
    """The fp32 buffer the forward accumulates dW into (`weight_grad_as_rows`): [V, C] for an fp32 weight is the
    gradient itself (`take_gradient`); otherwise a scratch buffer the backward writes back from."""
    ctx.dw_as_rows = backend.weight_grad_as_rows(w_VC.device)
    ctx.dw_is_grad = ctx.dw_as_rows and w_VC.dtype == torch.float32
    if ctx.dw_is_grad:
        return backend.take_gradient(w_VC.shape, torch.float32, w_VC.device)
    return backend.take(w_VC.shape if ctx.dw_as_rows else w_VC.shape[::-1], torch.float32, w_VC.device)


def _weight_grad_out_of(ctx, dw_buffer: torch.Tensor, ratio: torch.Tensor, w_dtype: torch.dtype) -> torch.Tensor:
    """The weight's [V, C] gradient from the forward's buffer, times the upstream gradient over the announced one."""
    backend = ctx.backend
    if ctx.dw_is_grad:  # on a CPU, where reading the ratio costs nothing; × 1.0 (the usual case) changes no bit
        if torch.compiler.is_compiling() or ratio.item() != 1.0:
            dw_buffer.mul_(ratio)
        return dw_buffer
    shape = dw_buffer.shape if ctx.dw_as_rows else dw_buffer.shape[::-1]
    dw = backend.take_gradient(shape, w_dtype, dw_buffer.device)
    if ctx.dw_as_rows or not backend.transpose_scaled(dw_buffer, ratio, dw):  # [C, V] back to [V, C], scaled
        torch.mul(dw_buffer if ctx.dw_as_rows else dw_buffer.T, ratio, out=dw)
    backend.give(dw_buffer)
    return dw


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
    backend = head_loss_backend(x_NC.device)
    threads = backend.kernel_threads()  # its forward and backward may run at more threads than the ops around it
    chunk = chunk or chunk_tokens(x_NC.shape[0], x_NC.shape[1], w_VC.shape[0], x_NC.device, threads)
    labels, weights = labels_N.long(), weight_N.float()
    return FusedLinearCrossEntropy.apply(x_NC, w_VC, labels, weights, chunk, float(grad_scale), backend)
