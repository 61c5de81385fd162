"""Worst-case error bounds of fp32 arithmetic: the tolerance of a test that compares moetron's CPU kernels with
ATen, derived from what both compute rather than tuned to one machine's observed maximum.

The vector width (AVX-512, AVX2, scalar), the BLAS blocking and the exp each ISA dispatches to change the last bits,
so no tolerance read off one machine holds on the next. What holds on every machine is the bound of each fp32
computation against the exact value, and two fp32 computations of one function agree within the sum of their bounds.
The bounds are the standard ones (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., ch. 2-3), with
u = 2^-24, fp32's unit roundoff, and γ_k = k·u / (1 − k·u):

  one rounding (+ − × /, a cast)            relative u
  a dot product of length k, in any order   |fl(a·b) − a·b| ≤ γ_k · |a|·|b|      (blocked, vectorised, FMA alike)
  a sum of k terms of one sign              relative γ_k
  exp                                       ≤ 2 ULP, relative 2 · 2^-23 (ATen's exp_u20, documented ≤ 2 ULP, which
                                            moetron's softmax kernel runs; Sleef's and libm's exp are ≤ 1 ULP);
                                            exp_u20 flushes results below e^-87 to 0: an absolute 2^-125 at most

The exact value is computed in float64 from the same fp32 inputs (float64's own error, ~1e-16 relative, is far
below every bound here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

U = 2.0**-24  # fp32 unit roundoff: half the spacing of fp32 numbers at 1.0
EXP_RELATIVE_ERROR = 2 * 2.0**-23  # 2 ULP; an ULP of a normal fp32 y is at most 2^-23·|y|
FLUSHED_EXP = 2.0**-125  # > e^-87: what exp_u20's flush to 0 (and a subnormal's lost bits) can take away
ROUNDINGS = 4  # roundings of a few single operations around a sum (a scale, a row weight, a division, a cast)
VOCAB_BLOCK = 2048  # the fused head kernel's online softmax: each block rescales the running sum once


def gamma(k: int) -> float:
    """γ_k = k·u / (1 − k·u): the relative error bound of k fp32 roundings in a row (a sum or dot product of k)."""
    assert k * U < 0.5, f"γ_{k} is meaningless for fp32 (k·u ≥ 1/2)"
    return k * U / (1 - k * U)


def matmul_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The elementwise bound of any fp32 evaluation of `a @ b` against the exact product: γ_K · |a|·|b|."""
    return gamma(a.shape[-1]) * (a.detach().double().abs() @ b.detach().double().abs())


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor | float, what: str) -> None:
    """|actual − expected| ≤ bound elementwise (NaN only where both are NaN), with the worst offender named."""
    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    both_nan = actual.isnan() & expected.isnan()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(actual)
    excess = torch.where(both_nan, 0.0, (actual - expected).abs() - bound).nan_to_num(nan=float("inf"))
    if bool((excess > 0).any()):
        worst = int(excess.flatten().argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), actual.shape))
        raise AssertionError(
            f"{what}: {int((excess > 0).sum())} of {actual.numel()} values beyond their fp32 error bound; worst at "
            f"{index}: {actual.flatten()[worst]:.9g} vs {expected.flatten()[worst]:.9g}, |Δ| "
            f"{abs(actual.flatten()[worst] - expected.flatten()[worst]):.3g} > bound {bound.flatten()[worst]:.3g}"
        )


@dataclass(frozen=True)
class SoftmaxBounds:
    """A softmax cross-entropy of fp32 logits [M, V]: exact values (float64) and the bound of any fp32 evaluation."""

    probs: torch.Tensor  # [M, V] softmax
    probs_bound: torch.Tensor
    label_logp: torch.Tensor  # [M] log-probability of the label
    label_logp_bound: torch.Tensor
    sum_exp: torch.Tensor  # [M] Σ exp(x − max)
    sum_exp_bound: torch.Tensor
    one_hot: torch.Tensor  # [M, V]


