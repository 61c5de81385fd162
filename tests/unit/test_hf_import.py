"""Hugging Face → moetron import: a random tiny transformers model of each class, saved by transformers itself,
imports into a moetron checkpoint whose logits equal the transformers model's; unsupported options are one line."""

from __future__ import annotations

import shutil

import pytest
import torch
from data_helpers import make_tiny_tokenizer
from interchange_support import VOCAB, tokens

from moetron.errors import UserError
from moetron.eval.generate import load_model, load_tokenizer
from moetron.interchange.hf_import import import_hf
from moetron.interchange.moetron_checkpoint import MoetronCheckpoint

transformers = pytest.importorskip("transformers", reason="the import is checked against transformers itself")

LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False)  # fmt: skip
CONFIGS = {
    "gpt2": ("GPT2", dict(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, n_inner=48, bos_token_id=0,
                          eos_token_id=0)),
    "llama": ("Llama", dict(LLAMA_LIKE, intermediate_size=48, attention_bias=True, mlp_bias=True,
                            tie_word_embeddings=True, rope_theta=5e5)),
    "mixtral": ("Mixtral", dict(LLAMA_LIKE, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2Moe", dict(LLAMA_LIKE, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=24,
                                   shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                   decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3Moe", dict(LLAMA_LIKE, num_hidden_layers=4, head_dim=12, intermediate_size=48,
                                   moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                   decoder_sparse_step=2, norm_topk_prob=True)),
    "olmoe": ("Olmoe", dict(LLAMA_LIKE, intermediate_size=24, num_experts=4, num_experts_per_tok=2, eos_token_id=0,
                            pad_token_id=0)),
    "glm4_moe": ("Glm4Moe", dict(LLAMA_LIKE, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=24,
                                 n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                                 routed_scaling_factor=2.5, first_k_dense_replace=1, n_shared_experts=1,
                                 use_qk_norm=True, attention_bias=True, num_mtp_layers=0,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                  "partial_rotary_factor": 1.0})),
}  # fmt: skip


def hf_config(prefix: str, kwargs: dict):
    return getattr(transformers, prefix + "Config")(**kwargs)


def hf_class(prefix: str):
    return getattr(transformers, "GPT2LMHeadModel" if prefix == "GPT2" else prefix + "ForCausalLM")


@torch.no_grad()
def random_hf_model(name: str):
    prefix, kwargs = CONFIGS[name]
    torch.manual_seed(0)
    model = hf_class(prefix)(hf_config(prefix, kwargs)).eval()
    for param_name, param in model.named_parameters():
        if "norm" in param_name or "ln_" in param_name or param_name.endswith("bias"):
            param.add_(torch.randn_like(param) * 0.1)  # away from 1 / 0: a swapped norm shows in the logits
    for buffer_name, buffer in model.named_buffers():
        if buffer_name.endswith("e_score_correction_bias"):
            buffer.add_(torch.randn_like(buffer) * 0.1)
    return model


def save_with_tokenizer(model, directory, tokenizer_root):
    model.save_pretrained(directory)
    tok = make_tiny_tokenizer(tokenizer_root)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(tok / name, directory / name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_import_equals_transformers(tmp_path, name):
    hf = random_hf_model(name)
    save_with_tokenizer(hf, tmp_path / "hf", tmp_path)
    result = import_hf(str(tmp_path / "hf"), str(tmp_path / "run"))
    assert result.hf_class == type(hf).__name__
    model, cfg, _ = load_model(str(tmp_path / "run"), "cpu")
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits[..., :VOCAB], hf(x).logits, atol=1e-4, rtol=0)
    assert cfg.data.tokenizer_type == "GPT2BPETokenizer" and load_tokenizer(cfg).vocab_size == VOCAB
    ckpt = MoetronCheckpoint.open(str(tmp_path / "run"))
    assert all(dtype == torch.float32 for dtype in ckpt.dtypes.values())  # fp32 master weights
    assert (tmp_path / "run" / "config.yaml").read_text().startswith("# imported by `moetron import --hf")


def test_pytorch_bin_weights_import_with_weights_only(tmp_path):
    hf = random_hf_model("gpt2")
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    torch.save(hf.state_dict(), tmp_path / "hf" / "pytorch_model.bin")  # the old format, lm_head.weight included
    import_hf(str(tmp_path / "hf"), str(tmp_path / "run"))
    model, _, _ = load_model(str(tmp_path / "run"), "cpu")
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits[..., :VOCAB], hf(x).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
        ("glm4_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor"),
        ("llama", {"attention_bias": True, "mlp_bias": False}, "attention_bias True with mlp_bias False"),
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv 8.0"),
    ],
)  # fmt: skip
def test_options_moetron_cannot_express_are_one_line_errors(tmp_path, name, change, message):
    prefix, kwargs = CONFIGS[name]
    hf_class(prefix)(hf_config(prefix, {**kwargs, **change})).save_pretrained(tmp_path / "hf")
    with pytest.raises(UserError, match=message) as err:
        import_hf(str(tmp_path / "hf"), str(tmp_path / "run"))
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()


def test_remote_code_export_imports_back(tmp_path):
    from interchange_support import tiny_checkpoint

    from moetron.interchange.hf_export import export_hf

    run, _, model = tiny_checkpoint(tmp_path, "gpt2", num_experts=[4], topk=1)
    export_hf(str(run), str(tmp_path / "hf"))
    assert import_hf(str(tmp_path / "hf"), str(tmp_path / "back")).hf_class == "MoetronForCausalLM"
    back, _, _ = load_model(str(tmp_path / "back"), "cpu")
    for (name, a), b in zip(model.state_dict().items(), back.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
