"""Interchange at expert parallelism 2 (2 gloo processes): a checkpoint written by the EP = 2 ranks (each its own
experts' DCP shard) exports to the Hugging Face class with the one-process model's logits, and `moetron eval-harness`
run with the experts spread over both ranks (requests split between them, forwards paired by all-to-all) scores
every request as the one-process harness does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from interchange_support import ARCHITECTURES, VOCAB, run_config, tokens
from launch import run_distributed

pytestmark = pytest.mark.distributed
MODEL = dict(ARCHITECTURES["mixtral"], seq_length=64, max_position_embeddings=64, init_method_std=0.2)
SEED = 7


def save_and_evaluate_at_ep2(rank: int, world_size: int, root: str) -> dict | None:
    """Every rank: build its half of the experts, save the checkpoint together, then run the harness at EP = 2."""
    from moetron.checkpoint import GlobalView, save_checkpoint
    from moetron.config_cli import to_yaml
    from moetron.parallel.env import init_distributed
    from moetron.parallel.mesh import ParallelMesh
    from moetron.parallel.parallelize import build

    env = init_distributed()
    cfg = run_config(Path(root) / "tok", **MODEL)
    cfg.train.seed, cfg.parallel.moe_expert_parallel_size = SEED, 2
    mesh = ParallelMesh.build(cfg.dims(world_size), env)
    parallel = build(cfg, mesh, env.device)
    model = parallel.model
    assert model.moe_layers()[0].experts.num_experts == 2  # this rank holds half of the 4 experts
    view = GlobalView(model, parallel.registry, mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(Path(root) / "ep2", 0, view, optimizer, {"iteration": 0}, to_yaml(cfg), env, keep_last_n=1)
    if importlib_find("lm_eval") is None:
        return None
    from moetron.eval.harness import evaluate_harness

    results, lm = evaluate_harness(str(Path(root) / "ep2"), ["moetron_tiny"], log_samples=True, batch_size=3)
    assert lm.mesh.size("ep") == 2 and lm.world_size == 2
    return None if results is None else {task: samples for task, samples in results["samples"].items()}


def importlib_find(name: str):
    import importlib.util

    return importlib.util.find_spec(name)


def logprob(response) -> float:
    """A loglikelihood response is (logprob, is_greedy); a rolling one the logprob itself."""
    return response if isinstance(response, float) else response[0]


def by_doc(samples: list[dict]) -> list:
    return [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]


def test_ep2_checkpoint_exports_and_evaluates_like_one_process(tmp_path):
    from data_helpers import make_tiny_tokenizer

    from moetron.interchange.hf_export import export_hf
    from moetron.model.gpt import create_model

    make_tiny_tokenizer(tmp_path)
    rank0, rank1 = run_distributed(save_and_evaluate_at_ep2, world_size=2, args=(str(tmp_path),), timeout=600)
    assert rank1 is None
    transformers = pytest.importorskip("transformers")
    export_hf(str(tmp_path / "ep2"), str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    reference = create_model(run_config(tmp_path / "tok", **MODEL).model, "cpu", seed=SEED).eval()
    x = tokens()
    with torch.no_grad():  # layout-free init: the EP = 2 ranks' experts are the one-process model's
        torch.testing.assert_close(hf(x).logits, reference(x).logits[..., :VOCAB], atol=1e-4, rtol=0)
    if rank0 is None:
        pytest.skip("lm_eval is not installed: the harness half of this test needs it")
    from moetron.eval.harness import evaluate_harness

    single, _ = evaluate_harness(str(tmp_path / "ep2"), ["moetron_tiny"], log_samples=True, batch_size=4)
    for task in ("moetron_tiny_mc", "moetron_tiny_ppl"):
        for ours, theirs in zip(by_doc(rank0[task]), by_doc(single["samples"][task]), strict=True):
            for (a,), (b,) in zip(ours, theirs, strict=True):
                assert abs(logprob(a) - logprob(b)) < 1e-4
    assert by_doc(rank0["moetron_tiny_gen"]) == by_doc(single["samples"]["moetron_tiny_gen"])
