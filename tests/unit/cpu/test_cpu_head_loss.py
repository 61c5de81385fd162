"""The CPU head-loss backend (`moetron/cpu/head_loss.py`): its C++ softmax and chunk loop give the plain head's loss
and gradients (and ATen's path through the model's seam) within the fp32 error bounds of `fp32_error_bounds`, one
thread and several the same bits; its chunk and worker rules; its buffers are never handed out twice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp32_error_bounds import assert_heads_agree, assert_within, linear_cross_entropy_bounds, softmax_bounds
from fused_head_inputs import C, N, V, inputs, plain_loss

from moetron.cpu import CPU_EXPERTS
from moetron.cpu.head_loss import CPU_HEAD_LOSS, CpuBufferPool, cpu_chunk_tokens, cpu_head_workers
from moetron.model import backends
from moetron.model.backends import ATEN_HEAD_LOSS
from moetron.model.fused_cross_entropy import fused_linear_cross_entropy


def test_chunk_rule():
    assert cpu_chunk_tokens(768, 128, 50304) == 256  # ~8 MiB of logits, at least 256 rows
    assert cpu_chunk_tokens(1000, 128, 50304) == 334  # three chunks of equal rows, not 256 + 256 + 256 + 232
    assert cpu_chunk_tokens(768, 128, 512) == 768  # fewer tokens than one chunk's rows: one chunk
    # a thread per chunk: every thread the same rows, whole chunks of at least 256 rows each
    assert cpu_chunk_tokens(768, 128, 50304, threads=2) == 384
    assert cpu_chunk_tokens(4096, 128, 50304, threads=2) == 256
    assert cpu_chunk_tokens(10, 128, 50304, threads=4) == 10  # fewer tokens than a chunk's rows: one thread


def test_buffers_are_reused_only_once_given_back_and_at_most_keep_are_kept():
    pool, cpu = CpuBufferPool(keep=2), torch.device("cpu")
    a, b = pool.take((3, 4), torch.float32, cpu), pool.take((3, 4), torch.float32, cpu)
    assert a.data_ptr() != b.data_ptr()  # both in use: never the same memory
    pool.give(a)
    assert pool.take((3, 4), torch.float32, cpu) is a
    assert pool.take((3, 4), torch.float16, cpu) is not a  # another dtype (or shape) is another buffer
    for t in (a, b, torch.empty(5)):
        pool.give(t)
    assert pool.take((3, 4), torch.float32, cpu) is b and pool.take((5,), torch.float32, cpu).shape == (5,)
    assert pool.take((3, 4), torch.float32, cpu) is not a  # the oldest was dropped beyond `keep`


@pytest.fixture
def softmax_kernel():
    """moetron's C++ softmax of the fused head (skipped, with the reason, where the CPU kernels do not load)."""
    from moetron.cpu import compiled_kernels

    reason = compiled_kernels.unavailable_reason()
    if reason or compiled_kernels.compiled_cpu_kernels() is None:
        pytest.skip(f"the CPU kernels are not available here: {reason or 'they did not build'}")
    return compiled_kernels.softmax_gradient_rows


