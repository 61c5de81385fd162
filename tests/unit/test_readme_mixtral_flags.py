"""The guide's "exactly Mixtral" flags, read from docs/guide.md and run through `moetron train --print-config`, give a
model whose logits are Hugging Face's MixtralForCausalLM's; without `--disable-moe-top2-2nd-expert-sampling` they are
not (DeepSpeed's top-2 draws the second expert from noise-perturbed logits, in evaluation too)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from test_gpt import hf_mixtral_model, moetron_state_from_hf_mixtral

from moetron.cli import main
from moetron.model.config import ModelConfig
from moetron.model.gpt import create_model

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide.md"
# the guide's flags at a test's size (later flags win): 2 layers, 4 experts, 2 KV heads, vocabulary 64
TINY = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-key-value-heads 2 --ffn-hidden-size 16 "
TINY += "--num-experts 4 --seq-length 12 --vocab-size 64 --make-vocab-size-divisible-by 64 --hidden-dropout 0 "
TINY += "--attention-dropout 0 --train-iters 1"


def readme_mixtral_flags() -> list[str]:
    text = GUIDE.read_text()
    after = text[text.index("This is\nexactly Mixtral") :]
    block = re.search(r"```bash\n(.*?)```", after, re.S).group(1)
    return block.split()


def printed_model_config(flags: list[str], tmp_path: Path, capsys) -> ModelConfig:
    prefix = tmp_path / "corpus"
    for ext in (".bin", ".idx"):
        prefix.with_suffix(ext).write_bytes(b"")  # existence is all --print-config's validation needs
    assert main(["train", *flags, *TINY.split(), "--data-path", str(prefix), "--print-config"]) == 0
    return ModelConfig(**yaml.safe_load(capsys.readouterr().out)["model"])


def moetron_from_hf(cfg: ModelConfig, hf: torch.nn.Module) -> torch.nn.Module:
    model = create_model(cfg, "cpu", seed=0).eval()
    model.load_state_dict(moetron_state_from_hf_mixtral(hf), strict=False)
    return model


def test_readme_mixtral_flags_are_hf_mixtral(tmp_path, capsys):
    transformers = pytest.importorskip("transformers", reason="optional: checks equality with HF Mixtral")
    flags = readme_mixtral_flags()
    assert "--disable-moe-top2-2nd-expert-sampling" in flags
    cfg = printed_model_config(flags, tmp_path, capsys)
    assert not cfg.moe_top2_2nd_expert_sampling and not cfg.moe_token_dropping and cfg.topk == 2
    hf = hf_mixtral_model(transformers)
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(x).logits
        torch.testing.assert_close(moetron_from_hf(cfg, hf)(x).logits, expected, atol=1e-5, rtol=1e-4)
        sampled = printed_model_config(
            [f for f in flags if f != "--disable-moe-top2-2nd-expert-sampling"], tmp_path, capsys
        )
        assert sampled.moe_top2_2nd_expert_sampling
        torch.manual_seed(0)
        assert not torch.allclose(moetron_from_hf(sampled, hf)(x).logits, expected, atol=1e-3)
