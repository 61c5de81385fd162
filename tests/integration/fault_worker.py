"""`moetron train` with a fault injected from the outside (the trainer has no test hooks), for the fault suite.

    MOETRON_TEST_FAULT=<where>:<iteration>[:<signal>] python fault_worker.py train --flags ...

<where> is one of
  step      as iteration <iteration> starts (mid-training)
  staging   in the save of <iteration>, right after its staging directory was created
  shards    in that save, after every tensor was written, before state.json
  renamed   in that save, after the staging directory became iter_*, before `latest` moved
  latest    in that save, after `latest` moved, before old checkpoints are pruned
<signal> (default KILL) is sent to this process there; with `rank1-` before <where> only global rank 1 does it.
<signal> RAISE raises a RuntimeError there instead (an internal error of that rank alone).
"""

from __future__ import annotations

import os
import signal
import sys


def install(spec: str) -> None:
    where, iteration, *rest = spec.split(":")
    raising = rest == ["RAISE"]
    sig = None if raising else getattr(signal, f"SIG{rest[0]}" if rest else "SIGKILL")
    if where.startswith("rank1-"):
        where = where[len("rank1-") :]
        if os.environ.get("RANK", "0") != "1":
            return
    iteration = int(iteration)

    def fire():
        if raising:
            raise RuntimeError(f"injected fault at {where} {iteration} on rank {os.environ.get('RANK', '0')}")
        os.kill(os.getpid(), sig)

    from moetron.checkpoint import files
    from moetron.train import trainer as trainer_module

    if where == "step":
        original_step = trainer_module.Trainer.train_step

        def train_step(self):
            if self.progress.iteration + 1 == iteration:
                fire()
            return original_step(self)

        trainer_module.Trainer.train_step = train_step
        return
    hooks = {
        "staging": (files, "prepare_staging", "after"),
        "shards": (files, "write_json", "before"),
        "renamed": (files, "write_text_atomic", "before"),
        "latest": (files, "prune", "before"),
    }
    module, name, when = hooks[where]
    original, saving = getattr(module, name), [None]  # the iteration being saved right now

    def hooked(*args, **kwargs):
        if saving[0] == iteration and when == "before":
            fire()
        out = original(*args, **kwargs)
        if saving[0] == iteration and when == "after":
            fire()
        return out

    original_save = trainer_module.save_checkpoint

    def save_checkpoint(run_dir, it, *args, **kwargs):
        saving[0] = it
        try:
            return original_save(run_dir, it, *args, **kwargs)
        finally:
            saving[0] = None

    setattr(module, name, hooked)
    trainer_module.save_checkpoint = save_checkpoint


if __name__ == "__main__":
    if os.environ.get("MOETRON_TEST_FAULT"):
        install(os.environ["MOETRON_TEST_FAULT"])
    from moetron.cli import main

    sys.exit(main(sys.argv[1:]))
