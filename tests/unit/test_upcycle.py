"""Upcycling: a dense model → a MoE model whose loss at step 0 equals the dense model's (within 1e-6)."""

from __future__ import annotations

import pytest
import torch
from interchange_support import tiny_checkpoint, tokens

from moetron.errors import ConfigError, UserError
from moetron.eval.generate import load_model
from moetron.interchange.upcycle import upcycle

CASES = {
    # the seeds' GPT (LayerNorm, GELU, biases) with DeepSpeed top-2 (sampled second expert), every other layer
    "gpt-top2": ("gpt2", dict(num_experts=[4], topk=2, expert_interval=2, moe_token_dropping=False)),
    # DeepSpeed top-2 at a capacity factor no batch here reaches
    "gpt-top2-capacity": ("gpt2", dict(num_experts=[4], topk=2, moe_train_capacity_factor=4.0,
                                       moe_eval_capacity_factor=4.0)),
    # PR-MoE: residual MLP + coefficient, top-1 renormalised (weight 1)
    "gpt-residual-top1": ("gpt2", dict(num_experts=[4], topk=1, mlp_type="residual", moe_router_topk_renorm=True,
                                       moe_token_dropping=False)),
    # Llama → Mixtral-style (SwiGLU, no biases), every layer
    "llama-mixtral": ("llama", dict(num_experts=[8], topk=2, expert_interval=1, moe_token_dropping=False,
                                    moe_top2_2nd_expert_sampling=False)),
    # DeepSeek-style: sigmoid scores, scaling factor 2.5, one gated shared expert
    "llama-deepseek": ("llama", dict(num_experts=[8], topk=2, expert_interval=1, moe_token_dropping=False,
                                     moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5,
                                     num_shared_experts=1, shared_expert_gate=True)),
}  # fmt: skip


def step0_loss(model, x: torch.Tensor, training: bool) -> float:
    model.train(training)
    torch.manual_seed(0)
    with torch.no_grad():
        return float(model(x[:, :-1], labels_BT=x[:, 1:]).lm_loss)


@pytest.mark.parametrize("case", list(CASES))
def test_upcycled_loss_equals_dense_at_step_0(tmp_path, case):
    arch, overrides = CASES[case]
    run, _, dense = tiny_checkpoint(tmp_path, arch, init_method_std=0.2)
    result = upcycle(str(tmp_path / "moe"), overrides, load=str(run))
    moe, cfg, _ = load_model(str(tmp_path / "moe"), "cpu")
    assert result.moe_layers == cfg.model.moe_layer_indices() and result.moe_layers
    x = tokens(4, 16)
    for training in (False, True):  # eval and the first training step's forward (dropout is 0 in these configs)
        assert abs(step0_loss(moe, x, training) - step0_loss(dense, x, training)) < 1e-6
    routed = torch.cat([a.routing.expert_ids_TK.flatten() for a in moe(x).moe_aux])
    assert routed.unique().numel() > 1  # the fresh router spreads tokens: the copies will diverge in training


def test_upcycling_refuses_what_would_change_the_output(tmp_path):
    run, _, _ = tiny_checkpoint(tmp_path, "gpt2")
    with pytest.raises(ConfigError) as err:
        upcycle(str(tmp_path / "moe"), {"num_experts": [4], "topk": 1, "moe_ffn_hidden_size": 16}, load=str(run))
    text = str(err.value)
    assert "raw router probability" in text and "--moe-ffn-hidden-size 16" in text
    moe_run, _, _ = tiny_checkpoint(tmp_path, "mixtral")
    with pytest.raises(ConfigError, match="already has MoE layers"):
        upcycle(str(tmp_path / "moe2"), {"num_experts": [8]}, load=str(moe_run))
    with pytest.raises(UserError, match="one of them"):
        upcycle(str(tmp_path / "moe3"), {"num_experts": [4]})


def test_upcycle_from_a_hugging_face_llama(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    overrides = dict(num_experts=[4], topk=2, expert_interval=1, moe_token_dropping=False)
    upcycle(str(tmp_path / "moe"), overrides, hf=str(tmp_path / "hf"))
    moe, _, _ = load_model(str(tmp_path / "moe"), "cpu")
    x = tokens(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(moe(x).logits[..., :300], hf(x).logits, atol=1e-5, rtol=0)
