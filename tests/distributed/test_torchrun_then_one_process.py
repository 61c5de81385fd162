"""`torchrun --nproc-per-node 2 -m moetron train` in each parallel layout on a tiny tinyshakespeare corpus, then one
process resumes the checkpoint with every parallel size 1 (the shards merge on load) and finishes; a layout's bad
flags are one clear error before any process group starts and before anything is written.

Layouts: EP 2 (one model/optim file per expert shard), PP 2 (each stage logs its MoE layer's load through rank 0),
TP 2 + SP × EP 2 (the README's two-GPU line; `moetron eval` in one process gives the trainer's last validation
loss and `moetron generate` continues a prompt), ZeRO-3 × EP 2 in bf16 with activation checkpointing (resumed with
Megatron's `--use-distributed-optimizer`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
from cli_support import moetron_train, shakespeare_corpus_flags

from moetron.cli import main

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 8 --num-experts 4 --expert-interval 1 --topk 2 --lr 3e-3 --lr-warmup-iters 2 --log-interval 5 "
    "--eval-iters 1 --eval-interval 5"
).split()


@dataclass(frozen=True)
class Layout:
    parallel: str  # the torchrun run's parallel flags
    model: str = ""  # flags of both runs beside TINY (a resume trains the checkpoint's model, as it was trained)
    resume: str = ""  # the one-process resume's own flags


LAYOUTS = {
    "ep2": Layout("--moe-expert-parallel-size 2"),
    "pp2": Layout("--pipeline-model-parallel-size 2"),
    "tp2_sp_ep2": Layout(
        "--tensor-model-parallel-size 2 --sequence-parallel --moe-expert-parallel-size 2",
        model="--global-batch-size 4 --topk 1 --attention-dropout 0",
    ),
    "zero3_ep2_bf16": Layout(
        "--zero-stage 3 --moe-expert-parallel-size 2 --checkpoint-activations",
        model="--bf16",
        resume="--use-distributed-optimizer",
    ),
}
BAD_FLAGS = {  # (WORLD_SIZE torchrun would announce, flags, what the one error says)
    "ep": (2, "--moe-expert-parallel-size 3", ["--moe-expert-parallel-size 3"]),
    "pp": (2, "--pipeline-model-parallel-size 2 --num-layers 3",
           ["--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"]),
    "zero": (2, "--zero-stage 4", ["--zero-stage 4 is not one of 0, 1, 2, 3"]),
    "tp": (4, "--expert-interval 2 --tensor-model-parallel-size 4 --num-attention-heads 6 --num-key-value-heads 2 "
           "--hidden-size 36 --ffn-hidden-size 90 --make-vocab-size-divisible-by 2 --expert-tensor-parallel-size 4 "
           "--moe-ffn-hidden-size 30 --sequence-parallel --seq-length 30", [
        "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4",
        "--num-key-value-heads 2 is not divisible by --tensor-model-parallel-size 4",
        "ffn size 90 (--ffn-hidden-size) is not divisible",
        "use --make-vocab-size-divisible-by 4",
        "experts' ffn size 30",
        "--seq-length 30 is not divisible by 4",
    ]),
}  # fmt: skip


@pytest.fixture
def corpus_flags(tmp_path, shakespeare, gpt2_files):
    return shakespeare_corpus_flags(tmp_path, shakespeare, gpt2_files, chars=40_000)


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_torchrun_trains_then_one_process_resumes(name, tmp_path, corpus_flags, capsys):
    layout, run = LAYOUTS[name], tmp_path / "run"
    common = [*TINY, *layout.model.split(), *corpus_flags, "--save", str(run)]
    proc = moetron_train(*common, *layout.parallel.split(), "--train-iters", "10", nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f" iteration {10:>7d}/10 |" in proc.stdout
    metrics, evals = records(run / "metrics.jsonl"), records(run / "eval.jsonl")
    assert all(np.isfinite(r["lm_loss"]) and np.isfinite(r["grad_norm"]) and r["moe_loss"] > 0 for r in metrics)
    assert len(evals) == 2 and all(np.isfinite(e["valid_loss"]) for e in evals)
    assert len(metrics[-1]["expert_load_max_over_mean"]) == 2  # both MoE layers (PP: one per stage, via rank 0)
    checkpoint = run / "iter_0000010"
    assert (checkpoint / ".metadata").is_file() and (checkpoint / "state.json").is_file()
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    if name == "tp2_sp_ep2":  # one process reads the TP checkpoint: vocabulary and heads whole again
        out_json = tmp_path / "eval.json"
        assert main(["eval", "--load", str(run), "--json", str(out_json)]) == 0
        result = json.loads(out_json.read_text())
        assert result["iteration"] == evals[-1]["iteration"] == 10
        assert result["valid_loss"] == pytest.approx(evals[-1]["valid_loss"], rel=1e-5)
        capsys.readouterr()
        assert main(["generate", "--load", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "5"]) == 0
        assert capsys.readouterr().out.startswith("ROMEO:")

    resumed = moetron_train(*common, *layout.resume.split(), "--train-iters", "12", "--load", str(run))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "loaded checkpoint" in resumed.stdout and "iteration 10" in resumed.stdout
    assert (run / "latest").read_text().strip() == "iter_0000012"


@pytest.mark.parametrize("name", BAD_FLAGS)
def test_a_layouts_bad_flags_are_one_clear_error_before_anything_starts(name, tmp_path, corpus_flags, capsys,
                                                                          monkeypatch):  # fmt: skip
    world_size, flags, fragments = BAD_FLAGS[name]
    monkeypatch.setenv("WORLD_SIZE", str(world_size))  # what torchrun announces; the check needs no process group
    run = tmp_path / "never"
    assert main(["train", *TINY, *corpus_flags, "--train-iters", "2", "--save", str(run), *flags.split()]) == 2
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err, fragment
    assert "Traceback" not in err and not run.exists()


@pytest.mark.distributed
@pytest.mark.slow
def test_the_seed_recipe_scaled_down_under_torchrun_keeps_expert_parallelism(tmp_path, corpus_flags):
    run = tmp_path / "seed"
    flags = ["--config", "seed-2x4090-moe128", "--scale-down", *corpus_flags, "--train-iters", "2", "--save", str(run)]
    proc = moetron_train(*flags, nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "expert parallel 2" in proc.stdout and f" iteration {2:>7d}/2 |" in proc.stdout
