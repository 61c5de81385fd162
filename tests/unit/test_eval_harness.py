"""`moetron eval-harness` scores what lm-eval's own `hf` model scores on the exported checkpoint: the same
loglikelihoods (1e-4), the same accuracy, the same greedy generations and rolling loglikelihoods, on the shipped
local task (multiple choice, generation, perplexity)."""

from __future__ import annotations

import json

import pytest
from interchange_support import tiny_checkpoint

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is in the [dev] and [eval] extras")
pytest.importorskip("accelerate", reason="lm-eval's hf model needs accelerate")

from moetron.cli import main  # noqa: E402
from moetron.eval.harness import TASKS_DIR, evaluate_harness, offline_hub  # noqa: E402
from moetron.interchange.hf_export import export_hf  # noqa: E402

LONG = dict(seq_length=64, max_position_embeddings=64, init_method_std=0.2)


def lm_eval_hf(hf_dir, tasks: list[str]) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    with offline_hub():
        return lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={hf_dir},dtype=float32", tasks=tasks, device="cpu", batch_size=3,
            task_manager=TaskManager(include_path=[str(TASKS_DIR)]), log_samples=True, bootstrap_iters=0,
        )  # fmt: skip


def responses(results: dict, task: str) -> list:
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.slow
def test_harness_equals_lm_evals_hf_model_on_the_export(tmp_path):
    run, _, _ = tiny_checkpoint(tmp_path, "mixtral", **LONG)
    export_hf(str(run), str(tmp_path / "hf"))
    ours, lm = evaluate_harness(str(run), ["moetron_tiny"], log_samples=True, batch_size=5)
    theirs = lm_eval_hf(tmp_path / "hf", ["moetron_tiny"])
    for (a,), (b,) in zip(sum(responses(ours, "moetron_tiny_mc"), []), sum(responses(theirs, "moetron_tiny_mc"), []),
                          strict=True):  # fmt: skip
        assert abs(a[0] - b[0]) < 1e-4 and a[1] == b[1]
    assert ours["results"]["moetron_tiny_mc"]["acc,none"] == theirs["results"]["moetron_tiny_mc"]["acc,none"]
    assert responses(ours, "moetron_tiny_gen") == responses(theirs, "moetron_tiny_gen")
    rolling = zip(responses(ours, "moetron_tiny_ppl"), responses(theirs, "moetron_tiny_ppl"), strict=True)
    assert all(abs(a[0][0] - b[0][0]) < 1e-3 for a, b in rolling)
    assert len(responses(ours, "moetron_tiny_mc")) == 24 and lm.rank == 0 and lm.world_size == 1


def test_cli_writes_results(tmp_path, capfd, monkeypatch):
    run, _, _ = tiny_checkpoint(tmp_path, "gpt2", num_experts=[4], topk=1, **LONG)  # DeepSpeed top-1, dropless
    out = tmp_path / "results.json"
    argv = ["eval-harness", "--load", str(run), "--tasks", "moetron_tiny_mc", "--limit", "6", "--output", str(out)]
    monkeypatch.setattr("moetron.progress.LOG_EVERY_S", 0.0)  # a progress line per batch (else one per 30 s)
    monkeypatch.chdir(tmp_path)  # not a git repository: lm-eval's `git describe` must not say so
    assert main(argv) == 0
    printed = capfd.readouterr()  # the file descriptors: what a child process (git) writes too
    assert "fatal:" not in printed.err and "Custom kwargs" not in printed.err and "Tokenizing" not in printed.err
    assert "moetron_tiny_mc" in printed.out and "eval-harness loglikelihood:" not in printed.out
    counts = [line.split()[2] for line in printed.err.splitlines() if line.startswith("eval-harness loglikelihood: ")]
    done, total = counts[-1].split("/")
    assert done == total and int(total) > 0  # on stderr only, up to every request
    results = json.loads(out.read_text())["results"]["moetron_tiny_mc"]
    assert results["sample_len"] == 6 and 0.0 <= results["acc,none"] <= 1.0


@pytest.mark.slow  # lm-eval scans its ~10k built-in task files before it can say a name is unknown
def test_unknown_task_is_one_line(tmp_path, capsys):
    run, _, _ = tiny_checkpoint(tmp_path, "llama", **LONG)
    assert main(["eval-harness", "--load", str(run), "--tasks", "no_such_task"]) == 2
    assert "error: --tasks: no_such_task not found" in capsys.readouterr().err


HUB_TASK = """task: hub_only_task
dataset_path: EleutherAI/lambada_openai
dataset_name: default
output_type: loglikelihood
test_split: test
doc_to_text: "{{text}}"
doc_to_target: " end"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def test_a_task_whose_data_must_be_downloaded_is_one_line_offline(tmp_path, monkeypatch, capsys):
    """A task of lm-eval's reads its data from the hub (here one like lambada_openai, defined in a local YAML so
    that lm-eval need not scan its ~10k built-in tasks to find it); offline, that is one line naming the task."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # no network wait, whatever the machine
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run, _, _ = tiny_checkpoint(tmp_path, "gpt2", **LONG)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "hub_only_task.yaml").write_text(HUB_TASK)
    argv = ["eval-harness", "--load", str(run), "--tasks", "hub_only_task", "--include-path", str(tmp_path / "tasks")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tasks hub_only_task: its data cannot be read here (") and err.count("\n") == 1
    assert "EleutherAI/lambada_openai" in err and "needs network" in err and "moetron_tiny" in err


def test_the_tokenizer_flags_its_message_suggests_are_accepted(tmp_path, capsys):
    run, _, _ = tiny_checkpoint(tmp_path, "gpt2", num_experts=[4], topk=1, **LONG)
    (tmp_path / "tok").rename(tmp_path / "moved")
    argv = ["eval-harness", "--load", str(run), "--tasks", "moetron_tiny_mc", "--limit", "2"]
    assert main(argv) == 2
    assert "does not exist; pass --vocab-file and --merge-file" in capsys.readouterr().err
    moved = [
        "--vocab-file",
        str(tmp_path / "moved" / "vocab.json"),
        "--merge-file",
        str(tmp_path / "moved" / "merges.txt"),
    ]
    assert main([*argv, *moved]) == 0
    assert "moetron_tiny_mc" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--limit", "-1"], "--limit -1: give a number of documents"),
        (["--limit", "2.5"], "--limit 2.5: give a number of documents"),
        (["--batch-size", "0"], "--batch-size 0: must be 1 or more"),
        (["--num-fewshot", "-2"], "--num-fewshot -2: must be 0 or more"),
    ],
)
def test_flag_values_are_checked_before_anything_loads(tmp_path, capsys, flags, names):
    assert main(["eval-harness", "--load", str(tmp_path / "never"), "--tasks", "moetron_tiny", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {names}") and err.count("\n") == 1, err
