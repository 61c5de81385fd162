"""`plan --measure`'s worker times each training step through the trainer's observer hook, not by patching it."""

from __future__ import annotations

from trainer_support import build_trainer, tiny_config

from moetron.plan import measure_worker
from moetron.train import trainer as trainer_module
from moetron.train.trainer import Trainer


def test_worker_notes_one_cpu_time_per_step_without_patching_the_trainer(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_module, "STEP_CPU_TIME_OBSERVERS", [])
    monkeypatch.setattr(trainer_module.Trainer, "train_step", Trainer.train_step)  # undone if time_steps patches it
    monkeypatch.setattr(measure_worker, "CPU_STEP_S", [])
    original_step = Trainer.__dict__["train_step"]
    measure_worker.time_steps()
    assert Trainer.__dict__["train_step"] is original_step  # the trainer's own step runs
    cfg = tiny_config(train_iters=3, log_interval=1, output_dir=str(tmp_path))
    assert build_trainer(cfg).train() == 0
    assert len(measure_worker.CPU_STEP_S) == 3 and all(s > 0 for s in measure_worker.CPU_STEP_S)
