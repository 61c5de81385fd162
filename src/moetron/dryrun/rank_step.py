"""One simulated rank: moetron's own build, trainer and `train_step()` on fake CUDA tensors, measured.

    record = run_rank(cfg, rank=5, world_size=64, steps=2)

The config is checked first as `moetron train` checks it (`validate()`, less this machine's data and output files).
The process group is torch's fake one (backend "fake": every collective returns at once and moves no data), the
mesh is built before the fake mode (DeviceMesh reads its rank table's values), then everything else runs inside
FakeTensorMode: the model is built on `cuda:0` (`parallelize.build`, the run's real recipe), the Trainer wraps it,
and each step runs under `MemTracker` (live bytes by category, and the peak's module and phase) and `StepObserver`
(host reads, collectives, fp32 GEMMs). The numbers reported per step are the last step's (step 2 holds the
optimizer's state: the steady state); the peak is the largest over all steps.
"""

from __future__ import annotations

import sys
import time

import torch

from moetron.config import RunConfig
from moetron.dryrun import attention_kernels, observe
from moetron.dryrun.observe import StepObserver, where

CATEGORIES = {  # MemTracker's reference types -> the report's names
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "other",
}


class FakeBatches:
    """The loader's interface with zero tokens: a dry run reads no data (values never matter here)."""

    def __init__(self, mbs: int, seq: int, cp_rank: int = 0, cp_size: int = 1):
        self.mbs, self.seq, self.cp_rank, self.cp_size, self.i = mbs, seq, cp_rank, cp_size, 0

    @property
    def next_first_sample(self) -> int:
        return self.i * self.mbs

    def next_micro_batch(self) -> torch.Tensor:
        self.i += 1
        return torch.zeros(self.mbs, self.seq + 1, dtype=torch.long)

    def local_chunks(self, x_BT: torch.Tensor) -> torch.Tensor:
        from moetron.data.context_chunks import take_zigzag

        return take_zigzag(x_BT, self.cp_rank, self.cp_size)

    def state_dict(self) -> dict:
        return {"consumed_samples": self.i * self.mbs}


def note_ep_routes() -> None:
    """Before each default all-to-all exchange, tell the stand-ins how many routes the micro-batch has (so its
    split sizes are balanced ones, `stand_ins.py`)."""
    from moetron.dryrun import stand_ins
    from moetron.parallel.ep.all_to_all import AllToAllDispatcher

    assert hasattr(AllToAllDispatcher, "exchange_counts"), "dry run: AllToAllDispatcher.exchange_counts is gone"
    dispatch = AllToAllDispatcher.dispatch
    if getattr(dispatch, "dryrun", False):
        return

    def noted(self, x_TD, routing):
        capacity = routing.capacity_source if isinstance(routing.capacity_source, int) else None
        cap = None if capacity is None else capacity * self.num_local
        stand_ins.note_routes(routing.expert_ids_TK.numel(), self.ep_size, self.ep_rank, cap)
        return dispatch(self, x_TD, routing)

    noted.dryrun = True
    AllToAllDispatcher.dispatch = noted
    from moetron.model.moe.layer import MoELayer

    forward = MoELayer.forward

    def forward_noted(self, *args, **kwargs):  # which layer's routing sizes the reads inside it
        stand_ins.note_layer(self.layer_index)
        return forward(self, *args, **kwargs)

    MoELayer.forward = forward_noted


