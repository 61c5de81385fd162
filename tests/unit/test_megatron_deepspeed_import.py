"""Megatron-DeepSpeed MoE checkpoints → moetron. The fixtures were written by the real Megatron-DeepSpeed and
DeepSpeed (tests/fixtures/megatron_deepspeed/record.py says how): an EP-2 top-1 MoE, a PR-MoE (pyramid +
residual, top-2) and a Llama-style top-2 MoE (rotary, SwiGLU experts, RMSNorm, untied, no biases), with what the
source model computed on a fixed batch and its live optimizer's moments.
Variants the recorder cannot produce here (tensor parallel 2; the pre-2024 per-head QKV layout) are written from the
real checkpoint exactly to Megatron-DeepSpeed's documented layout."""

from __future__ import annotations

import argparse
import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moetron.checkpoint import resolve_checkpoint
from moetron.checkpoint.state import single_process_quiet
from moetron.errors import UserError
from moetron.eval.generate import load_model
from moetron.interchange.mds_optimizer import read_moments
from moetron.interchange.mds_tensors import MDSTensors
from moetron.interchange.megatron_deepspeed import _args, find_step_dir, import_megatron_deepspeed, run_config
from moetron.interchange.safe_load import Opaque, load_pt

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_deepspeed"
RUNS = ["moe_top1_ep2", "prmoe_top2", "rotary_llama_top2"]


