"""A real full disk (a tiny tmpfs; skipped where it cannot be mounted) under every save: the synchronous save's first
write (the RNG file), an asynchronous save, the run's own logs and an export's tokenizer. Each is one line (no
traceback), leaves no temporaries and the previous checkpoint as it was; a periodic save that fails stops the run
unless --continue-on-save-failure asked it to train on."""

from __future__ import annotations

from pathlib import Path

import pytest
from fs_faults import full_disk
from interchange_support import tiny_checkpoint
from test_interchange_faults import export_argv, one_error_line
from trainer_support import build_trainer, tiny_config

from moetron.errors import UserError

# The run's config.yaml, metrics.jsonl and routing_counts.json take a 4 KiB page each; nothing else fits. The first
# save's first write — this rank's RNG file (15 KB) — meets the full disk.
SMALL = "12k"


def leftovers(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.name.startswith((".tmp", "iter_")))


def test_a_full_disk_at_the_rng_file_is_one_line_and_leaves_no_temporaries(tmp_path):
    with full_disk(tmp_path / "disk", SMALL) as disk:
        trainer = build_trainer(tiny_config(save=str(disk / "run"), save_interval=2, train_iters=4))
        with pytest.raises(UserError) as err:
            trainer.train()
        message = str(err.value)
        assert message.startswith(f"saving the checkpoint of iteration 2 in {disk / 'run'} failed (No space left")
        assert "\n" not in message and "no earlier checkpoint exists" in message
        assert leftovers(disk / "run") == [] and trainer.progress.iteration == 2  # stopped at the failed save


def test_continue_on_save_failure_trains_on_and_still_fails_the_final_save(tmp_path, capsys):
    with full_disk(tmp_path / "disk", SMALL) as disk:
        cfg = tiny_config(save=str(disk / "run"), save_interval=2, train_iters=4, continue_on_save_failure=True)
        trainer = build_trainer(cfg)
        with pytest.raises(UserError, match="saving the checkpoint of iteration 4 .* failed \\(No space left"):
            trainer.train()  # the final save must succeed: it is the run's result
        out = capsys.readouterr().out
        assert "saving the checkpoint of iteration 2" in out and "training goes on (--continue-on-save-failure)" in out
        assert trainer.progress.iteration == 4 and leftovers(disk / "run") == []


def test_an_asynchronous_save_on_a_full_disk_is_one_line(tmp_path):
    with full_disk(tmp_path / "disk", SMALL) as disk:
        trainer = build_trainer(tiny_config(save=str(disk / "run"), save_interval=2, train_iters=4, async_save=True))
        with pytest.raises(UserError) as err:
            trainer.train()
        assert "No space left on device" in str(err.value) and "\n" not in str(err.value)
        assert leftovers(disk / "run") == []


def test_the_runs_log_on_a_full_disk_is_one_line(tmp_path):
    with full_disk(tmp_path / "disk", "4k") as disk:  # config.yaml takes the only page: the first log line fails
        trainer = build_trainer(tiny_config(save=str(disk / "run"), train_iters=4, log_interval=1))
        with pytest.raises(UserError) as err:
            trainer.train()
        message = str(err.value)
        assert message.startswith("cannot write the run's ") and "the disk is full" in message and "\n" not in message


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    run, _, _ = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "gpt2")
    return run


def test_export_whose_tokenizer_meets_the_full_disk_is_one_line_and_leaves_nothing(checkpoint, tmp_path, capsys):
    with full_disk(tmp_path / "disk", "8k") as disk:  # vocab.json and merges.txt fit; tokenizer.json does not
        line = one_error_line(export_argv(checkpoint, disk / "hf"), capsys)
        assert line.startswith(f"error: cannot write --output {disk / 'hf'}: ") and "the disk is full" in line
        assert list(disk.iterdir()) == []
