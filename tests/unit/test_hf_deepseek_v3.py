"""DeepSeek-V3 (`DeepseekV3ForCausalLM`, multi-head latent attention + DeepSeek-V3's MoE) both ways: a random tiny
transformers model imports with its logits and greedy continuation (interleaved RoPE, transformers' default, and
halves; with and without a query latent); a moetron MLA model exports to the native class with its logits."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from interchange_support import ARCHITECTURES, VOCAB, run_config, save_model, tiny_checkpoint, tokens
from test_hf_export import greedy_hf, greedy_moetron, load_hf
from test_hf_import import CONFIGS, random_hf_model, save_with_tokenizer

from moetron.eval.generate import load_model
from moetron.interchange.hf_architectures import DEEPSEEK_V3, GLM4_MOE, find_architecture
from moetron.interchange.hf_export import export_hf
from moetron.interchange.hf_import import import_hf
from moetron.model.gpt import GPTModel
from moetron.model.loss import language_model_loss, make_head_loss

transformers = pytest.importorskip("transformers", reason="checked against transformers' DeepseekV3ForCausalLM")

TINY_V3 = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=32,
               rms_norm_eps=1e-6, intermediate_size=48, moe_intermediate_size=24, n_routed_experts=8,
               num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
               n_shared_experts=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
               v_head_dim=6, num_mtp_layers=0, rope_parameters={"rope_type": "default", "rope_theta": 1e4})  # fmt: skip
MLA = dict(multi_latent_attention=True, num_key_value_heads=None, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=6, layernorm_epsilon=1e-6, add_qkv_bias=False,
           qk_layernorm=False)  # fmt: skip


@pytest.mark.parametrize(
    "change", [{}, {"q_lora_rank": None, "rope_interleave": False}], ids=["q-latent-interleaved", "q-proj-halves"]
)
def test_deepseek_v3_imports_with_its_logits_and_greedy_tokens(tmp_path, monkeypatch, change):
    monkeypatch.setitem(CONFIGS, "deepseek_v3", ("DeepseekV3", {**TINY_V3, **change}))
    hf = random_hf_model("deepseek_v3")
    assert hf.config.rope_interleave == change.get("rope_interleave", True)
    save_with_tokenizer(hf, tmp_path / "hf", tmp_path)
    result = import_hf(str(tmp_path / "hf"), str(tmp_path / "run"))
    assert result.hf_class == "DeepseekV3ForCausalLM"
    model, cfg, _ = load_model(str(tmp_path / "run"), "cpu")
    assert cfg.model.multi_latent_attention and cfg.model.q_lora_rank == change.get("q_lora_rank", 24)
    assert cfg.model.moe_router_score_function == "sigmoid" and cfg.model.moe_first_dense_layers == 1
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits[..., :VOCAB], hf(x).logits, atol=1e-4, rtol=0)
    prompt = tokens(1, 5, seed=3)
    assert greedy_moetron(model, prompt, 8) == greedy_hf(hf, prompt, 8)


def test_mla_model_exports_to_deepseek_v3_with_its_logits(tmp_path):
    run, _, model = tiny_checkpoint(tmp_path, "glm4_moe", **{**MLA, "q_lora_rank": None}, init_method_std=0.2)
    assert find_architecture(model.cfg) is DEEPSEEK_V3
    result = export_hf(str(run), str(tmp_path / "hf"))
    assert (result.hf_class, result.remote_code) == ("DeepseekV3ForCausalLM", False)
    hf = load_hf(tmp_path / "hf")
    assert hf.config.rope_interleave  # DeepSeek's own rotary order, what other DeepSeek-V3 loaders assume
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x).logits[..., :VOCAB], atol=1e-4, rtol=0)
    prompt = tokens(1, 5, seed=3)
    assert greedy_hf(hf, prompt, 8) == greedy_moetron(model, prompt, 8)
    # and back: the export imports into the same model
    import_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    back, _, _ = load_model(str(tmp_path / "back"), "cpu")
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits[..., :VOCAB], model(x).logits[..., :VOCAB], atol=1e-5, rtol=0)


def test_deepseek_style_routing_without_mla_stays_glm4_moe_and_mla_never_goes_elsewhere(tmp_path):
    gqa = run_config(tmp_path, **ARCHITECTURES["glm4_moe"]).model
    assert find_architecture(gqa) is GLM4_MOE
    mla = run_config(tmp_path, **{**ARCHITECTURES["glm4_moe"], **MLA}).model
    assert find_architecture(mla) is DEEPSEEK_V3
    dense_mla = run_config(tmp_path, **{**ARCHITECTURES["llama"], **MLA}).model
    assert find_architecture(dense_mla) is None  # no dense MLA class: remote code, never Llama's attention


def test_dense_mla_model_exports_as_remote_code_with_its_logits_and_cache(tmp_path):
    """No transformers class has dense MLA: the bundled moetron code (model/mla.py included) carries it, KV cache
    and all."""
    run, _, model = tiny_checkpoint(tmp_path, "llama", **{**MLA, "q_lora_rank": 24}, init_method_std=0.2)
    result = export_hf(str(run), str(tmp_path / "hf"))
    assert result.remote_code
    hf = load_hf(tmp_path / "hf", trust_remote_code=True)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x).logits[..., :VOCAB], atol=1e-5, rtol=0)
    prompt = tokens(1, 5, seed=3)
    assert greedy_hf(hf, prompt, 8) == greedy_moetron(model, prompt, 8)


# DeepSeek's own config.json spelling (transformers 4's `rope_scaling`, `type`), YaRN over 8 positions: of the two
# rotary pairs one keeps its frequency and one is interpolated; mscale != mscale_all_dim puts a factor on cos / sin,
# and mscale_all_dim corrects the softmax scale (DeepSeek-V3's real config: factor 40, 4096, 32 / 1, 1.0 / 1.0)
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.8}  # fmt: skip


def test_deepseek_v3_with_yarn_imports_and_exports_with_its_logits(tmp_path, monkeypatch):
    monkeypatch.setitem(CONFIGS, "deepseek_v3", ("DeepseekV3", {**TINY_V3, "initializer_range": 0.2}))
    hf = random_hf_model("deepseek_v3")  # large weights: the scaled positions show in the logits
    save_with_tokenizer(hf, tmp_path / "hf", tmp_path)
    config_path = tmp_path / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("rope_parameters", None)
    config_path.write_text(json.dumps({**config, "rope_theta": 1e4, "rope_scaling": YARN}))
    hf = load_hf(tmp_path / "hf")  # transformers reads the same file
    assert hf.config.rope_parameters["rope_type"] == "yarn" and hf.model.layers[0].self_attn.scaling != 14**-0.5
    import_hf(str(tmp_path / "hf"), str(tmp_path / "run"))
    model, cfg, _ = load_model(str(tmp_path / "run"), "cpu")
    m = cfg.model
    assert (m.rope_type, m.rotary_scaling_factor, m.original_max_position_embeddings) == ("yarn", 4.0, 8)
    assert (m.beta_fast, m.beta_slow, m.mscale, m.mscale_all_dim) == (32.0, 1.0, 1.0, 0.8)
    x = tokens()
    with torch.no_grad():
        want = hf(x).logits
        torch.testing.assert_close(model(x).logits[..., :VOCAB], want, atol=1e-4, rtol=0)
        plain = dataclasses.replace(m, rope_type="rope", rotary_scaling_factor=1.0,
                                    original_max_position_embeddings=None, mscale_all_dim=0.0)  # fmt: skip
        assert (model(x).logits - load_model_as(model, plain)(x).logits).abs().max() > 1e-2  # YaRN changed them
    export_hf(str(tmp_path / "run"), str(tmp_path / "back"))
    back = load_hf(tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["rope_scaling"]["type"] == "yarn"
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, want, atol=1e-4, rtol=0)


def load_model_as(model, cfg):
    """The same weights under another model config."""
    other = GPTModel(cfg)
    other.load_state_dict(model.state_dict())
    return other.eval()


def mtp_loss_of(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x[:, :-1], mtp_labels_BT=x[:, 1:], return_logits=False).mtp_loss


def test_mla_mtp_model_exports_its_mtp_modules_in_deepseek_v3s_layout_and_imports_back(tmp_path, monkeypatch):
    """Two MoE MTP modules go to `model.layers.<num_hidden_layers + k>.` (enorm, hnorm, eh_proj, the layer,
    shared_head.norm and copies of the embedding and head, as DeepSeek's release stores them): transformers' class
    loads the model with the same logits, transformers' own `MtpModel` reads the modules and, from what transformers
    hands it, predicts what moetron's do, and the import gives back the same MTP loss."""
    # no padded vocabulary rows (300 = 75 · 4): the export drops those, and moetron's loss counts their softmax share
    run, cfg, model = tiny_checkpoint(tmp_path, "glm4_moe", **{**MLA, "q_lora_rank": None}, init_method_std=0.2,
                                      mtp_num_layers=2, make_vocab_size_divisible_by=4)  # fmt: skip
    trained_final_norms(model)
    shutil.rmtree(run)
    save_model(run, cfg, model)
    assert model.cfg.padded_vocab_size() == VOCAB
    assert model.mtp.layers["0"].transformer_layer.is_moe
    result = export_hf(str(run), str(tmp_path / "hf"))
    assert (result.hf_class, result.remote_code) == ("DeepseekV3ForCausalLM", False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 2 and "num_mtp_layers" not in config
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    mtp_names = {n.removeprefix("model.layers.4.") for n in index if n.startswith("model.layers.4.")}
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
            "embed_tokens.weight", "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate.e_score_correction_bias",
            "mlp.experts.7.down_proj.weight", "mlp.shared_experts.up_proj.weight"} <= mtp_names  # fmt: skip
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and all(k.startswith(("model.layers.3.", "model.layers.4.")) for k in
                                            info["unexpected_keys"])  # fmt: skip
    x = tokens(4, 12)
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(x).logits, model(x).logits[..., :VOCAB], atol=1e-4, rtol=0)
    check_with_transformers_mtp_model(hf, model, x, monkeypatch)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    back, cfg, _ = load_model(str(tmp_path / "back"), "cpu")
    assert cfg.model.mtp_num_layers == 2 and not cfg.model.mtp_dense_layers
    ours, theirs = model.state_dict(), back.state_dict()
    for name in (n for n in ours if n.startswith("mtp.")):  # every MTP tensor back, bit for bit
        torch.testing.assert_close(theirs[name], ours[name], atol=0, rtol=0, msg=name)
    torch.testing.assert_close(mtp_loss_of(back, x), mtp_loss_of(model, x), atol=1e-6, rtol=0)  # one round trip
    # --mtp-dense-layers has no DeepSeek-V3 equivalent: remote code, saying why
    dense = dataclasses.replace(model.cfg, mtp_dense_layers=True)
    assert any("--mtp-dense-layers has no DeepseekV3ForCausalLM" in w for w in DEEPSEEK_V3.problems(dense))


