"""`plan --measure`'s worker times each training step through the `on_step` it hands the trainer, not by patching it."""

from __future__ import annotations

from trainer_support import build_trainer, tiny_config

from moetron.plan import measure_worker


def test_worker_notes_one_cpu_time_per_step_without_patching_the_trainer(tmp_path, monkeypatch):
    monkeypatch.setattr(measure_worker, "CPU_STEP_S", [])
    cfg = tiny_config(train_iters=3, log_interval=1, output_dir=str(tmp_path))
    trainer = build_trainer(cfg)
    trainer.on_step = measure_worker.note_step  # what `moetron train` hands the trainer for the worker
    assert trainer.train() == 0
    assert len(measure_worker.CPU_STEP_S) == 3 and all(s > 0 for s in measure_worker.CPU_STEP_S)


def test_worker_records_the_end_of_a_run_once_through_the_finish_hook(tmp_path, monkeypatch):
    """A finished run's memory record is written by `DistEnv.finish`'s observer (under torchrun it leaves with
    os._exit, which skips atexit), once, without replacing `DistEnv.finish`."""
    import json

    from moetron.parallel import env as env_module
    from moetron.parallel.env import DistEnv

    monkeypatch.setattr(env_module, "RUN_FINISHED_OBSERVERS", [])
    monkeypatch.setattr(measure_worker, "RECORDED", [])
    monkeypatch.setattr(measure_worker, "CPU_STEP_S", [0.5])
    monkeypatch.setenv(measure_worker.OUT_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(measure_worker.atexit, "register", lambda fn: None)  # not at this test process's exit
    handed = []
    monkeypatch.setattr("moetron.cli.main", lambda argv, **options: handed.append(options) or DistEnv().finish(0))
    finish = DistEnv.__dict__["finish"]
    assert measure_worker.main() == 0
    assert DistEnv.__dict__["finish"] is finish
    assert handed == [{"on_step": measure_worker.note_step}]  # the trainer's step results reach the worker
    written = json.loads((tmp_path / "rank3.json").read_text())
    assert written["rank"] == 3 and written["cpu_step_s"] == [0.5] and written["vmhwm_bytes"] > 0
    (tmp_path / "rank3.json").unlink()
    measure_worker.record()  # atexit's turn: already recorded
    assert not (tmp_path / "rank3.json").exists()
