"""The sync-free MoE hot path against what it replaced: bitwise the same outputs, gradients and draws.

- The static T·K-row dispatch (dropped routes as an uncomputed tail) against the kept-rows-only dispatch it
  replaced, which read N on the host: identical outputs and gradients for every backend that does the same
  arithmetic (grouped_mm, loop, the CPU's expert-by-expert SwiGLU).
- Garbage in the uncomputed tail (NaN, as uninitialised CUDA memory may hold) reaches nothing.
- Noise draws and capacities computed without device tensors equal DeepSpeed's float32 tensor formulas.
- `auto` picks grouped_mm on CUDA only where torch runs a grouped kernel.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from host_read_counter import cuda_code_path

import moetron.model.moe.experts.grouped as experts_module
from moetron.model.config import ModelConfig
from moetron.model.moe.experts.backends import auto_backend, cuda_grouped_mm_is_a_grouped_kernel, grouped_mm_supported
from moetron.model.moe.layer import MoELayer
from moetron.model.moe.routing.deepspeed_gating import (
    capacity_from_factor,
    gumbel_rsample,
    multiplicative_jitter,
    uniform_rsample,
)

D, F, E = 16, 32, 8
needs_grouped_mm = pytest.mark.skipif(
    not grouped_mm_supported(torch.device("cpu"), torch.float32, D, F), reason="torch._grouped_mm missing"
)


class KeptRowsOnlyDispatcher:
    """The dispatch this change replaced: only the N kept rows, N read on the host (`int(counts.sum())`)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, x_TD, routing):
        keys_R = torch.where(routing.kept_TK.reshape(-1), routing.expert_ids_TK.reshape(-1), self.num_experts)
        counts_E = torch.bincount(keys_R, minlength=self.num_experts + 1)[: self.num_experts]
        order_N = torch.sort(keys_R, stable=True).indices[: int(counts_E.sum())]
        tokens_N = order_N // routing.topk
        return x_TD.index_select(0, tokens_N), counts_E, (tokens_N, order_N, routing.weights_TK, x_TD.shape[0])

    def combine(self, y_ND, ctx):
        tokens_N, order_N, weights_TK, num_tokens = ctx
        acc = torch.promote_types(y_ND.dtype, torch.float32)
        weighted_ND = y_ND.to(acc) * weights_TK.reshape(-1).index_select(0, order_N).to(acc).unsqueeze(1)
        return weighted_ND.new_zeros(num_tokens, y_ND.shape[1]).index_add_(0, tokens_N, weighted_ND).to(y_ND.dtype)


def _layer(backend: str, **routing) -> MoELayer:
    cfg = ModelConfig(hidden_size=D, num_attention_heads=2, num_layers=2, ffn_hidden_size=F, num_experts=[E])
    cfg.moe_expert_backend, cfg.moe_min_capacity = backend, 1
    for name, value in routing.items():
        setattr(cfg, name, value)
    layer = MoELayer(cfg, E, layer_index=1)
    layer.init_weights(std=0.3, out_std=0.2, seed=3)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith(("b1_EF", "b2_ED")):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return layer


def _step(layer: MoELayer, seed: int = 0) -> dict[str, torch.Tensor]:
    """Output and every gradient (input and parameters) of one forward+backward, router RNG seeded."""
    layer.zero_grad(set_to_none=True)
    x = torch.randn(2, 24, D, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    torch.manual_seed(seed)
    y, aux = layer(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 1))
    ((y * g).sum() + aux.loss(layer.cfg)).backward()
    out = {"y": y.detach(), "x.grad": x.grad, "dropped": aux.dropped_routes}
    out.update({name: p.grad for name, p in layer.named_parameters() if p.grad is not None})
    return out


