"""`import --hf` when config.json and the weights disagree: every tensor in the files is placed or named in a
one-line refusal (layers past num_hidden_layers, MTP modules past num_nextn_predict_layers), and a field the
weights contradict (kv_lora_rank, num_key_value_heads, …) is one line naming the field, both values, the tensor
and its file — never a traceback, never weights left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from interchange_support import VOCAB, save_model, tiny_checkpoint, tokens
from test_hf_deepseek_v3 import MLA, TINY_V3, check_with_transformers_mtp_model, trained_final_norms
from test_hf_import import CONFIGS, random_hf_model, save_with_tokenizer
from test_interchange_faults import one_error_line

from moetron.errors import UserError
from moetron.eval.generate import load_model
from moetron.interchange.hf_export import export_hf
from moetron.interchange.hf_import import import_hf

transformers = pytest.importorskip("transformers", reason="the checkpoints are written by transformers itself")


def saved(tmp_path: Path, name: str, monkeypatch, **config) -> Path:
    """A random tiny transformers model of CONFIGS[name] (with `config` changes), saved by transformers."""
    prefix, kwargs = CONFIGS[name] if name != "deepseek_v3" else ("DeepseekV3", TINY_V3)
    monkeypatch.setitem(CONFIGS, name, (prefix, {**kwargs, **config}))
    save_with_tokenizer(random_hf_model(name), tmp_path / "hf", tmp_path)
    return tmp_path / "hf"


def edit_config(hf_dir: Path, **changes) -> None:
    path = hf_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def refusal(hf_dir: Path, tmp_path: Path) -> str:
    with pytest.raises(UserError) as err:
        import_hf(str(hf_dir), str(tmp_path / "run"))
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(("name", "layers"), [("mixtral", 2), ("qwen3_moe", 4), ("deepseek_v3", 3)])
def test_weights_past_config_json_layer_count_are_refused_naming_both(tmp_path, monkeypatch, name, layers):
    """Today's importer left the last layers behind and wrote a shallower model."""
    hf_dir = saved(tmp_path, name, monkeypatch)
    edit_config(hf_dir, num_hidden_layers=layers - 1)
    message = refusal(hf_dir, tmp_path)
    assert f"num_hidden_layers {layers - 1} disagrees with the weights, which hold {layers} decoder layers" in message
    assert f"model.layers.0–{layers - 1}" in message and f"set num_hidden_layers to {layers}" in message
    assert not (tmp_path / "run").exists()


def test_a_config_json_naming_more_layers_than_the_weights_hold_is_one_line(tmp_path, monkeypatch):
    hf_dir = saved(tmp_path, "mixtral", monkeypatch)
    edit_config(hf_dir, num_hidden_layers=3)
    assert "num_hidden_layers 3 disagrees with the weights, which hold 2 decoder layers" in refusal(hf_dir, tmp_path)


@pytest.fixture(scope="module")
def mtp_export(tmp_path_factory) -> Path:
    """A DeepSeek-V3 export with two MTP modules (`model.layers.3.` and `.4.`, past num_hidden_layers 3)."""
    root = tmp_path_factory.mktemp("mtp")
    run, _, _ = tiny_checkpoint(root, "glm4_moe", **{**MLA, "q_lora_rank": None}, mtp_num_layers=2,
                                make_vocab_size_divisible_by=4)  # fmt: skip
    export_hf(str(run), str(root / "hf"))
    return root / "hf"


def copy_of(hf_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "hf"
    out.mkdir()
    for path in hf_dir.iterdir():
        (out / path.name).write_bytes(path.read_bytes())
    return out


@pytest.mark.parametrize("declared", [0, 1])
def test_mtp_modules_past_num_nextn_predict_layers_are_refused_naming_the_field(mtp_export, tmp_path, declared):
    """Today's importer dropped the modules config.json does not count (all of them, or the second)."""
    hf_dir = copy_of(mtp_export, tmp_path)
    edit_config(hf_dir, num_nextn_predict_layers=declared)
    message = refusal(hf_dir, tmp_path)
    assert f"past config.json's num_nextn_predict_layers {declared}" in message
    assert "set num_nextn_predict_layers to 2" in message and "--mtp-num-layers 2" in message
    unread = "model.layers.3–4" if declared == 0 else "model.layers.4"
    assert f"{2 - declared} MTP module(s) ({unread}:" in message


def test_mtp_modules_config_json_counts_are_placed(mtp_export, tmp_path):
    """Both modules and their copies of the shared embedding and head are accounted for: nothing left over."""
    result = import_hf(str(mtp_export), str(tmp_path / "run"))
    assert result.cfg.model.mtp_num_layers == 2


def test_a_class_without_mtp_modules_refuses_them_instead_of_dropping_them(mtp_export, tmp_path):
    """The same layers in a checkpoint of a class whose import reads no MTP modules (Mixtral, Qwen3-MoE, …): the
    layer check (the class's MTP field None) names them rather than leaving them behind."""
    from moetron.interchange.hf_weight_checks import check_layers
    from moetron.interchange.safetensors_stream import HFWeights
    from moetron.model.config import ModelConfig

    cfg = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=300)
    with pytest.raises(UserError, match=r"2 MTP module\(s\) \(model\.layers\.3–4: .*does not read"):
        check_layers(HFWeights(mtp_export), cfg, "num_hidden_layers", None, "--hf DIR")


