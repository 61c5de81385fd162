"""`--compile` with the zero-bubble schedule on a bias-free SwiGLU model (2 gloo processes, PP 2) against one process.

The combination that crashed (segfault, or a compiled block failing on a garbage view shape): attention dropout on
(its random-stream swap is a graph break, so a compiled fragment returns views of the bias-free QKV projection) and
no linear biases. AOTAutograd wrote its cache entry for such a block when its backward first compiled, inside zero
bubble's split backward, and pickling that entry crashed; a run that found the entry later read garbage. Under the
split backward `apply_compile` now keeps AOTAutograd's cache off. A fresh inductor cache directory makes every run
of this test the cold first run that crashed. The experts run the CPU expert-by-expert SwiGLU kernel, as a CLI run
of this model does (it was blamed, but GELU experts without biases crashed the same way). 3 steps must give the
eager one-process loss and gradient norm (1e-4 relative).
"""

from __future__ import annotations

import os

import pytest
import torch
from launch import run_distributed
from test_pipeline_parallel_train import curve, pp_config, pp_trainer

from moetron.parallel.env import init_distributed

STEPS = 3
BIAS_FREE_SWIGLU = {"swiglu": True, "add_bias_linear": False, "train_iters": STEPS}
BIAS_FREE_SWIGLU |= {"num_layers": 2, "moe_first_dense_layers": 0}  # the CLI model that crashed: MoE on both stages


def compiled_zero_bubble(rank: int, world_size: int, tmp: str) -> dict:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{tmp}/inductor"  # cold: the run that crashed wrote its entries
    env = init_distributed()
    trainer = pp_trainer(pp_config(2, "zero-bubble", 1, compile=True, **BIAS_FREE_SWIGLU), env)
    experts = [moe.experts for moe in trainer.model.moe_layers()]
    kernel = [e._runs_expert_by_expert(torch.empty(0)) and e.resolved_backend(torch.empty(0)) for e in experts]
    return curve(trainer, STEPS) | {"kernel": kernel}


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_zero_bubble_on_bias_free_swiglu_follows_one_process(tmp_path):
    two = run_distributed(compiled_zero_bubble, world_size=2, args=(str(tmp_path),), timeout=600)
    torch.set_num_threads(1)
    want = curve(pp_trainer(pp_config(1, **BIAS_FREE_SWIGLU)), STEPS)
    for r in two:
        assert r["kernel"] and all(k == "grouped_mm" for k in r["kernel"])  # the expert-by-expert kernel ran
        for key in ("lm", "norm"):
            torch.testing.assert_close(torch.tensor(r[key]), torch.tensor(want[key]), rtol=1e-4, atol=0, msg=key)
        assert r["ok"] == want["ok"]
