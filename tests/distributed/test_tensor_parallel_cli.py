"""`torchrun --nproc-per-node 2 -m moetron train --tensor-model-parallel-size 2 --moe-expert-parallel-size 2`.

The 2-GPU recipe of the README on CPU: attention, MLP and vocabulary split over 2 ranks (sequence parallel), the
experts over the same 2 ranks (folding). It trains and evaluates; `moetron eval` in one process gives the trainer's
final validation loss from the TP checkpoint, `moetron generate` continues a prompt from it, and one process
resumes it at TP = 1. TP problems are reported together, before anything starts.
"""

from __future__ import annotations

import json

import pytest
from cli_support import ENV, moetron_train, shakespeare_corpus_flags

from moetron.cli import main

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 4 --num-experts 4 --topk 1 --lr 3e-3 --lr-warmup-iters 2 --log-interval 4 "
    "--eval-iters 1 --eval-interval 4 --hidden-dropout 0.1 --attention-dropout 0"
).split()
TP2_EP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-expert-parallel-size", "2"]


@pytest.fixture
def corpus_flags(tmp_path, shakespeare, gpt2_files):
    return shakespeare_corpus_flags(tmp_path, shakespeare, gpt2_files, chars=30_000)


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_tp2_ep2_then_eval_generate_and_resume_on_one_process(tmp_path, corpus_flags, capsys):
    run = tmp_path / "run"
    common = [*TINY, *corpus_flags, "--save", str(run)]
    proc = moetron_train(*common, "--train-iters", "8", *TP2_EP2, nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f" iteration {8:>7d}/8 |" in proc.stdout
    final = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])

    out_json = tmp_path / "eval.json"  # one process reads the TP = 2 checkpoint (vocabulary and heads whole again)
    assert main(["eval", "--load", str(run), "--json", str(out_json)]) == 0
    result = json.loads(out_json.read_text())
    assert result["iteration"] == final["iteration"] == 8
    assert result["valid_loss"] == pytest.approx(final["valid_loss"], rel=1e-5)
    capsys.readouterr()
    assert main(["generate", "--load", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")

    resumed = moetron_train(*common, "--train-iters", "10", "--load", str(run))  # TP = 1, EP = 1, one process
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "loaded checkpoint" in resumed.stdout and "iteration 8" in resumed.stdout
    assert (run / "latest").read_text().strip() == "iter_0000010"


def test_every_tensor_parallel_problem_is_reported_at_once(tmp_path, corpus_flags):
    run = tmp_path / "never"
    env = {**ENV, "WORLD_SIZE": "4"}  # what torchrun announces; the check runs before any process group
    bad = [
        *("--tensor-model-parallel-size", "4", "--num-attention-heads", "6", "--num-key-value-heads", "2"),
        *("--hidden-size", "36", "--ffn-hidden-size", "90", "--make-vocab-size-divisible-by", "2"),
        *("--expert-tensor-parallel-size", "4", "--moe-ffn-hidden-size", "30", "--sequence-parallel"),
        *("--seq-length", "30"),
    ]
    args = [*TINY, *corpus_flags, "--train-iters", "2", "--save", str(run), *bad]
    proc = moetron_train(*args, env=env)
    assert proc.returncode == 2, proc.stderr
    for fragment in (
        "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4",
        "--num-key-value-heads 2 is not divisible by --tensor-model-parallel-size 4",
        "ffn size 90 (--ffn-hidden-size) is not divisible",
        "use --make-vocab-size-divisible-by 4",
        "experts' ffn size 30",
        "--seq-length 30 is not divisible by 4",
    ):
        assert fragment in proc.stderr, fragment
    assert "Traceback" not in proc.stderr and not run.exists()
