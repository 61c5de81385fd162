"""Context parallelism (gloo) against one process: loss curves, CP × EP folded, a CP 2 checkpoint continued on 1
process, `--compile` (the ring attention with the per-sequence aux loss), activation memory against the plan
(2 processes); CP 2 × TP 2 + SP × EP 2 at ZeRO 0 and 3, CP 2 × DP 2 at ZeRO 1 and 3, CP 2 × PP 2, and the
checkpoints (4: curves and gradient norms). Each `--cp-comm-type` (all_gather, p2p ring, a2a Ulysses) follows the
same curves, and the three attentions agree within fp64 rounding on the same inputs.

Every layout trains the same global batch (sequence length 256, zigzag-split over 2 ranks; 512 over 4) with the
seed recipes' defaults — hidden dropout 0.1, capacity factor 1.0 with dropping (min capacity 4), the aux loss,
top-2 with its sampled second expert or top-1 with RSample noise and random token selection — and must give the
one-process LM loss, MoE (aux) loss and gradient norm at every step of 10 within 1e-6 relative: every random draw
and capacity decision is the one-process run's (parallel/cp/whole_sequence.py; attention dropout is off: SDPA
draws its masks inside the kernel, which no split can reproduce). Three models: learned positions with multi-head
attention and a dense + MoE layer (top-2, the per-sequence aux loss `seq`); the same with the seed recipes' top-1
routing; RoPE with grouped-query attention, SwiGLU and RMSNorm (top-2, the `global` aux loss). Both position kinds
must see each chunk's true positions, and CP computes both aux losses over the whole sequences.
One spawned group carries every check.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from launch import run_distributed
from saved_tensors import saved_tensor_bytes
from trainer_support import VOCAB, tiny_config

from moetron.checkpoint import resolve_checkpoint
from moetron.data.context_chunks import take_zigzag
from moetron.data.loader import DistributedBatchLoader
from moetron.parallel.cp.apply_cp import ATTENTIONS
from moetron.parallel.cp.attention import ContextParallelAttention
from moetron.parallel.env import DistEnv, init_distributed
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.parallelize import build
from moetron.plan.memory import estimate_memory
from moetron.train.trainer import Trainer

SEQ, STEPS, HALF, MBS, GLOBAL_BATCH = 256, 10, 5, 2, 4
MODELS = {
    "learned-mha-seq-aux": {"moe_aux_loss_type": "seq", "moe_loss_coeff": 0.01},  # the aux loss of whole sequences
    "learned-mha-top1": {"topk": 1, "moe_noisy_gate_policy": "RSample", "moe_loss_coeff": 0.01},  # the seed recipes'
    "rope-gqa": {  # the `global` aux loss (the default type) of each micro-batch
        "moe_loss_coeff": 0.01,
        "position_embedding_type": "rope",
        "num_key_value_heads": 2,
        "swiglu": True,
        "normalization": "rmsnorm",
        "add_bias_linear": False,
    },
}


def samples(n: int = 256, seed: int = 0, seq: int = SEQ) -> np.ndarray:
    """Token sequences of seq + 1 with a pattern to learn (next = current + 1 mod VOCAB, from a random start)."""
    starts = np.random.default_rng(seed).integers(0, VOCAB, (n, 1))
    return (starts + np.arange(seq + 1)) % VOCAB


def cp_config(
    model: str, cp: int = 1, ep: int = 1, tp: int = 1, save: str | None = None, comm: str = "all_gather", zero: int = 0,
    pp: int = 1, compile_blocks: bool = False, seq: int = SEQ,
):  # fmt: skip
    cfg = tiny_config(micro_batch_size=MBS, global_batch_size=GLOBAL_BATCH, train_iters=STEPS)
    m, p = cfg.model, cfg.parallel
    m.seq_length, m.hidden_dropout, m.attention_dropout = seq, 0.1, 0.0  # the seed recipes' routing and dropout
    m.moe_token_dropping, m.moe_train_capacity_factor, m.moe_min_capacity = True, 1.0, 4
    m.moe_top2_2nd_expert_sampling, m.moe_use_rts = True, True
    for key, value in MODELS[model].items():
        setattr(m, key, value)
    p.context_parallel_size, p.moe_expert_parallel_size = cp, ep
    p.tensor_model_parallel_size, p.sequence_parallel, p.cp_comm_type = tp, tp > 1, comm
    p.zero_stage, p.pipeline_model_parallel_size = zero, pp
    cfg.train.lr_warmup_iters, cfg.train.save, cfg.train.compile = 2, save, compile_blocks
    return cfg


def trainer(cfg, env: DistEnv | None = None) -> Trainer:
    """The trainer as `moetron train` builds it: the meta-device recipe and the real loader, which hands every
    context-parallel rank its chunks of its data-parallel replica's samples."""
    env = env or DistEnv()
    mesh = ParallelMesh.build(cfg.dims(env.world_size), env)
    parallel = build(cfg, mesh, env.device)
    loader = DistributedBatchLoader(
        samples(seq=cfg.model.seq_length),
        MBS,
        mesh.coords.dp,
        mesh.size("dp"),
        cp_rank=mesh.coords.cp,
        cp_size=mesh.size("cp"),
    )
    return Trainer(cfg, env, parallel, loader, None, config_yaml="# test\n")