def softmax_bounds(
    logits: torch.Tensor, labels: torch.Tensor, logit_error: torch.Tensor | None = None, vocab_block: int = VOCAB_BLOCK
) -> SoftmaxBounds:
    """Bounds of softmax, log-softmax at the label and Σ exp(x − max) per row, where each logit may already be off by
    `logit_error` (e.g. a GEMM's bound). A logit error δ moves every log-probability of its row by at most
    δ_v + max δ (the shift and the log-sum-exp); the rounding of x − max adds u·|x − max| to exp's argument; each of
    the row's sum, its ⌈V / block⌉ rescales (exp(old max − new max) · sum) and the division adds its own."""
    z = logits.detach().double()
    rows, vocab = z.shape
    delta = torch.zeros_like(z) if logit_error is None else logit_error.double()
    delta_row = delta.amax(1, keepdim=True)
    shifted = z - z.amax(1, keepdim=True)  # ≤ 0
    blocks = -(-vocab // vocab_block)
    softmax_relative = gamma(vocab) + (blocks + 2) * (EXP_RELATIVE_ERROR + 2 * U)
    probs = torch.softmax(z, 1)
    one_hot = F.one_hot(labels, vocab).double()
    # relative error of a probability; at the label, Σ·softmax − Σ cancels: there the bound is absolute (p + 1)
    log_sum = shifted.exp().sum(1, keepdim=True).log()  # an evaluation through log_softmax rounds log Σ too
    relative = torch.expm1(delta + delta_row + U * (shifted.abs() + 2 * log_sum) + 2 * softmax_relative)
    probs_bound = relative * (probs + one_hot) + FLUSHED_EXP
    label_logp = torch.log_softmax(z, 1).gather(1, labels[:, None])[:, 0]
    label_shift = shifted.gather(1, labels[:, None])[:, 0]
    label_logp_bound = (
        delta.gather(1, labels[:, None])[:, 0]
        + delta_row[:, 0]
        + 2 * softmax_relative
        + ROUNDINGS * U * (label_shift.abs() + label_logp.abs() + 1)
    )
    exps = shifted.exp()
    sum_exp = exps.sum(1)
    sum_exp_bound = (torch.expm1(2 * delta_row + U * shifted.abs() + softmax_relative) * exps).sum(1) + FLUSHED_EXP
    return SoftmaxBounds(probs, probs_bound, label_logp, label_logp_bound, sum_exp, sum_exp_bound, one_hot)


@dataclass(frozen=True)
class LinearCrossEntropyBounds:
    """loss = Σ_i r_i · CE(x_i Wᵀ, label_i) and the gradients of scale · loss: exact values and fp32 bounds."""

    loss: torch.Tensor
    loss_bound: torch.Tensor
    dx: torch.Tensor
    dx_bound: torch.Tensor
    dw: torch.Tensor
    dw_bound: torch.Tensor


def linear_cross_entropy_bounds(
    x: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    row_weights: torch.Tensor,
    scale: float = 1.0,
    vocab_block: int = VOCAB_BLOCK,
) -> LinearCrossEntropyBounds:
    """The LM head + cross-entropy, whichever way an fp32 implementation evaluates it (ATen's logits path, the fused
    head's chunks in Python, its C++ loop over vocabulary blocks with per-block rescaling): the logits are a dot
    product of length C; the loss a weighted sum of N rows; the logits' gradient g = scale · r · (softmax − one-hot);
    dx = g W a dot product of length V, dW = gᵀ x one of length N (chunk after chunk: still a sum of N)."""
    x64, w64 = x.detach().double(), w.detach().double()
    r = row_weights.detach().double()
    rows, vocab = x64.shape[0], w64.shape[0]
    soft = softmax_bounds(x64 @ w64.T, labels, matmul_bound(x64, w64.T), vocab_block)
    losses = -soft.label_logp
    loss = (r * losses).sum()
    loss_bound = (r.abs() * soft.label_logp_bound).sum() + (gamma(rows) + ROUNDINGS * U) * (r * losses).abs().sum()
    g = scale * r[:, None] * (soft.probs - soft.one_hot)
    g_bound = abs(scale) * r.abs()[:, None] * (soft.probs_bound + ROUNDINGS * U * (soft.probs - soft.one_hot).abs())
    dx = g @ w64
    dx_bound = g_bound @ w64.abs() + (gamma(vocab) + ROUNDINGS * U) * (g.abs() @ w64.abs())
    dw = g.T @ x64
    dw_bound = g_bound.T @ x64.abs() + (gamma(rows) + ROUNDINGS * U) * (g.abs().T @ x64.abs())
    return LinearCrossEntropyBounds(loss, loss_bound, dx, dx_bound, dw, dw_bound)


def assert_heads_agree(
    ours: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...], bounds: LinearCrossEntropyBounds, what: str
) -> None:
    """Two fp32 evaluations (loss, dx, dW) of one head: each lies within its bound of the exact value, so the two lie
    within twice the bound of each other."""
    limits = (bounds.loss_bound, bounds.dx_bound, bounds.dw_bound)
    for name, a, b, bound in zip(("loss", "dx", "dW"), ours, theirs, limits, strict=True):
        assert_within(a, b, 2 * bound, f"{what}: {name}")


