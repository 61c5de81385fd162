"""Generation with the KV cache against an uncached reference decode; sampling filters; CLI errors."""

from __future__ import annotations

import functools

import pytest
import torch

from moetron.cli import main
from moetron.eval.generate import (
    GenerationOptions,
    filter_logits,
    generate,
    generate_batch,
    generate_texts,
    inference_routing,
)
from moetron.model.config import ModelConfig
from moetron.model.gpt import create_model

PROMPT = [3, 17, 5, 42, 8, 11]
VOCAB = 50
# A cycle through every token, starting with PROMPT: trained on walks along it, the model's greedy continuation
# of PROMPT walks on (13, 29, ...), so outputs vary and a cache bug cannot hide behind a repeated token (an
# untrained tied-embedding model just repeats the last token, whatever the cache does).
CYCLE = PROMPT + [
    t for t in torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0)).tolist() if t not in PROMPT
]

TRAIN_STEPS = 40


def model_config(topk: int = 1, **overrides) -> ModelConfig:
    return ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=32,
        vocab_size=VOCAB,  # padded to 128 in the embedding: sampling must never return an id >= 50
        num_experts=[4],
        expert_interval=1,
        topk=topk,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        moe_top2_2nd_expert_sampling=False,
        untie_embeddings_and_output_weights=True,
        **overrides,
    )


def cycle_batch(batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """`batch` windows of `length + 1` tokens along CYCLE, at random starts."""
    cycle = torch.tensor(CYCLE * 3)
    starts = torch.randint(0, VOCAB, (batch,), generator=generator)
    return torch.stack([cycle[s : s + length + 1] for s in starts.tolist()])


@functools.cache
def trained_model(topk: int = 1, overrides: tuple = ()) -> torch.nn.Module:
    """A few Adam steps on CYCLE walks: enough for the greedy path to follow the cycle for a while."""
    model = create_model(model_config(topk, **dict(overrides)), seed=7)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    model.train()
    for _ in range(TRAIN_STEPS):
        batch = cycle_batch(16, 24, generator)
        out = model(batch[:, :-1], labels_BT=batch[:, 1:])
        optimizer.zero_grad()
        (out.lm_loss + out.moe_loss).backward()
        optimizer.step()
    return model.eval()


def tiny_model(topk: int = 1, **overrides) -> torch.nn.Module:
    return trained_model(topk, tuple(sorted(overrides.items())))


@torch.no_grad()
def uncached_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """The reference: the whole sequence through the model at every step, no cache, argmax of the last position."""
    tokens = list(prompt)
    with model.inference_routing(dropless=True):
        for _ in range(steps):
            logits = model(torch.tensor([tokens])).logits[0, -1, : model.cfg.vocab_size]
            tokens.append(int(torch.argmax(logits)))
    return tokens[len(prompt) :]


class IdTokenizer:
    """Text is space-separated token ids: lets `generate_texts` (the CLI's path) run on the tiny model."""

    eod = None

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int]) -> str:
        return "".join(f" {t}" for t in ids)


@pytest.mark.parametrize(
    "topk, overrides",
    [(1, {}), (2, {}), (2, {"position_embedding_type": "rope", "num_key_value_heads": 2, "swiglu": True})],
)
def test_greedy_with_cache_equals_uncached_decode(topk, overrides):
    model = tiny_model(topk, **overrides)
    reference = uncached_greedy(model, PROMPT, 12)
    assert len(set(reference)) >= 3, reference  # a decode that varies, or the comparison proves nothing
    assert generate(model, PROMPT, GenerationOptions(max_new_tokens=12, temperature=0)) == reference
    # the CLI's path: text in, text out, through the same cached decode
    prompt_text = " ".join(map(str, PROMPT))
    texts = generate_texts(model, IdTokenizer(), [prompt_text], GenerationOptions(max_new_tokens=12, temperature=0))
    assert IdTokenizer().encode(texts[0]) == reference


def test_the_trained_model_follows_the_cycle():
    # the premise of the tests here: greedy decoding walks on along CYCLE, distinct tokens at every step
    following = CYCLE[len(PROMPT) : len(PROMPT) + 6]
    assert generate(tiny_model(), PROMPT, GenerationOptions(max_new_tokens=6, temperature=0)) == following


def test_top_k_one_equals_greedy_and_sampling_repeats_with_the_seed():
    model = tiny_model()
    greedy = generate(model, PROMPT, GenerationOptions(max_new_tokens=10, temperature=0))
    assert generate(model, PROMPT, GenerationOptions(max_new_tokens=10, temperature=1.5, top_k=1)) == greedy
    hot = GenerationOptions(max_new_tokens=20, temperature=5.0, seed=3)
    first, again = generate(model, PROMPT, hot), generate(model, PROMPT, hot)
    assert first == again
    assert all(0 <= t < 50 for t in first)  # never a padding id of the embedding
    assert first != generate(model, PROMPT, GenerationOptions(max_new_tokens=20, temperature=5.0, seed=4))


