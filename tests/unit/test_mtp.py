"""Multi-token prediction (`--mtp-num-layers`): the modules' loss against a hand-written DeepSeek-V3 chain, its
place in training (the LM curve is untouched at scaling factor 0 and changed above it; `mtp_loss` in
metrics.jsonl), generation that ignores the modules, and the layouts refused before launch."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from trainer_support import build_trainer, random_samples, run_losses, tiny_config

from moetron.eval.generate import GenerationOptions, generate_batch
from moetron.model.config import ModelConfig
from moetron.model.gpt import create_model
from moetron.validate import validate

VOCAB, SEQ = 96, 16


def mtp_model(depths: int = 2, **overrides):
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=SEQ,
                      make_vocab_size_divisible_by=32, num_experts=[4], topk=2, moe_token_dropping=False,
                      moe_top2_2nd_expert_sampling=False, hidden_dropout=0.0, attention_dropout=0.0,
                      position_embedding_type="rope", normalization="rmsnorm", swiglu=True, mtp_num_layers=depths,
                      **overrides)  # fmt: skip
    return create_model(cfg, seed=3).eval()


def chain_by_hand(model, tokens_BT: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's sequential MTP on truncated sequences: depth k keeps positions 0 … T−k−1 (causal attention, so
    the rolled-in tail of the model's version cannot reach them), sees t_{i+k} and predicts t_{i+k+1}. Every depth
    reads a normed state, as Megatron-Core's and transformers' MTP do: depth 1 the model's final norm's output (what
    its head reads), depth k + 1 depth k's final norm's output (what the head reads for depth k)."""
    hidden = model.final_layernorm(model(tokens_BT, return_logits=False).hidden)
    T, losses = tokens_BT.shape[1], []
    for k, module in enumerate(model.mtp.layers.values(), start=1):
        keep = T - k
        hidden = hidden[:, :keep]
        embedded = module.enorm(model.word_embeddings(tokens_BT[:, k:]))
        x = module.eh_proj(torch.cat([embedded, module.hnorm(hidden)], dim=-1))
        rope = model.rope_angles(torch.arange(keep))
        x, _ = module.transformer_layer(x, rope)
        hidden = module.final_layernorm(x)
        logits = F.linear(hidden, model.head_weight()).float()
        losses.append(F.cross_entropy(logits.flatten(0, 1), labels_BT[:, k:].flatten()))
    return torch.stack(losses).mean()


@pytest.mark.parametrize("fused", [True, False])
def test_mtp_loss_is_deepseek_v3s_sequential_chain(fused):
    model = mtp_model(depths=2)
    with torch.no_grad():  # final norms far from 1, as training leaves them: reading before or after them differs
        for norm in [model.final_layernorm] + [m.final_layernorm for m in model.mtp.layers.values()]:
            norm.weight.uniform_(0.2, 3.0, generator=torch.Generator().manual_seed(11))
    batch = random_samples(3, seed=5)
    tokens, labels = batch[:, :-1], batch[:, 1:]
    with torch.no_grad():
        got = model(tokens, return_logits=not fused, mtp_labels_BT=labels).mtp_loss
        want = chain_by_hand(model, tokens, labels)
        assert model(tokens, labels_BT=labels).mtp_loss is None  # evaluation (labels only) does not run them
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_generation_ignores_the_mtp_modules():
    model = mtp_model(depths=1)
    prompt = [[5, 9, 2, 7]]
    options = GenerationOptions(max_new_tokens=6, temperature=0)
    with_modules = generate_batch(model, prompt, options)
    model.mtp = None  # the same trunk without the modules
    assert generate_batch(model, prompt, options) == with_modules


def mtp_config(depths: int, factor: float = 0.1, dense: bool = False, **train):
    cfg = tiny_config(train_iters=4, hidden_dropout=0.1, **train)
    cfg.model.position_embedding_type, cfg.model.normalization = "rope", "rmsnorm"
    cfg.model.mtp_num_layers, cfg.model.mtp_loss_scaling_factor = depths, factor
    cfg.model.mtp_dense_layers = dense
    return cfg


