"""The fused LM head + cross-entropy (`model/fused_cross_entropy.py`) computes the loss and the gradients of the plain
`F.linear` + `F.cross_entropy` path, chunk by chunk, and the trainer trains the same with it as without it.

Its fp32 results are compared with ATen's within the worst-case error bound of both (`fp32_error_bounds`: the GEMMs'
γ_K·|a||b|, exp's 2 ULP, the sums' γ_N), which holds whatever ISA ATen and the C++ kernels dispatch to; the same-code
claims (one thread against several, the same chunk size) stay bitwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp32_error_bounds import assert_heads_agree, assert_within, linear_cross_entropy_bounds, softmax_bounds
from trainer_support import build_trainer, run_losses, tiny_config

from moetron.model.config import ModelConfig
from moetron.model.fused_cross_entropy import (
    CpuBufferPool,
    _softmax_in_place_and_label_logp,
    chunk_tokens,
    cpu_head_workers,
    fused_linear_cross_entropy,
    softmax_block_rows,
)
from moetron.model.gpt import create_model
from moetron.model.loss import FusedHeadLoss, LogitsHeadLoss, token_weights

N, C, V = 37, 16, 96


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g, requires_grad=True)
    w = (torch.randn(V, C, generator=g) * 0.5).requires_grad_(True)
    labels = torch.randint(0, V, (N,), generator=g)
    mask = (torch.rand(N, generator=g) > 0.3).float()
    return x, w, labels, mask


def plain_loss(x, w, labels, mask):
    losses = F.cross_entropy(F.linear(x, w).float(), labels, reduction="none")
    return (losses * mask).sum() / mask.sum()


@pytest.fixture(params=[False, True], ids=["dw_CV", "dw_VC"])
def dw_layout(request, monkeypatch):
    """Both layouts of the head's dW accumulation, whichever this CPU would pick (`weight_grad_as_rows`)."""
    from moetron.model import fused_cross_entropy

    monkeypatch.setattr(fused_cross_entropy, "weight_grad_as_rows", lambda device: request.param)
    return request.param


@pytest.mark.parametrize("chunk", [1, 8, 10, N, 64])
def test_loss_and_gradients_match_the_plain_head(chunk, dw_layout):
    x, w, labels, mask = inputs()
    ref = plain_loss(x, w, labels, mask)
    ref.backward()
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    weights = token_weights(mask, N, x.device)
    loss = fused_linear_cross_entropy(x, w, labels, weights, chunk)
    (loss * 3.0).backward()  # the upstream gradient scales both
    bounds = linear_cross_entropy_bounds(x, w, labels, weights, scale=3.0)
    assert_heads_agree((loss, x.grad, w.grad), (ref, 3.0 * gx, 3.0 * gw), bounds, "fused vs plain head")


def test_row_weights_and_grad_scale_folded_into_the_gemms_match_the_plain_head():
    """fp32: the per-row weight and the announced scale multiply the [M, C] side of the gradient GEMMs (not the
    [M, V] chunk); the gradients are the plain head's × the scale, and a zero-weight row gets an exactly zero dx."""
    x, w, labels, mask = inputs(4)
    mask[:5] = 0.0
    ref = plain_loss(x, w, labels, mask)
    gx, gw = torch.autograd.grad(ref, (x, w))
    weights = token_weights(mask, N, x.device)
    for scale in (1.0, 1024.0, 1 / 3):
        x.grad = w.grad = None
        loss = fused_linear_cross_entropy(x, w, labels, weights, 8, grad_scale=scale)
        (loss * scale).backward()  # the announced scale came true: the backward's ratio is exactly 1
        bounds = linear_cross_entropy_bounds(x, w, labels, weights, scale=scale)
        assert_heads_agree((loss, x.grad, w.grad), (ref, scale * gx, scale * gw), bounds, f"scale {scale}")
        assert torch.equal(x.grad[:5], torch.zeros(5, C)) and w.grad.is_contiguous()


