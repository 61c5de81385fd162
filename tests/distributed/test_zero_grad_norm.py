"""The one-process gradient norm at every ZeRO stage and (dp, ep) layout of 4 gloo ranks, edp = 1 included.

One spawned 4-process group trains every (stage 0–3) × (dp 4, ep 4 / 2 / 1: edp 1 / 2 / 4) for four steps of two
accumulated micro-batches, from the weights a single process draws (MoE layers of 8 and 4 experts, aux-loss-free
biases moving). Each layout must give the single process's global loss, its gradient norm within 1e-6 at every
step (one norm on every rank), and its optimizer state after them: Adam's moments of every tensor, the routed
experts' above all (a norm alone could hide errors that cancel). Every step is clipped, so a layout's norm that
differs changes the update too; the experts' tensors are large (8 × 32 × 2048), where an fp32 norm of a whole
tensor and the fp32 norms of its shards summed differ by about 1e-6 (the norm is accumulated in float64 instead).
With ep = dp each expert lives on one rank (an edp group of one), where FSDP2 runs no collective at all and used to
divide the expert gradients by dp twice.

The stage-3 edp = 1 run saves its checkpoint; this process loads it (1 process, ep 1) with the same optimizer
state and continues the single process's curve.
"""

from __future__ import annotations

import pytest
import torch
from launch import run_distributed
from test_expert_parallel_train import ep_trainer, global_losses
from test_zero import assert_same_state, global_optimizer_state, run, zero_config

from moetron.checkpoint import resolve_checkpoint
from moetron.parallel.dp.zero_spec import STAGES
from moetron.parallel.env import init_distributed

STEPS = 4  # in the 4-process group; the single process runs one more (the resumed checkpoint's next step)
EXPERT_PARALLEL = (4, 2, 1)  # edp = 1, 2, 4 on 4 ranks
LAYOUTS = [(stage, ep) for ep in EXPERT_PARALLEL for stage in STAGES]
SAVED = (3, 4)  # (stage, ep) of the run whose checkpoint this process resumes
RTOL = 1e-5
NORM_RTOL = 1e-6  # the gradient norm: what clipping sees must not depend on the layout
EXPERT_FFN = 2048  # expert tensors of 0.5M elements: an fp32 norm is off by ~1e-6 there
CLIP = 0.05  # below every step's norm (about 1): every step is clipped


def config(stage: int, ep: int, **overrides):
    cfg = zero_config(stage, ep=ep, train_iters=STEPS + 1, moe_ffn_hidden_size=EXPERT_FFN, clip_grad=CLIP, **overrides)
    cfg.model.num_experts = [8, 4]  # ep = 4 holds 2 and 1 experts per rank
    return cfg


def layout_checks(rank: int, world_size: int, save_dir: str) -> dict:
    env = init_distributed()
    out = {}
    for stage, ep in LAYOUTS:
        trainer = ep_trainer(config(stage, ep, **({"save": save_dir} if (stage, ep) == SAVED else {})), env)
        out[(stage, ep)] = run(trainer, STEPS) | {"state": global_optimizer_state(trainer)}
        if (stage, ep) == SAVED:
            trainer.save()
    return out


def assert_close_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], layout) -> None:
    """Every tensor of the optimizer state within RTOL of the single process's, relative to its largest entry
    (Adam's second moments span many orders of magnitude)."""
    assert got.keys() == want.keys(), layout
    for key, value in want.items():
        scale = float(value.abs().max()) if value.is_floating_point() and value.numel() else 0.0
        torch.testing.assert_close(got[key], value, rtol=RTOL, atol=RTOL * scale, msg=f"{layout} {key}")


@pytest.mark.distributed
@pytest.mark.slow
def test_every_zero_stage_and_expert_layout_has_the_single_process_gradient_norm(tmp_path):
    save_dir = str(tmp_path / "edp1_stage3")
    four = run_distributed(layout_checks, world_size=4, args=(save_dir,), timeout=900)
    torch.set_num_threads(1)

    single = ep_trainer(config(0, 1))
    first = run(single, STEPS)
    state = global_optimizer_state(single)
    last = run(single, 1)
    assert any(".experts." in key for key in state)
    want_losses = torch.tensor(first["losses"], dtype=torch.float64)
    want_norms = torch.tensor(first["norms"], dtype=torch.float64)
    assert bool((want_norms > CLIP).all()), want_norms  # clipping is active at every step

    for layout in LAYOUTS:
        losses = global_losses([r[layout]["losses"] for r in four])
        torch.testing.assert_close(losses, want_losses, rtol=RTOL, atol=0, msg=f"{layout} losses")
        norms = torch.tensor(four[0][layout]["norms"], dtype=torch.float64)
        torch.testing.assert_close(norms, want_norms, rtol=NORM_RTOL, atol=0, msg=f"{layout} gradient norms")
        assert all(r[layout]["norms"] == four[0][layout]["norms"] for r in four), layout  # one norm everywhere
        assert_close_state(four[0][layout]["state"], state, layout)

    resumed = ep_trainer(config(0, 1))
    resumed.load(resolve_checkpoint(save_dir))
    assert resumed.progress.iteration == STEPS
    assert_same_state(global_optimizer_state(resumed), four[0][SAVED]["state"])
    after = run(resumed, 1)
    assert after["losses"] == pytest.approx(last["losses"], rel=RTOL)
    assert after["norms"] == pytest.approx(last["norms"], rel=NORM_RTOL)