@pytest.mark.parametrize("vocab", [1, 5, 16, 33, 1000])
def test_softmax_kernel_gives_the_label_log_probability_and_the_scaled_gradient(softmax_kernel, vocab):
    """One exp per logit: the chunk becomes Σ·(softmax − one-hot), with log_softmax's value at the label and Σ; large
    logits (scale 30) saturate exp, vector tails (V = 5, 33) take the scalar exp."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=g) * 30
    labels = torch.randint(0, vocab, (9,), generator=g)
    chunk = logits.clone()
    label_logp, sums = softmax_kernel(chunk, labels)
    exact = softmax_bounds(logits, labels)  # the kernel against the exact values, within its fp32 bound
    assert_within(label_logp, exact.label_logp, exact.label_logp_bound, "label log-probability")
    assert_within(sums, exact.sum_exp, exact.sum_exp_bound, "Σ exp(x − max)")
    assert_within(chunk / sums[:, None], exact.probs - exact.one_hot, exact.probs_bound, "softmax − one-hot")
    # and against ATen's fp32 evaluation of the same, within both bounds
    gradient = torch.softmax(logits, 1) - F.one_hot(labels, vocab)
    assert_within(chunk / sums[:, None], gradient, 2 * exact.probs_bound, "softmax − one-hot vs ATen")


def test_softmax_kernel_refuses_labels_outside_the_vocabulary_and_leaves_other_tensors_to_aten(softmax_kernel):
    with pytest.raises(RuntimeError, match="label 7 of row 1 is outside the vocabulary of 7"):
        softmax_kernel(torch.zeros(2, 7), torch.tensor([0, 7]))
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        softmax_kernel(torch.zeros(2, 7), torch.tensor([-1, 0]))
    assert softmax_kernel(torch.zeros(7, 2).t(), torch.tensor([0, 1])) is None  # not contiguous
    assert softmax_kernel(torch.zeros(2, 7, dtype=torch.float64), torch.tensor([0, 1])) is None
    assert softmax_kernel(torch.zeros(2, 7), torch.tensor([0, 1], dtype=torch.int32)) is None


def test_the_cpu_head_loss_equals_atens(softmax_kernel, monkeypatch):
    """The CPU backend (the fp32 chunk loop in C++, its softmax's Σ·(softmax − one-hot) with 1/Σ folded into the row
    factor) against ATen's ops (log_softmax + exp_ + the one-hot subtraction): the same loss and gradients to fp32
    rounding, at a loss scale and with row weights."""
    results = []
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setitem(backends._REGISTERED, "cpu", (CPU_EXPERTS, ATEN_HEAD_LOSS))
        x, w, labels, mask = inputs(seed=4)
        loss = fused_linear_cross_entropy(x, w, labels, mask / mask.sum(), chunk=10, grad_scale=8.0)
        (loss * 8.0).backward()
        results.append((loss.detach(), x.grad, w.grad))
    bounds = linear_cross_entropy_bounds(x, w, labels, mask / mask.sum(), scale=8.0)
    assert_heads_agree(results[0], results[1], bounds, "softmax kernel vs ATen's softmax")


def test_a_thread_per_chunk_while_the_buffers_fit():
    assert cpu_head_workers(768, 128, 50304, threads=2, rows=384) == 2
    assert cpu_head_workers(768, 128, 50304, threads=4, rows=384) == 2  # two chunks: two threads
    assert cpu_head_workers(768, 128, 50304, threads=1, rows=256) == 1
    # 32 threads' [256, V] chunks would take 1.6 GiB: one chunk at a time instead
    assert cpu_head_workers(8192, 4096, 50304, threads=32, rows=256) == 1
    assert cpu_head_workers(8192, 4096, 50304, threads=16, rows=256) == 16
    assert cpu_head_workers(0, 128, 50304, threads=2, rows=256) == 1


def _fused_grads(x, w, labels, weights, chunk, scale=8.0):
    x.grad = w.grad = None
    loss = fused_linear_cross_entropy(x, w, labels, weights, chunk, grad_scale=scale)
    (loss * scale).backward()
    return loss.detach(), x.grad.clone(), w.grad.clone()


@pytest.fixture
def head_kernel():
    """The fused head's C++ chunk loop (skipped, with the reason, where the CPU kernels do not load)."""
    from moetron.cpu import compiled_kernels

    reason = compiled_kernels.unavailable_reason()
    if reason or compiled_kernels.compiled_cpu_kernels() is None:
        pytest.skip(f"the CPU kernels are not available here: {reason or 'they did not build'}")
    return compiled_kernels.compiled_cpu_kernels()


def test_the_cpp_chunk_loop_matches_the_python_loop(head_kernel, dw_layout, monkeypatch):
    """One worker against the Python loop (with the softmax kernel), at a loss scale, with row weights and a short
    last chunk, in either layout of dW: the same values to fp32 rounding (the C++ loop adds the label's term of the
    gradients apart, block by block of the vocabulary)."""
    x, w, labels, mask = inputs(seed=5)
    weights = mask / mask.sum()
    cpp = _fused_grads(x, w, labels, weights, chunk=10)
    monkeypatch.setattr(CPU_HEAD_LOSS, "fused_head_forward", lambda *args: None)
    python = _fused_grads(x, w, labels, weights, chunk=10)
    assert_heads_agree(cpp, python, linear_cross_entropy_bounds(x, w, labels, weights, 8.0), "C++ vs Python loop")


