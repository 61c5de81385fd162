"""GroupedExperts: the three backends agree (values and gradients), init is per global expert id."""

from __future__ import annotations

import pytest
import torch

from moetron.model.moe.experts.backends import GROUP_ALIGN, AlignedGroups, grouped_mm_supported
from moetron.model.moe.experts.grouped import GroupedExperts

D, F = 16, 32
BACKENDS = ["grouped_mm", "batched", "loop"]


def _skip_unsupported(backend: str, dtype: torch.dtype = torch.float32) -> None:
    if backend == "grouped_mm" and not grouped_mm_supported(torch.device("cpu"), dtype, D, F):
        pytest.skip("torch._grouped_mm does not run on this CPU build")


def _experts(num_experts: int = 4, swiglu: bool = False, bias: bool = True, **kw) -> GroupedExperts:
    experts = GroupedExperts(num_experts, D, F, swiglu=swiglu, bias=bias, **kw)
    experts.reset_parameters(std=0.5, out_std=0.3, seed=11)
    with torch.no_grad():  # non-zero biases so that the per-row bias gather is exercised
        for b in (experts.b1_EF, experts.b2_ED):
            if b is not None:
                b.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    return experts


def _loop_reference(experts: GroupedExperts, x_ND: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each expert written out with explicit per-expert weights."""
    out = []
    for e, x_e in enumerate(x_ND.split(counts)):
        h = x_e @ experts.w1_EDF[e]
        if experts.b1_EF is not None:
            h = h + experts.b1_EF[e]
        h = experts.activation(h)
        if experts.w3_EDF is not None:
            h = h * (x_e @ experts.w3_EDF[e])
        y = h @ experts.w2_EFD[e]
        out.append(y + experts.b2_ED[e] if experts.b2_ED is not None else y)
    return torch.cat(out)


def _grads(experts: GroupedExperts, x_ND: torch.Tensor, y_ND: torch.Tensor) -> list[torch.Tensor]:
    g_ND = torch.randn(y_ND.shape, generator=torch.Generator().manual_seed(5))
    params = [p for p in experts.parameters()]
    return torch.autograd.grad((y_ND * g_ND).sum(), [x_ND, *params])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("swiglu,bias", [(False, True), (True, False)])
def test_backends_match_reference_values_and_gradients(backend: str, swiglu: bool, bias: bool) -> None:
    _skip_unsupported(backend)
    experts = _experts(swiglu=swiglu, bias=bias, backend=backend)
    counts = [3, 0, 6, 2]  # an empty expert included
    x_ND = torch.randn(sum(counts), D, requires_grad=True)
    y_ND = experts(x_ND, torch.tensor(counts))
    ref_ND = _loop_reference(experts, x_ND, counts)
    torch.testing.assert_close(y_ND, ref_ND, rtol=1e-5, atol=1e-5)
    for got, want in zip(_grads(experts, x_ND, y_ND), _grads(experts, x_ND, ref_ND), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_rows_at_all(backend: str) -> None:
    _skip_unsupported(backend)
    experts = _experts(backend=backend)
    y_ND = experts(torch.zeros(0, D), torch.zeros(4, dtype=torch.int64))
    assert y_ND.shape == (0, D)


@pytest.mark.parametrize("backend", BACKENDS)
def test_expanded_output_gradient_is_accepted(backend: str) -> None:
    _skip_unsupported(backend)
    experts = _experts(backend=backend)
    x_ND = torch.randn(5, D, requires_grad=True)
    experts(x_ND, torch.tensor([1, 1, 1, 2])).sum().backward()  # sum's gradient is a stride-0 expand
    assert torch.isfinite(x_ND.grad).all()


def test_auto_picks_grouped_mm_when_aligned_and_batched_otherwise() -> None:
    experts = _experts()
    x = torch.zeros(1, D)
    expected = "grouped_mm" if grouped_mm_supported(x.device, x.dtype, D, F) else "batched"
    assert experts.resolved_backend(x) == expected
    odd = GroupedExperts(2, 6, 10, swiglu=False, bias=False)  # 24- and 40-byte rows: not 16-byte aligned
    assert odd.resolved_backend(torch.zeros(1, 6)) == "batched"
    odd(torch.randn(3, 6), torch.tensor([1, 2]))  # and it runs


def test_unknown_backend_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="--moe-expert-backend 'fast'"):
        GroupedExperts(2, D, F, swiglu=False, bias=False, backend="fast")


def test_slice_of_experts_gets_the_full_layers_weights() -> None:
    full = GroupedExperts(8, D, F, swiglu=True, bias=True)
    full.reset_parameters(0.02, 0.01, 7, 3)  # std, out_std, seed, the layer index as the key
    part = GroupedExperts(4, D, F, swiglu=True, bias=True, expert_offset=4, num_global_experts=8)
    part.reset_parameters(0.02, 0.01, 7, 3)  # std, out_std, seed, the layer index as the key
    for name in ("w1_EDF", "w3_EDF", "w2_EFD"):
        torch.testing.assert_close(getattr(part, name), getattr(full, name)[4:], rtol=0, atol=0)
    assert not torch.equal(full.w1_EDF[0], full.w1_EDF[1])
    assert torch.all(full.b1_EF == 0) and torch.all(full.b2_ED == 0)
    other_layer = GroupedExperts(8, D, F, swiglu=True, bias=True)
    other_layer.reset_parameters(0.02, 0.01, 7, 4)  # std, out_std, seed, the layer index as the key
    assert not torch.equal(other_layer.w1_EDF, full.w1_EDF)


def test_output_projection_uses_out_std() -> None:
    experts = GroupedExperts(4, 64, 128, swiglu=False, bias=False)
    experts.reset_parameters(std=1.0, out_std=0.01, seed=0)
    assert 0.9 < experts.w1_EDF.std().item() < 1.1
    assert 0.009 < experts.w2_EFD.std().item() < 0.011


def test_identical_init_gives_deep_copies() -> None:
    experts = GroupedExperts(4, D, F, swiglu=False, bias=False)
    experts.reset_parameters(0.02, 0.01, 7, 0, identical=True)
    for e in range(1, 4):
        assert torch.equal(experts.w1_EDF[e], experts.w1_EDF[0])
        assert torch.equal(experts.w2_EFD[e], experts.w2_EFD[0])


def test_meta_construction_then_to_empty_and_init_matches_cpu() -> None:
    with torch.device("meta"):
        meta = GroupedExperts(4, D, F, swiglu=True, bias=True)
    meta.to_empty(device="cpu")
    meta.reset_parameters(0.02, 0.01, 5, 1)
    cpu = GroupedExperts(4, D, F, swiglu=True, bias=True)
    cpu.reset_parameters(0.02, 0.01, 5, 1)
    for (name, a), b in zip(meta.named_parameters(), cpu.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_dense_forward_is_the_one_expert_mlp() -> None:
    mlp = _experts(num_experts=1)
    x_BTD = torch.randn(2, 3, D)
    counts = torch.tensor([6])
    torch.testing.assert_close(mlp.dense_forward(x_BTD).reshape(6, D), mlp(x_BTD.reshape(6, D), counts))
    with pytest.raises(ValueError, match="one expert"):
        _experts(num_experts=2).dense_forward(x_BTD)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_autocast_runs_in_bf16_and_stays_close(backend: str) -> None:
    _skip_unsupported(backend, torch.bfloat16)
    experts = _experts(swiglu=True, bias=False, backend=backend)
    counts = torch.tensor([4, 4, 0, 8])
    x_ND = torch.randn(16, D, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ND = experts(x_ND, counts)
    assert y_ND.dtype == torch.bfloat16
    y_ND.float().sum().backward()
    assert experts.w1_EDF.grad.dtype == torch.float32 and x_ND.grad is not None
    ref_ND = experts(x_ND, counts)
    torch.testing.assert_close(y_ND.float(), ref_ND, rtol=0.05, atol=0.05 * ref_ND.abs().max().item())


def test_grouped_mm_runs_on_aligned_groups_with_zero_padding_and_dropped_tail_rows() -> None:
    """Every expert's group starts at a multiple of GROUP_ALIGN rows (zeros in between), the dropped routes' rows
    past Σ counts are in no group: their outputs and gradients are zeros, the others the loop's."""
    _skip_unsupported("grouped_mm")
    counts = [3, 0, 9, 1]  # odd sizes and an empty expert
    groups = AlignedGroups(torch.tensor(counts), num_rows=16)  # 3 dropped rows after the 13
    assert groups.offsets_E.tolist() == [8, 8, 24, 32] and groups.size == 16 + 4 * (GROUP_ALIGN - 1) + 1
    x_RD = torch.randn(16, D)
    buffer = groups.scatter(x_RD)
    assert torch.equal(buffer[:3], x_RD[:3]) and torch.equal(buffer[8:17], x_RD[3:12])
    assert not buffer[3:8].any() and not buffer[17:24].any() and not buffer[32:].any()
    experts = _experts(swiglu=True, bias=False, backend="grouped_mm")
    x_RD.requires_grad_(True)
    y_RD = experts(x_RD, torch.tensor(counts))
    assert not y_RD[13:].any()
    ref = _loop_reference(experts, x_RD[:13], counts)
    torch.testing.assert_close(y_RD[:13], ref, rtol=1e-5, atol=1e-5)
    (grad,) = torch.autograd.grad(y_RD.sum(), [x_RD])
    assert not grad[13:].any() and grad[:13].abs().sum() > 0