def run_losses(t: Trainer, steps: int, norms: list[float] | None = None, moe: list[float] | None = None) -> list[float]:
    """`steps` optimizer steps; each step's LM loss as the trainer logs it (averaged over the data- and
    context-parallel ranks by its `reduce_mean`: a CP rank's own loss is that of its chunks only), and each step's
    global gradient norm (before clipping) and MoE loss (coefficient × aux loss, summed over layers, averaged like
    the LM loss) appended to `norms` and `moe` when given."""
    out = []
    t.model.train()
    for _ in range(steps):
        result = t.train_step()
        t._account(result)
        lm_loss, moe_loss = (float(x) for x in t.reduce_mean(result.sums.losses))
        out.append(lm_loss)
        if norms is not None:
            norms.append(result.grad_norm)
        if moe is not None:
            moe.append(moe_loss)
    return out


def run_curve(t: Trainer, steps: int) -> dict[str, list[float]]:
    """The LM losses, gradient norms and MoE losses of `steps` optimizer steps."""
    norms: list[float] = []
    moe: list[float] = []
    return {"loss": run_losses(t, steps, norms, moe), "norm": norms, "moe": moe}


def resumed_losses(cfg, path: str, env: DistEnv | None = None) -> list[float]:
    t = trainer(cfg, env)
    t.load(resolve_checkpoint(path))
    return run_losses(t, STEPS - t.progress.iteration)


def saved_activation_bytes(t: Trainer) -> int:
    """Bytes of the non-parameter tensors autograd saves in one training forward to the last hidden states (each
    storage once): the activations `moetron plan` prices, on this rank."""
    tokens = t.next_micro_batch().tokens_BT
    return saved_tensor_bytes(t.model, lambda: t.model(tokens, return_logits=False))


def attention_differences(mesh: ParallelMesh) -> dict[str, list[float]]:
    """Max |difference| of the p2p and a2a attentions' output and input gradients from all_gather's (fp64, GQA 4 / 2
    heads, one rank's zigzag chunks of a 32-token sequence, the same on every rank)."""
    rank, size, group = mesh.coords.cp, mesh.size("cp"), mesh.group("cp")
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(2, heads, 32, 8, generator=gen, dtype=torch.float64) for heads in (4, 2, 2, 4)]
    local = [take_zigzag(x, rank, size, dim=2) for x in full]

    def run(attention) -> list[torch.Tensor]:
        q, k, v = (x.clone().requires_grad_() for x in local[:3])
        out = attention(group, rank, size)(q, k, v, enable_gqa=True)
        out.backward(local[3])
        return [out.detach(), q.grad, k.grad, v.grad]

    want = run(ContextParallelAttention)
    others = {name: run(ATTENTIONS[name]) for name in ("p2p", "a2a")}
    return {name: [float((g - w).abs().max()) for g, w in zip(got, want, strict=True)] for name, got in others.items()}


