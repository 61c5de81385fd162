"""`moetron train` end to end on a tiny tinyshakespeare corpus (GPT-2 BPE), as a user runs it.

A tiny MoE GPT (hidden 32; the 50k-token embedding is most of it) trains for a few dozen steps: validation
loss falls, metrics and checkpoints appear, `--load` resumes, SIGTERM saves and exits 0, and bad flags give
one clear error before anything is written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moetron.data.indexed import IndexedDatasetBuilder
from moetron.data.tokenizer import build_tokenizer

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


_CORPUS: dict = {}  # built once per test session, shared by the tests below


@pytest.fixture
def corpus(tmp_path_factory, shakespeare, gpt2_files):
    """(flags naming the data and tokenizer, tmp dir): 150 kB of tinyshakespeare, one document per paragraph."""
    if not _CORPUS:
        vocab, merges = gpt2_files
        tokenizer = build_tokenizer("GPT2BPETokenizer", str(vocab), str(merges))
        tmp = tmp_path_factory.mktemp("corpus")
        prefix = tmp / "shakespeare_text_document"
        builder = IndexedDatasetBuilder(prefix, np.uint16)
        for paragraph in shakespeare.read_text()[:150_000].split("\n\n"):
            builder.add_document(tokenizer.encode(paragraph) + [tokenizer.eod])
        builder.finalize()
        flags = ["--data-path", str(prefix), "--split", "90,10,0", "--tokenizer-type", "GPT2BPETokenizer"]
        flags += ["--vocab-file", str(vocab), "--merge-file", str(merges)]
        _CORPUS.update(flags=flags, tmp=tmp)
    return _CORPUS["flags"], _CORPUS["tmp"]


TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 4 "
    "--global-batch-size 4 --num-experts 4 --topk 2 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 5 --log-interval 10 --eval-iters 2 --hidden-dropout 0 --attention-dropout 0"
).split()


def moetron_train(*args: str, **kwargs) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moetron", "train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=240, **kwargs)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_train_evaluate_save_and_resume(corpus):
    flags, tmp = corpus
    run = tmp / "run"
    common = [*TINY, *flags, "--save", str(run), "--save-interval", "20", "--eval-interval", "20"]
    proc = moetron_train(*common, "--train-iters", "40", "--memory-snapshot-steps", "10")
    assert proc.returncode == 0, proc.stderr
    assert " iteration      40/40 | consumed tokens 5120 |" in proc.stdout and "ETA" in proc.stdout
    # peak memory beside the plan's prediction: in the banner, each log line and metrics.jsonl; no snapshot on CPU
    assert "memory     plan predicts" in proc.stdout and " GiB RSS (plan " in proc.stdout
    assert "--memory-snapshot-steps skipped on cpu" in proc.stdout and not (run / "memory_snapshots").exists()
    evals = read_jsonl(run / "eval.jsonl")
    assert [e["iteration"] for e in evals] == [20, 40]
    assert evals[-1]["valid_loss"] < evals[0]["valid_loss"] - 0.5  # it learns
    metrics = read_jsonl(run / "metrics.jsonl")
    assert len(metrics) == 4 and len(metrics[-1]["expert_load_max_over_mean"]) == 1
    assert metrics[-1]["peak_memory_gib"] > 0 and metrics[-1]["planned_memory_gib"] > 0
    assert metrics[-1]["reserved_memory_gib"] is None  # CUDA's reserved figure only
    # on CPU the process's RSS before the model (not in the plan) is logged beside it: measured − baseline compares
    assert 0 < metrics[-1]["baseline_memory_gib"] < metrics[-1]["peak_memory_gib"]
    assert f"+ {metrics[-1]['baseline_memory_gib']:.2f} at start)" in proc.stdout
    assert (run / "latest").read_text().strip() == "iter_0000040"
    assert (run / "config.yaml").exists() and (run / "iter_0000040" / "config.yaml").exists()

    resumed = moetron_train(*common, "--train-iters", "45", "--load", str(run))
    assert resumed.returncode == 0, resumed.stderr
    assert "loaded checkpoint" in resumed.stdout and "iteration 40" in resumed.stdout
    assert read_jsonl(run / "metrics.jsonl")[-1]["iteration"] == 45
    assert (run / "latest").read_text().strip() == "iter_0000045"


def test_sigterm_saves_and_exits_zero(corpus):
    flags, tmp = corpus
    run = tmp / "sigterm"
    cmd = [sys.executable, "-m", "moetron", "train", *TINY, *flags, "--train-iters", "100000"]
    cmd += ["--save", str(run), "--log-interval", "1", "--eval-iters", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.time() + 120
        while not (run / "metrics.jsonl").exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "received SIGTERM" in out
    latest = (run / "latest").read_text().strip()
    assert (run / latest / ".metadata").exists() and int(latest[5:]) >= 1


def test_bad_flags_are_one_clear_error(tmp_path, corpus):
    flags, _ = corpus
    run = tmp_path / "never"
    proc = moetron_train(*flags, "--hidden-size", "30", "--fp16", "--bf16", "--save", str(run))
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: 3 configuration problem(s):")
    assert "Traceback" not in proc.stderr and not run.exists()
    missing = moetron_train(
        *TINY, *flags, "--train-iters", "1", "--load", str(tmp_path / "nope"), "--exit-on-missing-checkpoint"
    )
    assert missing.returncode == 2 and "no checkpoint there" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
