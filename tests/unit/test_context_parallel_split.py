"""Context parallelism's arithmetic, without processes: the zigzag split and positions written out by hand, the
loader's chunks, and the causal mask over gathered keys reproducing one process's causal attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moetron.config import RunConfig
from moetron.data.context_chunks import take_zigzag, zigzag_chunk_ids, zigzag_positions
from moetron.data.loader import DistributedBatchLoader
from moetron.model.moe.routing.router import Router, RouterConfig, sequence_aux_loss
from moetron.parallel.cp import attention as cp_attention
from moetron.parallel.cp.attention import ContextParallelAttention
from moetron.parallel.cp.ring import zigzag_block
from moetron.parallel.cp.sizes import context_parallel_problems


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


@pytest.mark.parametrize("size", [2, 4])
def test_each_chunks_bottom_right_causal_call_is_one_process_causal_attention(size, monkeypatch):
    """The all-gather variant's two calls per rank (a chunk against the keys up to its own end, causal from the
    bottom right: no mask tensor, flash-eligible on a GPU), with grouped-query attention, equal one process's
    causal SDPA at the rank's positions; the gather itself is stood in for by the keys of every rank."""
    torch.manual_seed(0)
    B, H, K, S, D = 2, 4, 2, 8 * size, 8
    q = torch.randn(B, H, S, D)
    k, v = torch.randn(B, K, S, D), torch.randn(B, K, S, D)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    gathered = {id(x): torch.cat([take_zigzag(x, r, size, dim=2) for r in range(size)], dim=2) for x in (k, v)}
    for rank in range(size):
        local_k, local_v = (take_zigzag(x, rank, size, dim=2) for x in (k, v))
        lookup = {id(local_k): gathered[id(k)], id(local_v): gathered[id(v)]}
        monkeypatch.setattr(cp_attention._GatherSequence, "apply", lambda x, *_, seen=lookup: seen[id(x)])
        attention = ContextParallelAttention(None, rank, size)
        got = attention.attend(take_zigzag(q, rank, size, dim=2), local_k, local_v, 0.0, {"enable_gqa": True})
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


@pytest.mark.parametrize("size", [2, 3, 4])
def test_ring_blocks_are_the_causal_mask_between_zigzag_ranks(size):
    """Ring attention's dense / causal block pairs (no ragged mask) are exactly key position <= query position."""
    seq, local = 8 * size, 8
    for rank in range(size):
        query_pos = zigzag_positions(seq, rank, size)
        for src in range(size):
            key_pos = zigzag_positions(seq, src, size)
            rows, cols, causal = zigzag_block(rank, src, local)
            described = torch.zeros(local, local, dtype=torch.bool)
            block = torch.ones(local, local, dtype=torch.bool)[rows, cols]
            described[rows, cols] = block.tril() if causal else block
            assert torch.equal(described, key_pos[None, :] <= query_pos[:, None]), (rank, src)


def cp_run(comm: str, heads: int = 4, kv_heads: int = 4, tp: int = 1, attention_dropout: float = 0.0) -> RunConfig:
    cfg = RunConfig()
    m, p = cfg.model, cfg.parallel
    m.num_layers, m.hidden_size, m.seq_length, m.attention_dropout = 2, 32, 64, attention_dropout
    m.num_attention_heads, m.num_key_value_heads = heads, kv_heads
    p.context_parallel_size, p.tensor_model_parallel_size, p.cp_comm_type = 2, tp, comm
    return cfg


