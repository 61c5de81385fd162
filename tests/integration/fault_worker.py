"""`moetron train` with a fault injected from the outside (the trainer has no test hooks), for the fault suite.

    MOETRON_TEST_FAULT=<where>:<iteration>[:<signal>] python fault_worker.py train --flags ...

<where> is one of
  step      as iteration <iteration> starts (mid-training)
  staging   in the save of <iteration>, right after its staging directory was created
  shards    in that save, after every tensor was written, before state.json
  renamed   in that save, after the staging directory became iter_*, before `latest` moved
  latest    in that save, after `latest` moved, before old checkpoints are pruned
  write     in that save, after DCP wrote its first tensor (with --async-save: in the background thread, while
            training goes on)
Under --async-save the phases are those of `AsyncCheckpointer`'s save: its part between steps and its thread's.
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

    import torch.distributed.checkpoint.filesystem as dcp_files

    from moetron.checkpoint import files
    from moetron.checkpoint.async_save import AsyncCheckpointer
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
        "write": (dcp_files, "_write_item", "after"),
    }
    module, name, when = hooks[where]
    original = getattr(module, name)
    saving: list[int] = []  # the iterations being saved now (with --async-save: by the loop and by the writer thread)

    def hooked(*args, **kwargs):
        if iteration in saving and when == "before":
            fire()
        out = original(*args, **kwargs)
        if iteration in saving and when == "after":
            fire()
        return out

    def saving_while(method, position: int):  # `method`'s argument `position` is the iteration it saves
        def wrapped(*args, **kwargs):
            saving.append(args[position])
            try:
                return method(*args, **kwargs)
            finally:
                saving.remove(args[position])

        return wrapped

    setattr(module, name, hooked)
    trainer_module.save_checkpoint = saving_while(trainer_module.save_checkpoint, 1)
    async_save = saving_while(AsyncCheckpointer.save, 2)  # (self, run_dir, iteration, ...)

    def save_after_the_write_in_flight(self, *args, **kwargs):  # the write of an earlier save is not this save's
        self.wait()
        return async_save(self, *args, **kwargs)

    AsyncCheckpointer.save = save_after_the_write_in_flight
    AsyncCheckpointer._finish = saving_while(AsyncCheckpointer._finish, 3)  # (self, future, run_dir, iteration, ...)


if __name__ == "__main__":
    if os.environ.get("MOETRON_TEST_FAULT"):
        install(os.environ["MOETRON_TEST_FAULT"])
    from moetron.cli import main

    sys.exit(main(sys.argv[1:]))
