"""Run simulated ranks of tiny configs in ONE process, for the dry-run tests (process start-up and imports are most
of a tiny rank's time, so the layouts share one):

    python tests/support/dry_run_driver.py OUT.json WORLD_SIZE RANK "PLANT|FLAGS" ["PLANT|FLAGS" ...]

loads the fake-CUDA shim (`$MOETRON_FAKE_CUDA_SHIM`) before torch, applies the dry run's patches, then for each
spec runs `rank_step.run_rank` on the moetron train FLAGS as rank RANK of WORLD_SIZE, with a GPU-path defect
planted for that run only (PLANT: `none`, `cpu_tensor` — a CPU tensor added to the attention's output — or `item`
— an `.item()` at the start of every MoE layer's forward), and writes the list of records (or error records, as
the worker writes them) with the planted line (`planted_line`) to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from moetron.dryrun.shim import SHIM_ENV, load_shim

load_shim(os.environ.get(SHIM_ENV) or None)  # before torch

import torch  # noqa: E402

from moetron.config_cli import config_from_flags  # noqa: E402
from moetron.dryrun import patches  # noqa: E402
from moetron.dryrun.worker import error_record  # noqa: E402


def plant_cpu_tensor() -> tuple[object, str, object, int]:
    from moetron.model.attention import SelfAttention

    forward = SelfAttention.forward

    def planted(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        return out + torch.ones(out.shape[-1], dtype=out.dtype)  # planted: a CPU tensor on the GPU path

    return SelfAttention, "forward", planted, planted.__code__.co_firstlineno + 2


def plant_item() -> tuple[object, str, object, int]:
    from moetron.model.moe.layer import MoELayer

    forward = MoELayer.forward

    def planted(self, x_BTD):
        if x_BTD.sum().item() > 1e30:  # planted: a host read inside a MoE layer
            pass
        return forward(self, x_BTD)

    return MoELayer, "forward", planted, planted.__code__.co_firstlineno + 1


PLANTS = {"cpu_tensor": plant_cpu_tensor, "item": plant_item}


def run_one(spec: str, rank: int, world_size: int) -> dict:
    from moetron.dryrun.rank_step import run_rank

    plant, flags = spec.split("|", 1)
    owner, name, planted, line = PLANTS[plant]() if plant != "none" else (None, "", None, None)
    original = getattr(owner, name, None)
    if owner is not None:
        setattr(owner, name, planted)
    try:
        record = run_rank(config_from_flags(flags.split())[0], rank, world_size, steps=2)
    except Exception as err:  # noqa: BLE001 - the test reads the worker's one-line record
        record = error_record(err)
    finally:
        if owner is not None:
            setattr(owner, name, original)
    return {**record, "planted_line": line}


def main(argv: list[str]) -> int:
    out, world_size, rank, *specs = argv
    patches.apply_all()
    records = [run_one(spec, int(rank), int(world_size)) for spec in specs]
    Path(out).write_text(json.dumps(records))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