def test_bf16_gradients_are_as_close_to_exact_as_the_logits_path(dw_layout):
    """bf16: the row factor is applied in fp32 while the gradient is cast (one pass), dW accumulates in fp32."""
    x, w, labels, mask = inputs(5)
    exact = plain_loss(x.double(), w.double(), labels, mask.double())
    gx, gw = torch.autograd.grad(exact, (x, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        px, pw = torch.autograd.grad(plain_loss(x, w, labels, mask), (x, w))
        loss = fused_linear_cross_entropy(x, w, labels, token_weights(mask, N, x.device), 8, grad_scale=2.0**10)
    fx, fw = torch.autograd.grad(loss * 2.0**10, (x, w))
    torch.testing.assert_close(loss.double(), exact, rtol=2e-2, atol=2e-2)
    for fused, plain, want in ((fx / 2.0**10, px, gx), (fw / 2.0**10, pw, gw)):
        assert (fused.double() - want).abs().max() <= 1.5 * (plain.double() - want).abs().max() + 1e-7


def test_softmax_blocks_are_cache_sized_at_one_cpu_thread_only():
    cpu = torch.device("cpu")
    assert softmax_block_rows(50304, cpu, threads=1) == 10  # 2 MiB of fp32 logits
    assert softmax_block_rows(10**7, cpu, threads=1) == 1
    assert softmax_block_rows(50304, cpu, threads=2) >= 2**30  # the whole chunk: fewer parallel regions
    assert softmax_block_rows(50304, torch.device("cuda"), threads=1) >= 2**30


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


def test_two_heads_in_flight_on_one_weight_keep_their_own_gradients(dw_layout):
    """Two forwards before one backward (e.g. the LM head and an MTP head sharing it): the pooled weight-gradient
    buffer of the first is not the second's."""
    x, w, labels, mask = inputs(6)
    x2 = torch.randn(N, C).requires_grad_(True)
    ref = plain_loss(x, w, labels, mask) + plain_loss(x2, w, labels.flip(0), mask)
    gw = torch.autograd.grad(ref, w)[0]
    weights = token_weights(mask, N, x.device)
    # one dW as the sum of the two heads': within the sum of their bounds (and one rounding of the sum, in them)
    dw_bound = sum(
        linear_cross_entropy_bounds(rows, w, y, weights).dw_bound for rows, y in ((x, labels), (x2, labels.flip(0)))
    )
    for _ in range(2):  # the second time from the pool
        w.grad = None
        loss = fused_linear_cross_entropy(x, w, labels, weights, 8)
        (loss + fused_linear_cross_entropy(x2, w, labels.flip(0), weights, 8)).backward()
        assert_within(w.grad, gw, 2 * dw_bound, "dW of two heads")


def test_without_gradients_only_the_loss_is_computed():
    x, w, labels, mask = inputs(1)
    with torch.no_grad():
        weights = token_weights(None, N, x.device)
        loss = fused_linear_cross_entropy(x, w, labels, weights, 8)
        ref = F.cross_entropy(F.linear(x, w), labels)
    assert not loss.requires_grad
    assert_within(loss, ref, 2 * linear_cross_entropy_bounds(x, w, labels, weights).loss_bound, "loss")


def test_bf16_autocast_runs_the_gemms_in_bf16_and_keeps_fp32_weights_grads():
    x, w, labels, _ = inputs(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(x, w, labels, token_weights(None, N, x.device), 8)
        ref = F.cross_entropy(F.linear(x, w).float(), labels)
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == w.grad.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 4, 6, 100])  # blocks of the chunk, the last one short (4) or the whole chunk
def test_block_wise_in_place_log_softmax_gives_the_labels_log_probability_and_the_softmax(rows):
    g = torch.Generator().manual_seed(3)
    logits_MV = torch.randn(6, 1000, generator=g) * 8
    logits_MV[0, 7] = 200.0  # a confident row: the label (0) lies ~200 nats below the max, its softmax is 0
    logits_MV[1] = 0.0  # a flat row: every probability is 1 / V
    labels_M1 = torch.tensor([[0], [5], [9], [999], [1], [2]])
    logp_MV = torch.log_softmax(logits_MV, dim=1)
    probs_MV = logits_MV.clone()
    logp_M1 = _softmax_in_place_and_label_logp(probs_MV, labels_M1, rows)
    # bitwise: F.cross_entropy's log_softmax at the labels, and the exp of it the logits path's backward uses
    assert torch.equal(logp_M1, logp_MV.gather(1, labels_M1))
    assert torch.equal(probs_MV, logp_MV.exp())
    assert torch.isfinite(logp_M1).all() and logp_M1[0, 0] < -150
    bounds = softmax_bounds(logits_MV, labels_M1[:, 0])  # exp(log_softmax) and softmax: two fp32 evaluations
    assert_within(probs_MV, torch.softmax(logits_MV, dim=1), 2 * bounds.probs_bound, "exp(log_softmax) vs softmax")


def test_a_second_backward_is_refused():
    x, w, labels, _ = inputs(3)
    loss = fused_linear_cross_entropy(x, w, labels, token_weights(None, N, x.device), 8)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()


def test_chunk_rule():
    cpu = torch.device("cpu")
    assert chunk_tokens(768, 128, 50304, cpu) == 256  # ~8 MiB of logits, at least 256 rows
    assert chunk_tokens(1000, 128, 50304, cpu) == 334  # three chunks of equal rows, not 256 + 256 + 256 + 232
    assert chunk_tokens(768, 128, 512, cpu) == 768  # fewer tokens than one chunk's rows: one chunk
    # a thread per chunk: every thread the same rows, whole chunks of at least 256 rows each
    assert chunk_tokens(768, 128, 50304, cpu, threads=2) == 384
    assert chunk_tokens(4096, 128, 50304, cpu, threads=2) == 256
    assert chunk_tokens(10, 128, 50304, cpu, threads=4) == 10  # fewer tokens than a chunk's rows: one thread
    assert chunk_tokens(65536, 2048, 50304, torch.device("cuda")) == 2622  # ⌈V/C⌉ = 25 chunks
    assert chunk_tokens(2048, 2048, 50304, torch.device("cuda")) == 1024


@pytest.mark.parametrize("untied", [False, True])
def test_model_loss_and_gradients_equal_with_and_without_logits(untied):
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=12, vocab_size=90)
    cfg.untie_embeddings_and_output_weights = untied
    cfg.hidden_dropout = cfg.attention_dropout = 0.0
    model = create_model(cfg, "cpu", seed=3)
    g = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, 90, (2, 2, 12), generator=g)
    mask = (torch.rand(2, 12, generator=g) > 0.2).float()
    grads = []
    for head in (LogitsHeadLoss(), FusedHeadLoss()):
        model.zero_grad(set_to_none=True)
        out = model(tokens, return_logits=False)
        assert out.logits is None
        loss = head(model, out.hidden, labels, mask)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, plain_grads), (fused, fused_grads) = grads
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    with torch.no_grad():  # evaluation's path: forward(labels, return_logits=False)
        torch.testing.assert_close(
            model(tokens, labels_BT=labels, loss_mask_BT=mask, return_logits=False).lm_loss,
            model(tokens, labels_BT=labels, loss_mask_BT=mask).lm_loss,
        )


