"""Context parallelism's draws as one process makes them (`parallel/cp/whole_sequence.py`,
`parallel/sequence_dropout.py`): where a rank's tokens sit in the micro-batch, and dropout masks that are the
one-process mask at a rank's positions — zigzag chunks, sequence-parallel shards, and both. The whole runs against
one process are in tests/distributed/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moetron.data.context_chunks import take_zigzag
from moetron.model.moe.routing.deepspeed_gating import LOCAL_ROWS
from moetron.parallel.cp.whole_sequence import micro_batch_rows
from moetron.parallel.sequence_dropout import PositionDropout, shard_dropout, zigzag_dropout


def test_each_ranks_rows_are_its_zigzag_chunks_of_every_sequence():
    batch, seq, size = 3, 8, 2
    order = torch.arange(batch * seq).view(batch, seq)  # the one-process row of each token, [B, S]
    rows = [micro_batch_rows(batch * seq // size, seq // size, rank, size, torch.device("cpu")) for rank in (0, 1)]
    for rank in (0, 1):
        assert torch.equal(rows[rank], take_zigzag(order, rank, size).reshape(-1))
    assert torch.equal(torch.cat(rows).sort().values, torch.arange(batch * seq))  # every row once


def test_local_rows_are_the_identity():
    x = torch.arange(6).view(3, 2)
    assert LOCAL_ROWS.tokens(3) == 3 and LOCAL_ROWS.whole(x) is x and LOCAL_ROWS.mine(x) is x
    torch.manual_seed(0)
    drawn = LOCAL_ROWS.draw(torch.rand, (3, 2))
    torch.manual_seed(0)
    assert torch.equal(drawn, torch.rand(3, 2))


def one_process_mask(shape: tuple[int, ...], p: float, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return nn.Dropout(p).train()(torch.ones(shape))


@pytest.mark.parametrize(("cp", "tp"), [(2, 1), (4, 1), (1, 2), (2, 2)])
def test_dropout_keeps_the_one_process_mask_at_each_ranks_positions(cp, tp):
    """CP's zigzag chunks, then (sequence parallelism, applied after) a contiguous shard of those."""
    batch, seq, hidden, p = 2, 16, 3, 0.4
    full = one_process_mask((batch, seq, hidden), p, seed=7)
    positions = torch.arange(seq)
    for cp_rank in range(cp):
        for tp_rank in range(tp):
            module: nn.Dropout = nn.Dropout(p)
            if cp > 1:
                module = zigzag_dropout(module, cp_rank, cp)
            if tp > 1:
                module = shard_dropout(module, tp_rank, tp)
            assert isinstance(module, PositionDropout) and module.split == cp * tp
            mine = take_zigzag(positions, cp_rank, cp, dim=0).chunk(tp)[tp_rank]
            torch.manual_seed(7)
            got = module.train()(torch.ones(batch, seq // (cp * tp), hidden))
            assert torch.equal(got, full[:, mine]), (cp_rank, tp_rank)
            assert module.eval()(torch.ones(1, 2, 1)).eq(1).all()  # evaluation: no mask