def two_process_checks(rank: int, world_size: int, cp_dir: str) -> dict:
    env = init_distributed()
    # first, as `moetron train --compile` does in a fresh process: compiled blocks around the eager ring attention
    # (its batch_isend_irecv) and the router's all-reduce of the per-sequence route fractions
    compiled = run_curve(trainer(cp_config("learned-mha-seq-aux", cp=2, comm="p2p", compile_blocks=True), env), STEPS)
    out = {"learned-mha-seq-aux-p2p-compiled": compiled}
    first = trainer(cp_config("rope-gqa", cp=2), env)
    backends = {name: first.mesh.group(name)._get_backend(torch.device("cpu")) for name in ("cp", "dp_cp")}
    out["timeouts"] = {name: b.options._timeout.total_seconds() for name, b in backends.items()}
    out["attention"] = attention_differences(first.mesh)
    out["saved"] = saved_activation_bytes(first)
    out |= {model: run_curve(trainer(cp_config(model, cp=2), env), STEPS) for model in MODELS}
    for comm in ("p2p", "a2a"):  # the other attentions: the same curves, and their own activation memory
        out[f"saved-{comm}"] = saved_activation_bytes(trainer(cp_config("rope-gqa", cp=2, comm=comm), env))
        out[f"rope-gqa-{comm}"] = run_losses(trainer(cp_config("rope-gqa", cp=2, comm=comm), env), STEPS)
    out["cp2-ep2"] = run_curve(trainer(cp_config("rope-gqa", cp=2, ep=2), env), STEPS)
    first = trainer(cp_config("rope-gqa", cp=2, save=cp_dir), env)
    out["head"] = run_losses(first, HALF)
    first.save()
    return out


def assert_curve(got: list[float], want: list[float], what: str) -> None:
    got_t, want_t = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    torch.testing.assert_close(got_t, want_t, rtol=1e-6, atol=0, msg=what)


@pytest.mark.distributed
@pytest.mark.slow
def test_context_parallel_follows_one_process(tmp_path):
    torch.set_num_threads(1)
    cp_dir = str(tmp_path / "cp2")
    reference = {model: run_curve(trainer(cp_config(model)), STEPS) for model in MODELS}
    saved = saved_activation_bytes(trainer(cp_config("rope-gqa")))
    results = run_distributed(two_process_checks, world_size=2, args=(cp_dir,))
    # CP 2 saves at most 0.6× the activations of one process (the gathered K/V are the extra), and the plan's
    # CP 2 / CP 1 ratio is the measured one within 10 % (its absolute terms are checked per layer in test_plan.py)
    configs = {cp: cp_config("rope-gqa", cp=cp) for cp in (1, 2)}
    planned = {cp: estimate_memory(cfg, cfg.dims(cp), "cpu").activations for cp, cfg in configs.items()}
    for comm in ("p2p", "a2a"):
        planned[comm] = estimate_memory(cfg := cp_config("rope-gqa", cp=2, comm=comm), cfg.dims(2), "cpu").activations
    for rank, got in enumerate(results):  # the flattened dp × cp group waits as long as every other (launch.py: 2 min)
        assert got["timeouts"] == {"cp": 120.0, "dp_cp": 120.0}, got["timeouts"]
        for name, differences in got["attention"].items():  # output, dq, dk, dv
            assert max(differences) < 1e-12, (rank, name, differences)
        assert got["saved"] <= 0.6 * saved, (rank, got["saved"], saved)
        assert got["saved"] / saved == pytest.approx(planned[2] / planned[1], rel=0.1), (rank, got["saved"], saved)
        for comm in ("p2p", "a2a"):  # neither keeps the gathered K/V nor the mask: less than all_gather, as planned
            assert got[f"saved-{comm}"] < got["saved"], (rank, comm, got[f"saved-{comm}"], got["saved"])
            ratio = got[f"saved-{comm}"] / saved
            assert ratio == pytest.approx(planned[comm] / planned[1], rel=0.1), (rank, comm, ratio)
    for rank, got in enumerate(results):
        curves = {model: (model, model) for model in MODELS} | {"cp2-ep2": ("rope-gqa", "CP 2 × EP 2 folded")}
        curves["learned-mha-seq-aux-p2p-compiled"] = ("learned-mha-seq-aux", "--compile, p2p, seq aux loss")
        for name, (model, what) in curves.items():  # the LM and MoE loss curves and the gradient norms
            for key in ("loss", "moe", "norm"):
                assert_curve(got[name][key], reference[model][key], f"rank {rank}: {what} at CP 2: {key}")
        for name in ("rope-gqa-p2p", "rope-gqa-a2a"):
            assert_curve(got[name], reference["rope-gqa"]["loss"], f"rank {rank}: {name} at CP 2")
        assert_curve(got["head"], reference["rope-gqa"]["loss"][:HALF], f"rank {rank}: CP 2 before the checkpoint")
    # the CP 2 checkpoint continues on one process as the straight one-process run does
    want = reference["rope-gqa"]["loss"][HALF:]
    assert_curve(resumed_losses(cp_config("rope-gqa"), cp_dir), want, "CP 2 → 1 resume")


