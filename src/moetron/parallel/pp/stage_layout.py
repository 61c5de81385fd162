"""Pipeline layout: which layers each stage holds and which stages each pipeline rank runs (pure arithmetic).

    layout = PipelineLayout.build(num_layers=8, pp=2, virtual_layers=2)   # 4 stages of 2 layers
    layout.stage_layers      # ((0, 1), (2, 3), (4, 5), (6, 7))
    layout.stages_of(0)      # (0, 2): rank 0 runs stages 0 and 2 (Megatron's interleaving, torch's "loop" order)
    layout.layers_of(1)      # (2, 3, 6, 7): the layers rank 1 holds, by their GLOBAL index

`S = pp · v` stages, `v` virtual stages per rank (`--num-layers-per-virtual-pipeline-stage L`: v = num_layers /
(pp · L), Megatron's interleaved schedule); stage s runs on pipeline rank `s mod pp`. Without interleaving the
layers are split evenly, or unevenly with Megatron-Core's `--decoder-first-pipeline-num-layers` /
`--decoder-last-pipeline-num-layers` (the first stage also holds the embedding and the last the LM head, so
giving them fewer layers balances the stages); the middle stages share the rest evenly. The first and last stage
may hold 0 layers (embedding or head only); a middle stage holds at least one.

Everything here is checked in `pipeline_problems` before any process group exists (moetron.validate).
"""

from __future__ import annotations

from dataclasses import dataclass

# --pipeline-schedule → the torch.distributed.pipelining schedule that runs it (moetron.parallel.pp.schedules)
SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe", "zero-bubble")
MULTI_STAGE = ("interleaved-1f1b", "zero-bubble")  # schedules that can run several stages per rank


def schedule_name(schedule: str | None, virtual_layers: int | None) -> str:
    """The schedule a config asks for: `--pipeline-schedule`, else (Megatron's rule) interleaved 1F1B when
    `--num-layers-per-virtual-pipeline-stage` is set, plain 1F1B otherwise."""
    if schedule:
        return schedule
    return "interleaved-1f1b" if virtual_layers else "1f1b"


def splits_backward(schedule: str) -> bool:
    """Whether the schedule splits each backward in two (inputs, then weights): zero bubble."""
    return schedule == "zero-bubble"


@dataclass(frozen=True)
class PipelineLayout:
    pp: int
    stage_layers: tuple[tuple[int, ...], ...]  # global layer indices of every stage, in stage order
    schedule: str = "1f1b"

    @classmethod
    def build(
        cls,
        num_layers: int,
        pp: int,
        schedule: str | None = None,
        virtual_layers: int | None = None,
        first_layers: int | None = None,
        last_layers: int | None = None,
    ) -> PipelineLayout:
        """The layout of a config that `pipeline_problems` accepts (raises ValueError otherwise)."""
        sizes = stage_sizes(num_layers, pp, virtual_layers, first_layers, last_layers)
        if isinstance(sizes, str):
            raise ValueError(sizes)
        starts = [sum(sizes[:s]) for s in range(len(sizes))]
        layers = tuple(tuple(range(start, start + n)) for start, n in zip(starts, sizes, strict=True))
        return cls(pp, layers, schedule_name(schedule, virtual_layers))

    @property
    def splits_backward(self) -> bool:
        """A pipeline whose schedule splits each backward in two (`splits_backward`)."""
        return self.pp > 1 and splits_backward(self.schedule)

    @classmethod
    def from_config(cls, num_layers: int, parallel) -> PipelineLayout:
        """From a `ParallelConfig` (duck-typed: this module stays free of the config package)."""
        p = parallel
        return cls.build(
            num_layers,
            p.pipeline_model_parallel_size,
            p.pipeline_schedule,
            p.num_layers_per_virtual_pipeline_stage,
            p.decoder_first_pipeline_num_layers,
            p.decoder_last_pipeline_num_layers,
        )

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    @property
    def virtual(self) -> int:
        return self.num_stages // self.pp

    def rank_of_stage(self, stage: int) -> int:
        return stage % self.pp

    def stages_of(self, pp_rank: int) -> tuple[int, ...]:
        return tuple(s for s in range(self.num_stages) if self.rank_of_stage(s) == pp_rank)

    def layers_of(self, pp_rank: int) -> tuple[int, ...]:
        return tuple(i for s in self.stages_of(pp_rank) for i in self.stage_layers[s])

    def holds_first(self, pp_rank: int) -> bool:
        return self.rank_of_stage(0) == pp_rank

    def holds_last(self, pp_rank: int) -> bool:
        return self.rank_of_stage(self.num_stages - 1) == pp_rank


