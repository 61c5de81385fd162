"""Tokenizer files between a moetron run config and a Hugging Face model directory.

Export: GPT-2 BPE files (vocab.json + merges.txt, and the same tokenizer as tokenizer.json) go out with a
`tokenizer_config.json` naming `GPT2Tokenizer`;
an HF `tokenizer.json` goes out with one naming `PreTrainedTokenizerFast`; either way `AutoTokenizer` loads them and
gives moetron's ids. Import: the HF directory's tokenizer files are copied into the new run directory and the
config points at the copies (`tokenizer.json` → HFTokenizer, else vocab.json + merges.txt → GPT2BPETokenizer).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from moetron.data.config import DataConfig
from moetron.data.tokenizer import EOD_TOKEN, build_tokenizer
from moetron.errors import UserError
from moetron.interchange.hf_architectures import Tokens

FIX = "pass the tokenizer files with --vocab-file/--merge-file or --tokenizer-model, or --no-tokenizer"


def _tokenizer_model_file(data: DataConfig) -> Path:
    path = Path(data.tokenizer_model)
    return path / "tokenizer.json" if path.is_dir() else path


def check_tokenizer_files(data: DataConfig) -> None:
    """The files the run config names exist (before any weight is written)."""
    if data.tokenizer_type == "GPT2BPETokenizer":
        wanted = [("--vocab-file", data.vocab_file), ("--merge-file", data.merge_file)]
    else:
        wanted = [("--tokenizer-model", data.tokenizer_model and str(_tokenizer_model_file(data)))]
    for name, value in wanted:
        if not value or not Path(value).is_file():
            raise UserError(f"the checkpoint's tokenizer file {name} {value} is not there; {FIX}")


def export_tokenizer(data: DataConfig, out: Path, max_length: int) -> Tokens:
    """Write the tokenizer files `AutoTokenizer.from_pretrained(out)` loads; returns its special token ids."""
    check_tokenizer_files(data)
    tokenizer = build_tokenizer(data.tokenizer_type, data.vocab_file, data.merge_file, data.tokenizer_model)
    try:
        eod = tokenizer.eod
    except UserError:
        eod = None
    eod_text = tokenizer.core.id_to_token(eod) if eod is not None else None
    config = {"model_max_length": max_length, "clean_up_tokenization_spaces": False}
    if data.tokenizer_type == "GPT2BPETokenizer":
        shutil.copy(data.vocab_file, out / "vocab.json")
        shutil.copy(data.merge_file, out / "merges.txt")
        # the fast form, found whatever the model type maps to; written by Python, so that a full disk is an
        # OSError (one line, `hf_export._staged`), not the tokenizers library's bare Exception
        (out / "tokenizer.json").write_text(tokenizer.core.to_str(pretty=True))
        config.update(tokenizer_class="GPT2Tokenizer", add_prefix_space=False, errors="replace")
    else:
        shutil.copy(_tokenizer_model_file(data), out / "tokenizer.json")
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if eod_text is not None:
        config.update(bos_token=eod_text, eos_token=eod_text, unk_token=eod_text)
        (out / "special_tokens_map.json").write_text(
            json.dumps({"bos_token": eod_text, "eos_token": eod_text, "unk_token": eod_text}, indent=2) + "\n"
        )
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Tokens(bos=eod, eos=eod)


def import_tokenizer(hf_dir: Path, run_dir: Path) -> dict:
    """Copy the HF directory's tokenizer into `run_dir/tokenizer/`; returns the DataConfig fields naming it ({}
    when the directory has no tokenizer files)."""
    target = run_dir / "tokenizer"
    if (hf_dir / "tokenizer.json").is_file():
        target.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (hf_dir / name).is_file():
                shutil.copy(hf_dir / name, target / name)
        return {"tokenizer_type": "HFTokenizer", "tokenizer_model": str((target / "tokenizer.json").resolve())}
    if (hf_dir / "vocab.json").is_file() and (hf_dir / "merges.txt").is_file():
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(hf_dir / "vocab.json", target / "vocab.json")
        shutil.copy(hf_dir / "merges.txt", target / "merges.txt")
        vocab = json.loads((target / "vocab.json").read_text(encoding="utf-8"))
        if EOD_TOKEN in vocab:
            return {
                "tokenizer_type": "GPT2BPETokenizer",
                "vocab_file": str((target / "vocab.json").resolve()),
                "merge_file": str((target / "merges.txt").resolve()),
            }
        return {}
    return {}