@pytest.mark.parametrize("moe", [False, True])
def test_trainer_trains_the_same_with_the_fused_loss(moe):
    curves = [run_losses(build_trainer(tiny_config(moe, fused_cross_entropy=fused)), 6) for fused in (False, True)]
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), rtol=1e-5, atol=0)


def _fp16_grads(loss_of, x, w, scale: float):
    x.grad = w.grad = None
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_of()
    (loss * scale).backward()
    return loss.detach(), x.grad.clone(), w.grad.clone()


def test_fp16_gradients_are_scaled_before_their_cast_like_the_logits_path():
    """Under fp16 a large loss scale multiplies the softmax gradient in fp32 before the cast to fp16 (the logits
    path's order): unscaled, (softmax − one-hot) / N underflows in fp16; scaled after the cast, 2^20 overflows."""
    x, w, labels, _ = inputs()
    weights = token_weights(None, N, x.device)
    exact = F.cross_entropy(F.linear(x.double(), w.double()), labels)
    gx, gw = torch.autograd.grad(exact, (x, w))
    for scale in (2.0**14, 2.0**20):
        ref, px, pw = _fp16_grads(lambda: F.cross_entropy(F.linear(x, w).float(), labels), x, w, scale)
        loss, fx, fw = _fp16_grads(
            lambda s=scale: fused_linear_cross_entropy(x, w, labels, weights, 8, grad_scale=s), x, w, scale
        )
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
        for fused, plain, want in ((fx, px, gx), (fw, pw, gw)):  # as close to the exact gradient as the logits path
            # overflow where the logits path overflows (the loss scaler then skips the step either way)
            assert bool(torch.isfinite(fused).all()) == bool(torch.isfinite(plain).all())
            if not torch.isfinite(plain).all():
                continue
            fused_err = (fused.double() / scale - want).abs().max()
            plain_err = (plain.double() / scale - want).abs().max()
            assert fused_err <= 1.5 * plain_err + 1e-7
    # an announced scale that did not come true is corrected in the backward (ratio upstream / announced)
    x.grad = w.grad = None
    fused_linear_cross_entropy(x, w, labels, weights, 8, grad_scale=4.0).backward()
    torch.testing.assert_close(x.grad.double(), gx.double(), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="grad_scale must be positive"):
        fused_linear_cross_entropy(x, w, labels, weights, 8, grad_scale=0.0)


