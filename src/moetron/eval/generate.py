"""Text generation from a checkpoint with the model's KV cache: greedy, temperature, top-k, top-p, stop at EOD.

    model, cfg, path = load_model("runs/quickstart")            # a run directory (follows `latest`) or iter_*
    tokenizer = load_tokenizer(cfg)
    ids = generate(model, tokenizer.encode("def main"), GenerationOptions(max_new_tokens=40), eod=tokenizer.eod)

A prompt goes through the model once (prefill), then one token per step reads and extends the cache.
`generate_texts` decodes prompts of the same token length together, as one batch sharing every forward
(nothing is padded, so no row can see another's tokens); each row samples with its own generator seeded
like a prompt alone, so a result equals what the model gives that prompt alone (up to float rounding in
the batched matmuls). Batching needs routing where each token is routed on its own: with
`--capacity-factor` (tokens compete for capacity) or top-2 2nd-expert sampling (random draws shared by
the batch), prompts are decoded one at a time.

Routing at inference (`inference_routing`): dropless by default, so no token of a prompt is ever dropped;
with a capacity factor the routers drop at that factor, except in forward passes of fewer tokens than
`moe_min_capacity` (every decode step), where nothing can be dropped anyway (the capacity is at least
min_capacity) and the pass routes dropless instead of hitting DeepSpeed's top-1 minimum-token check.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

# `load_model` and `load_tokenizer` are where generation starts; a checkpoint is opened the one way every command
# opens one (`moetron.checkpoint.open`).
from moetron.checkpoint.open import load_model as load_model
from moetron.data.tokenizer import load_tokenizer as load_tokenizer
from moetron.errors import UserError
from moetron.model.gpt import GPTModel
from moetron.model.kv_cache import KVCache
from moetron.progress import Progress


@dataclass
class GenerationOptions:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0: greedy (argmax)
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int = 1234
    capacity_factor: float | None = None  # None: dropless routing

    def problems(self) -> list[str]:
        p = []
        if self.max_new_tokens < 1:
            p.append(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            p.append(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            p.append(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            p.append(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            p.append(f"--capacity-factor must be > 0, got {self.capacity_factor}")
        return p


# ---------------------------------------------------------------------------- routing
def _router_configs(model: GPTModel, num_tokens: int, capacity_factor: float | None):
    base = model.cfg
    if capacity_factor is None or num_tokens < base.moe_min_capacity:
        return dataclasses.replace(base, moe_token_dropping=False, moe_min_capacity=0)
    return dataclasses.replace(base, moe_token_dropping=True, moe_eval_capacity_factor=capacity_factor)


@contextlib.contextmanager
def inference_routing(model: GPTModel, num_tokens: int, capacity_factor: float | None = None) -> Iterator[None]:
    """Route a forward pass of `num_tokens` tokens for generation (see the module docstring); restores after."""
    routers = [moe.router for moe in model.moe_layers()]
    previous = [r.cfg for r in routers]
    cfg = _router_configs(model, num_tokens, capacity_factor)
    try:
        for router in routers:
            router.cfg = cfg
        yield
    finally:
        for router, old in zip(routers, previous, strict=True):
            router.cfg = old


# ---------------------------------------------------------------------------- sampling
def filter_logits(logits_V: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits with everything outside the top-k and outside the top-p nucleus set to -inf."""
    if top_k > 0 and top_k < logits_V.shape[-1]:
        kth = torch.topk(logits_V, top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    if top_p < 1.0:
        sorted_V, order_V = torch.sort(logits_V, descending=True)
        cumulative_V = torch.softmax(sorted_V, dim=-1).cumsum(-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first token always stays).
        drop_sorted_V = (cumulative_V - torch.softmax(sorted_V, dim=-1)) >= top_p
        logits_V = logits_V.masked_fill(drop_sorted_V.scatter(0, order_V, drop_sorted_V), float("-inf"))
    return logits_V


def next_token(logits_V: torch.Tensor, options: GenerationOptions, generator: torch.Generator) -> int:
    """Greedy at temperature 0, else a draw from softmax(filtered logits / temperature)."""
    if options.temperature == 0:
        return int(torch.argmax(logits_V))
    filtered_V = filter_logits(logits_V.float() / options.temperature, options.top_k, options.top_p)
    probs_V = torch.softmax(filtered_V, dim=-1)
    return int(torch.multinomial(probs_V, 1, generator=generator))


def _check_length(model: GPTModel, prompt_len: int, options: GenerationOptions) -> None:
    limit = model.cfg.max_positions
    if model.position_embeddings is not None and prompt_len + options.max_new_tokens > limit:
        raise UserError(
            f"the prompt has {prompt_len} tokens and --max-new-tokens is {options.max_new_tokens}, but the model "
            f"was trained for at most {limit} positions; shorten the prompt or lower --max-new-tokens"
        )


def _check_prompts(model: GPTModel, prompts_ids: list[list[int]], options: GenerationOptions) -> None:
    if any(not ids for ids in prompts_ids):
        raise UserError("empty prompt: give at least one character of text to continue")
    if len({len(ids) for ids in prompts_ids}) != 1:
        raise ValueError("a batch of prompts must have one token length (generate_texts groups them)")
    _check_length(model, len(prompts_ids[0]), options)


@torch.no_grad()
def generate_batch(
    model: GPTModel,
    prompts_ids: list[list[int]],
    options: GenerationOptions,
    eod: int | None = None,
    on_step: Callable[[], None] | None = None,
) -> list[list[int]]:
    """The new token ids of B prompts of equal length, decoded as one batch (each ends with `eod` if produced).

    Row b draws from its own generator seeded with `options.seed`, exactly like `generate` on that prompt
    alone. Finished rows keep stepping (their outputs ignored) until every row is done.
    """
    _check_prompts(model, prompts_ids, options)
    batch, prompt_len = len(prompts_ids), len(prompts_ids[0])
    vocab = model.cfg.vocab_size  # the embedding is padded past the tokenizer's vocabulary: never sample there
    generators = [torch.Generator(device="cpu").manual_seed(options.seed) for _ in range(batch)]
    device = next(model.parameters()).device
    cache = KVCache.for_model(model.cfg, batch, prompt_len + options.max_new_tokens, device)
    tokens_BT = torch.tensor(prompts_ids, dtype=torch.long, device=device)
    new: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    model.eval()
    for _ in range(options.max_new_tokens):
        with inference_routing(model, tokens_BT.numel(), options.capacity_factor):
            logits_BV = model(tokens_BT, kv_cache=cache).logits[:, -1, :vocab].cpu()
        step = [next_token(logits_BV[b], options, generators[b]) for b in range(batch)]
        for b, token in enumerate(step):
            if not done[b]:
                new[b].append(token)
                done[b] = token == eod
        if on_step is not None:
            on_step()
        if all(done):
            break
        tokens_BT = torch.tensor([[token] for token in step], dtype=torch.long, device=device)
    return new


def generate(model: GPTModel, prompt_ids: list[int], options: GenerationOptions, eod: int | None = None) -> list[int]:
    """The new token ids for one prompt (ending with `eod` when the model produced it)."""
    return generate_batch(model, [prompt_ids], options, eod)[0]


def batchable(model: GPTModel, options: GenerationOptions) -> bool:
    """Whether a batch routes each token exactly as alone: dropless, and no random draws shared by the batch."""
    return options.capacity_factor is None and not model.cfg.moe_top2_2nd_expert_sampling


def length_groups(prompts_ids: list[list[int]], batched: bool) -> list[list[int]]:
    """Indices of the prompts decoded together: one group per token length, or one prompt per group."""
    if not batched:
        return [[i] for i in range(len(prompts_ids))]
    groups: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts_ids):
        groups.setdefault(len(ids), []).append(i)
    return list(groups.values())


