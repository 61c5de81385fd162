"""Context parallelism's arithmetic, without processes: the zigzag split and positions written out by hand, the
loader's chunks, and the causal mask over gathered keys reproducing one process's causal attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moetron.data.context_chunks import take_zigzag, zigzag_chunk_ids, zigzag_positions
from moetron.data.loader import DistributedBatchLoader
from moetron.model.moe.routing.balancing_losses import sequence_aux_loss
from moetron.parallel.cp.attention import ContextParallelAttention


def test_zigzag_chunks_and_positions_by_hand():
    # sequence 0..15 over 2 ranks: chunks of 4, rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_chunk_ids(0, 2) == (0, 3) and zigzag_chunk_ids(1, 2) == (1, 2)
    assert zigzag_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # 4 ranks, 8 chunks of 2: rank r holds chunks r and 7 - r
    assert zigzag_positions(16, 1, 4).tolist() == [2, 3, 12, 13]
    assert zigzag_positions(16, 3, 4).tolist() == [6, 7, 8, 9]
    every = torch.cat([zigzag_positions(16, r, 4) for r in range(4)])
    assert sorted(every.tolist()) == list(range(16))  # every token on exactly one rank
    x_BT = torch.arange(32).view(2, 16)
    assert torch.equal(take_zigzag(x_BT, 1, 4), x_BT[:, [2, 3, 12, 13]])
    assert take_zigzag(x_BT, 0, 1) is x_BT
    with pytest.raises(ValueError, match="not divisible by 2 × 3"):
        take_zigzag(x_BT, 0, 3)


def test_loader_gives_every_cp_rank_its_chunks_of_the_same_samples():
    data = np.arange(6 * 9).reshape(6, 9)  # 6 samples of seq 8 + 1
    ranks = [DistributedBatchLoader(data, 2, 0, 1, cp_rank=r, cp_size=2) for r in range(2)]
    batches = [loader.next_micro_batch() for loader in ranks]
    assert torch.equal(batches[0], batches[1])  # the same samples: no rank reads another's
    assert all(loader.consumed_samples == 2 for loader in ranks)
    inputs = [loader.local_chunks(b[:, :-1]) for loader, b in zip(ranks, batches, strict=True)]
    labels = [loader.local_chunks(b[:, 1:]) for loader, b in zip(ranks, batches, strict=True)]
    assert inputs[0][0].tolist() == [0, 1, 6, 7] and labels[0][0].tolist() == [1, 2, 7, 8]
    assert inputs[1][0].tolist() == [2, 3, 4, 5] and labels[1][0].tolist() == [3, 4, 5, 6]
    with pytest.raises(ValueError, match="context-parallel rank 2 of 2"):
        DistributedBatchLoader(data, 2, 0, 1, cp_rank=2, cp_size=2)


@pytest.mark.parametrize("size", [2, 4])
def test_gathered_keys_with_the_zigzag_mask_give_one_process_causal_attention(size):
    """Every rank's queries against the keys of all ranks in rank order (what the all-gather returns), masked by
    `causal_mask`, equal the rows of one process's causal SDPA at those positions."""
    torch.manual_seed(0)
    B, H, S, D = 2, 4, 8 * size, 8
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    gathered_k = torch.cat([take_zigzag(k, r, size, dim=2) for r in range(size)], dim=2)
    gathered_v = torch.cat([take_zigzag(v, r, size, dim=2) for r in range(size)], dim=2)
    for rank in range(size):
        mask = ContextParallelAttention(None, rank, size).causal_mask(S // size, q.device)
        got = F.scaled_dot_product_attention(take_zigzag(q, rank, size, dim=2), gathered_k, gathered_v, attn_mask=mask)
        torch.testing.assert_close(got, take_zigzag(want, rank, size, dim=2), rtol=1e-5, atol=1e-6)


def test_sequence_aux_loss_over_split_sequences_is_the_whole_sequences():
    """Each rank's seq aux loss with the route fractions averaged over the ranks (`Router.sequence_mean`): their
    mean is the loss of the whole sequences, as one process computes it."""
    torch.manual_seed(0)
    B, L, E, K, size = 3, 8, 4, 2, 2
    probs_BLE = torch.softmax(torch.randn(B, L, E), -1)
    ids_BLK = probs_BLE.topk(K, -1).indices
    whole = sequence_aux_loss(probs_BLE.flatten(0, 1), ids_BLK.flatten(0, 1), L)
    parts = [(take_zigzag(probs_BLE, r, size), take_zigzag(ids_BLK, r, size)) for r in range(size)]
    fractions = [torch.zeros(B, L // size, E).scatter_(2, ids, 1.0).mean(1) for _, ids in parts]
    mean_fraction = torch.stack(fractions).mean(0)
    losses = [
        sequence_aux_loss(p.flatten(0, 1), ids.flatten(0, 1), L // size, lambda f: mean_fraction) for p, ids in parts
    ]
    torch.testing.assert_close(torch.stack(losses).mean(), whole)
    assert not torch.allclose(losses[0], whole)  # a part alone is not the whole sequence's loss
