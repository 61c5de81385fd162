"""`moetron plan` prices each --optimizer's state: AdamW 8 B per parameter; Muon 4 B per hidden-matrix parameter
(one momentum buffer) and AdamW's 8 B for the rest. The rest is counted from the config
(`parallel/terms/optimizer_state.py`); these tests hold the count to a real model's parameter registry and the
plan to a real optimizer's state."""

from __future__ import annotations

import json

import pytest
from trainer_support import build_trainer, tiny_config

from moetron.cli import main
from moetron.config_cli import load_config
from moetron.model.config import ModelConfig
from moetron.model.gpt import create_model
from moetron.parallel.params import ParamRegistry
from moetron.parallel.terms.optimizer_state import model_adamw
from moetron.plan.memory import estimate_memory
from moetron.plan.stages import stage_parameters

TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=97)
TINY_MLA = dict(multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
MODELS = [
    {},  # GPT-2: biases, LayerNorm, learned positions
    {"num_experts": [4], "expert_interval": 1, "topk": 2},
    {"num_experts": [4], "expert_interval": 2, "add_bias_linear": False, "swiglu": True, "normalization": "rmsnorm"},
    {"num_experts": [4], "num_shared_experts": 1, "shared_expert_gate": True},
    {"untie_embeddings_and_output_weights": True, "position_embedding_type": "rope"},
    {"num_experts": [4], "mlp_type": "residual", "position_embedding_type": "rope"},
    {"add_bias_linear": False, "add_qkv_bias": True, "qk_layernorm": True, "qk_layernorm_scope": "all_heads"},
    {"mtp_num_layers": 1, "position_embedding_type": "rope"},
    {**TINY_MLA, "position_embedding_type": "rope", "q_lora_rank": 8},
    {**TINY_MLA, "position_embedding_type": "rope", "add_bias_linear": False},
]


@pytest.mark.parametrize("overrides", MODELS)
def test_the_parameters_muon_leaves_to_adamw_are_the_registrys(overrides):
    cfg = ModelConfig(**{**TINY, **overrides})
    model = create_model(cfg)
    registry = ParamRegistry.from_model(model)
    rest = [(n, p.numel()) for n, p in model.named_parameters() if not registry[n].matrix]
    experts = sum(size for n, size in rest if registry[n].kind == "expert")
    assert model_adamw(cfg, ep=1) == (sum(size for _, size in rest), experts)
    assert model_adamw(cfg, ep=2)[1] * 2 == experts  # expert parallelism halves the experts' biases per rank


@pytest.mark.parametrize("optimizer", ["adam", "muon"])
def test_the_planned_state_is_what_the_optimizer_keeps_after_a_step(optimizer):
    cfg = tiny_config(optimizer=optimizer, num_experts=[4], expert_interval=1, untie_embeddings_and_output_weights=True)
    trainer = build_trainer(cfg)
    trainer.train_step()
    kept = sum(
        value.nbytes
        for state in trainer.optimizer.state.values()
        for key, value in state.items()
        if key != "step"  # one scalar per parameter, not a term of the plan
    )
    assert estimate_memory(cfg, cfg.dims(1)).optimizer == kept


def test_plan_shows_muons_state_and_shards_it_like_adams(capsys):
    def plan(*flags: str) -> tuple[dict, str]:  # the recipe's own layout: 64 GPUs, expert parallel 64
        assert main(["plan", "--config", "gpt-1.3B-moe128", "--gpus", "64", "--json", *flags]) == 0
        data = json.loads(capsys.readouterr().out)
        assert main(["plan", "--config", "gpt-1.3B-moe128", "--gpus", "64", *flags]) == 0
        return data["memory"], capsys.readouterr().out

    adam, adam_text = plan()
    muon, muon_text = plan("--optimizer", "muon")
    assert "Adam moments exp_avg + exp_avg_sq (fp32)" in adam_text and "Muon momentum" not in adam_text
    assert "Muon momentum + Adam moments of the rest (fp32)" in muon_text
    # the matrices' one buffer instead of Adam's two; the embeddings, norms, biases and routers keep two
    cfg, _ = load_config("gpt-1.3B-moe128", {})
    adamw, _ = model_adamw(cfg.model, ep=64)
    assert muon["optimizer"] == adam["optimizer"] // 2 + 4 * adamw
    assert muon["peak"] == adam["peak"] - (adam["optimizer"] - muon["optimizer"])
    assert muon["weights"] == adam["weights"] and muon["gradients"] == adam["gradients"]
    # ZeRO-1 shards both alike: the dense state over the 64 data-parallel ranks (the experts' edp is 1)
    sharded_adam, _ = plan("--zero-stage", "1")
    sharded_muon, sharded_text = plan("--zero-stage", "1", "--optimizer", "muon")
    assert "Muon momentum + Adam moments of the rest (fp32, sharded)" in sharded_text
    assert sharded_muon["optimizer"] < muon["optimizer"] / 2 and sharded_muon["optimizer"] < sharded_adam["optimizer"]
    assert sharded_adam["optimizer"] - sharded_muon["optimizer"] < adam["optimizer"] - muon["optimizer"]


@pytest.mark.parametrize("untied", [True, False])
def test_pipeline_stages_split_adamws_parameters(untied):
    cfg = ModelConfig(**TINY, num_experts=[4], untie_embeddings_and_output_weights=untied)
    first = stage_parameters(cfg, (0,), first=True, last=False, ep=2)
    last = stage_parameters(cfg, (1,), first=False, last=True, ep=2)
    whole = model_adamw(cfg, ep=2)
    tied_copy = 0 if untied else cfg.padded_vocab_size() * cfg.hidden_size  # the last stage's copy of the embedding
    assert (first.adamw + last.adamw, first.adamw_experts + last.adamw_experts) == (whole[0] + tied_copy, whole[1])
    assert first.adamw > last.adamw - tied_copy  # the embedding (and positions) sit on the first stage
