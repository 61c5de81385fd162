"""Layout-free initialisation: same seed → same weights on any device and model shape; Megatron's stds."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moetron.model import GPTModel, ModelConfig, create_model
from moetron.model.init import TensorSlice, init_tree, normal_, seeded_draw, seeded_generator, stable_seed


def cfg(**overrides) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, seq_length=16)
    base.update(overrides)
    return ModelConfig(**base)


MOE = dict(num_layers=4, num_experts=[4], topk=2, mlp_type="residual", num_shared_experts=1, swiglu=True)


@pytest.mark.parametrize("options", [{}, MOE], ids=["dense", "moe"])
def test_meta_build_and_cpu_build_give_identical_weights(options):
    on_meta = create_model(cfg(**options), "cpu", seed=42)
    on_cpu = GPTModel(cfg(**options))
    on_cpu.init_weights(42)
    for (name, a), (_, b) in zip(on_meta.state_dict().items(), on_cpu.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    other_seed = create_model(cfg(**options), "cpu", seed=43)
    assert not torch.equal(
        other_seed.layers["0"].mlp.dense_h_to_4h.weight, on_meta.layers["0"].mlp.dense_h_to_4h.weight
    )


def test_each_parameter_has_its_own_stream():
    """An extra layer (or a layer owned by another pipeline stage) does not shift anyone's weights."""
    two = create_model(cfg(num_layers=2), "cpu", seed=7)
    three = create_model(cfg(num_layers=3), "cpu", seed=7)
    assert torch.equal(two.word_embeddings.weight, three.word_embeddings.weight)
    for name in ("self_attention.query_key_value.weight", "mlp.dense_h_to_4h.weight"):
        assert torch.equal(two.layers["1"].get_parameter(name), three.layers["1"].get_parameter(name))
    # same shape, different names → different draws
    assert not torch.equal(two.layers["0"].mlp.dense_h_to_4h.weight, two.layers["1"].mlp.dense_h_to_4h.weight)


def test_moe_layers_keep_their_weights_when_layers_are_added():
    two = create_model(cfg(**dict(MOE, num_layers=2)), "cpu", seed=7)
    four = create_model(cfg(**MOE), "cpu", seed=7)
    # (output projections legitimately differ: their std is std / sqrt(2 · num_layers))
    for name in ("router.weight", "experts.w1_EDF", "experts.w3_EDF", "mlp.w1_EDF", "shared_experts.w1_EDF"):
        assert torch.equal(two.layers["1"].mlp.get_parameter(name), four.layers["1"].mlp.get_parameter(name)), name


def test_moe_expert_output_projections_are_scaled():
    c = cfg(num_layers=8, hidden_size=128, num_experts=[4], init_method_std=0.02)
    experts = create_model(c, "cpu", seed=0).moe_layers()[0].experts
    assert experts.w1_EDF.std().item() == pytest.approx(0.02, rel=0.05)
    assert experts.w2_EFD.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


def test_megatron_standard_deviations():
    c = cfg(num_layers=8, hidden_size=128, init_method_std=0.02)
    model = create_model(c, "cpu", seed=0)
    out_std = 0.02 / math.sqrt(2 * 8)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert p.abs().max() == 0, name
        elif "layernorm" in name:
            assert torch.all(p == 1), name
        elif name.endswith(("self_attention.dense.weight", "dense_4h_to_h.weight")):
            assert p.std().item() == pytest.approx(out_std, rel=0.05), name
        else:
            assert p.std().item() == pytest.approx(0.02, rel=0.05), name
            assert p.mean().abs().item() < 0.002, name


def test_stable_seed_is_deterministic_and_name_sensitive():
    assert stable_seed(1, "a.weight") == stable_seed(1, "a.weight")
    assert len({stable_seed(1, "a.weight"), stable_seed(2, "a.weight"), stable_seed(1, "b.weight")}) == 3
    x, y = torch.empty(4, 4), torch.empty(4, 4, dtype=torch.bfloat16)
    normal_(x, 1.0, seed=3, name="w")
    normal_(y, 1.0, seed=3, name="w")
    torch.testing.assert_close(y.float(), x.to(torch.bfloat16).float())  # same draw, any dtype


def test_submodules_with_their_own_init_get_a_name_derived_seed():
    calls = []

    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(2, 2)

        def init_weights(self, std, out_std, seed):
            calls.append((std, out_std, seed))

    root = nn.Module()
    root.block = Custom()
    root.head = nn.Linear(2, 2)
    init_tree(root, seed=5, std=0.1, out_std=0.01)
    assert calls == [(0.1, 0.01, stable_seed(5, "block"))]


def test_unknown_parameter_types_are_refused():
    root = nn.Module()
    root.scale = nn.Parameter(torch.ones(3))
    with pytest.raises(TypeError, match="no initialisation rule for parameter scale"):
        init_tree(root, seed=0, std=0.02, out_std=0.01)


def test_seeded_draw_of_a_part_is_that_part_of_the_whole_draw():
    whole = seeded_draw((6, 4), seeded_generator(3, "w"), std=0.5)
    part = TensorSlice((6, 4), (slice(2, 4), slice(None)))
    torch.testing.assert_close(seeded_draw((2, 4), seeded_generator(3, "w"), std=0.5, part=part), whole[2:4])
    uniform = seeded_draw((1000,), seeded_generator(3, "u"), low=0.1)
    assert uniform.abs().max() <= 0.1 and uniform.std() < 0.1  # uniform(-0.1, 0.1), not N(0, ·)
    param = torch.empty(2, 4, dtype=torch.float64)  # the copying path of normal_ gives the same values
    normal_(param, 0.5, 3, "w", part)
    torch.testing.assert_close(param, whole[2:4].double())
