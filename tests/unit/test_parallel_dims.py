"""ParallelDims: every rank's coordinates and every group, against Megatron-LM's and DeepSpeed's documented
layouts written out by hand (no process group needed: the layout is arithmetic)."""

from __future__ import annotations

import itertools

import pytest

from moetron.parallel.dims import DENSE_DIMS, EXPERT_DIMS, ParallelDims


def dims(world: int, pp: int = 1, tp: int = 1, ep: int = 1, etp: int = 1) -> ParallelDims:
    return ParallelDims(world_size=world, dp=world // (pp * tp), tp=tp, pp=pp, ep=ep, etp=etp)


# (pp, tp, ep, etp) on 8 ranks → the groups by hand. etp = tp is DeepSpeed's expert layout (EP drawn from the
# data-parallel ranks of one TP index); etp = 1 with tp > 1 is Megatron-Core's MoE parallel folding.
WORLD_8 = {
    (1, 1, 1, 1): {
        "dp": [[0, 1, 2, 3, 4, 5, 6, 7]],
        "tp": [[r] for r in range(8)],
        "ep": [[r] for r in range(8)],
        "edp": [[0, 1, 2, 3, 4, 5, 6, 7]],
    },
    (1, 1, 2, 1): {  # DeepSpeed's E+D: contiguous EP blocks, strided EDP
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "edp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    },
    (1, 1, 4, 1): {"ep": [[0, 1, 2, 3], [4, 5, 6, 7]], "edp": [[0, 4], [1, 5], [2, 6], [3, 7]]},
    (1, 1, 8, 1): {"ep": [[0, 1, 2, 3, 4, 5, 6, 7]], "edp": [[r] for r in range(8)]},
    (1, 2, 1, 2): {  # Megatron: TP neighbours, DP strided by TP
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "ep": [[r] for r in range(8)],
        "edp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "etp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    },
    (1, 2, 2, 2): {  # DeepSpeed with TP 2: EP among the data-parallel ranks of one TP index
        "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    },
    (1, 2, 4, 2): {"ep": [[0, 2, 4, 6], [1, 3, 5, 7]], "edp": [[r] for r in range(8)]},
    (1, 2, 2, 1): {  # folding: EP = 2 spans the TP pair, attention TP 2 and experts EP 2 on the same ranks
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "edp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "etp": [[r] for r in range(8)],
    },
    (1, 2, 8, 1): {"ep": [[0, 1, 2, 3, 4, 5, 6, 7]], "edp": [[r] for r in range(8)]},
    (1, 4, 4, 1): {
        "tp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    },  # fmt: skip
    (2, 1, 1, 1): {"pp": [[0, 4], [1, 5], [2, 6], [3, 7]], "dp": [[0, 1, 2, 3], [4, 5, 6, 7]]},
    (2, 1, 2, 1): {  # experts per stage: EP and EDP never cross a pipeline stage
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "edp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    },
    (2, 2, 1, 2): {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    },
    (2, 2, 2, 2): {"ep": [[0, 2], [1, 3], [4, 6], [5, 7]], "edp": [[r] for r in range(8)]},
    (2, 2, 2, 1): {"ep": [[0, 1], [2, 3], [4, 5], [6, 7]], "edp": [[0, 2], [1, 3], [4, 6], [5, 7]]},
    (4, 2, 1, 2): {
        "pp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp": [[r] for r in range(8)],
    },  # fmt: skip
    (8, 1, 1, 1): {"pp": [[0, 1, 2, 3, 4, 5, 6, 7]], "dp": [[r] for r in range(8)]},
}


@pytest.mark.parametrize("layout", list(WORLD_8), ids=lambda k: "pp{}-tp{}-ep{}-etp{}".format(*k))
def test_world_8_groups_equal_the_documented_layouts(layout):
    pp, tp, ep, etp = layout
    d = dims(8, pp=pp, tp=tp, ep=ep, etp=etp)
    for name, groups in WORLD_8[layout].items():
        assert d.groups(name) == groups, name


def test_megatron_and_deepspeed_world_16_examples():
    # Megatron-LM (parallel_state docstring): world 16, tp 2, pp 4
    megatron = dims(16, pp=4, tp=2)
    assert megatron.groups("tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert megatron.groups("pp") == [[r, r + 4, r + 8, r + 12] for r in range(4)]
    assert megatron.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    # DeepSpeed (utils/groups.py docstring): world 16, model parallel 2, expert parallel 4
    deepspeed = dims(16, tp=2, ep=4, etp=2)
    assert deepspeed.groups("ep") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert deepspeed.groups("edp") == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]


def valid_layouts(world: int):
    for pp, tp in itertools.product([1, 2, 4, 8], repeat=2):
        if world % (pp * tp):
            continue
        dp = world // (pp * tp)
        for ep, etp in itertools.product([1, 2, 4, 8], [1, tp]):
            if (dp * tp) % (ep * etp) == 0 and (etp == 1 or dp % ep == 0):
                yield dims(world, pp=pp, tp=tp, ep=ep, etp=etp)


def test_every_world_8_layout_partitions_the_ranks_and_round_trips_coordinates():
    layouts = list(valid_layouts(8))
    assert len(layouts) > len(WORLD_8)
    for d in layouts:
        for name in DENSE_DIMS + EXPERT_DIMS:
            groups = d.groups(name)
            assert sorted(r for g in groups for r in g) == list(range(8)), (d, name)
            assert all(len(g) == d.sizes[name] for g in groups), (d, name)
        assert d.pp * d.dp * d.tp == 8 and d.edp * d.ep * d.etp == d.dp * d.tp
        for rank in range(8):
            c = d.coordinates(rank)
            assert d.rank_of(pp=c.pp, dp=c.dp, tp=c.tp) == rank
            assert d.rank_of(pp=c.pp, edp=c.edp, ep=c.ep, etp=c.etp) == rank
            if d.etp == d.tp:  # expert-TP shard = the attention TP rank, EP from the data-parallel ranks
                assert c.etp == c.tp and c.dp == c.edp * d.ep + c.ep


def test_problems_name_every_flag_and_the_fix():
    assert dims(8, ep=2).problems([8]) == []
    text = "\n".join(ParallelDims(world_size=8, dp=8, ep=3, etp=2).problems([6, 8]))
    assert "--expert-tensor-parallel-size 2 must be 1" in text and "expert count(s) [8]" in text
    assert "not divisible" not in text  # the etp problem is reported, not a consequence of it
    deepspeed_style = ParallelDims(world_size=8, dp=2, tp=4, ep=4, etp=4).problems()
    assert any("data-parallel size 2 is not divisible by --moe-expert-parallel-size 4" in p for p in deepspeed_style)


def test_an_expert_parallel_size_that_does_not_divide_names_the_flag_that_does():
    """A recipe's EP under pipelining (its data-parallel ranks halved): the flag value that runs, not a riddle."""
    (two_stages,) = dims(2, pp=2, ep=8).problems([64] * 6)
    assert two_stages == (
        "data-parallel size 1 (world size 2 over 2 pipeline stages) is not divisible by --moe-expert-parallel-size "
        "8; experts are sharded over those ranks: pass --moe-expert-parallel-size 1 (every rank holds all experts)"
    )
    (four_ranks,) = dims(8, pp=2, ep=8).problems([64, 128])
    assert "pass --moe-expert-parallel-size 4 (a divisor of 4)" in four_ranks
    assert dims(8, pp=2, ep=4).problems([64, 128]) == []  # the value it names is accepted


def test_context_parallel_layout_is_megatrons_order():
    """Megatron's rank order with context parallelism, fastest first: tp, cp, dp, pp. World 8, tp 2, cp 2 → TP
    [0, 1], …; CP [0, 2], [1, 3], [4, 6], [5, 7]; DP [0, 4], [1, 5], …; the gradient replicas (dp × cp) of each TP
    index [0, 2, 4, 6], [1, 3, 5, 7]."""
    d = ParallelDims(world_size=8, dp=2, tp=2, cp=2)
    assert d.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]] and d.sizes["dp_cp"] == 4
    for rank in range(8):
        c = d.coordinates(rank)
        assert d.rank_of(pp=c.pp, dp=c.dp, cp=c.cp, tp=c.tp) == rank
    # EP folded over dp × cp: world 4, cp 2, ep 2 → EP = the CP pairs [0, 1], [2, 3]; EDP [0, 2], [1, 3]
    folded = ParallelDims(world_size=4, dp=2, cp=2, ep=2)
    assert folded.groups("cp") == folded.groups("ep") == [[0, 1], [2, 3]]
    assert folded.groups("edp") == [[0, 2], [1, 3]] and folded.problems([4]) == []
    # EP over all four replicas spans data- and context-parallel ranks
    assert ParallelDims(world_size=4, dp=2, cp=2, ep=4).groups("ep") == [[0, 1, 2, 3]]


def test_context_parallel_problems():
    assert ParallelDims(world_size=2, dp=1, cp=2).problems() == []
    world = ParallelDims(world_size=3, dp=1, cp=2).problems()
    assert world == [
        "world size 3 is not divisible by --tensor-model-parallel-size 1 × --pipeline-model-parallel-size 1 × "
        "--context-parallel-size 2; change the process count or the degrees"
    ]
    assert ParallelDims(world_size=2, dp=1, cp=0).problems() == ["--context-parallel-size must be >= 1, got 0"]
    ep = ParallelDims(world_size=4, dp=1, cp=2, tp=2, ep=3).problems([6])
    assert any("data- × context- × tensor-parallel size 4 is not divisible by --moe-expert-parallel-size 3" in p
               for p in ep)  # fmt: skip
