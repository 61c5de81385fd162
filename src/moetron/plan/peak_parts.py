"""What each row of `moetron plan`'s memory table holds at the moment of the peak, and the line that says so.

Each row is its term at its largest (all the fp32 gradients, one micro-batch's activations), but the peak is
one moment (`memory_terms.assemble`): at the start of backward only the gradients made so far exist (the LM
head's, or all of them when micro-batches accumulate into them) and ZeRO-1's all-gather bucket comes after the
step; after backward the activations, the loss buffers, the half-precision weight copies and the all-to-all
buffers are freed. So the rows can add up to more than the peak; the plan says by how much and why, instead of
leaving a reader to find that its own table does not add up.
"""

from __future__ import annotations

from moetron.plan.memory_terms import MemoryEstimate

ROWS = ("weights", "gradients", "ddp_buckets", "optimizer", "weight_casts", "gathered", "activations", "logits",
        "all_to_all")  # fmt: skip
HELD_AFTER_BACKWARD = ("weights", "gradients", "ddp_buckets", "optimizer")
FREED_WORDS = {"weight_casts": "half-precision weight copies", "activations": "activations",
               "logits": "LM-head loss buffers", "all_to_all": "all-to-all buffers"}  # fmt: skip


def held_at_peak(mem: MemoryEstimate) -> dict[str, int]:
    """Bytes of each memory row at the peak's moment; they add up to `mem.peak`."""
    rows = {name: getattr(mem, name) for name in ROWS}
    if mem.phase == "after backward":
        kept = {*HELD_AFTER_BACKWARD, *(("gathered",) if mem.zero_stage == 1 else ())}
        return {name: value if name in kept else 0 for name, value in rows.items()}
    if mem.zero_stage == 1:
        rows["gathered"] = 0  # ZeRO-1's all-gather bucket: after the optimizer step
    others = sum(value for name, value in rows.items() if name != "gradients")
    rows["gradients"] = min(mem.gradients, max(0, mem.peak - others))  # those made before backward
    return rows


def overlap_note(mem: MemoryEstimate, gib, context_bytes: int = 0) -> str | None:
    """One line when the rows (with the device's `context_bytes`) add up to more than the peak (by 0.01 GiB or
    more): their sum, and what is not there at the peak's moment; None when they add up."""
    held, total = held_at_peak(mem), sum(getattr(mem, name) for name in ROWS)
    if total - mem.peak < 2**30 / 100:
        return None
    if mem.phase == "after backward":
        freed = [words for name, words in FREED_WORDS.items() if getattr(mem, name)]
        if mem.zero_stage >= 2 and mem.gathered:
            freed.append("gathered weights")
        why = f"the {', '.join(freed)} are freed by then"
    else:
        why = (
            f"only {gib(held['gradients'])} of the {gib(mem.gradients)} GiB of gradients exist (the LM head's: the "
            f"others are made during backward, as activations are freed)"
        )
        if mem.zero_stage == 1 and mem.gathered:
            why += " and ZeRO-1's all-gather bucket comes after the step"
    return f"  (the rows add up to {gib(total + context_bytes)} GiB: at the peak, the {mem.phase}, {why})"
