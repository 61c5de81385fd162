"""Router behaviour on small hand-built cases: capacity, dropping, weights, losses and the modern options.

Most tests give the router an identity gate (hidden size = E, weight = I), so the input rows ARE the logits.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moetron.errors import ConfigError, UserError
from moetron.model.config import ModelConfig
from moetron.model.moe.routing.deepspeed_gating import capacity_from_factor
from moetron.model.moe.routing.router import Router


def identity_router(num_experts: int, **cfg_fields) -> Router:
    """A router whose logits equal its input (D = E, gate weight = identity)."""
    fields = dict(moe_min_capacity=0, moe_top2_2nd_expert_sampling=False) | cfg_fields
    cfg = ModelConfig(hidden_size=num_experts, num_experts=[num_experts], **fields)
    router = Router(cfg, num_experts)
    with torch.no_grad():
        router.weight.copy_(torch.eye(num_experts))
    return router


def cyclic_logits(num_tokens: int, num_experts: int) -> torch.Tensor:
    """Token t prefers t % E (5), then t+1 (3), then t+2 (1): every expert is equally loaded and likely."""
    logits = torch.zeros(num_tokens, num_experts)
    t = torch.arange(num_tokens)
    for offset, value in enumerate([5.0, 3.0, 1.0]):
        logits[t, (t + offset) % num_experts] = value
    return logits


# ---------------------------------------------------------------- capacity
@pytest.mark.parametrize(
    "tokens, experts, factor, k, min_capacity, expected",
    [
        (64, 4, 1.0, 1, 4, 16),  # ceil(64/4 · 1)
        (64, 4, 1.25, 2, 4, 40),  # ceil(16 · 2.5)
        (8, 4, 1.0, 1, 4, 4),  # 2, floored at min_capacity
        (3, 8, 1.0, 1, 4, 4),  # S < E: ceil(0.375) = 1, floored
        (3, 8, 1.0, 2, 0, 1),  # S < E, no floor: ceil(0.75)
        (35, 3, 1.2, 1, 0, 15),  # float32 arithmetic as DeepSpeed: float64 would give 14
    ],
)
def test_capacity_formula(tokens, experts, factor, k, min_capacity, expected):
    assert capacity_from_factor(tokens, experts, factor, k, min_capacity) == expected


def test_top1_with_fewer_tokens_than_min_capacity_is_a_clear_error():
    router = identity_router(4, topk=1, moe_min_capacity=4)
    with pytest.raises(ValueError, match="--moe-min-capacity is 4") as info:
        router(torch.randn(3, 4))
    assert isinstance(info.value, UserError)  # the CLI prints it as one line, no traceback


def test_eval_uses_eval_capacity_factor():
    router = identity_router(4, topk=1, moe_train_capacity_factor=1.0, moe_eval_capacity_factor=2.0)
    x = torch.randn(64, 4)
    assert router.train()(x).capacity == 16
    assert router.eval()(x).capacity == 32


@pytest.mark.parametrize("topk", [1, 2, 3])
def test_dropless_capacity_is_the_max_load_and_nothing_drops(topk):
    router = identity_router(4, topk=topk, moe_token_dropping=False)
    logits = torch.randn(30, 4)
    logits[:20, 0] += 10  # expert 0 takes far more than its fair share
    routing = router(logits)
    assert routing.capacity == int(routing.tokens_per_expert_E.max()) >= 20
    assert routing.kept_TK.all()
    assert int(routing.slots_TK.max()) == routing.capacity - 1


# ---------------------------------------------------------------- dropping
def test_rts_keeps_exactly_capacity_random_tokens_per_overfull_expert():
    router = identity_router(4, topk=1)  # cf 1 → C = 32/4 = 8
    logits = torch.zeros(32, 4)
    logits[:20, 0] = logits[20:26, 1] = logits[26:, 2] = 5.0
    kept_sets = []
    for seed in range(2):
        torch.manual_seed(seed)
        routing = router(logits)
        assert routing.capacity == 8
        assert routing.kept_tokens_per_expert().tolist() == [8, 6, 6, 0]
        kept_e0 = routing.kept_TK[:20, 0].nonzero()[:, 0]
        assert torch.equal(routing.slots_TK[kept_e0, 0], torch.arange(8))  # slots follow token order
        assert (routing.weights_TK[~routing.kept_TK] == 0).all()
        kept_sets.append(kept_e0.tolist())
    assert kept_sets[0] != kept_sets[1], "random token selection should depend on the seed"


@pytest.mark.parametrize("factor, second_kept", [(1.0, False), (2.0, True)])
def test_top2_queues_first_choices_first_and_renormalises_after_dropping(factor, second_kept):
    router = identity_router(4, topk=2, moe_train_capacity_factor=factor)  # C = ceil(8/4 · 2 · cf)
    logits = torch.zeros(8, 4)
    logits[:4, 0], logits[:4, 1] = 4.0, 2.0  # tokens 0-3: first e0, second e1
    logits[4:, 1], logits[4:, 2] = 4.0, 2.0  # tokens 4-7: first e1, second e2
    routing = router(logits)
    assert routing.capacity == 4 * factor
    assert routing.expert_ids_TK.tolist() == [[0, 1]] * 4 + [[1, 2]] * 4
    assert routing.tokens_per_expert_E.tolist() == [4, 8, 4, 0]
    # e1's four first choices (tokens 4-7) take slots 0-3 although tokens 0-3 come earlier in the batch.
    assert routing.slots_TK[4:, 0].tolist() == [0, 1, 2, 3]
    assert routing.slots_TK[:4, 1].tolist() == ([4, 5, 6, 7] if second_kept else [-1] * 4)
    assert routing.kept_TK[:4, 1].tolist() == [second_kept] * 4
    p = torch.softmax(logits[0], 0)
    expected_first = p[0] / (p[0] + p[1]) if second_kept else torch.tensor(1.0)
    torch.testing.assert_close(routing.weights_TK[:4, 0], expected_first.expand(4))
    torch.testing.assert_close(routing.weights_TK[:, :].sum(1), torch.ones(8))


@pytest.mark.parametrize("use_rts, kept_tokens", [(True, [6, 7]), (False, [0, 1])])
def test_generic_path_drops_by_score_or_by_position(use_rts, kept_tokens):
    router = identity_router(4, topk=1, moe_router_score_function="sigmoid", moe_use_rts=use_rts)
    logits = torch.zeros(8, 4)
    logits[:, 0] = torch.arange(8.0) + 1  # all to e0, later tokens score higher; C = 2
    routing = router(logits)
    assert routing.capacity == 2
    assert routing.kept_TK[:, 0].nonzero()[:, 0].tolist() == kept_tokens


# ---------------------------------------------------------------- losses
@pytest.mark.parametrize(
    "fields",
    [
        dict(topk=1),
        dict(topk=2),
        dict(topk=3),
        dict(topk=2, moe_router_score_function="sigmoid"),
        dict(topk=2, moe_aux_loss_type="seq"),
    ],
    ids=["top1", "top2", "top3", "sigmoid", "seq"],
)
def test_aux_loss_is_one_under_perfectly_uniform_routing(fields):
    router = identity_router(4, **fields)
    routing = router(cyclic_logits(16, 4), seq_len=4)
    torch.testing.assert_close(routing.aux_loss, torch.tensor(1.0))


def test_sequence_aux_loss_by_hand():
    router = identity_router(2, topk=1, moe_aux_loss_type="seq")
    logits = torch.tensor([[2.0, 0.0], [2.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    routing = router(logits, seq_len=2)
    a = math.exp(2) / (math.exp(2) + 1)
    seq_a = 2 * a  # both tokens on e0: E · mean-prob(e0) · 1
    seq_b = 1.0  # one token each, mean probabilities (0.5, 0.5)
    torch.testing.assert_close(routing.aux_loss, torch.tensor((seq_a + seq_b) / 2))
    with pytest.raises(ValueError, match="whole number of 3-token sequences"):
        router(logits, seq_len=3)


def test_aux_loss_none_is_zero():
    routing = identity_router(4, topk=1, moe_aux_loss_type="none")(torch.randn(8, 4))
    assert routing.aux_loss.item() == 0.0


def test_z_loss_value_and_gradient_only_when_trained_on():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [math.log(3), 0.0, 0.0, 0.0]])
    expected = (math.log(4) ** 2 + math.log(6) ** 2) / 2
    routing = identity_router(4, topk=1, moe_z_loss_coeff=1e-3)(logits)
    torch.testing.assert_close(routing.z_loss, torch.tensor(expected))
    assert routing.z_loss.requires_grad
    assert not identity_router(4, topk=1)(logits).z_loss.requires_grad


# ---------------------------------------------------------------- modern options
def test_sigmoid_scores_raw_for_top1_renormalised_for_top2_and_scaled():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    s = torch.sigmoid(logits[0])
    top1 = identity_router(4, topk=1, moe_router_score_function="sigmoid")(logits)
    torch.testing.assert_close(top1.weights_TK, s[[0]].view(1, 1))
    top2 = identity_router(4, topk=2, moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5)(logits)
    assert top2.expert_ids_TK.tolist() == [[0, 2]]
    torch.testing.assert_close(top2.weights_TK, 2.5 * torch.stack([s[0], s[2]]).view(1, 2) / (s[0] + s[2]))
    raw = identity_router(4, topk=2, moe_router_score_function="sigmoid", moe_router_topk_renorm=False)(logits)
    torch.testing.assert_close(raw.weights_TK, torch.stack([s[0], s[2]]).view(1, 2))


def test_pre_softmax_weights_are_a_softmax_over_the_chosen_logits():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    routing = identity_router(4, topk=2, moe_router_pre_softmax=True, moe_router_topk_renorm=False)(logits)
    assert routing.expert_ids_TK.tolist() == [[0, 2]]
    torch.testing.assert_close(routing.weights_TK, torch.softmax(torch.tensor([[3.0, 2.0]]), -1))
    post = identity_router(4, topk=2, moe_router_topk_renorm=False)(logits)  # softmax over all, no renorm
    torch.testing.assert_close(post.weights_TK, torch.softmax(logits, -1)[:, [0, 2]])


def test_group_limited_routing_picks_only_from_the_best_groups():
    fields = dict(topk=2, moe_router_score_function="sigmoid", num_expert_groups=4, topk_groups=2)
    router = identity_router(8, **fields)
    # Group 0 holds the single best expert, but groups 1 and 2 have the best top-2 sums.
    logits = torch.tensor([[10.0, -5.0, 4.0, 4.0, 3.0, 3.0, 0.0, 0.0]])
    assert router(logits).expert_ids_TK.tolist() == [[2, 3]]
    ungrouped = identity_router(8, topk=2, moe_router_score_function="sigmoid")(logits)
    assert ungrouped.expert_ids_TK[0, 0].item() == 0
    random_logits = torch.randn(64, 8) * 3
    groups_TG = torch.sigmoid(random_logits).view(64, 4, 2).sum(-1)  # group of 2: top-2 sum = the sum
    allowed_TG = torch.zeros(64, 4, dtype=torch.bool).scatter_(1, groups_TG.topk(2, -1).indices, True)
    chosen_groups_TK = router(random_logits).expert_ids_TK // 2
    assert allowed_TG.gather(1, chosen_groups_TK).all()


def test_expert_bias_update_rule_and_selection_only_effect():
    fields = dict(moe_router_score_function="sigmoid", moe_router_bias_update_rate=0.1, moe_token_dropping=False)
    router = identity_router(4, topk=1, **fields)
    logits = torch.tensor([[2.0, 1.9, -3.0, -3.0]] * 5 + [[-3.0, 2.0, -3.0, -3.0], [-3.0, -3.0, 2.0, -3.0]])
    logits = torch.cat([logits, torch.tensor([[-3.0, -3.0, -3.0, 2.0]])])
    before = router(logits)
    assert before.tokens_per_expert_E.tolist() == [5, 1, 1, 1]
    assert router.load_since_update_E.tolist() == [5.0, 1.0, 1.0, 1.0]
    router.update_expert_bias()  # mean load 2: over-loaded e0 goes down, the others go up
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.1, 0.1, 0.1, 0.1]))
    assert router.load_since_update_E.tolist() == [0.0] * 4
    after = router(logits)
    assert after.expert_ids_TK[:5, 0].tolist() == [1] * 5  # 1.9 + 0.1 now beats 2.0 − 0.1
    torch.testing.assert_close(after.weights_TK[:5, 0], torch.sigmoid(torch.tensor(1.9)).expand(5))  # unbiased
    torch.testing.assert_close(after.weights_TK[5:], before.weights_TK[5:])


def test_no_bias_update_or_load_accumulation_by_default_or_in_eval():
    router = identity_router(4, topk=1)
    router(torch.randn(8, 4))
    router.update_expert_bias()
    assert router.expert_bias.abs().sum() == 0 and router.load_since_update_E.abs().sum() == 0
    biased = identity_router(4, topk=1, moe_router_bias_update_rate=0.1).eval()
    biased(torch.randn(8, 4))
    assert biased.load_since_update_E.abs().sum() == 0


def test_conflicting_router_options_are_reported_together():
    cfg = ModelConfig(hidden_size=8, topk=5, moe_router_pre_softmax=True, moe_router_score_function="sigmoid")
    with pytest.raises(ConfigError) as info:
        Router(cfg, 4)
    assert len(info.value.problems) == 2
    assert "--topk 5" in str(info.value) and "--moe-router-pre-softmax" in str(info.value)


# ---------------------------------------------------------------- gate: dtype, gradients, init, stats
@pytest.mark.parametrize(
    "fields",
    [dict(topk=1), dict(topk=2), dict(topk=3), dict(topk=2, moe_router_score_function="sigmoid")],
    ids=["top1", "top2", "top3", "sigmoid"],
)
def test_gradients_reach_the_gate_through_weights_and_aux_loss(fields):
    torch.manual_seed(0)
    router = Router(ModelConfig(hidden_size=8, num_experts=[4], moe_min_capacity=0, **fields), 4)
    x = torch.randn(16, 8)
    routing = router(x)
    (routing.weights_TK * torch.randn_like(routing.weights_TK)).sum().backward()
    assert router.weight.grad.abs().sum() > 0
    router.weight.grad = None
    router(x).aux_loss.backward()
    assert router.weight.grad.abs().sum() > 0


def test_low_precision_input_routes_in_fp32():
    torch.manual_seed(0)
    router = Router(ModelConfig(hidden_size=8, num_experts=[4], topk=2), 4)
    x = torch.randn(16, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = router(x)
    assert routing.weights_TK.dtype == routing.aux_loss.dtype == routing.z_loss.dtype == torch.float32
    assert routing.expert_ids_TK.dtype == routing.tokens_per_expert_E.dtype == torch.int64
    torch.manual_seed(1)
    reference = router(x.float())
    torch.manual_seed(1)
    torch.testing.assert_close(router(x).weights_TK, reference.weights_TK, rtol=0, atol=0)


def test_gate_init_matches_nn_linear():
    torch.manual_seed(7)
    linear = nn.Linear(8, 4, bias=False)
    torch.manual_seed(7)
    router = Router(ModelConfig(hidden_size=8, num_experts=[4]), 4)
    assert torch.equal(router.weight, linear.weight)
    assert router.weight.dtype == torch.float32 and router.expert_bias.shape == (4,)
    assert "expert_bias" in router.state_dict() and "load_since_update_E" not in router.state_dict()


def test_stats():
    router = identity_router(4, topk=1)  # C = 8/4 = 2
    logits = torch.zeros(8, 4)
    logits[:5, 0] = logits[5:, 1] = 1e-3  # near-uniform probabilities, loads (5, 3, 0, 0)
    stats = router(logits).stats()
    assert stats["tokens_per_expert"].tolist() == [5, 3, 0, 0]
    torch.testing.assert_close(stats["dropped_fraction"], torch.tensor(4 / 8))
    torch.testing.assert_close(stats["load_max_over_mean"], torch.tensor(5 / 2))
    torch.testing.assert_close(stats["entropy"], torch.tensor(math.log(4)), atol=1e-5, rtol=0)
