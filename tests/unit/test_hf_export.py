"""moetron → Hugging Face export: every native class gives moetron's logits and greedy tokens; everything else
exports as remote code that does too (DeepSpeed top-1 with capacity, PR-MoE); shards stream; errors are one line."""

from __future__ import annotations

import json

import pytest
import torch
from interchange_support import ARCHITECTURES, HF_CLASSES, VOCAB, tiny_checkpoint, tokens

from moetron.errors import UserError
from moetron.eval.generate import GenerationOptions, generate_batch, load_tokenizer
from moetron.interchange.hf_export import export_hf
from moetron.interchange.remote_code import bundled_model_source, module_order
from moetron.model.rng import STREAMS

transformers = pytest.importorskip("transformers", reason="the export is checked against transformers itself")


def load_hf(path, **kwargs):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    return model.eval()


def greedy_hf(model, prompt: torch.Tensor, new: int) -> list[int]:
    out = model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, prompt.shape[1] :].tolist()


def greedy_moetron(model, prompt: torch.Tensor, new: int) -> list[int]:
    return generate_batch(model, [prompt[0].tolist()], GenerationOptions(max_new_tokens=new, temperature=0))[0]


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_native_export_equals_moetron(tmp_path, arch):
    run, cfg, model = tiny_checkpoint(tmp_path, arch, init_method_std=0.2)
    result = export_hf(str(run), str(tmp_path / "hf"))
    assert (result.hf_class, result.remote_code) == (HF_CLASSES[arch], False)
    hf = load_hf(tmp_path / "hf")
    assert type(hf).__name__ == HF_CLASSES[arch]
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x).logits[..., :VOCAB], atol=1e-4, rtol=0)
    prompt = tokens(1, 5, seed=3)
    assert greedy_hf(hf, prompt, 8) == greedy_moetron(model, prompt, 8)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "The quick brown fox jumps over the lazy dog."
    assert tokenizer.encode(text) == load_tokenizer(cfg).encode(text)
    files = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"].values()
    assert set(files) == {"model-00001-of-00001.safetensors"}


