"""Megatron-DeepSpeed's rotary embeddings after its PR #441 (queries and keys rotated by cos(mθ), not mθ):
moetron's `rotary_compat: megatron-deepspeed-441` computes exactly that, `moetron import --megatron-deepspeed`
detects it from the saved args and keeps it (or converts to standard RoPE with a warning), and no native
transformers class claims to express it.

The reference below is written from the description of Megatron-DeepSpeed's code, in its [s, b, h, d] layout:
`RotaryEmbedding` returns [cos(emb), sin(emb)] of the angles emb = positions ⊗ inv_freq (twice), the attention
unpacks that pair as (query frequencies, key frequencies), and `apply_rotary_pos_emb(t, freqs)` rotates t by
cos(freqs)/sin(freqs), cached in a module-level table keyed only by the sequence length (so the key call reuses
the table the query call built). The real library's rotary checkpoint (fixture rotary_llama_top2, recorded at
Megatron-DeepSpeed 4efb479d, after PR #441) checks the detection on the args it saved and the import against the
logits it computed; the variants it cannot record (saved before PR #441, DeepSpeed sequence parallelism) are built
from a real fixture by rewriting its args.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moetron.cli import main
from moetron.errors import UserError
from moetron.eval.generate import load_model
from moetron.interchange.mds_rotary import MDS_441, rotary_kind
from moetron.interchange.megatron_deepspeed import find_step_dir, import_megatron_deepspeed
from moetron.interchange.safe_load import Opaque, load_pt
from moetron.model import attention as attention_module
from moetron.model.gpt import GPTModel
from moetron.model.rotary import apply_rotary, rotary_angles

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_deepspeed"
FIXTURE = FIXTURES / "moe_top1_ep2"
RECORDED = FIXTURES / "rotary_llama_top2"  # recorded with --use-rotary-position-embeddings by the real library


class MegatronDeepSpeed441Rotary:
    """An independent re-implementation of the defective code path (see the module docstring)."""

    def __init__(self) -> None:
        self.cached: tuple[torch.Tensor, torch.Tensor] | None = None  # the module-level cos/sin table

    @staticmethod
    def embedding(seq: int, dim: int, theta: float) -> list[torch.Tensor]:
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
        freqs = torch.einsum("i,j->ij", torch.arange(seq).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # [s, 1, 1, d]
        return [emb.cos(), emb.sin()]

    def apply(self, t_SBHD: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        if self.cached is None or self.cached[0].shape[0] != t_SBHD.shape[0]:
            table = freqs[: t_SBHD.shape[0]]
            self.cached = (table.cos().to(t_SBHD.dtype), table.sin().to(t_SBHD.dtype))
        cos, sin = self.cached
        half = t_SBHD.shape[-1] // 2
        rotated = torch.cat((-t_SBHD[..., half:], t_SBHD[..., :half]), dim=-1)
        return t_SBHD * cos + rotated * sin

    def attention_inputs(self, q_SBHD, k_SBHD, theta: float):
        q_pos_emb, k_pos_emb = self.embedding(q_SBHD.shape[0], q_SBHD.shape[-1], theta)
        return self.apply(q_SBHD, q_pos_emb), self.apply(k_SBHD, k_pos_emb)


def test_compat_rotary_equals_megatron_deepspeeds_formula():
    g = torch.Generator().manual_seed(0)
    B, H, K, T, D, base = 2, 4, 2, 24, 16, 10000.0
    q_BHTD, k_BKTD = torch.randn(B, H, T, D, generator=g), torch.randn(B, K, T, D, generator=g)
    ref_q, ref_k = MegatronDeepSpeed441Rotary().attention_inputs(
        q_BHTD.permute(2, 0, 1, 3), k_BKTD.permute(2, 0, 1, 3), base
    )
    rope = rotary_angles(torch.arange(T), D, base, MDS_441)
    torch.testing.assert_close(apply_rotary(q_BHTD, *rope), ref_q.permute(1, 2, 0, 3), atol=0, rtol=0)
    torch.testing.assert_close(apply_rotary(k_BKTD, *rope), ref_k.permute(1, 2, 0, 3), atol=0, rtol=0)
    standard = rotary_angles(torch.arange(T), D, base)
    assert (apply_rotary(q_BHTD, *standard) - apply_rotary(q_BHTD, *rope)).abs().max() > 0.5
    # a KV-cached decode step (absolute positions) gets the rows of the whole sequence's table
    tail = rotary_angles(torch.arange(T - 3, T), D, base, MDS_441)
    torch.testing.assert_close(tail[0], rope[0][T - 3 :], atol=0, rtol=0)


# ---------------------------------------------------------------------------- the importer
def test_recorded_rotary_checkpoint_is_pr441_and_imports_what_it_computed(tmp_path, capsys):
    """The real library's checkpoint, args as saved: detected as PR #441's rotary, and the import computes the
    logits Megatron-DeepSpeed computed; standard RoPE on the same weights does not (so the recording did rotate by
    cos(mθ))."""
    args = vars(load_pt(find_step_dir(str(RECORDED / "checkpoint")) / "mp_rank_00_model_states.pt")["args"])
    assert (args["use_rotary_position_embeddings"], args["add_position_embedding"]) == (True, False)
    assert args["ds_sequence_parallel_fpdt"] is False and rotary_kind(args) == "pr441"
    expected = load_file(RECORDED / "expected.safetensors")
    tokens = expected["tokens"]

    def computed(run: Path) -> tuple[torch.Tensor, torch.Tensor, object]:
        model, cfg, _ = load_model(str(run), "cpu")
        torch.manual_seed(1234)  # DeepSpeed's eval-mode random token selection drew from this seed too
        with torch.no_grad():
            out = model(tokens[:, :-1], labels_BT=tokens[:, 1:])
        return out.logits, out.lm_loss, cfg

    argv = ["import", "--megatron-deepspeed", str(RECORDED / "checkpoint")]
    assert main([*argv, "--save", str(tmp_path / "kept")]) == 0
    assert "note: rotary embeddings as Megatron-DeepSpeed computed them since its PR #441" in capsys.readouterr().out
    logits, loss, cfg = computed(tmp_path / "kept")
    assert (cfg.model.position_embedding_type, cfg.model.rotary_compat) == ("rope", MDS_441)
    torch.testing.assert_close(logits, expected["logits"], atol=1e-5, rtol=0)
    assert abs(float(loss) - float(expected["loss"])) < 1e-5

    assert main([*argv, "--save", str(tmp_path / "standard"), "--rope-convert", "standard"]) == 0
    assert "fine-tune it before use" in capsys.readouterr().err
    logits, _, cfg = computed(tmp_path / "standard")
    assert cfg.model.rotary_compat == "none"
    assert (logits - expected["logits"]).abs().max() > 0.5


def rotary_checkpoint(out: Path, **arg_changes) -> Path:
    """The real EP-2 fixture with rotary embeddings on in its args (learned positions dropped), saved as Megatron-
    DeepSpeed after PR #441 saves it (its args include ds_sequence_parallel_fpdt)."""
    step = find_step_dir(str(FIXTURE / "checkpoint"))
    shutil.copytree(step, out, ignore=shutil.ignore_patterns("*optim_states.pt"))
    states = load_pt(step / "mp_rank_00_model_states.pt")
    values = {k: (v.value if isinstance(v, Opaque) else v) for k, v in vars(states["args"]).items()}
    assert "ds_sequence_parallel_fpdt" in values  # recorded from code after PR #441
    changes = dict(use_rotary_position_embeddings=True, add_position_embedding=False, **arg_changes)
    states["args"] = argparse.Namespace(**{k: v for k, v in {**values, **changes}.items() if v is not _DROP})
    del states["module"]["language_model"]["embedding"]["position_embeddings"]
    torch.save(states, out / "mp_rank_00_model_states.pt")
    return out