@pytest.fixture
def softmax_kernel():
    """moetron's C++ softmax of the fused head (skipped, with the reason, where the CPU kernels do not load)."""
    from moetron.model import compiled_kernels

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


def test_fused_head_with_the_softmax_kernel_equals_the_aten_softmax(softmax_kernel, monkeypatch):
    """The kernel's Σ·(softmax − one-hot) with 1/Σ folded into the row factor, against log_softmax + exp_ + the
    one-hot subtraction: the same loss and gradients to fp32 rounding, at a loss scale and with row weights."""
    from moetron.model import fused_cross_entropy

    results = []
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(fused_cross_entropy, "softmax_gradient_rows", lambda *tensors: None)
            monkeypatch.setattr(fused_cross_entropy, "fused_head_kernels", lambda *tensors: None)
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
    from moetron.model import compiled_kernels

    reason = compiled_kernels.unavailable_reason()
    if reason or compiled_kernels.compiled_cpu_kernels() is None:
        pytest.skip(f"the CPU kernels are not available here: {reason or 'they did not build'}")
    return compiled_kernels.compiled_cpu_kernels()


def test_weight_grad_layout_follows_the_cpu():
    from moetron.model import fused_cross_entropy

    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    assert fused_cross_entropy.weight_grad_as_rows(torch.device("cpu")) is not avx512
    assert fused_cross_entropy.weight_grad_as_rows(torch.device("cuda")) is False


def test_the_cpp_chunk_loop_matches_the_python_loop(head_kernel, dw_layout, monkeypatch):
    """One worker against the Python loop (with the softmax kernel), at a loss scale, with row weights and a short
    last chunk, in either layout of dW: the same values to fp32 rounding (the C++ loop adds the label's term of the
    gradients apart, block by block of the vocabulary)."""
    from moetron.model import fused_cross_entropy

    x, w, labels, mask = inputs(seed=5)
    weights = mask / mask.sum()
    cpp = _fused_grads(x, w, labels, weights, chunk=10)
    monkeypatch.setattr(fused_cross_entropy, "fused_head_kernels", lambda *tensors: None)
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


@pytest.mark.parametrize("as_rows", [False, True])
def test_a_bf16_weight_gradient_is_formed_block_by_block_of_the_vocabulary(as_rows, monkeypatch):
    """The bf16 dW product and its fp32 copy never exist for the whole vocabulary at once (a 1.9 GB transient at
    Qwen3's): blocks of a few vocabulary rows give the same sums as one block (the same dot products)."""
    from moetron.model import fused_cross_entropy

    g = torch.Generator().manual_seed(12)
    x = torch.randn(N, C, generator=g).bfloat16()
    grads = [torch.randn(N, V, generator=g).bfloat16() for _ in range(2)]
    shape = (V, C) if as_rows else (C, V)
    results = []
    for block_bytes in (2**40, C * 6 * 7):  # one block; blocks of 7 vocabulary entries (the last one short)
        monkeypatch.setattr(fused_cross_entropy, "DW_PRODUCT_BLOCK_BYTES", block_bytes)
        dw = torch.full(shape, float("nan"))
        for i, grad in enumerate(grads):
            fused_cross_entropy._accumulate_weight_grad(dw, x, grad, i == 0, as_rows)
        results.append(dw)
    assert torch.equal(results[0], results[1])
    exact = sum(grad.double().T @ x.double() for grad in grads)
    # each chunk's product is rounded to bf16 (half an ULP: 2^-9 relative) before the fp32 sum
    bound = 2.0**-8 * sum(grad.double().abs().T @ x.double().abs() for grad in grads)
    assert_within(results[0], exact if as_rows else exact.T, bound if as_rows else bound.T, "bf16 dW")