def init_fake_group(rank: int, world_size: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


class PeakWhere:
    """Wraps MemTracker's peak bookkeeping: when the peak grows, note the innermost module, the phase and the step."""

    def __init__(self, tracker, device: torch.device):
        self.tracker, self.device = tracker, device
        self.step = 0
        self.at = {"module": "", "phase": "", "step": 0, "where": ""}
        original = tracker._update_peak_stats

        def update(peak_state) -> None:
            before = tracker._peak_mem.get(device, 0)
            original(peak_state)
            if tracker._peak_mem.get(device, 0) > before:
                self.at = self._now()

        tracker._update_peak_stats = update
        tracker._pre_fw_hook = self._each_call_anew(tracker._pre_fw_hook)
        track = tracker._track

        def track_the_ranks_own(reftype, tensor) -> None:  # not DTensor's global-shape propagation (patches.py)
            if not observe.PROPAGATING[0]:
                track(reftype, tensor)

        tracker._track = track_the_ranks_own

    def _each_call_anew(self, pre_forward):
        # MemTracker refuses a root module's second forward before `reset_mod_stats` (it reads it as a second
        # iteration), but a step calls the model once per micro-batch (gradient accumulation, pipeline stages).
        # Only the global peak and categories are read here: forget that module's own stats and track it again.
        tracker = self.tracker

        def pre_forward_each_call(module, inputs) -> None:
            name = tracker._mod_tracker.get_known_fqn(module)
            others = set(tracker._mod_tracker.parents) - {name}
            if module in tracker.memory_tracking and not tracker._mod_tracker.is_bw and others <= {"Global"}:
                del tracker.memory_tracking[module]
            pre_forward(module, inputs)

        return pre_forward_each_call

    def _now(self) -> dict:
        mods = self.tracker._mod_tracker
        parents = [p for p in mods.parents if p != "Global"]
        module = max(parents, key=lambda p: p.count("."), default="")
        phase = "optimizer" if self.tracker._in_opt else ("backward" if mods.is_bw else "forward")
        return {"module": module, "phase": phase, "step": self.step, "where": where(sys._getframe(2))}


def moe_module_names(model) -> set[str]:
    moe = {id(m) for m in model.moe_layers()}
    return {name for name, module in model.named_modules() if id(module) in moe}


def build_trainer(cfg: RunConfig, env, mesh):
    """The rank's Trainer as `moetron train` builds it (inside the fake mode: every tensor on the fake cuda:0)."""
    from moetron.parallel.parallelize import build
    from moetron.train.trainer import Trainer

    dims = cfg.dims(env.world_size)
    coords = dims.coordinates(env.rank)
    parallel = build(cfg, mesh, env.device)
    loader = FakeBatches(cfg.train.micro_batch_size, cfg.model.seq_length, coords.cp, dims.cp)
    trainer = Trainer(cfg, env, parallel, loader)
    trainer.model.train()
    return trainer


class StepProbe:
    """The instruments around a trainer's steps: MemTracker (bytes by category, the peak and where) and the
    StepObserver (host reads, collectives, fp32 GEMMs, CPU tensors), both told which module is running."""

    def __init__(self, trainer):
        from torch.distributed._tools.mem_tracker import MemTracker

        self.trainer = trainer
        moe_names = moe_module_names(trainer.model)
        self.local_moe_layers = len(moe_names)
        self.moe_suffixes = tuple("." + name for name in moe_names)  # the tracker names modules from the
        self.tracker = MemTracker()  # outermost wrapper (DDP's `module.`): MoE layers are matched by suffix
        self.tracker.track_external(trainer.model, trainer.optimizer)
        self.peak = PeakWhere(self.tracker, trainer.env.device)
        self.observer = StepObserver(self.in_model, self.in_moe_layer, self.module_now)

    def parents(self) -> set[str]:
        return self.tracker._mod_tracker.parents

    def in_model(self) -> bool:
        return len(self.parents()) > 1  # "Global" is always there

    def in_moe_layer(self) -> bool:
        return any(p.endswith(suffix) for p in self.parents() for suffix in self.moe_suffixes)

    def module_now(self) -> str:
        return max((p for p in self.parents() if p != "Global"), key=lambda p: p.count("."), default="")

    def run(self, steps: int) -> list[float]:
        """`steps` training steps; the seconds of each. The per-step records are the last step's."""
        seconds = []
        # anomaly mode keeps each autograd node's forward stack: a backward op's `where` is its forward's line
        # (check_nan off: it would read values)
        with self.tracker, self.observer, torch.autograd.set_detect_anomaly(True, check_nan=False):
            for step in range(1, steps + 1):
                self.peak.step = step
                self.tracker.reset_mod_stats()
                self.observer.reset()
                attention_kernels.CHOICES.clear()
                start = time.perf_counter()
                self.trainer.train_step()
                seconds.append(time.perf_counter() - start)
        return seconds

    def record(self) -> dict:
        snapshot = self.tracker.get_tracker_snapshot("peak").get(self.trainer.env.device, {})
        observer = self.observer
        return {
            "peak_bytes": int(snapshot.get("Total", 0)),
            "peak_by_category": {CATEGORIES.get(k, k): int(v) for k, v in snapshot.items() if k != "Total"},
            "peak_at": self.peak.at,
            "host_reads": dict(observer.reads),
            "host_reads_per_step": sum(observer.reads.values()),
            "moe_layer_reads_per_step": observer.moe_reads,
            "local_moe_layers": self.local_moe_layers,
            "collectives": [
                [op, dtype, size, n, observer.collective_sites.get((op, dtype, size), "?")]
                for (op, dtype, size), n in sorted(observer.collectives.items())
            ],
            "fp32_gemms": [[op, at, n] for (op, at), n in sorted(observer.fp32_gemms.items())],
            "cpu_ops": [[op, at, n] for (op, at), n in sorted(observer.cpu_ops.items())],
            "attention_kernels": {k: attention_kernels.CHOICES.get(k, 0) for k in attention_kernels.KERNELS},
        }


def check_config(cfg: RunConfig, world_size: int) -> None:
    """moetron's own `validate()`, as `moetron train` runs it, less the problems of this machine's files: a dry run
    reads no data and writes nothing (the data and output sections' problems are not its). A `ConfigError`."""
    from moetron.errors import ConfigError
    from moetron.validate import output_problems, validate

    not_ours = {*cfg.data.problems(), *cfg.data.tokenizer_file_problems(), *output_problems(cfg)}
    problems = [p for p in validate(cfg, world_size) if p not in not_ours]
    if problems:
        raise ConfigError(problems)


def run_rank(
    cfg: RunConfig, rank: int, world_size: int, steps: int, routing: dict[int, list[float]] | None = None
) -> dict:
    """Build and step rank `rank` of `world_size` on a fake cuda:0; its measurements (see `report.py`).
    `routing`: routes per expert by MoE layer index (a run's measured loads) instead of balanced routing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moetron.dryrun import stand_ins
    from moetron.parallel.env import DistEnv
    from moetron.parallel.mesh import ParallelMesh

    started = time.perf_counter()
    check_config(cfg, world_size)
    note_ep_routes()
    stand_ins.use_routing(routing or {})
    init_fake_group(rank, world_size)
    env = DistEnv(rank=rank, world_size=world_size, device=torch.device("cuda", 0))
    dims = cfg.dims(world_size)
    mesh = ParallelMesh.build(dims, env)  # outside the fake mode: DeviceMesh reads its rank table
    with FakeTensorMode(allow_non_fake_inputs=True):
        trainer = build_trainer(cfg, env, mesh)
        built = time.perf_counter()
        probe = StepProbe(trainer)
        step_seconds = probe.run(steps)
    return {
        "rank": rank,
        "pp_stage": dims.coordinates(rank).pp,
        "micro_batches": cfg.num_micro_batches(dims.dp),
        **probe.record(),
        "build_seconds": built - started,
        "step_seconds": step_seconds,
    }