SILU_SLOPE = 1.1  # max |silu'(t)| = 1.0998 (at t ≈ 2.4): a silu input off by δ moves silu by ≤ 1.1·δ
SILU_CURVE = 0.5  # max |silu''(t)| = 0.5 (at t = 0): the same for silu' (its backward's factor)
FIRST_ORDER = 1.01  # the bounds below keep first-order terms; products of two errors (≲ 1e-9 relative) fit in 1%


@dataclass(frozen=True)
class SwiGLUExpertBounds:
    """y = (silu(x W1) ⊙ x W3) W2 per expert, with the gradients of Σ y ⊙ grad: exact values and fp32 bounds, in
    the order (y, dx, dW1, dW3, dW2)."""

    values: tuple[torch.Tensor, ...]
    bounds: tuple[torch.Tensor, ...]


def swiglu_experts_bounds(
    x_ND: torch.Tensor,
    counts_E: torch.Tensor,
    w1_EDF: torch.Tensor,
    w3_EDF: torch.Tensor,
    w2_EFD: torch.Tensor,
    grad_ND: torch.Tensor,
) -> SwiGLUExpertBounds:
    """Rows sorted by expert (`counts_E` of them each). Each GEMM adds its γ_K·|a||b|, each element-wise product one
    rounding, silu and its derivative exp's 2 ULP plus a few roundings of their terms; an input error propagates
    through silu by its slope (≤ 1.1) and through silu' by its curvature (≤ 0.5)."""
    x_all, g_all = x_ND.detach().double(), grad_ND.detach().double()
    outputs: list[list[torch.Tensor]] = [[], [], [], [], []]
    bounds: list[list[torch.Tensor]] = [[], [], [], [], []]
    own = EXP_RELATIVE_ERROR + ROUNDINGS * U  # silu's (and silu''s) own error, relative to its terms' magnitude
    start = 0
    for e, count in enumerate(counts_E.tolist()):
        x, g = x_all[start : start + count], g_all[start : start + count]
        start += count
        w1, w3, w2 = (w.detach().double()[e] for w in (w1_EDF, w3_EDF, w2_EFD))
        hidden, ffn = w1.shape
        h1, h3 = x @ w1, x @ w3
        d_h1, d_h3 = matmul_bound(x, w1), matmul_bound(x, w3)
        sigmoid = torch.sigmoid(h1)
        s = h1 * sigmoid
        d_s = SILU_SLOPE * d_h1 + own * s.abs()
        a = s * h3
        d_a = h3.abs() * d_s + s.abs() * d_h3 + U * a.abs()
        y = a @ w2
        d_y = d_a @ w2.abs() + matmul_bound(a, w2)
        ga = g @ w2.T
        d_ga = matmul_bound(g, w2.T)
        slope = sigmoid * (1 + h1 * (1 - sigmoid))
        slope_terms = sigmoid * (1 + h1.abs() * (1 + sigmoid))  # the magnitude of the terms that form silu'
        d_slope = SILU_CURVE * d_h1 + own * slope_terms
        gs, gh3 = ga * h3, ga * s
        d_gs = d_ga * h3.abs() + ga.abs() * d_h3 + U * gs.abs()
        d_gh3 = d_ga * s.abs() + ga.abs() * d_s + U * gh3.abs()
        gh1 = gs * slope
        d_gh1 = d_gs * slope.abs() + gs.abs() * d_slope + U * gh1.abs()
        dx = gh1 @ w1.T + gh3 @ w3.T  # one GEMM of length 2F or two and a sum: γ_{2F+1} covers either
        both = gamma(2 * ffn + 1) * (gh1.abs() @ w1.abs().T + gh3.abs() @ w3.abs().T)
        d_dx = d_gh1 @ w1.abs().T + d_gh3 @ w3.abs().T + both
        d_dw1 = x.abs().T @ d_gh1 + matmul_bound(x.T, gh1)
        d_dw3 = x.abs().T @ d_gh3 + matmul_bound(x.T, gh3)
        d_dw2 = d_a.T @ g.abs() + matmul_bound(a.T, g)
        values = (y, dx, x.T @ gh1, x.T @ gh3, a.T @ g)
        for i, (value, bound) in enumerate(zip(values, (d_y, d_dx, d_dw1, d_dw3, d_dw2), strict=True)):
            outputs[i].append(value)
            bounds[i].append(FIRST_ORDER * bound)
    rows = [torch.cat(outputs[i]) for i in (0, 1)] + [torch.stack(outputs[i]) for i in (2, 3, 4)]
    limits = [torch.cat(bounds[i]) for i in (0, 1)] + [torch.stack(bounds[i]) for i in (2, 3, 4)]
    return SwiGLUExpertBounds(tuple(rows), tuple(limits))