def _assert_bitwise(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


MODES = {
    "top1-capacity": dict(topk=1, moe_train_capacity_factor=0.5),
    "top1-capacity-no-rts": dict(topk=1, moe_train_capacity_factor=0.5, moe_use_rts=False),
    "top2-capacity": dict(topk=2, moe_train_capacity_factor=0.5),
    "top4-capacity-generic": dict(topk=4, moe_train_capacity_factor=0.75, moe_router_score_function="sigmoid"),
    "top2-dropless": dict(topk=2, moe_token_dropping=False),
}
EXPERT_KINDS = {"gelu-bias": dict(), "swiglu": dict(swiglu=True, add_bias_linear=False)}


@needs_grouped_mm
@pytest.mark.parametrize("cuda_path", [False, True], ids=["cpu-path", "cuda-path"])
@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
@pytest.mark.parametrize("kind", list(EXPERT_KINDS))
@pytest.mark.parametrize("mode", list(MODES))
def test_static_dispatch_is_bitwise_the_kept_rows_dispatch(mode, kind, backend, cuda_path):
    layer = _layer(backend, **MODES[mode], **EXPERT_KINDS[kind])
    with cuda_code_path() if cuda_path else contextlib.nullcontext():
        new = _step(layer)
        layer.dispatcher = KeptRowsOnlyDispatcher(E)
        old = _step(layer)
    assert (new["dropped"] > 0) == ("capacity" in mode)
    _assert_bitwise(new, old)


def _nan_tail(t_RA: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Rows past the last offset set to NaN: what uninitialised CUDA memory may hold there."""
    return t_RA.masked_fill((torch.arange(t_RA.shape[0]) >= offsets_E[-1]).unsqueeze(1), float("nan"))


class NaNTailGroupedMM(torch.autograd.Function):
    """torch._grouped_mm whose output and input gradient are NaN past the last offset."""

    @staticmethod
    def forward(ctx, x_RA, w_EAB, offsets_E):
        ctx.save_for_backward(x_RA, w_EAB, offsets_E)
        return _nan_tail(torch._grouped_mm(x_RA, w_EAB, offs=offsets_E), offsets_E)

    @staticmethod
    def backward(ctx, grad_RB):
        x_RA, w_EAB, offsets_E = ctx.saved_tensors
        with torch.enable_grad():
            x, w = x_RA.detach().requires_grad_(), w_EAB.detach().requires_grad_()
            grad_x, grad_w = torch.autograd.grad(torch._grouped_mm(x, w, offs=offsets_E), (x, w), grad_RB)
        return _nan_tail(grad_x, offsets_E), grad_w, None


@needs_grouped_mm
@pytest.mark.parametrize("kind", list(EXPERT_KINDS))
@pytest.mark.parametrize("mode", ["top1-capacity", "top2-capacity"])
def test_garbage_in_the_uncomputed_tail_reaches_no_output_or_gradient(mode, kind, monkeypatch):
    layer = _layer("grouped_mm", **MODES[mode], **EXPERT_KINDS[kind])
    calls = []

    def poisoned_matmul(x_RA, w_EAB, offsets_E):
        calls.append(x_RA.shape[0] - int(offsets_E[-1]))  # rows in the tail
        return NaNTailGroupedMM.apply(x_RA, w_EAB, offsets_E)

    with cuda_code_path():
        clean = _step(layer)
        monkeypatch.setattr(experts_module, "grouped_matmul", poisoned_matmul)
        poisoned = _step(layer)
    assert clean["dropped"] > 0 and len(calls) == (3 if kind == "swiglu" else 2) and min(calls) > 0
    assert all(torch.isfinite(t).all() for t in poisoned.values())
    _assert_bitwise(poisoned, clean)


def test_batched_backend_pads_to_the_host_capacity_and_matches_loop():
    layer = _layer("batched", **MODES["top2-capacity"])
    layouts = []
    original = experts_module.PaddedLayout

    class Recording(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            layouts.append(self)

    experts_module.PaddedLayout = Recording
    try:
        got = _step(layer)
    finally:
        experts_module.PaddedLayout = original
    capacity = capacity_from_factor(48, E, 0.5, 2, 1)
    assert [layout.slots for layout in layouts] == [capacity + 1]  # the static capacity, not the max count
    layer.experts.backend = "loop"
    want = _step(layer)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------- noise and capacity without device tensors
def _deepspeed_uniform(shape, low: float, high: float) -> torch.Tensor:
    """torch.distributions.Uniform's rsample with float32 0-dim tensor bounds (DeepSpeed's formula)."""
    low_t, high_t = torch.tensor(low), torch.tensor(high)
    return low_t + torch.rand(shape) * (high_t - low_t)


TINY, EPS = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).eps
BOUNDS = [(1 - 1e-2, 1 + 1e-2), (TINY, 1 - EPS), (0.99, 1.01), (-3.7, 2.1), (0.1, 0.2), (1e-30, 3e38), (0.0, 1.0)]


@pytest.mark.parametrize("low,high", BOUNDS)
def test_uniform_draws_are_bitwise_the_float32_tensor_formula(low, high):
    torch.manual_seed(7)
    expected = _deepspeed_uniform((500, 64), low, high)
    torch.manual_seed(7)
    assert torch.equal(uniform_rsample(torch.Size((500, 64)), low, high, torch.device("cpu")), expected)


def test_random_bounds_jitter_and_gumbel_are_bitwise_the_old_draws():
    rng = np.random.default_rng(0)
    for low, high in np.sort(rng.normal(size=(50, 2)) * rng.choice([1e-3, 1.0, 1e4], size=(50, 1)), axis=1):
        torch.manual_seed(1)
        expected = _deepspeed_uniform((64,), float(low), float(high))
        torch.manual_seed(1)
        assert torch.equal(uniform_rsample(torch.Size((64,)), float(low), float(high), torch.device("cpu")), expected)
    x = torch.randn(300, 40)
    torch.manual_seed(2)
    expected_jitter = x * _deepspeed_uniform(x.shape, 1.0 - 1e-2, 1.0 + 1e-2)  # DeepSpeed's multiplicative_jitter
    torch.manual_seed(2)
    assert torch.equal(multiplicative_jitter(x), expected_jitter)
    torch.manual_seed(3)
    expected_gumbel = -torch.log(-torch.log(_deepspeed_uniform((300, 40), TINY, 1 - EPS)))  # RSample's noise
    torch.manual_seed(3)
    assert torch.equal(gumbel_rsample(torch.Size((300, 40)), torch.device("cpu")), expected_gumbel)


def _deepspeed_capacity(num_tokens: int, num_experts: int, factor: float, k: int, min_capacity: int) -> int:
    capacity = torch.ceil((num_tokens / num_experts) * torch.tensor(factor * k)).to(torch.int64)
    return max(int(capacity), min_capacity)


def test_capacity_is_deepspeeds_float32_tensor_arithmetic():
    factors = [0.5, 0.7, 0.75, 1.0, 1.1, 1.2, 1.25, 1.3, 1 / 3, 2.5, 3.7]
    for num_tokens in range(1, 260, 3):
        for num_experts in (1, 3, 6, 7, 8, 12, 64):
            for factor in factors:
                for k in (1, 2, 3):
                    want = _deepspeed_capacity(num_tokens, num_experts, factor, k, 4)
                    assert capacity_from_factor(num_tokens, num_experts, factor, k, 4) == want
    assert math.ceil(25 / 2 * 1.2) == 15 and capacity_from_factor(25, 2, 1.2, 1, 0) == 16  # float32, not float64


# ---------------------------------------------------------------- auto backend
@pytest.mark.parametrize(
    "dtype,capability,rocm,expected",
    [
        (torch.bfloat16, (9, 0), False, True),  # H100/H200: CUTLASS grouped GEMM
        (torch.bfloat16, (10, 0), False, True),  # B200
        (torch.bfloat16, (8, 0), False, False),  # A100: the fallback loop (offs.cpu())
        (torch.bfloat16, (12, 0), False, False),  # consumer Blackwell: not in torch's sm90/sm100 check
        (torch.float16, (9, 0), False, False),
        (torch.float32, (9, 0), False, False),
        (torch.bfloat16, (9, 4), True, False),  # ROCm: treated as the fallback
    ],
)
def test_cuda_grouped_kernel_rule(dtype, capability, rocm, expected):
    assert cuda_grouped_mm_is_a_grouped_kernel(dtype, capability, rocm) is expected


def test_auto_backend_on_cuda_picks_grouped_mm_only_for_the_grouped_kernel(monkeypatch):
    import moetron.model.moe.experts.backends as backends

    monkeypatch.setattr(backends, "_grouped_mm_runs", lambda device_type, dtype: True)
    monkeypatch.setattr(torch.version, "hip", None)
    cuda = torch.device("cuda", 0)
    for capability, dtype, dims, expected in [
        ((9, 0), torch.bfloat16, (D, F), "grouped_mm"),
        ((9, 0), torch.float32, (D, F), "batched"),
        ((8, 6), torch.bfloat16, (D, F), "batched"),
        ((9, 0), torch.bfloat16, (6, F), "batched"),  # 12-byte rows: not 16-byte aligned
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        assert auto_backend(cuda, dtype, *dims) == expected
    assert auto_backend(torch.device("meta"), torch.bfloat16, D, F) == "batched"
    cpu_pick = "grouped_mm" if grouped_mm_supported(torch.device("cpu"), torch.float32, D, F) else "batched"
    assert auto_backend(torch.device("cpu"), torch.float32, D, F) == cpu_pick  # the CPU choice is unchanged