def four_process_checks(rank: int, world_size: int, cp_dir: str) -> dict:
    env = init_distributed()
    first = trainer(cp_config("rope-gqa", cp=2, tp=2, ep=2, save=f"{cp_dir}/tp"), env)
    out = {"head": run_losses(first, HALF)}
    first.save()
    # CP 2 × DP 2 with ZeRO: the dense state sharded over the 4 dp × cp ranks, the gradients reduced over them
    out["zero1"] = run_curve(trainer(cp_config("rope-gqa", cp=2, zero=1), env), HALF)
    zero3 = trainer(cp_config("rope-gqa", cp=2, zero=3, save=f"{cp_dir}/zero3"), env)
    out["zero3"] = run_curve(zero3, HALF)
    zero3.save()
    # the ring under TP + SP × EP at ZeRO-3: TP shards sharded again over dp × cp, saved as their global tensors
    ring = trainer(cp_config("rope-gqa", cp=2, tp=2, ep=2, comm="p2p", zero=3, save=f"{cp_dir}/p2p-zero3"), env)
    out["p2p-zero3"] = run_curve(ring, HALF)
    ring.save()
    # CP 2 × PP 2 (1F1B): each stage runs the micro-batches' zigzag chunks, the later stage at their positions
    out["pp2"] = run_curve(trainer(cp_config("rope-gqa", cp=2, pp=2), env), HALF)
    # the later stage's RoPE positions when sequence parallelism hands it T / tp tokens (no CP: the same code path)
    out["pp2-tp2-sp"] = run_curve(trainer(cp_config("rope-gqa", pp=2, tp=2), env), HALF)
    # CP 4 over sequences of 512: the seed recipes' top-1 routing alone, top-2 with EP 2 folded over dp × cp
    out["cp4"] = run_curve(trainer(cp_config("learned-mha-top1", cp=4, seq=2 * SEQ), env), HALF)
    out["cp4-ep2"] = run_curve(trainer(cp_config("rope-gqa", cp=4, ep=2, seq=2 * SEQ), env), HALF)
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_context_and_tensor_parallel_follow_one_process(tmp_path):
    """CP 2 × TP 2 with sequence parallelism × EP 2 folded (4 processes), at ZeRO 0 and 3; CP 2 × DP 2 at ZeRO 1
    and 3; CP 2 × PP 2; CP 4 alone and × EP 2: the one-process curve and gradient norm, and each checkpoint
    continues on one process."""
    torch.set_num_threads(1)
    cp_dir = str(tmp_path)
    reference = run_curve(trainer(cp_config("rope-gqa")), STEPS)
    losses, norms, moe = reference["loss"], reference["norm"], reference["moe"]
    long = {name: run_curve(trainer(cp_config(model, seq=2 * SEQ)), HALF)
            for name, model in (("cp4", "learned-mha-top1"), ("cp4-ep2", "rope-gqa"))}  # fmt: skip
    for rank, got in enumerate(run_distributed(four_process_checks, world_size=4, args=(cp_dir,))):
        assert_curve(got["head"], losses[:HALF], f"rank {rank}: CP 2 × TP 2 + SP × EP 2")
        for name, what in (("cp4", "CP 4, seq 512, top-1 RSample"), ("cp4-ep2", "CP 4 × EP 2, seq 512")):
            for key in ("loss", "norm", "moe"):
                assert_curve(got[name][key], long[name][key], f"rank {rank}: {what}: {key}")
        for name, what in (("zero1", "CP 2 × DP 2, ZeRO-1"), ("zero3", "CP 2 × DP 2, ZeRO-3"),
                           ("p2p-zero3", "CP 2 (p2p) × TP 2 + SP × EP 2, ZeRO-3"), ("pp2", "CP 2 × PP 2"),
                           ("pp2-tp2-sp", "PP 2 × TP 2 + SP, RoPE")):  # fmt: skip
            assert_curve(got[name]["loss"], losses[:HALF], f"rank {rank}: {what}")
            assert_curve(got[name]["norm"], norms[:HALF], f"rank {rank}: {what}: gradient norm")
            assert_curve(got[name]["moe"], moe[:HALF], f"rank {rank}: {what}: MoE loss")
    for name in ("tp", "zero3", "p2p-zero3"):
        assert_curve(resumed_losses(cp_config("rope-gqa"), f"{cp_dir}/{name}"), losses[HALF:], f"{name} → 1 resume")