def test_training_with_mtp_logs_mtp_loss_and_trains_the_trunk(tmp_path, capsys):
    torch.set_num_threads(1)
    # factor 0 with dense MTP layers: the modules run but send no gradient to the trunk, so the LM curve is the plain
    # one bit for bit (without clipping: the global norm would sum the modules' zero gradients in another order)
    unclipped = run_losses(build_trainer(mtp_config(0, clip_grad=0.0)), 4)
    assert run_losses(build_trainer(mtp_config(1, factor=0.0, dense=True, clip_grad=0.0)), 4) == unclipped
    # a MoE MTP layer's aux loss is a loss of its own (not scaled by the factor): it reaches the trunk through its
    # router's input, as in Megatron-Core
    assert run_losses(build_trainer(mtp_config(1, factor=0.0, clip_grad=0.0)), 4) != unclipped
    plain = run_losses(build_trainer(mtp_config(0)), 4)
    trainer = build_trainer(mtp_config(2, factor=0.5, save=str(tmp_path / "run"), log_interval=2))
    assert trainer.train() == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [2, 4]
    assert f"mtp loss {records[-1]['mtp_loss']:.4E}" in capsys.readouterr().out  # the console line has it too
    assert all(r["mtp_loss"] > 0 for r in records) and records[-1]["mtp_loss"] < records[0]["mtp_loss"]
    lm = [r["lm_loss"] for r in records]
    assert lm != [sum(plain[0:2]) / 2, sum(plain[2:4]) / 2]  # the MTP gradient reached the trunk


def test_mtp_layers_are_moe_layers_like_the_last_layer_and_route_with_the_others():
    """DeepSeek-V3's MTP block is a MoE block: keyed after the main layers, listed with them (expert bias updates,
    routing statistics), its aux loss attached to its output; --mtp-dense-layers keeps a dense one."""
    model = mtp_model(depths=2, moe_router_score_function="sigmoid", moe_router_bias_update_rate=1e-3)
    layers = [m.transformer_layer for m in model.mtp.layers.values()]
    assert all(layer.is_moe and layer.mlp.num_experts == 4 for layer in layers)
    assert [moe.layer_index for moe in model.moe_layers()] == model.cfg.routed_layer_indices() == [1, 2, 3]
    batch = random_samples(3, seed=5)
    model.train()
    out = model(batch[:, :-1], labels_BT=batch[:, 1:], mtp_labels_BT=batch[:, 1:])
    (out.lm_loss + out.mtp_loss).backward()
    assert all(layer.mlp.router.weight.grad.abs().sum() > 0 for layer in layers)
    assert all(layer.mlp.router.load_since_update_E.sum() > 0 for layer in layers)  # what the bias update reads
    dense = mtp_model(depths=2, mtp_dense_layers=True)
    assert not any(m.transformer_layer.is_moe for m in dense.mtp.layers.values())
    assert dense.cfg.routed_layer_indices() == [1]


def test_layouts_pass_validate_and_bad_values_are_refused_in_one_line_each():
    # TP, TP + SP, PP and EP run (tests/distributed/test_tensor_parallel_train.py, test_pipeline_parallel_train.py,
    # test_expert_parallel_train.py): a MoE MTP layer under EP 2, at ZeRO 0 and 2, and under TP 2 + SP passes
    # validate()
    for zero_stage in (0, 2):
        run = tiny_config(mtp_num_layers=1)
        run.parallel.moe_expert_parallel_size, run.parallel.zero_stage = 2, zero_stage
        assert run.model.mtp_layer_experts() == 4 and run.dims(2).ep == 2
        assert not [p for p in validate(run, 2) if "mtp" in p], zero_stage
    run = tiny_config(mtp_num_layers=1)
    run.parallel.tensor_model_parallel_size, run.parallel.sequence_parallel = 2, True
    assert run.dims(2).sp and not [p for p in validate(run, 2) if "mtp" in p]
    moe = ModelConfig(num_experts=[4], mtp_num_layers=1)  # the MTP layer is MoE, like the last main layer
    assert moe.mtp_layer_experts() == 4
    bad = ModelConfig(seq_length=16, mtp_num_layers=16, mtp_loss_scaling_factor=-1.0).problems()
    assert "--mtp-num-layers must be in [0, --seq-length 16), got 16" in bad
    assert "--mtp-loss-scaling-factor must be a finite value >= 0, got -1.0" in bad


def test_an_mtp_model_exports_as_remote_code_with_its_modules(tmp_path):
    """No transformers class has MTP modules (DeepSeek-V3's drops them): a native class refuses the config, and the
    remote-code export keeps every MTP weight, so the import gives back the same model."""
    from interchange_support import tiny_checkpoint

    from moetron.eval.generate import load_model
    from moetron.interchange.hf_export import export_hf
    from moetron.interchange.hf_import import import_hf

    pytest.importorskip("transformers")
    run, _, model = tiny_checkpoint(tmp_path, "qwen3_moe", mtp_num_layers=1)
    result = export_hf(str(run), str(tmp_path / "hf"))
    assert result.remote_code and "--mtp-num-layers 1 has no Qwen3MoeForCausalLM equivalent" in result.why_remote[0]
    import_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    back, cfg, _ = load_model(str(tmp_path / "back"), "cpu")
    assert cfg.model.mtp_num_layers == 1
    for (name, a), b in zip(model.state_dict().items(), back.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
