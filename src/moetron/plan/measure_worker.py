"""`python -m moetron.plan.measure_worker train ...`: `moetron train` in this process, then this rank's peak memory.

`moetron plan --measure` launches it under torchrun instead of `-m moetron`: the run is `moetron train` itself
(same flags, same code path); at exit the worker writes `rank<RANK>.json` into `$MOETRON_MEASURE_DIR` with
  vmhwm_bytes   the process's resident-set high-water mark (/proc/self/status VmHWM: its own peak, not the
                parent's — `ru_maxrss` inherits the launcher's), what a CPU run's tensors cost
  cuda_bytes    torch.cuda.max_memory_allocated() on a GPU run (the tensors; not the CUDA context)
  cpu_step_s    the CPU time (all of the process's threads) of each training step, as the trainer reports it in
                each step's result (`StepResult.cpu_s`, handed to the `on_step` this worker gives `moetron train`): on
                a CPU shared with other work, what a step costs this rank regardless of how long it waited for a core
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

from moetron.process_memory import vmhwm_bytes

OUT_ENV = "MOETRON_MEASURE_DIR"
CPU_STEP_S: list[float] = []
RECORDED: list[bool] = []  # once per process: the run's end is seen by DistEnv.finish and by atexit


def record() -> None:
    out = os.environ.get(OUT_ENV)
    if not out or RECORDED:
        return
    RECORDED.append(True)
    import torch

    cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    rank = os.environ.get("RANK", "0")
    record = {"rank": int(rank), "vmhwm_bytes": vmhwm_bytes(), "cuda_bytes": cuda, "cpu_step_s": CPU_STEP_S}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


def note_step(result) -> None:
    """The trainer's `on_step`: each training step's CPU time into CPU_STEP_S (it logs only wall-clock rates)."""
    CPU_STEP_S.append(result.cpu_s)


def main() -> int:
    # a run that fails returns through atexit; a finished one through DistEnv.finish, which under torchrun leaves
    # with os._exit (gloo's teardown can abort) and so skips atexit: record at both, the first one writes
    from moetron.parallel.env import RUN_FINISHED_OBSERVERS

    atexit.register(record)
    RUN_FINISHED_OBSERVERS.append(record)
    from moetron.cli import main as moetron_main

    return moetron_main(sys.argv[1:], on_step=note_step)


if __name__ == "__main__":
    sys.exit(main())
