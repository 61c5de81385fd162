"""Muon (`--optimizer muon`): the Newton–Schulz orthogonalisation, the scale rule, the registry's parameter split,
one step by hand, the fused QKV weight split into Q, K and V (and its flags), and a checkpoint round trip that
resumes bit for bit."""

import argparse

import pytest
import torch
from trainer_support import build_trainer, run_losses, tiny_config

from moetron.config_cli import add_config_arguments, cli_overrides, load_config
from moetron.model.gpt import create_model
from moetron.parallel.params import ParamRegistry
from moetron.parallel.whole_matrix import WholeAlready
from moetron.train.muon import MatrixPlan, Muon, orthogonalise, update_scale
from moetron.train.optim import build_optimizer
from moetron.validate import validate


def test_newton_schulz_keeps_the_singular_vectors_and_pulls_singular_values_to_one():
    torch.manual_seed(0)
    for shape in ((16, 48), (48, 16), (32, 32)):
        k = min(shape)
        u, _ = torch.linalg.qr(torch.randn(shape[0], k, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(shape[1], k, dtype=torch.float64))
        s = torch.logspace(0, -1.5, k, dtype=torch.float64)  # singular values over a factor of ~30
        update = (u * s) @ v.T
        out = orthogonalise(update.float(), steps=5).double()
        rotated = u.T @ out @ v  # diagonal iff `out` has the update's singular vectors
        off_diagonal = rotated - torch.diag(torch.diagonal(rotated))
        assert off_diagonal.abs().max() < 1e-4, shape
        singular = torch.diagonal(rotated)
        assert singular.min() > 0.6 and singular.max() < 1.25, (shape, singular)  # all pulled into a band around 1


def test_experts_are_orthogonalised_one_by_one_in_one_batch():
    stack = torch.randn(4, 8, 24, generator=torch.Generator().manual_seed(1))
    stack[2] *= 1000.0  # each expert normalised by its own norm: one large expert changes no other
    batched = orthogonalise(stack, steps=5)
    for e in range(4):
        torch.testing.assert_close(batched[e], orthogonalise(stack[e], steps=5), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(orthogonalise(stack.mT, 5), batched.mT, rtol=1e-5, atol=1e-6)  # tall = wide, turned


def test_spectral_times_0_2_gives_the_update_adamws_rms():
    """Moonlight's rule: an orthogonal m×n matrix scaled by 0.2·sqrt(max(m, n)) has RMS 0.2 whatever its shape."""
    for m, n in ((64, 256), (256, 64), (96, 96)):
        u, _, vh = torch.linalg.svd(torch.randn(m, n, dtype=torch.float64), full_matrices=False)
        polar = u @ vh
        rms = (update_scale("spectral", m, n, 0.2) * polar).pow(2).mean().sqrt()
        assert float(rms) == pytest.approx(0.2, rel=1e-9)
    assert update_scale("shape_scaling", 256, 64, 1.0) == 2.0 and update_scale("shape_scaling", 64, 256, 1.0) == 1.0
    assert update_scale("unit_rms_norm", 64, 256, 1.0) == 0.5


def test_the_registry_splits_hidden_matrices_from_the_rest():
    cfg = tiny_config(moe=True, untie_embeddings_and_output_weights=True, swiglu=True, num_shared_experts=1)
    model = create_model(cfg.model, "cpu", 0)
    registry = ParamRegistry.from_model(model)
    matrices = {n for n, info in registry.infos.items() if info.matrix}
    expected = {
        n
        for n, p in model.named_parameters()
        if p.ndim >= 2
        and not any(part in n for part in ("embeddings", "output_layer", "router", "b1_EF", "b2_ED", "coefficient"))
    }
    assert matrices == expected
    assert any(n.endswith("experts.w2_EFD") for n in matrices) and any("shared" in n for n in matrices)
    assert registry["layers.1.mlp.experts.w1_EDF"].fan_out_in((4, 32, 64)) == (64, 32)  # experts: x · w [in, out]
    assert registry["layers.0.self_attention.query_key_value.weight"].fan_out_in((96, 32)) == (96, 32)

    optimizer = build_optimizer(model, registry, tiny_config(optimizer="muon").train, torch.device("cpu"))
    assert isinstance(optimizer, Muon)
    names = {id(p): n for n, p in model.named_parameters()}
    by_group = {g["name"]: {names[id(p)] for p in g["params"]} for g in optimizer.param_groups}
    assert by_group["muon"] == matrices
    assert by_group["muon"] | by_group["decay"] | by_group["no_decay"] == set(names.values())
    assert sum(len(g) for g in by_group.values()) == len(names)  # each parameter in exactly one group
    assert {"word_embeddings.weight", "output_layer.weight", "layers.1.mlp.router.weight"} <= by_group["decay"]


def test_one_step_by_hand():
    """Nesterov momentum from zero, orthogonalised, scaled by 0.2·sqrt(max(m, n)), decoupled weight decay."""
    weight = torch.nn.Parameter(torch.randn(8, 24))
    start, grad = weight.detach().clone(), torch.randn(8, 24)
    weight.grad = grad.clone()
    registry = ParamRegistry({"w": ParamRegistry.from_model(torch.nn.Linear(24, 8)).infos["weight"]})
    group = {"params": [weight], "muon": True, "momentum": 0.9, "nesterov": True, "ns_steps": 5}
    group |= {"scale_mode": "spectral", "extra_scale_factor": 0.2, "weight_decay": 0.1}
    optimizer = Muon([group], {id(weight): MatrixPlan(registry["w"], WholeAlready())}, lr=0.05)
    optimizer.step()
    momentum = 0.1 * grad
    update = grad.lerp(momentum, 0.9)
    expected = start * (1 - 0.05 * 0.1) - 0.05 * 0.2 * 24**0.5 * orthogonalise(update, 5)
    torch.testing.assert_close(weight.detach(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(optimizer.state[weight]["momentum_buffer"], momentum)


QKV = "layers.0.self_attention.query_key_value.weight"


def qkv_step(split: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float]:
    """One Muon step of only the fused QKV weight of a GQA model (4 query heads, 2 key/value groups, head dim 8):
    (weight before, weight after, the gradient, lr, weight decay)."""
    cfg = tiny_config(optimizer="muon", num_key_value_heads=2, muon_split_qkv=split)
    model = create_model(cfg.model, "cpu", 0)
    registry = ParamRegistry.from_model(model)
    assert registry[QKV].qkv_heads == (2, 8)
    weight = dict(model.named_parameters())[QKV]
    before, grad = weight.detach().clone(), torch.randn(weight.shape, generator=torch.Generator().manual_seed(3))
    weight.grad = grad.clone()  # every other parameter has no gradient: the step leaves it alone
    optimizer = build_optimizer(model, registry, cfg.train, torch.device("cpu"))
    optimizer.step()
    group = next(g for g in optimizer.param_groups if any(p is weight for p in g["params"]))
    return before, weight.detach().clone(), grad, group["lr"], group["weight_decay"]


def test_the_fused_qkv_weight_is_orthogonalised_as_q_k_and_v_apart():
    """Split (the default): the update of the fused weight is Newton–Schulz of its Q rows (4 heads · 8), K rows and V
    rows (2 groups · 8 each) apart, each scaled by 0.2·sqrt(max(its rows, 32)). The rows are picked here from the
    layout itself (per key/value group: its 2 query heads, its key head, its value head), not by the code under test.
    `--muon-no-split-qkv` orthogonalises the 64 × 32 matrix whole."""
    before, after, grad, lr, decay = qkv_step(split=True)
    update = grad.lerp(0.05 * grad, 0.95)  # Nesterov from a zero buffer: buf = (1 − μ)·g
    head_dim, per_group = 8, 4  # rows of a group: 2 query heads, the key head, the value head
    heads = torch.arange(64).view(2, per_group, head_dim)  # [group, head in group, channel]
    rows = {"q": heads[:, :2].reshape(-1), "k": heads[:, 2].reshape(-1), "v": heads[:, 3].reshape(-1)}
    expected = torch.empty_like(update)
    for part in rows.values():
        expected[part] = orthogonalise(update[part], 5) * update_scale("spectral", len(part), 32, 0.2)
    torch.testing.assert_close(after, before * (1 - lr * decay) - lr * expected, rtol=1e-6, atol=1e-6)

    before, whole_after, grad, lr, decay = qkv_step(split=False)
    whole = orthogonalise(update, 5) * update_scale("spectral", 64, 32, 0.2)
    torch.testing.assert_close(whole_after, before * (1 - lr * decay) - lr * whole, rtol=1e-6, atol=1e-6)
    assert (whole - expected).norm() > 0.1 * whole.norm()  # the two rules really differ


def test_muon_split_qkv_is_on_by_default_and_megatron_cores_flag_turns_it_off():
    def parse(argv: list[str]) -> bool:
        parser = argparse.ArgumentParser()
        add_config_arguments(parser)
        return load_config(None, cli_overrides(parser.parse_args(argv)))[0].train.muon_split_qkv

    assert parse([]) is True and parse(["--muon-split-qkv"]) is True
    assert parse(["--muon-no-split-qkv"]) is False and parse(["--no-muon-split-qkv"]) is False


def test_muon_state_round_trips_a_checkpoint_bit_exactly(tmp_path):
    n = 4
    cfg = tiny_config(optimizer="muon", train_iters=2 * n, save=str(tmp_path), lr_warmup_iters=2)
    straight_trainer = build_trainer(cfg)
    straight = run_losses(straight_trainer, 2 * n)
    first = build_trainer(cfg)
    head = run_losses(first, n)
    first.save()
    resumed = build_trainer(cfg)
    resumed.load(tmp_path / f"iter_{n:07d}")
    saved, loaded = first.optimizer.state, resumed.optimizer.state
    names = {id(p): name for name, p in first.model.named_parameters()}
    for param, again in zip(first.model.parameters(), resumed.model.parameters(), strict=True):
        for key, value in saved[param].items():
            assert torch.equal(value, loaded[again][key]), (names[id(param)], key)
    assert any("momentum_buffer" in s for s in saved.values()) and any("exp_avg" in s for s in saved.values())
    tail = run_losses(resumed, n)
    assert head + tail == straight  # bit-identical
    for a, b in zip(straight_trainer.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_bad_muon_flags_are_reported_together():
    cfg = tiny_config(optimizer="sgd", muon_momentum=1.0, muon_num_ns_steps=0, muon_scale_mode="rms")
    cfg.train.muon_extra_scale_factor, cfg.train.muon_tp_mode = 0.0, "distributed"
    problems = "\n".join(validate(cfg, 1))
    for flag in ("--optimizer", "--muon-momentum", "--muon-num-ns-steps", "--muon-scale-mode"):
        assert flag in problems
    assert "--muon-extra-scale-factor" in problems and "--muon-tp-mode" in problems
