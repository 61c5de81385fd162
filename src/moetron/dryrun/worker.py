"""`python -m moetron.dryrun.worker CONFIG.pkl RANK WORLD_SIZE STEPS OUT.json [ROUTING.json]`: one simulated rank
(a child of `moetron dry-run`; ROUTING.json: routes per expert by MoE layer index, from `--routing-from`).

The fake-CUDA shim (`$MOETRON_FAKE_CUDA_SHIM`) is loaded before anything imports torch, then the patches, then the
rank runs (`rank_step.run_rank`). OUT.json receives the rank's record, or `{"error": ..., "op": ..., "where": ...}`:
a GPU-path defect or an error of the run, one line naming the op and the place in moetron it was called from.
Exit status 0 (measured) or 2 (error).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import traceback
from pathlib import Path

from moetron.dryrun.shim import SHIM_ENV, load_shim


def root_cause(err: BaseException) -> BaseException:
    """The exception that started it (torch's pipeline stage re-raises an op's error as its cause)."""
    seen = {id(err)}
    while (err.__cause__ or err.__context__) is not None and id(err.__cause__ or err.__context__) not in seen:
        err = err.__cause__ or err.__context__
        seen.add(id(err))
    return err


def error_record(err: BaseException) -> dict:
    """One line for an exception of the step: the op that raised (when an op did), its first line, and where."""
    from moetron.dryrun.observe import SKIPPED_DIRS, _short

    err = root_cause(err)
    op = getattr(err, "dryrun_op", "")
    at = getattr(err, "dryrun_where", "")
    if not at:  # raised outside an op: the innermost frame outside torch in the traceback
        frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(SKIPPED_DIRS)]
        at = f"{_short(frames[-1].filename)}:{frames[-1].lineno}" if frames else "?"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    first = lines[0] if lines else type(err).__name__
    return {"error": f"{type(err).__name__}: {first}", "op": op, "where": at}


def main(argv: list[str]) -> int:
    load_shim(os.environ.get(SHIM_ENV) or None)
    return run(argv)


def run(argv: list[str]) -> int:
    """The rank's run in a process whose shim is loaded (`main`, or a test's driver that plants a defect first)."""
    config_path, rank, world_size, steps, out, *routing_path = argv
    from moetron.dryrun import patches

    patches.apply_all()
    from moetron.dryrun.rank_step import run_rank

    cfg = pickle.loads(Path(config_path).read_bytes())
    try:
        routing = (
            {int(k): v for k, v in json.loads(Path(routing_path[0]).read_text()).items()} if routing_path else None
        )
        record = run_rank(cfg, int(rank), int(world_size), int(steps), routing)
        status = 0
    except Exception as err:  # noqa: BLE001 - any failure of the step is the report, as one line
        record, status = error_record(err), 2
        if os.environ.get("MOETRON_DRYRUN_TRACEBACK"):
            traceback.print_exc()
    Path(out).write_text(json.dumps(record))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