_DROP = object()  # an arg_changes value: remove that argument (a checkpoint saved by older code lacks it)
BATCH = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(3))


def logits(model: GPTModel) -> torch.Tensor:
    torch.manual_seed(1234)  # DeepSpeed's eval-mode random token selection draws from the global generator
    with torch.no_grad():
        return model(BATCH).logits


def megatron_deepspeed_forward(model: GPTModel, monkeypatch) -> torch.Tensor:
    """`model` with its rotary replaced by the reference: the attention gets Megatron-DeepSpeed's pair as
    (query frequencies, key frequencies) and applies it through the reference's cached table."""
    reference = MegatronDeepSpeed441Rotary()
    calls = []

    def pair(self, positions_T):
        return tuple(reference.embedding(len(positions_T), self.cfg.head_dim, self.cfg.rotary_base))

    def apply(x_BHTD, q_pos_emb, k_pos_emb):  # the attention calls it for q, then for k
        calls.append(x_BHTD)
        freqs = q_pos_emb if len(calls) % 2 else k_pos_emb
        return reference.apply(x_BHTD.permute(2, 0, 1, 3), freqs).permute(1, 2, 0, 3)

    monkeypatch.setattr(GPTModel, "rope_angles", pair)
    monkeypatch.setattr(attention_module, "apply_rotary", apply)
    out = logits(model)
    monkeypatch.undo()
    assert len(calls) == 2 * model.cfg.num_layers
    return out


