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
from fused_head_inputs import C, N, V, inputs, plain_loss
from trainer_support import build_trainer, run_losses, tiny_config

from moetron.model.config import ModelConfig
from moetron.model.fused_cross_entropy import (
    _softmax_in_place_and_label_logp,
    chunk_tokens,
    fused_linear_cross_entropy,
)
from moetron.model.gpt import create_model
from moetron.model.loss import FusedHeadLoss, LogitsHeadLoss, token_weights


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
    """The device-neutral rule (a GPU's); the CPU backend's: tests/unit/cpu/test_cpu_head_loss.py."""
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