def test_shards_are_streamed_and_dtypes_converted(tmp_path):
    run, _, model = tiny_checkpoint(tmp_path, "mixtral")
    result = export_hf(str(run), str(tmp_path / "hf"), dtype="bf16", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == result.num_shards > 3 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    from safetensors import safe_open

    total = 0
    for shard in shards:
        with safe_open(str(tmp_path / "hf" / shard), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                assert t.dtype == torch.bfloat16 and index["weight_map"][name] == shard
                total += t.numel() * 2
    assert total == index["metadata"]["total_size"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    hf = load_hf(tmp_path / "hf", dtype=torch.float32)
    x = tokens()
    with torch.no_grad():  # bf16 weights: close to the fp32 model, not equal
        torch.testing.assert_close(hf(x).logits, model(x).logits[..., :VOCAB], atol=0.05, rtol=0.05)


def eval_logits(model, x: torch.Tensor, seed: int, first_sample: int = 0) -> torch.Tensor:
    """The logits `moetron eval` computes for a micro-batch `x` whose first dataset sample is `first_sample`."""
    previous = STREAMS.seed
    STREAMS.configure(seed)
    try:
        with torch.no_grad(), STREAMS.micro_batch("valid", first_sample):
            return model(x).logits
    finally:
        STREAMS.configure(previous)


def routes_dropped(model, x: torch.Tensor) -> int:
    with torch.no_grad():
        return sum(int(aux.dropped_routes) for aux in model(x).moe_aux)


@pytest.mark.parametrize(
    "overrides",
    [
        # the seeds' routing: DeepSpeed top-1, capacity factor 1 in eval, random token selection
        dict(num_experts=[4], expert_interval=2, topk=1, moe_eval_capacity_factor=1.0, moe_min_capacity=2),
        # PR-MoE: a pyramid of expert counts, residual MLP, top-2 with DeepSpeed's sampled second expert
        dict(num_layers=4, num_experts=[2, 4], expert_interval=2, topk=2, mlp_type="residual",
             moe_eval_capacity_factor=1.0, moe_min_capacity=2),
    ],
    ids=["top1-capacity", "pr-moe"],
)  # fmt: skip
def test_remote_code_export_equals_moetron_at_eval_capacity(tmp_path, overrides):
    run, cfg, model = tiny_checkpoint(tmp_path, "gpt2", init_method_std=0.2, **overrides)
    result = export_hf(str(run), str(tmp_path / "hf"))
    assert result.remote_code and "--normalization 'layernorm' has no" in result.why_remote[0]
    assert {"modeling_moetron.py", "configuration_moetron.py"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    hf = load_hf(tmp_path / "hf", trust_remote_code=True)
    assert type(hf).__name__ == "MoetronForCausalLM"
    x = tokens(2, 16)
    torch.manual_seed(0)
    assert routes_dropped(model, x) > 0  # the capacity really binds: the equality covers dropping
    with torch.no_grad():  # random token selection / second-expert draws: `moetron eval`'s seeded streams
        ours = eval_logits(model, x, cfg.train.seed)[..., :VOCAB]
        theirs = hf(x).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    if overrides["topk"] == 1:  # top-2's second expert is sampled, so greedy decoding is random there
        prompt = tokens(1, 5, seed=3)
        assert greedy_hf(hf, prompt, 8) == greedy_moetron(model, prompt, 8)


def test_forced_architecture_names_the_option(tmp_path):
    run, _, _ = tiny_checkpoint(tmp_path, "gpt2")
    with pytest.raises(UserError, match=r"^--arch mixtral: --normalization 'layernorm' has no MixtralForCausalLM"):
        export_hf(str(run), str(tmp_path / "hf"), arch="mixtral")
    assert not (tmp_path / "hf").exists()


def test_capacity_routing_is_native_only_when_exported_dropless(tmp_path):
    run, _, _ = tiny_checkpoint(tmp_path, "mixtral", moe_token_dropping=True)
    result = export_hf(str(run), str(tmp_path / "remote"))
    assert result.remote_code and "--moe-token-dropping" in result.why_remote[0]
    assert export_hf(str(run), str(tmp_path / "native"), dropless=True).hf_class == "MixtralForCausalLM"


def test_missing_tokenizer_files_fail_before_writing(tmp_path):
    run, _, _ = tiny_checkpoint(tmp_path, "llama")
    (tmp_path / "tok" / "merges.txt").unlink()
    with pytest.raises(UserError, match="--merge-file .* is not there"):
        export_hf(str(run), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()
    assert export_hf(str(run), str(tmp_path / "hf"), tokenizer=False).hf_class == "LlamaForCausalLM"


def test_a_tokenizer_larger_than_the_model_is_refused_before_writing(tmp_path):
    """The tokenizer the config names must fit the model's vocabulary (eval's and generate's check); a model with
    more rows than the tokenizer's ids (a padded vocabulary) exports."""
    small, _, _ = tiny_checkpoint(tmp_path, "llama", vocab_size=VOCAB - 44)
    with pytest.raises(UserError, match=rf"has {VOCAB} tokens but the checkpoint's model only {VOCAB - 44} "):
        export_hf(str(small), str(tmp_path / "hf"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "run_llama", "tok"]
    assert export_hf(str(small), str(tmp_path / "hf"), tokenizer=False).hf_class == "LlamaForCausalLM"
    padded, _, _ = tiny_checkpoint(tmp_path, "gpt2", vocab_size=VOCAB + 20)
    assert export_hf(str(padded), str(tmp_path / "padded_hf")).hf_class == "GPT2LMHeadModel"
    assert (tmp_path / "padded_hf" / "tokenizer.json").is_file()


def test_bundled_model_code_imports_nothing_from_moetron():
    source = bundled_model_source()
    assert "moetron.model.gpt" == module_order()[-1]
    assert not [line for line in source.splitlines() if line.lstrip().startswith(("from moetron", "import moetron"))]
    compile(source, "modeling_moetron.py", "exec")


PR_MOE_SAMPLED = dict(num_layers=4, num_experts=[2, 4], expert_interval=2, topk=2, mlp_type="residual",
                      moe_eval_capacity_factor=1.0, moe_min_capacity=2)  # fmt: skip


def test_remote_code_random_routing_draws_moetron_evals_streams(tmp_path):
    """Random token selection and top-2's sampled second expert draw from the streams `moetron eval` uses, keyed by
    the run's seed and the batch's first sample index, so the exported logits equal eval's, call after call."""
    run, cfg, model = tiny_checkpoint(tmp_path, "gpt2", init_method_std=0.2, **PR_MOE_SAMPLED)
    assert cfg.model.moe_use_rts and cfg.model.moe_top2_2nd_expert_sampling
    export_hf(str(run), str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["random_seed"] == cfg.train.seed
    hf = load_hf(tmp_path / "hf", trust_remote_code=True)
    x = tokens(2, 16)
    assert routes_dropped(model, x) > 0
    rng = torch.random.get_rng_state()
    with torch.no_grad():
        for first_sample in (0, 5):
            ours = eval_logits(model, x, cfg.train.seed, first_sample)[..., :VOCAB]
            for _ in range(2):
                torch.testing.assert_close(hf(x, sample_index=first_sample).logits, ours, atol=0, rtol=0)
        assert (eval_logits(model, x, cfg.train.seed, 0)[..., :VOCAB] - ours).abs().max() > 1e-3  # keyed by sample
        assert torch.equal(torch.random.get_rng_state(), rng)  # the global generator is left alone
        hf.config.random_seed = None  # an export without the seed: torch's global generator, not eval's draws
        assert (hf(x, sample_index=5).logits - ours).abs().max() > 1e-3


def test_rotary_compat_exports_only_with_remote_code(tmp_path):
    from moetron.interchange.mds_rotary import MDS_441

    run, _, model = tiny_checkpoint(tmp_path, "llama", rotary_compat=MDS_441)
    with pytest.raises(UserError, match=r"^--arch llama: --rotary-compat 'megatron-deepspeed-441' has no Llama"):
        export_hf(str(run), str(tmp_path / "native"), arch="llama")
    assert not (tmp_path / "native").exists()
    result = export_hf(str(run), str(tmp_path / "hf"))  # no --arch: no class fits, so remote code, which carries it
    assert result.remote_code and "--rotary-compat 'megatron-deepspeed-441' has no" in result.why_remote[0]
    hf = load_hf(tmp_path / "hf", trust_remote_code=True)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x).logits[..., :VOCAB], atol=1e-5, rtol=0)


def test_a_remote_code_export_says_why_in_one_short_line():
    from moetron.commands.export import why_not_native

    many = ["closest Qwen3MoeForCausalLM: --a has no equivalent; --b differs; --c differs"]
    assert why_not_native(many) == "closest Qwen3MoeForCausalLM: --a has no equivalent, and 2 more difference(s)"
    assert why_not_native(["--remote-code was asked for"]) == "--remote-code was asked for"