@torch.no_grad()
def trained_final_norms(model) -> None:
    """Final-norm weights far from 1, as training leaves them (DeepSeek-V3's range from 0.2 to a few): whether a
    depth reads the state before or after a final norm then changes its predictions, not just their last digits."""
    g = torch.Generator().manual_seed(11)
    for norm in [model.final_layernorm] + [m.final_layernorm for m in model.mtp.layers.values()]:
        norm.weight.uniform_(0.2, 3.0, generator=g)


def check_with_transformers_mtp_model(hf, model, x: torch.Tensor, monkeypatch) -> None:
    """transformers' `MtpModel` (what `generate(use_mtp=True)` drafts with) finds DeepSeek-V3's MTP layers by the
    class's `model.layers.61` pattern (the real model's layer count; GLM-4-MoE's: 46 and 92); pointed at this tiny
    model's layers, it loads the exported modules. Handed what `generate` hands it, the main model's
    `hidden_states[-1]` (after the final norm), and chained as its own drafting loop chains the depths (each one's
    `post_norm` output into the next), its logits are moetron's at every depth, and so is the MTP loss computed
    from them."""
    from transformers.modeling_layers import MtpModel

    L, D = model.cfg.num_layers, model.cfg.mtp_num_layers
    indices = "|".join(str(L + k) for k in range(D))
    monkeypatch.setattr(hf, "_keys_to_ignore_on_load_unexpected", {rf"model\.layers\.({indices})\..*"})
    drafter = MtpModel.from_pretrained(hf).eval()
    assert len(drafter.layers) == D
    inputs, labels = x[:, :-1], x[:, 1:]
    B, T = inputs.shape
    ours: list[torch.Tensor] = []

    def keep_logits(logits_BTV, labels_BT, mask_BT=None):
        ours.append(logits_BTV[..., :VOCAB])
        return language_model_loss(logits_BTV, labels_BT, mask_BT)

    with torch.no_grad():
        mtp_loss = model(inputs, mtp_labels_BT=labels, head_loss=make_head_loss(False, keep_logits)).mtp_loss
        hidden = hf(inputs, output_hidden_states=True).hidden_states[-1]  # what generate(use_mtp=True) hands it
        positions = torch.arange(T)[None].expand(B, -1)
        losses = []
        for k in range(
            1, D + 1
        ):  # depth k reads t_{i+k} (the tail past the sequence: any token, masked out of the loss)
            shifted = torch.cat([inputs[:, k:], inputs[:, :k]], dim=1)
            hidden = drafter.forward_layer(k - 1, hidden, positions, None, input_ids=shifted)
            theirs = drafter._project_to_logits(hidden)
            torch.testing.assert_close(theirs[:, : T - k], ours[k - 1][:, : T - k], atol=1e-4, rtol=0)
            losses.append(F.cross_entropy(theirs[:, : T - k].flatten(0, 1), labels[:, k:].flatten()))
        torch.testing.assert_close(mtp_loss, torch.stack(losses).mean(), atol=1e-5, rtol=0)