def stage_sizes(
    num_layers: int, pp: int, virtual_layers: int | None, first: int | None, last: int | None
) -> list[int] | str:
    """Layers per stage, or the problem (naming the flags and the fix) when the split is impossible."""
    if virtual_layers is not None:
        if first is not None or last is not None:
            return (
                "--decoder-first/last-pipeline-num-layers cannot be combined with "
                "--num-layers-per-virtual-pipeline-stage (every virtual stage has that many layers); drop one"
            )
        if virtual_layers < 1 or num_layers % (pp * virtual_layers):
            return (
                f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp} × "
                f"--num-layers-per-virtual-pipeline-stage {virtual_layers}; use a divisor of {num_layers // pp or 1}"
            )
        return [virtual_layers] * (num_layers // virtual_layers)
    if first is None and last is None:
        if num_layers % pp:
            return (
                f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp}; change either, "
                f"or split unevenly with --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"
            )
        return [num_layers // pp] * pp
    return _uneven_sizes(num_layers, pp, first, last)


def _uneven_sizes(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int] | str:
    flags = "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"
    if pp == 1:
        return f"{flags} need --pipeline-model-parallel-size > 1"
    if min(n for n in (first, last) if n is not None) < 0:
        return f"{flags} must be >= 0, got {first} / {last}"
    ends = [n for n in (first, last) if n is not None]
    middle = pp - len(ends)
    rest = num_layers - sum(ends)
    if rest < 0 or (middle == 0 and rest) or (middle and (rest < middle or rest % middle)):
        where = f"the other {middle} stage(s)" if middle else "no other stage"
        return (
            f"{flags} ({first} / {last}) leave {rest} of --num-layers {num_layers} for {where}; the middle "
            f"stages need an equal share of at least one layer each"
        )
    share = rest // middle if middle else 0
    return [first if first is not None else share] + [share] * (pp - 2) + [last if last is not None else share]


def micro_batch_problems(schedule: str, pp: int, num_micro: int) -> list[str]:
    """What torch's schedules require of the micro-batch count (global batch / (micro batch × dp))."""
    fix = "raise --global-batch-size (micro-batches = global batch / (micro batch × data-parallel size))"
    if schedule == "1f1b" and num_micro < pp:
        return [f"--pipeline-schedule 1f1b needs at least {pp} micro-batches (one per stage), got {num_micro}; {fix}"]
    if schedule in MULTI_STAGE:
        rounds = max(1, num_micro // pp)
        if num_micro % rounds:
            return [
                f"--pipeline-schedule {schedule} runs micro-batches in rounds of {pp} (the pipeline size): "
                f"{num_micro} micro-batches is not a multiple of {rounds} rounds; use a multiple of {pp}"
            ]
    return []


def pipeline_problems(num_layers: int, parallel, num_micro: int) -> list[str]:
    """Every problem of the pipeline flags (`ParallelConfig`), each with its fix; [] when pp == 1 and unused."""
    p = parallel
    pp, virtual = p.pipeline_model_parallel_size, p.num_layers_per_virtual_pipeline_stage
    schedule = schedule_name(p.pipeline_schedule, virtual)
    if schedule not in SCHEDULES:
        return [f"--pipeline-schedule {schedule!r} is not one of {', '.join(SCHEDULES)}"]
    if pp < 1:
        return []  # reported with the other degrees (dims.problems)
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    if pp == 1:
        given = {"--num-layers-per-virtual-pipeline-stage": virtual, "--decoder-first-pipeline-num-layers": first,
                 "--decoder-last-pipeline-num-layers": last}  # fmt: skip
        flags = " ".join(f"{flag} {value}" for flag, value in given.items() if value is not None)
        unused = "split pipeline stages, but --pipeline-model-parallel-size is 1; set it > 1 or drop them"
        return [f"{flags} {unused}"] if flags else []
    problems = []
    sizes = stage_sizes(num_layers, pp, virtual, first, last)
    if isinstance(sizes, str):
        problems.append(sizes)
    elif len(sizes) > pp and schedule not in MULTI_STAGE:
        problems.append(
            f"--pipeline-schedule {schedule} runs one stage per rank, but --num-layers-per-virtual-pipeline-stage "
            f"{virtual} gives {len(sizes) // pp}; use --pipeline-schedule interleaved-1f1b or zero-bubble"
        )
    elif num_micro > 0:
        problems += micro_batch_problems(schedule, pp, num_micro)
    return problems