def test_import_detects_pr441_rotary_and_keeps_it_exactly(tmp_path, monkeypatch, capsys):
    source = rotary_checkpoint(tmp_path / "global_step3")
    assert main(["import", "--megatron-deepspeed", str(source), "--save", str(tmp_path / "kept")]) == 0
    printed = capsys.readouterr()
    assert "note: rotary embeddings as Megatron-DeepSpeed computed them since its PR #441" in printed.out
    assert f"rotary_compat: {MDS_441}" in printed.out and printed.err == ""
    model, cfg, _ = load_model(str(tmp_path / "kept"), "cpu")
    assert (cfg.model.position_embedding_type, cfg.model.rotary_compat) == ("rope", MDS_441)
    assert f"rotary_compat: {MDS_441}" in (tmp_path / "kept" / "config.yaml").read_text()
    ours = logits(model)
    torch.testing.assert_close(ours, megatron_deepspeed_forward(model, monkeypatch), atol=0, rtol=0)  # bit for bit

    result = import_megatron_deepspeed(str(source), str(tmp_path / "standard"), rope_convert="standard")
    assert len(result.warnings) == 1 and "fine-tune it before use" in result.warnings[0]
    standard, cfg, _ = load_model(str(tmp_path / "standard"), "cpu")
    assert cfg.model.rotary_compat == "none"
    assert (logits(standard) - ours).abs().max() > 0.05  # the same weights compute another function


def test_convert_path_warns_on_stderr(tmp_path, capsys):
    source = rotary_checkpoint(tmp_path / "global_step3")
    argv = ["import", "--megatron-deepspeed", str(source), "--save", str(tmp_path / "run")]
    assert main([*argv, "--rope-convert", "standard"]) == 0
    printed = capsys.readouterr()
    assert printed.err.startswith("warning: --rope-convert standard: the checkpoint was trained with Megatron-")
    assert "fine-tune it before use" in printed.err and "rotary_compat" not in printed.out
    assert "fine-tune it before use" in (tmp_path / "run" / "config.yaml").read_text()  # kept with the run


def test_rotary_saved_before_pr441_is_standard(tmp_path):
    pre = {name: _DROP for name in ("ds_sequence_parallel_fpdt", "ds_sequence_parallel_fpdt_chunk_size",
                                    "ds_sequence_parallel_fpdt_offloading")}  # fmt: skip
    source = rotary_checkpoint(tmp_path / "global_step3", **pre)
    result = import_megatron_deepspeed(str(source), str(tmp_path / "run"))
    _, cfg, _ = load_model(str(tmp_path / "run"), "cpu")
    assert (cfg.model.position_embedding_type, cfg.model.rotary_compat) == ("rope", "none")
    assert not result.warnings and not any("PR #441 (queries" in n for n in result.notes)


def test_deepspeed_sequence_parallel_rotary_needs_conversion(tmp_path):
    source = rotary_checkpoint(tmp_path / "global_step3", ds_sequence_parallel_size=2)
    with pytest.raises(UserError, match=r"DeepSpeed sequence parallelism .* add --rope-convert standard"):
        import_megatron_deepspeed(str(source), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    result = import_megatron_deepspeed(str(source), str(tmp_path / "run"), rope_convert="standard")
    assert "sequence-parallel rotary attention" in result.warnings[0]
