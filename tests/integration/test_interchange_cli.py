"""The interchange commands end to end, as a user runs them: a Megatron-DeepSpeed run continues in moetron at its
iteration with its optimizer state; a checkpoint goes to Hugging Face and back and fine-tunes; a dense checkpoint
upcycles and fine-tunes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from interchange_support import tiny_checkpoint

from moetron.data.indexed import IndexedDatasetBuilder
from moetron.data.tokenizer import build_tokenizer

pytestmark = pytest.mark.slow
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
MDS = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_deepspeed"
TEXT = [f"Document {i}: the experts route token {i} to expert {i % 4}, and the router learns." for i in range(200)]


def moetron(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "moetron", *args], capture_output=True, text=True, env=ENV, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def dataset(directory: Path, vocab: Path, merges: Path) -> list[str]:
    """A small indexed dataset in the tokenizer's ids; the flags that name it and the tokenizer."""
    tokenizer = build_tokenizer("GPT2BPETokenizer", str(vocab), str(merges))
    prefix = directory / "data_text_document"
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    for text in TEXT:
        builder.add_document(tokenizer.encode(text) + [tokenizer.eod])
    builder.finalize()
    return ["--data-path", str(prefix), "--split", "90,10,0", "--vocab-file", str(vocab), "--merge-file", str(merges)]


def run_printed(stdout: str, **values: str) -> subprocess.CompletedProcess:
    """The `train with:` command an import or upcycle printed, run as printed with its placeholders replaced by
    `values` (every placeholder it holds must be given, and each is explained on the lines below it)."""
    lines = stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("train with: "))
    command = lines[at].removeprefix("train with: ").split()
    placeholders = [word for word in command if word.isupper() and word.replace("_", "").isalpha()]
    assert sorted(placeholders) == sorted(values), placeholders
    assert [line.split(":")[0].strip() for line in lines[at + 1 :]] == placeholders  # explained, in order
    command = [values.get(word, word) for word in command]
    if command[0] == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", *command[1:]]
    else:
        assert command[:2] == ["moetron", "train"], command
        command = [sys.executable, "-m", "moetron", *command[1:]]
    done = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def state(run: Path, iteration: int) -> dict:
    return json.loads((run / f"iter_{iteration:07d}" / "state.json").read_text())


def test_megatron_deepspeed_run_continues_in_moetron(tmp_path):
    out = tmp_path / "run"
    done = moetron("import", "--megatron-deepspeed", str(MDS / "moe_top1_ep2" / "checkpoint"), "--save", str(out))
    assert "iteration 3, weights and optimizer state" in done.stdout
    vocab, merges = MDS / "tokenizer" / "vocab.json", MDS / "tokenizer" / "merges.txt"
    prefix = dataset(tmp_path, vocab, merges)[1]
    # The run had EP = 2 on 2 processes: the printed command continues it so, under torchrun
    tokenizer = {"VOCAB_JSON": str(vocab), "MERGES_TXT": str(merges)}
    done = run_printed(done.stdout, LAST_ITERATION="5", DATA_PREFIX=prefix, **tokenizer)
    assert "loaded checkpoint" in done.stdout and "iteration 3" in done.stdout
    final = state(out, 5)
    assert final["iteration"] == 5 and final["consumed_samples"] == 6 + 2 * 2  # 2 more steps of 2 samples


def test_hugging_face_round_trip_then_finetune(tmp_path):
    run, cfg, _ = tiny_checkpoint(tmp_path, "qwen2_moe")
    moetron("export", "--load", str(run), "--output", str(tmp_path / "hf"), "--dtype", "bf16")
    done = moetron("import", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "back"))
    assert "imported Qwen2MoeForCausalLM" in done.stdout
    prefix = dataset(tmp_path, Path(cfg.data.vocab_file), Path(cfg.data.merge_file))[1]
    run_printed(done.stdout, ITERATIONS="2", DATA_PREFIX=prefix)  # fine-tunes into back-finetuned
    assert state(tmp_path / "back-finetuned", 2)["iteration"] == 2


def test_upcycle_then_finetune(tmp_path):
    run, cfg, _ = tiny_checkpoint(tmp_path, "gpt2")
    flags = "--num-experts 4 --topk 2 --disable-moe-token-dropping".split()
    done = moetron("upcycle", "--load", str(run), "--save", str(tmp_path / "moe"), *flags)
    assert "MoE layers [1]" in done.stdout
    prefix = dataset(tmp_path, Path(cfg.data.vocab_file), Path(cfg.data.merge_file))[1]
    run_printed(done.stdout, ITERATIONS="2", DATA_PREFIX=prefix)
    assert state(tmp_path / "moe-finetuned", 2)["iteration"] == 2


def test_errors_are_one_line(tmp_path):
    run, _, _ = tiny_checkpoint(tmp_path, "gpt2")
    command = [sys.executable, "-m", "moetron", "export", "--load", str(run), "--output", str(tmp_path / "hf")]
    done = subprocess.run([*command, "--arch", "mixtral"], capture_output=True, text=True, env=ENV)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("error: --arch mixtral: --normalization 'layernorm' has no MixtralForCausalLM")