def source_outputs(model, run: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    expected = load_file(FIXTURES / run / "expected.safetensors")
    tokens = expected["tokens"]
    torch.manual_seed(1234)  # DeepSpeed's eval-mode random token selection drew from this seed too
    with torch.no_grad():
        out = model(tokens[:, :-1], labels_BT=tokens[:, 1:])
    return out.logits, out.lm_loss, expected


@pytest.mark.parametrize("run", RUNS)
def test_imported_model_computes_what_megatron_deepspeed_computed(tmp_path, run):
    result = import_megatron_deepspeed(str(FIXTURES / run / "checkpoint"), str(tmp_path / "run"))
    assert (result.iteration, result.with_optimizer, result.qkv_layout) == (3, True, "thirds")
    model, cfg, path = load_model(str(tmp_path / "run"), "cpu")
    logits, loss, expected = source_outputs(model, run)
    torch.testing.assert_close(logits, expected["logits"], atol=1e-5, rtol=0)
    assert abs(float(loss) - float(expected["loss"])) < 1e-5
    assert cfg.model.mlp_type == ("residual" if run == "prmoe_top2" else "standard")
    m = cfg.model
    llama = run == "rotary_llama_top2"  # every Llama-style setting came from the recorded args
    assert (m.position_embedding_type, m.swiglu, m.normalization) == (
        ("rope", True, "rmsnorm") if llama else ("learned_absolute", False, "layernorm")
    )
    assert (m.untie_embeddings_and_output_weights, m.add_bias_linear) == (llama, not llama)
    import json

    state = json.loads((path / "state.json").read_text())
    assert (state["iteration"], state["consumed_samples"], state["consumed_tokens"]) == (3, 6, 96)


@pytest.mark.parametrize("run", RUNS)
def test_optimizer_indices_map_to_the_live_optimizers_parameters(run):
    step = find_step_dir(str(FIXTURES / run / "checkpoint"))
    states = load_pt(step / "mp_rank_00_model_states.pt")
    args = _args(states, step)
    cfg = run_config(args, states, step)
    moments, why = read_moments(step, MDSTensors.read(step, states, args), cfg.model, allow_pickle=False)
    expected = {}
    for path in sorted((FIXTURES / run).glob("expected_optim_rank*.safetensors")):
        expected.update(load_file(path))
    assert len(expected) == 2 * len(moments) > 0, why
    for key, value in expected.items():
        name, moment = key.rsplit("/", 1)
        torch.testing.assert_close(moments[name.removeprefix("language_model.")][moment], value, atol=0, rtol=0)


def test_optimizer_moments_follow_the_weights_layout(tmp_path):
    import torch.distributed.checkpoint as dcp

    import_megatron_deepspeed(str(FIXTURES / "moe_top1_ep2" / "checkpoint"), str(tmp_path / "run"))
    expected = {**load_file(FIXTURES / "moe_top1_ep2" / "expected_optim_rank0.safetensors"),
                **load_file(FIXTURES / "moe_top1_ep2" / "expected_optim_rank1.safetensors")}  # fmt: skip
    prefix = "language_model.encoder.layers.1.mlp.deepspeed_moe.experts.deepspeed_experts"
    key = "optim.layers.1.mlp.experts.w1_EDF.exp_avg"
    loaded = {key: torch.empty(4, 16, 64), "optim.layers.1.mlp.router.weight.step": torch.empty(())}
    with single_process_quiet():
        dcp.load(loaded, checkpoint_id=str(resolve_checkpoint(str(tmp_path / "run"))), no_dist=True)
    for g in range(4):  # global expert 3 lived on EP rank 1: its moments came from expp_rank_1
        torch.testing.assert_close(loaded[key][g], expected[f"{prefix}.{g}.dense_h_to_4h.weight/exp_avg"].t())
    assert float(loaded["optim.layers.1.mlp.router.weight.step"]) == 3


def _plain_args(states: dict, **changes) -> None:
    """Args with the Megatron enum stand-ins replaced by their values (so the rewritten file pickles plainly)."""
    values = {k: (v.value if isinstance(v, Opaque) else v) for k, v in vars(states["args"]).items()}
    states["args"] = argparse.Namespace(**{**values, **changes})


def _split_for_tensor_parallel(step: Path, out: Path, heads: int = 4) -> None:
    """mp_rank_00 → mp_rank_00/01 exactly as Megatron shards them (column-, row-parallel, replicated)."""
    shutil.copytree(step, out)
    states = load_pt(step / "mp_rank_00_model_states.pt")
    _plain_args(states, tensor_model_parallel_size=2)
    shards = [{k: v for k, v in states.items() if k != "module"} for _ in range(2)]
    lm = states["module"]["language_model"]
    for rank, shard in enumerate(shards):
        encoder = {}
        for name, t in lm["encoder"].items():
            if "query_key_value" in name:  # each rank: its own heads' [Q | K | V] thirds
                q, k, v = (x.chunk(2)[rank] for x in t.chunk(3))
                encoder[name] = torch.cat([q, k, v]).clone()
            elif "dense_h_to_4h" in name and "deepspeed" not in name and "mlp.mlp" not in name:
                encoder[name] = t.chunk(2)[rank].clone()
            elif name.endswith(("self_attention.dense.weight", "dense_4h_to_h.weight")) and "mlp.mlp" not in name:
                encoder[name] = t.chunk(2, dim=1)[rank].clone()
            else:
                encoder[name] = t.clone()
        words = lm["embedding"]["word_embeddings"]["weight"].chunk(2)[rank].clone()
        embedding = {
            "word_embeddings": {"weight": words},
            "position_embeddings": lm["embedding"]["position_embeddings"],
        }
        shard["module"] = {"language_model": {"embedding": embedding, "encoder": encoder}}
        torch.save(shard, out / f"mp_rank_{rank:02d}_model_states.pt")


def test_tensor_parallel_shards_merge(tmp_path):
    step = find_step_dir(str(FIXTURES / "moe_top1_ep2" / "checkpoint"))
    _split_for_tensor_parallel(step, tmp_path / "global_step3")
    result = import_megatron_deepspeed(str(tmp_path / "global_step3"), str(tmp_path / "run"))
    assert not result.with_optimizer
    assert [n for n in result.notes if n.startswith("optimizer state not imported") and "tensor-parallel" in n]
    model, _, _ = load_model(str(tmp_path / "run"), "cpu")
    logits, _, expected = source_outputs(model, "moe_top1_ep2")
    torch.testing.assert_close(logits, expected["logits"], atol=1e-5, rtol=0)


def test_per_head_qkv_layout(tmp_path):
    """Megatron-DeepSpeed before PR #441 kept each head's q, k, v rows together."""
    step = find_step_dir(str(FIXTURES / "prmoe_top2" / "checkpoint"))
    shutil.copytree(step, tmp_path / "global_step3")
    states = load_pt(step / "mp_rank_00_model_states.pt")
    _plain_args(states)
    encoder = states["module"]["language_model"]["encoder"]
    for name, t in encoder.items():
        if "query_key_value" in name:
            q, k, v = (x.reshape(4, -1, *t.shape[1:]) for x in t.chunk(3))  # [heads, head_dim, ...]
            encoder[name] = torch.stack([q, k, v], 1).reshape(t.shape).clone()
    torch.save(states, tmp_path / "global_step3" / "mp_rank_00_model_states.pt")
    import_megatron_deepspeed(str(tmp_path / "global_step3"), str(tmp_path / "run"), qkv_layout="per-head")
    model, _, _ = load_model(str(tmp_path / "run"), "cpu")
    logits, _, expected = source_outputs(model, "prmoe_top2")
    torch.testing.assert_close(logits, expected["logits"], atol=1e-5, rtol=0)


def _recorded_root() -> str:
    spec = importlib.util.spec_from_file_location("mds_record", FIXTURES / "record.py")
    record = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(record)
    return record.RECORDED_ROOT


def _paths(value) -> list[str]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, str) and v.startswith("/")]


