"""Which rotary embedding a Megatron-DeepSpeed checkpoint's attention computed, told by its saved `args`.

Megatron-DeepSpeed's PR #441 (Dec 2024, the FPDT commit) made `RotaryEmbedding` return [cos(mθ), sin(mθ)]; its
attention unpacks that pair as (query frequencies, key frequencies), so queries and keys are rotated by the angle
cos(mθ) instead of mθ (`moetron.model.rotary` has the details). Every checkpoint trained with rotary embeddings on
that code learned that function; imported as standard RoPE it computes another one. The checkpoint records no
version or commit, but its `args` do tell: PR #441 added `--ds-sequence-parallel-fpdt` (and its chunk-size and
offloading flags), and argparse saves every flag, set or not, so `ds_sequence_parallel_fpdt` in the saved args means
the run used the code of PR #441 or later (through deepspeedai/Megatron-DeepSpeed HEAD 4efb479d, Jul 2025).

The import then either keeps the checkpoint's function exactly (`--rope-convert keep`, the default: the run's
config gets `rotary_compat: megatron-deepspeed-441`) or switches to standard RoPE (`--rope-convert standard`, with a
warning: the weights were trained for the other function, so the model needs fine-tuning).

Not reproduced: with DeepSpeed's sequence parallelism (Ulysses `--ds-sequence-parallel-size > 1`,
`--force-ds-sequence-parallel`, FPDT) the pair went to DeepSpeed's distributed attention instead, which moetron
does not model; such a checkpoint imports only with `--rope-convert standard`.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetron.errors import UserError

ROPE_CONVERT = ("keep", "standard")
MDS_441 = "megatron-deepspeed-441"  # the ModelConfig.rotary_compat value
PR441_ARG = "ds_sequence_parallel_fpdt"  # an argument PR #441 added: its presence dates the checkpoint


@dataclass
class RotaryChoice:
    rotary_compat: str  # what the imported config's rotary_compat is set to
    note: str | None = None  # printed as "note: …" and written at the top of config.yaml
    warning: str | None = None  # printed as "warning: …" (and written with the notes)


def rotary_kind(args: dict) -> str:
    """none (no rotary embeddings) | standard | pr441 (cos(mθ) angles) | sequence-parallel (DeepSpeed's own)."""
    if not args.get("use_rotary_position_embeddings"):
        return "none"
    if PR441_ARG not in args:
        return "standard"  # saved before PR #441: RotaryEmbedding returned the angles themselves
    if int(args.get("ds_sequence_parallel_size") or 1) > 1 or args.get("force_ds_sequence_parallel") or args[PR441_ARG]:
        return "sequence-parallel"
    return "pr441"


def choose_rotary(args: dict, rope_convert: str, where: str) -> RotaryChoice:
    """The rotary setting of the imported model for `--rope-convert rope_convert` (see the module docstring)."""
    if rope_convert not in ROPE_CONVERT:
        raise UserError(f"--rope-convert {rope_convert!r} is not one of {', '.join(ROPE_CONVERT)}")
    kind = rotary_kind(args)
    if kind in ("none", "standard"):
        what = "has no rotary embeddings" if kind == "none" else "uses standard RoPE (saved before PR #441)"
        if rope_convert == "keep":
            return RotaryChoice("none")
        return RotaryChoice("none", f"--rope-convert standard: nothing to convert, the checkpoint {what}")
    if rope_convert == "standard":
        trained = "DeepSpeed's sequence-parallel rotary attention" if kind == "sequence-parallel" else (
            "Megatron-DeepSpeed's PR #441 rotary embeddings (queries and keys rotated by cos(m*theta), not m*theta)"
        )  # fmt: skip
        warning = (
            f"--rope-convert standard: the checkpoint was trained with {trained}; with standard RoPE it computes "
            f"another function: fine-tune it before use"
        )
        return RotaryChoice("none", warning=warning)
    if kind == "sequence-parallel":
        raise UserError(
            f"{where}: rotary embeddings under DeepSpeed sequence parallelism (--ds-sequence-parallel-size "
            f"{args.get('ds_sequence_parallel_size')}, FPDT {bool(args[PR441_ARG])}) ran inside DeepSpeed's attention, "
            f"which moetron does not reproduce; add --rope-convert standard to import with standard RoPE and fine-tune"
        )
    note = (
        f"rotary embeddings as Megatron-DeepSpeed computed them since its PR #441 (queries and keys rotated by "
        f"cos(m*theta), not m*theta): kept exactly with rotary_compat: {MDS_441} in config.yaml; "
        f"--rope-convert standard imports standard RoPE instead (then fine-tune)"
    )
    return RotaryChoice(MDS_441, note)
