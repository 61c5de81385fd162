"""How one moetron tensor becomes Hugging Face tensors and back: a `Rule` per moetron tensor.

    rule = Rule("layers.0.self_attention.query_key_value.weight", ("…q_proj.weight", "…k_proj.weight", "…v_proj…"),
                to_hf=lambda w: list(split_qkv_weight(w, H, K)), to_moetron=lambda qkv: fuse_qkv(*qkv, H, K))

Every rule maps ONE moetron tensor to one or more HF tensors (q/k/v from the grouped QKV projection, one HF
tensor per expert from an `[E, …]` expert stack), so export reads one moetron tensor at a time and import builds
one moetron tensor from its HF parts. Shapes of the HF side are found by running `to_hf` on meta tensors.

Layouts (moetron → HF): nn.Linear weights are `[out, in]` on both sides; routed experts `w1_EDF` / `w3_EDF`
`[E, C, F]` → per-expert gate / up `[F, C]`, `w2_EFD` `[E, F, C]` → down `[C, F]`; the padded vocabulary rows
beyond the tokenizer's vocabulary are dropped on export and zero-filled on import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moetron.model.attention import fuse_qkv, split_qkv_weight


@dataclass(frozen=True)
class Rule:
    moetron: str
    hf: tuple[str, ...]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]
    to_moetron: Callable[[list[torch.Tensor]], torch.Tensor]


def same(moetron: str, hf: str) -> Rule:
    return Rule(moetron, (hf,), lambda t: [t], lambda ts: ts[0])


def transposed(moetron: str, hf: str) -> Rule:
    """HF's GPT-2 `Conv1D` stores `[in, out]`."""
    return Rule(moetron, (hf,), lambda t: [t.t()], lambda ts: ts[0].t())


def vocab_rows(moetron: str, hf: str, vocab: int, padded: int) -> Rule:
    """Embedding / output rows: the tokenizer's `vocab` rows on the HF side, `padded` rows in moetron."""

    def pad(ts: list[torch.Tensor]) -> torch.Tensor:
        t = ts[0][:padded]
        return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])]) if t.shape[0] < padded else t

    return Rule(moetron, (hf,), lambda t: [t[:vocab]], pad)


def qkv(moetron: str, q: str, k: str, v: str, heads: int, kv_heads: int) -> Rule:
    """The grouped `query_key_value` weight or bias ↔ separate q, k, v projections."""
    return Rule(
        moetron,
        (q, k, v),
        lambda t: list(split_qkv_weight(t, heads, kv_heads)),
        lambda ts: fuse_qkv(ts[0], ts[1], ts[2], heads, kv_heads),
    )


def gpt2_qkv(moetron: str, hf: str, heads: int, kv_heads: int) -> Rule:
    """GPT-2's `c_attn` ([in, 3·out] Conv1D, [Q | K | V] thirds; bias [3·out]) ↔ the grouped projection."""

    def to_hf(t: torch.Tensor) -> list[torch.Tensor]:
        joined = torch.cat(split_qkv_weight(t, heads, kv_heads))
        return [joined.t() if joined.dim() == 2 else joined]

    def to_moetron(ts: list[torch.Tensor]) -> torch.Tensor:
        t = ts[0].t() if ts[0].dim() == 2 else ts[0]
        return fuse_qkv(*t.chunk(3), heads, kv_heads)

    return Rule(moetron, (hf,), to_hf, to_moetron)


def per_expert(moetron: str, hf_pattern: str, num_experts: int) -> Rule:
    """An `[E, A, B]` expert stack ↔ E HF `[B, A]` nn.Linear weights named `hf_pattern.format(e=…)`."""
    names = tuple(hf_pattern.format(e=e) for e in range(num_experts))
    return Rule(
        moetron,
        names,
        lambda t: [t[e].t() for e in range(t.shape[0])],
        lambda ts: torch.stack([t.t() for t in ts]),
    )


def single_expert(moetron: str, hf: str) -> Rule:
    """A one-expert stack `[1, A, B]` (shared experts) ↔ one `[B, A]` nn.Linear weight."""
    return Rule(moetron, (hf,), lambda t: [t[0].t()], lambda ts: ts[0].t()[None])