def test_cp_comm_type_problems_are_found_before_launch():
    def problems(cfg: RunConfig, world: int = 2) -> list[str]:
        return context_parallel_problems(cfg, cfg.dims(world))

    for comm in ("all_gather", "p2p", "a2a"):
        assert problems(cp_run(comm)) == [], comm
    assert problems(cp_run("all_gather", attention_dropout=0.1)) == problems(cp_run("a2a", attention_dropout=0.1)) == []
    assert problems(cp_run("p2p", attention_dropout=0.1)) == [
        "--cp-comm-type p2p with --attention-dropout 0.1 is not supported: ring attention has no attention dropout; "
        "use --attention-dropout 0 or --cp-comm-type all_gather or a2a"
    ]
    # a2a splits this rank's heads, after tensor parallelism: 4 heads / TP 2 = 2 per rank, 2 key/value heads → 1
    assert problems(cp_run("a2a", kv_heads=2)) == []
    (only,) = problems(cp_run("a2a", kv_heads=2, tp=2), world=4)
    assert only.startswith(
        "--cp-comm-type a2a needs the query heads (4 / --tensor-model-parallel-size 2 = 2) and key/value heads "
        "(2 / --tensor-model-parallel-size 2 = 1) of a rank divisible by --context-parallel-size 2"
    )
    assert problems(cp_run("p2p", kv_heads=2, tp=2), world=4) == []  # the ring attends with any head count
    # a bad name is reported with every other problem (and even without CP)
    bad = cp_run("ring")
    bad.model.seq_length = 6
    assert problems(bad) == [
        "--cp-comm-type 'ring' is not one of all_gather, p2p, a2a",
        "--seq-length 6 is not divisible by 2 × --context-parallel-size 2 = 4: every context-parallel rank holds "
        "two equal chunks of each sequence; use a multiple of 4",
    ]
    bad.parallel.context_parallel_size = 1
    assert problems(bad, world=1) == ["--cp-comm-type 'ring' is not one of all_gather, p2p, a2a"]


def test_context_parallel_composes_with_zero_and_pipelines():
    """ZeRO 1–3 shard the dense state over dp × cp (parallel/dp/) and pipeline stages run the zigzag chunks: neither
    is refused under CP."""
    for stage in (1, 2, 3):
        cfg = cp_run("all_gather")
        cfg.parallel.zero_stage = stage
        assert context_parallel_problems(cfg, cfg.dims(4)) == [], stage
    cfg = cp_run("all_gather")
    cfg.parallel.pipeline_model_parallel_size = 2  # pipeline stages run the zigzag chunks (pp/split.py)
    assert context_parallel_problems(cfg, cfg.dims(4)) == []


ROUTERS = {  # every gating path's `global` aux loss: DeepSpeed's top-1 / GShard's top-2 / top-k, the generic path
    "top1": {"topk": 1},
    "top2": {"topk": 2, "moe_top2_2nd_expert_sampling": False},
    "top3": {"topk": 3},
    "generic-sigmoid": {"topk": 2, "moe_router_score_function": "sigmoid"},
}


@pytest.mark.parametrize("router", ROUTERS)
def test_global_aux_loss_over_split_sequences_is_the_whole_micro_batch(router):
    """Each CP rank's `global` aux loss with the route fractions averaged over the ranks (`Router.sequence_mean`):
    their mean is the one-process micro-batch's loss, value and gradient; a rank's own loss is not."""
    torch.manual_seed(0)
    B, L, D, E, size = 2, 16, 8, 6, 2
    cfg = RouterConfig(hidden_size=D, moe_token_dropping=False, moe_use_rts=False, **ROUTERS[router])
    gate = Router(cfg, E)
    x_BLD = torch.randn(B, L, D)
    whole = gate(x_BLD.flatten(0, 1), L).aux_loss
    (whole_grad,) = torch.autograd.grad(whole, gate.weight)
    parts = [take_zigzag(x_BLD, r, size, dim=1).flatten(0, 1) for r in range(size)]
    alone = [gate(x, L // size).aux_loss for x in parts]
    fractions: list[torch.Tensor] = []
    gate.sequence_mean = lambda f: fractions.append(f) or f  # record each part's route fractions
    for x in parts:
        gate(x, L // size)
    gate.sequence_mean = lambda f: torch.stack(fractions).mean(0)  # as SequenceMean's all-reduce returns them
    split = torch.stack([gate(x, L // size).aux_loss for x in parts]).mean()
    torch.testing.assert_close(split, whole)
    torch.testing.assert_close(torch.autograd.grad(split, gate.weight)[0], whole_grad)
    assert not torch.allclose(torch.stack(alone).mean(), whole)