def test_stops_at_end_of_document():
    model = tiny_model()
    options = GenerationOptions(max_new_tokens=10, temperature=0)
    eod = CYCLE[len(PROMPT) + 3]  # the 4th greedy token (the cycle's next after PROMPT), never seen before it
    greedy = generate(model, PROMPT, options)
    assert greedy.index(eod) == 3 and len(greedy) == 10
    stopped = generate(model, PROMPT, options, eod=eod)
    assert stopped == greedy[:4] and stopped[-1] == eod  # stopped right there, 6 tokens early


PROMPTS = ["3 17 5 42 8 11", "44 39 7 6", "1 2 3 4 5 6", "7 6 29 21 37 33"]  # lengths 6, 4, 6, 6


def count_forwards(model) -> list[int]:
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("options", [dict(temperature=0), dict(temperature=1.5, top_k=10, seed=5)])
def test_prompts_of_one_length_share_forwards_and_equal_each_prompt_alone(options):
    model = create_model(tiny_model().cfg, seed=7)  # a fresh copy: the hook must not stay on the cached model
    model.load_state_dict(tiny_model().state_dict())
    model.eval()
    opts = GenerationOptions(max_new_tokens=5, **options)
    alone = [generate_texts(model, IdTokenizer(), [p], opts)[0] for p in PROMPTS]
    calls = count_forwards(model)
    assert generate_texts(model, IdTokenizer(), PROMPTS, opts) == alone
    assert calls[0] == 2 * 5  # two lengths → two batches of 5 steps (one prompt at a time: 4 × 5)
    calls[0] = 0
    # a capacity factor makes tokens of a batch compete for capacity: one prompt at a time then
    capped = GenerationOptions(max_new_tokens=5, capacity_factor=2.0, **options)
    generate_texts(model, IdTokenizer(), PROMPTS, capped)
    assert calls[0] == 4 * 5


def test_rows_of_a_batch_stop_at_end_of_document_on_their_own():
    model = tiny_model()
    options = GenerationOptions(max_new_tokens=8, temperature=0)
    prompts = [PROMPT, CYCLE[1:7]]  # the second runs one step ahead along the cycle
    eod = CYCLE[len(PROMPT) + 3]
    batched = generate_batch(model, prompts, options, eod=eod)
    assert batched == [generate(model, p, options, eod=eod) for p in prompts]
    assert [len(ids) for ids in batched] == [4, 3] and all(ids[-1] == eod for ids in batched)


def test_top1_decode_under_min_capacity_routes_with_a_capacity_factor():
    """Batch-1 decode steps route 1 token (< moe_min_capacity 4): dropless there, the factor elsewhere."""
    model = tiny_model(topk=1, moe_min_capacity=4)
    with_factor = generate(model, PROMPT, GenerationOptions(max_new_tokens=6, temperature=0, capacity_factor=8.0))
    assert with_factor == generate(model, PROMPT, GenerationOptions(max_new_tokens=6, temperature=0))
    with inference_routing(model, 1, capacity_factor=1.0):
        assert not model.moe_layers()[0].router.cfg.moe_token_dropping
    with inference_routing(model, 16, capacity_factor=1.0):
        assert model.moe_layers()[0].router.cfg.moe_token_dropping
        assert model.moe_layers()[0].router.cfg.moe_eval_capacity_factor == 1.0
    assert model.moe_layers()[0].router.cfg is model.cfg  # restored


def test_filters_keep_the_top_k_and_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, top_k=0, top_p=0.8)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, top_k=0, top_p=0.81)).tolist() == [True, True, True, False]
    assert torch.isfinite(filter_logits(logits, top_k=0, top_p=0.1)).tolist() == [True, False, False, False]


def test_too_long_for_the_positions_is_a_clear_error():
    from moetron.errors import UserError

    with pytest.raises(UserError, match="--max-new-tokens"):
        generate(tiny_model(), PROMPT, GenerationOptions(max_new_tokens=40))


def test_bad_load_path_is_one_line_error(tmp_path, capsys):
    rc = main(["generate", "--load", str(tmp_path / "nowhere"), "--prompt", "hello"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: --load ") and "no checkpoint" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_sampling_flags_are_reported_together(tmp_path, capsys):
    rc = main(["generate", "--load", str(tmp_path), "--prompt", "x", "--top-p", "0", "--temperature", "-1"])
    err = capsys.readouterr().err
    assert rc == 2 and "--top-p" in err and "--temperature" in err


def test_progress_goes_to_stderr_per_decoding_step_and_counts_prompts(monkeypatch, capsys):
    """A long generation says it is still working (a line per report interval, here every step) on stderr only."""
    monkeypatch.setattr("moetron.progress.LOG_EVERY_S", 0.0)
    opts = GenerationOptions(max_new_tokens=3, temperature=0)
    generate_texts(tiny_model(), IdTokenizer(), PROMPTS, opts)
    out, err = capsys.readouterr()
    lines = [line.split()[1] for line in err.splitlines() if line.startswith("generate: ")]
    assert out == "" and lines[0].startswith("0/4") and lines[-1] == "4/4"