@pytest.mark.parametrize("run", RUNS)
def test_fixture_args_name_no_path_of_the_recording_machine(tmp_path, run):
    """The saved args' paths lie under a root no machine has, so the import says the same on every machine: the
    tokenizer files the run used are not here (a checkpoint brought from elsewhere)."""
    root = _recorded_root()
    assert not Path(root).exists()
    step = find_step_dir(str(FIXTURES / run / "checkpoint"))
    args = vars(load_pt(step / "mp_rank_00_model_states.pt")["args"])
    paths = {k: p for k, v in args.items() for p in _paths(v)}
    assert {"save", "vocab_file", "merge_file"} <= set(paths)
    assert all(p.startswith(root + "/") for p in paths.values()), paths
    result = import_megatron_deepspeed(str(FIXTURES / run / "checkpoint"), str(tmp_path / "run"), no_optim=True)
    assert f"the tokenizer files in args ({root}/tokenizer/vocab.json) are not here" in "\n".join(result.notes)


def test_weights_only_refuses_code_and_names_the_escape_hatch(tmp_path):
    import fractions

    torch.save({"module": {}, "args": fractions.Fraction(1, 3)}, tmp_path / "mp_rank_00_model_states.pt")
    with pytest.raises(UserError, match=r"fractions\.Fraction.*--allow-pickle"):
        load_pt(tmp_path / "mp_rank_00_model_states.pt")
    assert load_pt(tmp_path / "mp_rank_00_model_states.pt", allow_pickle=True)["args"] == fractions.Fraction(1, 3)


def test_not_a_checkpoint_is_one_line(tmp_path):
    with pytest.raises(UserError, match="no mp_rank_00_model_states.pt there"):
        import_megatron_deepspeed(str(tmp_path), str(tmp_path / "run"))


@pytest.mark.parametrize("gone", [0, 1])
def test_a_missing_optimizer_file_of_an_ep_rank_is_named(tmp_path, gone):
    """The EP-2 fixture without one of its two optimizer files: refused in one line naming the missing file (not the
    one present, which an EP-1 reading of it would blame), with the way to import the weights alone."""
    import shutil

    from moetron.errors import UserError

    source = tmp_path / "mds"
    shutil.copytree(FIXTURES / "moe_top1_ep2" / "checkpoint", source)
    (missing,) = source.glob(f"*/expp_rank_{gone}_mp_rank_00_optim_states.pt")
    missing.unlink()
    with pytest.raises(UserError) as err:
        import_megatron_deepspeed(str(source), str(tmp_path / "run"))
    message = str(err.value)
    assert f"{missing.name} is missing (the checkpoint was saved by 2 expert-parallel ranks" in message
    assert "--no-optim" in message and f"expp_rank_{1 - gone}" not in message
    assert import_megatron_deepspeed(str(source), str(tmp_path / "weights"), no_optim=True).with_optimizer is False