def test_the_cpp_chunk_loop_over_vocabulary_blocks_matches_the_plain_head(head_kernel, dw_layout):
    """A vocabulary of several 2048-column blocks (the last one short) with each row's max in a later block than
    its label, and some rows whose label lies ~120 nats below their max (exp underflows there): the online max and
    sum, the rescaled dx and the per-block factors of dW give the plain head's loss and gradients, at one and two
    threads; a NaN in a row's input reaches the loss."""
    g = torch.Generator().manual_seed(11)
    rows, hidden, vocab = 40, 16, 5000
    x = torch.randn(rows, hidden, generator=g, requires_grad=True)
    w = (torch.randn(vocab, hidden, generator=g) * 0.5).requires_grad_(True)
    with torch.no_grad():
        w[4500] = x[:8].mean(0) * 3.0  # rows 0-7: the max in the last block
        w[4999] = x[8:12].mean(0) * 40.0  # rows 8-11: a max ~100+ nats above the rest
    labels = torch.randint(0, 2048, (rows,), generator=g)  # every label in the first block
    weights = torch.full((rows,), 1.0 / rows)
    ref = F.cross_entropy(F.linear(x, w), labels)
    gx, gw = torch.autograd.grad(ref * 4.0, (x, w))
    bounds = linear_cross_entropy_bounds(x, w, labels, weights, scale=4.0)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            fused = _fused_grads(x, w, labels, weights, chunk=16, scale=4.0)
            assert_heads_agree(fused, (ref, gx, gw), bounds, f"vocabulary blocks, {threads} threads")
    finally:
        torch.set_num_threads(previous)
    with torch.no_grad():
        x_nan = x.detach().clone()
        x_nan[5, 3] = float("nan")
        assert torch.isnan(fused_linear_cross_entropy(x_nan, w.detach(), labels, weights, 16))
        # a first block of nothing but −inf logits (a row of W at −inf against a positive x): they count as exps of 0
        x_pos, w_inf = x.detach().abs() + 0.1, w.detach().clone()
        w_inf[:2048] = float("-inf")
        later = torch.randint(2048, vocab, (rows,), generator=g)
        expected = F.cross_entropy(F.linear(x_pos, w_inf), later)
        # the −inf columns add exact zeros (exp(−inf) = 0) everywhere: the bound is the finite columns' head's
        finite = linear_cross_entropy_bounds(x_pos, w_inf[2048:], later - 2048, weights)
        actual = fused_linear_cross_entropy(x_pos, w_inf, later, weights, 16)
        assert_within(actual, expected, 2 * finite.loss_bound, "loss with a first block of −inf logits")


def test_a_thread_per_chunk_matches_the_plain_head_and_computes_the_one_thread_bits(head_kernel, dw_layout):
    """Two and three threads, each running whole chunks and then its share of dW's columns (rounds of a chunk per
    thread, a short last round included): the plain head's loss and gradients to fp32 rounding, and at the same
    chunk size the same bits as one thread — dW's chunk products are added in chunk order whatever the threads."""
    x, w, labels, mask = inputs(seed=6)
    weights = mask / mask.sum()
    ref = plain_loss(x, w, labels, mask)
    gx, gw = torch.autograd.grad(ref * 8.0, (x, w))
    previous = torch.get_num_threads()
    runs = {}
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert cpu_head_workers(N, C, V, torch.get_num_threads(), 10) == threads
            runs[threads] = _fused_grads(x, w, labels, weights, chunk=10)
    finally:
        torch.set_num_threads(previous)
    bounds = linear_cross_entropy_bounds(x, w, labels, weights, scale=8.0)
    assert_heads_agree(runs[2], (ref, gx, gw), bounds, "two threads vs the plain head")
    for threads in (2, 3):
        for a, b in zip(runs[threads], runs[1], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("as_rows", [False, True])
def test_the_chunk_loop_splits_dw_by_vocabulary_for_more_workers_than_chunks_and_refuses_bad_labels(
    head_kernel, as_rows
):
    """Both layouts of dW (`weight_grad_as_rows`): [V, C] by rows, [C, V] by columns, written back transposed."""
    x, w, labels, _ = inputs(seed=7)
    weights = torch.full((N,), 1.0 / N)
    buffers = [torch.empty(N, V) for _ in range(3)]
    shape = (V, C) if as_rows else (C, V)
    dw_buffer = torch.full(shape, float("nan"))  # every row/column written: two chunks of 20 rows, three shares
    forward = head_kernel.fused_head_forward
    loss = forward(x.detach(), w.detach(), labels, weights, 1.0, 20, buffers, None, dw_buffer, as_rows)
    dw = dw_buffer
    if not as_rows:
        dw = torch.empty(V, C)
        head_kernel.transpose_scaled(dw_buffer, torch.tensor(1.0), dw)
    gw = torch.autograd.grad(F.cross_entropy(F.linear(x, w), labels), w)[0]
    bounds = linear_cross_entropy_bounds(x, w, labels, weights)
    assert_within(dw, gw, 2 * bounds.dw_bound, "dW")
    assert_within(loss, F.cross_entropy(F.linear(x, w), labels), 2 * bounds.loss_bound, "loss")
    empty = torch.full(shape, float("nan"))  # no rows: a zero gradient
    forward(x[:0].detach(), w.detach(), labels[:0], weights[:0], 1.0, 20, buffers, None, empty, as_rows)
    assert torch.equal(empty, torch.zeros(shape))
    with pytest.raises(RuntimeError, match="the weight gradient must be a contiguous float32"):
        forward(x.detach(), w.detach(), labels, weights, 1.0, 20, buffers, None, dw_buffer, not as_rows)
    labels[3] = V
    with pytest.raises(RuntimeError, match=f"label {V} of row 3 is outside the vocabulary of {V}"):
        forward(x.detach(), w.detach(), labels, weights, 1.0, 20, buffers, None, dw_buffer, as_rows)
