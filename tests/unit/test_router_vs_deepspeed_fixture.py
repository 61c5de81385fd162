"""The router against outputs recorded from DeepSpeed 0.19.8's real `TopKGate` (runs in CI, without deepspeed).

`tests/fixtures/deepspeed_gating.safetensors` holds 60 cases recorded by `tests/fixtures/record_deepspeed_gating.py`
(top-1 with/without RTS, RSample, Jitter, top-2 with/without 2nd-expert sampling, top-k, dropless, capacity
factors, min capacity; train and eval): inputs, gate weights and DeepSpeed's capacity, kept routes (token,
expert, slot), combine weights, aux loss and exp_counts. The router must make the same routing decisions
exactly; weights and aux loss are compared to within float32 rounding (the recording machine's CPU kernels may
differ from this one's in the last bit). Random modes draw from `torch.manual_seed(case seed)` as DeepSpeed did.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moetron.model.config import ModelConfig
from moetron.model.moe.routing.router import Router  # the one import of the routing code (its modules may be renamed)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed_gating.safetensors"
RANDOM_MODES = ("rts", "rsample", "jitter", "sampling")


def _load():
    from safetensors import safe_open

    with safe_open(str(FIXTURE), framework="pt") as f:
        meta = f.metadata()
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    return meta, json.loads(meta["cases"]), tensors


META, CASES, TENSORS = _load()


def _is_random(case: dict) -> bool:
    uses_rts = case["k"] == 1 and case["use_rts"] and case["drop_tokens"]
    uses_sampling = case["k"] == 2 and case["top2_2nd_expert_sampling"]
    noisy = case["noisy_gate_policy"] is not None and case["training"]
    return uses_rts or uses_sampling or noisy


def _same_torch() -> bool:
    return META["torch"].split("+")[0].split(".")[:2] == torch.__version__.split("+")[0].split(".")[:2]


def router_for(case: dict) -> Router:
    cfg = ModelConfig(
        hidden_size=int(META["hidden"]),
        num_experts=[case["experts"]],
        topk=case["k"],
        moe_train_capacity_factor=case["capacity_factor"],
        moe_eval_capacity_factor=case["eval_capacity_factor"],
        moe_min_capacity=case["min_capacity"],
        moe_noisy_gate_policy=case["noisy_gate_policy"],
        moe_token_dropping=case["drop_tokens"],
        moe_use_rts=case["use_rts"],
        moe_top2_2nd_expert_sampling=case["top2_2nd_expert_sampling"],
    )
    return Router(cfg, case["experts"]).train(case["training"])


def kept_routes(routing) -> tuple[torch.Tensor, torch.Tensor]:
    """([R, 3] (token, expert, slot) sorted like DeepSpeed's [S, E, C] nonzero(); [R] weights)."""
    tokens, ks = routing.kept_TK.nonzero(as_tuple=True)
    routes = torch.stack([tokens, routing.expert_ids_TK[tokens, ks], routing.slots_TK[tokens, ks]], dim=1)
    weights = routing.weights_TK.detach()[tokens, ks].float()
    order = torch.tensor(sorted(range(len(routes)), key=lambda r: routes[r].tolist()), dtype=torch.long)
    return routes[order].to(torch.int32), weights[order] if len(order) else weights


def test_fixture_was_recorded_from_the_real_deepspeed():
    assert META["deepspeed"] == "0.19.8" and len(CASES) >= 50
    names = {case["name"] for case in CASES}
    assert {"top1-rts", "top1-no-rts", "top1-rsample", "top2-sampling", "top4-dropless"} <= names
    assert FIXTURE.stat().st_size < 512 * 1024


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{i}-{c['name']}" for i, c in enumerate(CASES)])
def test_router_equals_recorded_deepspeed(index):
    case = CASES[index]
    if _is_random(case) and not _same_torch():
        pytest.skip(f"random routing draws were recorded with torch {META['torch']}; this is {torch.__version__}")
    router = router_for(case)
    with torch.no_grad():
        router.weight.copy_(TENSORS[f"{index}.weight"])
    torch.manual_seed(case["seed"])
    routing = router(TENSORS[f"{index}.x"])
    assert routing.capacity == int(TENSORS[f"{index}.capacity"])
    assert torch.equal(routing.tokens_per_expert_E.to(torch.int64), TENSORS[f"{index}.exp_counts"])
    routes, weights = kept_routes(routing)
    assert torch.equal(routes, TENSORS[f"{index}.routes"])
    torch.testing.assert_close(weights, TENSORS[f"{index}.route_weights"], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(routing.aux_loss.reshape(1).float(), TENSORS[f"{index}.aux_loss"], rtol=2e-6, atol=0)