def clamp_to_context(model: GPTModel, prompt_len: int, options: GenerationOptions) -> tuple[GenerationOptions, str]:
    """`options` with `max_new_tokens` lowered to what the model's positions leave after the prompt, and the
    note saying so ("" when nothing changed). A prompt that fills the context is a UserError."""
    limit = model.cfg.max_positions
    if model.position_embeddings is None or prompt_len + options.max_new_tokens <= limit:
        return options, ""
    room = limit - prompt_len
    if room < 1:
        raise UserError(
            f"the prompt has {prompt_len} tokens but the model was trained for at most {limit} positions, so no "
            f"token can follow it; shorten the prompt"
        )
    note = (
        f"note: --max-new-tokens {options.max_new_tokens} lowered to {room} for a prompt of {prompt_len} tokens: "
        f"the model has {limit} positions"
    )
    return dataclasses.replace(options, max_new_tokens=room), note


def _print_note(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)


def generate_texts(model: GPTModel, tokenizer, prompts: list[str], options: GenerationOptions,
                   note=_print_note) -> list[str]:  # fmt: skip
    """Each prompt's continuation as text (the EOD token, when produced, is not part of it).

    A prompt whose length plus `max_new_tokens` exceeds the model's positions gets fewer new tokens, and
    `note(line)` is called once per distinct reduction (default: printed to stderr)."""
    try:
        eod = tokenizer.eod
    except UserError:  # a tokenizer without an end-of-document token: generation simply never stops early
        eod = None
    torch.manual_seed(options.seed)  # routing draws (random token selection, 2nd-expert sampling), if any
    prompts_ids = [tokenizer.encode(prompt) for prompt in prompts]
    results: list[list[int]] = [[] for _ in prompts]
    noted: set[str] = set()
    groups = length_groups(prompts_ids, batchable(model, options))
    progress = Progress("generate", len(prompts), "prompts")  # stderr; a line only if it takes a while

    def still_working() -> None:  # each decoding step: a long generation reports while its prompts are unfinished
        progress.advance(0)

    for group in groups:
        group_options, message = clamp_to_context(model, len(prompts_ids[group[0]]), options)
        if message and message not in noted:
            noted.add(message)
            note(message)
        group_ids = generate_batch(model, [prompts_ids[i] for i in group], group_options, eod, on_step=still_working)
        for i, ids in zip(group, group_ids, strict=True):
            results[i] = ids
        progress.advance(len(group))
    progress.close()
    return [tokenizer.decode(ids[:-1] if ids and ids[-1] == eod else ids) for ids in results]