def test_glm4_moe_mtp_modules_are_placed_both_ways(tmp_path, monkeypatch):
    """GLM-4.5's releases hold DeepSeek-V3-layout MTP layers with GLM's attention: a GQA DeepSeek-style model with
    an MTP module exports natively to Glm4MoeForCausalLM (which loads the trunk with the same logits; transformers'
    MtpModel predicts what moetron's module does) and imports back with every MTP tensor; with
    num_nextn_predict_layers 0 they are refused, not dropped."""
    run, cfg, model = tiny_checkpoint(tmp_path, "glm4_moe", mtp_num_layers=1, init_method_std=0.2,
                                      make_vocab_size_divisible_by=4)  # fmt: skip
    trained_final_norms(model)
    shutil.rmtree(run)
    save_model(run, cfg, model)
    result = export_hf(str(run), str(tmp_path / "hf"))
    assert (result.hf_class, result.remote_code) == ("Glm4MoeForCausalLM", False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x).logits[..., :VOCAB], atol=1e-4, rtol=0)
    check_with_transformers_mtp_model(hf, model, tokens(4, 12), monkeypatch)
    back = import_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    assert back.cfg.model.mtp_num_layers == 1
    ours, theirs = model.state_dict(), load_model(str(tmp_path / "back"), "cpu")[0].state_dict()
    for name in (n for n in ours if n.startswith("mtp.")):
        torch.testing.assert_close(theirs[name], ours[name], atol=0, rtol=0, msg=name)
    edit_config(tmp_path / "hf", num_nextn_predict_layers=0)
    assert "past config.json's num_nextn_predict_layers 0" in refusal(tmp_path / "hf", tmp_path)


def test_kv_lora_rank_that_disagrees_with_the_weights_is_one_line_naming_both(tmp_path, monkeypatch):
    """Today: a reshape traceback from the rotary-row permutation."""
    hf_dir = saved(tmp_path, "deepseek_v3", monkeypatch)
    edit_config(hf_dir, kv_lora_rank=12)
    message = refusal(hf_dir, tmp_path)
    assert "config.json's kv_lora_rank 12 disagrees with the weights' 16" in message
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight in model.safetensors is [20, 32]" in message


@pytest.mark.parametrize(("name", "wrong"), [("mixtral", 4), ("qwen3_moe", 1)])
def test_num_key_value_heads_that_disagrees_with_the_weights_is_one_line_naming_both(
    tmp_path, monkeypatch, name, wrong
):
    """Today: a traceback from fusing q, k and v."""
    hf_dir = saved(tmp_path, name, monkeypatch)
    edit_config(hf_dir, num_key_value_heads=wrong)
    message = refusal(hf_dir, tmp_path)
    assert f"config.json's num_key_value_heads {wrong} disagrees with the weights' 2" in message
    assert "model.layers.0.self_attn.k_proj.weight in model.safetensors is" in message


def test_an_expert_count_that_disagrees_names_the_field(tmp_path, monkeypatch):
    hf_dir = saved(tmp_path, "mixtral", monkeypatch)
    edit_config(hf_dir, num_local_experts=2)
    assert "config.json's num_local_experts 2 disagrees with the weights' 4" in refusal(hf_dir, tmp_path)


def test_the_cli_prints_the_disagreement_as_one_line(tmp_path, monkeypatch, capsys):
    hf_dir = saved(tmp_path, "mixtral", monkeypatch)
    edit_config(hf_dir, num_hidden_layers=1)
    capsys.readouterr()
    line = one_error_line(["import", "--hf", str(hf_dir), "--save", str(tmp_path / "run")], capsys)
    assert "config.json's num_hidden_layers 1 disagrees with the weights, which hold 2 decoder layers" in line


def test_a_matching_checkpoint_still_imports(tmp_path, monkeypatch):
    hf_dir = saved(tmp_path, "deepseek_v3", monkeypatch)
    assert import_hf(str(hf_dir), str(tmp_path / "run")).cfg.model.kv_lora_rank == 16
