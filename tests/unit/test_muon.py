"""Muon (`--optimizer muon`): the Newton–Schulz orthogonalisation, the scale rule, the registry's parameter split,
one step by hand, and a checkpoint round trip that resumes bit for bit."""

import pytest
import torch
from trainer_support import build_trainer, run_losses, tiny_config

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
