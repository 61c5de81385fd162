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


def test_cli_writes_results(tmp_path, capsys):
    run, _, _ = tiny_checkpoint(tmp_path, "gpt2", num_experts=[4], topk=1, **LONG)  # DeepSpeed top-1, dropless
    out = tmp_path / "results.json"
    argv = ["eval-harness", "--load", str(run), "--tasks", "moetron_tiny_mc", "--limit", "6", "--output", str(out)]
    assert main(argv) == 0
    assert "moetron_tiny_mc" in capsys.readouterr().out
    results = json.loads(out.read_text())["results"]["moetron_tiny_mc"]
    assert results["sample_len"] == 6 and 0.0 <= results["acc,none"] <= 1.0


@pytest.mark.slow  # lm-eval scans its ~10k built-in task files before it can say a name is unknown
def test_unknown_task_is_one_line(tmp_path, capsys):
    run, _, _ = tiny_checkpoint(tmp_path, "llama", **LONG)
    assert main(["eval-harness", "--load", str(run), "--tasks", "no_such_task"]) == 2
    assert "error: --tasks: no_such_task not found" in capsys.readouterr().err
