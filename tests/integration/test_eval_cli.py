"""`moetron eval` on a checkpoint written by `moetron train`: the trainer's numbers, the report, outputs, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moetron.cli import main
from moetron.data.indexed import IndexedDatasetBuilder
from moetron.eval.plots import matplotlib_missing

VOCAB, SEQ, MBS = 96, 16, 2
TINY = (
    f"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length {SEQ} --vocab-size {VOCAB} "
    f"--micro-batch-size {MBS} --global-batch-size 4 --num-experts 4 --expert-interval 1 --topk 2 "
    "--disable-moe-top2-2nd-expert-sampling --moe-eval-capacity-factor 1.0 --lr 3e-3 --log-interval 3 "
    "--eval-iters 2 --eval-interval 3 --train-iters 6 --split 80,20,0"
).split()


def write_dataset(prefix, seed: int, documents: int = 60) -> str:
    """Documents of a repeating pattern plus noise: learnable, so the loss moves."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    for _ in range(documents):
        start = int(rng.integers(0, VOCAB))
        doc = (start + np.arange(int(rng.integers(20, 60)))) % VOCAB
        doc[rng.random(len(doc)) < 0.2] = rng.integers(0, VOCAB)
        builder.add_document(doc)
    builder.finalize()
    return str(prefix)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("eval_cli")
    prefix = write_dataset(base / "corpus_text_document", seed=0)
    run = base / "run"
    assert main(["train", *TINY, "--data-path", prefix, "--save", str(run)]) == 0
    return run, base


def test_eval_equals_the_trainers_final_evaluation(trained_run, tmp_path, capsys):
    run, _ = trained_run
    final = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])
    out_json = tmp_path / "eval.json"
    assert main(["eval", "--load", str(run), "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert result["iteration"] == final["iteration"] == 6
    assert result["valid_loss"] == pytest.approx(final["valid_loss"], rel=1e-9)
    assert result["valid_ppl"] == pytest.approx(final["valid_ppl"], rel=1e-9)
    assert f"{final['valid_loss']:.4f}" in printed and "routing report" in printed
    routed = result["micro_batches"] * MBS * SEQ * 2  # T · k
    assert [sum(r["tokens_per_expert"]) for r in result["routing"]] == [routed, routed]
    assert {"load_max_over_mean", "load_cv", "dropped_fraction", "entropy", "dead_experts", "aux_loss"} <= set(
        result["routing"][0]
    )


def test_eval_of_one_iteration_directory_other_data_and_dropless(trained_run, tmp_path, capsys):
    run, base = trained_run
    other = write_dataset(base / "other_text_document", seed=1, documents=30)
    args = ["eval", "--load", str(run / "iter_0000006"), "--data-path", other, "--eval-iters", "3"]
    assert main([*args, "--dropless", "--json", str(tmp_path / "e.json")]) == 0
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["micro_batches"] == 3 * 2  # 3 global batches of 2 micro-batches
    assert all(r["dropped_fraction"] == 0 for r in result["routing"])
    assert np.isfinite(result["valid_loss"])


def test_plots_or_a_clear_note(trained_run, tmp_path, capsys):
    run, _ = trained_run
    assert main(["eval", "--load", str(run), "--plots-dir", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    if matplotlib_missing():
        assert "pip install moetron[plot]" in out
    else:
        assert (tmp_path / "plots" / "expert_load.png").is_file()
        assert (tmp_path / "plots" / "loss_curves.png").is_file()


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--load", "{tmp}/nowhere"], "--load"),
        (["--load", "{run}", "--data-path", "{tmp}/missing_prefix"], "--data-path"),
        (["--load", "{run}", "--json", "{tmp}/no/such/dir/e.json"], "--json"),
        (["--load", "{run}", "--eval-iters", "0"], "--eval-iters"),
    ],
)
def test_bad_inputs_are_one_line_errors(trained_run, tmp_path, capsys, extra, expected):
    run, _ = trained_run
    args = [a.format(tmp=tmp_path, run=run) for a in extra]
    assert main(["eval", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {expected}") and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.rglob("*.json"))


@pytest.mark.parametrize(
    "routing",
    [
        ["--topk", "2"],  # DeepSpeed's default top-2: the second expert is sampled, in eval too
        ["--topk", "1", "--moe-eval-capacity-factor", "0.5"],  # top-1 drops tokens: random token selection
    ],
    ids=["top2-sampling", "top1-rts-drops"],
)
def test_eval_equals_the_trainer_with_random_routing(tmp_path, capsys, routing):
    prefix = write_dataset(tmp_path / "corpus_text_document", seed=0)
    run = tmp_path / "run"
    tiny = [a for a in TINY if a != "--disable-moe-top2-2nd-expert-sampling"]
    assert main(["train", *tiny, *routing, "--data-path", prefix, "--save", str(run)]) == 0
    final = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])
    out_json = tmp_path / "eval.json"
    assert main(["eval", "--load", str(run), "--json", str(out_json)]) == 0
    result = json.loads(out_json.read_text())
    assert result["valid_loss"] == final["valid_loss"] and result["valid_ppl"] == final["valid_ppl"]
    if routing[1] == "1":
        assert any(r["dropped_fraction"] > 0 for r in result["routing"])  # the random selection did run


def test_wrong_tokenizer_data_is_one_line_error(trained_run, tmp_path, capsys):
    run, _ = trained_run
    prefix = tmp_path / "wide_text_document"
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    for _ in range(10):
        builder.add_document(np.arange(400, 440))  # ids of a bigger vocabulary than the checkpoint's 96
    builder.finalize()
    assert main(["eval", "--load", str(run), "--data-path", str(prefix)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {prefix}: token id 439 is out of range for the vocabulary of {VOCAB} tokens")
    assert "tokenizer" in err and len(err.strip().splitlines()) == 1


def test_progress_goes_to_stderr_and_leaves_stdout_as_it_was(trained_run, tmp_path, capsys, monkeypatch):
    """A log line per report interval (here every micro-batch) on stderr; stdout is what `--json`-less users parse."""
    run, _ = trained_run
    assert main(["eval", "--load", str(run)]) == 0
    quiet_out, quiet_err = capsys.readouterr()
    monkeypatch.setattr("moetron.progress.LOG_EVERY_S", 0.0)
    assert main(["eval", "--load", str(run)]) == 0
    out, err = capsys.readouterr()
    assert out == quiet_out and "eval:" not in quiet_err  # a run shorter than the interval prints nothing
    counts = [line.split()[1] for line in err.splitlines() if line.startswith("eval: ")]
    assert counts == ["1/4", "2/4", "3/4", "4/4"]  # 2 global batches of 2 micro-batches
