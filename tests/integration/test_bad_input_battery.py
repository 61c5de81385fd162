"""A battery of bad inputs across the commands: each must fail with one clear line and touch nothing.

For every case: a non-zero exit status; exactly one line on stderr containing `error:`, which names the flag or
file and the value; no traceback; no file created, removed or changed anywhere under the test's world
directory (snapshotted before and after). Commands run in-process through `moetron.cli.main`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fs_faults import snapshot

from moetron.cli import main
from moetron.config_cli import load_config, to_yaml
from moetron.data.indexed import IndexedDatasetBuilder
from moetron.data.tokenizer import train_bpe_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture of experts routes every token to its top-k experts.",
    "Numbers 12345 and symbols are bytes too.\nA second line.",
]
TINY = (
    "--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --micro-batch-size 2 "
    "--global-batch-size 2 --train-iters 2 --log-interval 1 --eval-iters 1 --eval-interval 2 --split 80,20,0"
).split()


def write_dataset(prefix: Path, documents: int, high: int) -> str:
    rng = np.random.default_rng(documents)
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for _ in range(documents):
            builder.add_document(rng.integers(0, high, 20))
        builder.finalize()
    return str(prefix)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """Good inputs (tokenizer, JSONL, datasets, a trained checkpoint) beside broken ones, built once."""
    w = tmp_path_factory.mktemp("world")
    (w / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    train_bpe_tokenizer([w / "docs.jsonl"], 300, w / "tok")
    good = write_dataset(w / "good_text_document", 40, 300)
    small = write_dataset(w / "small_text_document", 5, 300)
    (w / "mixed_text_document.idx").write_bytes(Path(small + ".idx").read_bytes())
    (w / "mixed_text_document.bin").write_bytes(Path(good + ".bin").read_bytes())
    (w / "garbage_text_document.idx").write_bytes(b"this is not an index file at all")
    (w / "garbage_text_document.bin").write_bytes(b"\x00" * 64)
    (w / "a_file").write_text("in the way")
    (w / "bad.yaml").write_text("num_layers: [1,\n")
    (w / "typo.yaml").write_text("num_layer: 2\n")
    (w / "recipe.yaml").write_text("vocab_size: 50257\ntrain_iters: 2\n")
    (w / "empty.jsonl").write_text("")
    write_parquet(w / "docs.parquet", TEXTS)
    (w / "garbage.parquet").write_bytes(b"PAR1 this is not a parquet file")
    (w / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (w / "garbage_ckpt").mkdir()
    (w / "garbage_ckpt" / "state.json").write_text("{}")
    (w / "garbage_ckpt" / "config.yaml").write_text("\x00\x01 not yaml: [")
    write_moe_checkpoint_config(w / "moe_ckpt")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(w)
        assert main(["train", *TINY, "--vocab-size", "300", "--data-path", good, "--save", str(w / "run")]) == 0
    return w


def write_parquet(path: Path, texts: list[str]) -> None:
    import pyarrow as pa  # the [parquet] extra, in [dev]
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts}), path)


def write_moe_checkpoint_config(directory: Path) -> None:
    """A checkpoint's state.json and config.yaml (no tensors: they are never reached) of TINY with 2 layers, the
    second MoE: loading it into TINY's 1 layer would drop the MoE layer while every tensor left fits."""
    cfg, _ = load_config(None, {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 8})
    cfg.model.vocab_size, cfg.model.num_experts = 300, [2]
    directory.mkdir()
    (directory / "state.json").write_text("{}")
    (directory / "config.yaml").write_text(to_yaml(cfg))


def tok(world: Path) -> list[str]:
    return ["--vocab-file", str(world / "tok" / "vocab.json"), "--merge-file", str(world / "tok" / "merges.txt")]


def train(*extra: str) -> list[str]:
    return ["train", *TINY, "--vocab-size", "300", "--data-path", "good_text_document", *extra]


def preprocess(w: Path, *extra: str, inputs: str = "docs.jsonl", prefix: str = "corpus") -> list[str]:
    base = ["preprocess", "--input", inputs, "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer"]
    return [*base, *tok(w), "--log-interval", "0", *extra]


def harness() -> list[str]:
    return ["eval-harness", "--load", "run", "--tasks", "moetron_tiny"]


# a pipeline that runs (two micro-batches per step) but asks for two ZeRO stages, which `moetron train` refuses
PIPELINED_ZERO = "--gpus 4 --pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 8 --zero-stage 3"
PIPELINED_ZERO += " --use-distributed-optimizer"

QK_NORM_ALL_HEADS_TP2 = "--tensor-model-parallel-size 2 --qk-layernorm --qk-layernorm-scope all_heads"

# (id, argv builder, what the error line must name)
CASES = [
    # ---- train: flags and values
    ("train-unknown-flag", lambda w: train("--num-layer", "4"), "--num-layer"),
    ("train-bad-int", lambda w: train("--hidden-size", "big"), "'big'"),
    ("train-heads", lambda w: train("--num-attention-heads", "3"), "--hidden-size 16 is not divisible by"),
    ("train-no-data", lambda w: ["train", *TINY, "--data-path", "nowhere"], "'nowhere'"),
    (
        "train-nan-weight",
        lambda w: train("--data-path", "nan", "good_text_document", "1", "good_text_document"),
        "weight 'nan'",
    ),  # fmt: skip
    ("train-odd-blend", lambda w: train("--data-path", "0.3", "good_text_document", "0.7"), "--data-path has 3"),
    ("train-bad-split", lambda w: train("--split", "90,x"), "--split '90,x'"),
    ("train-save-is-file", lambda w: train("--save", "a_file"), "--save a_file"),
    ("train-tensorboard-under-file", lambda w: train("--tensorboard-dir", "a_file/tb"), "--tensorboard-dir a_file/tb"),
    ("train-cache-under-file", lambda w: train("--data-cache-path", "a_file/c"), "--data-cache-path a_file/c"),
    ("train-dense-topk", lambda w: train("--topk", "2"), "--topk 2"),
    ("train-exit-interval", lambda w: train("--exit-interval", "0"), "--exit-interval must be > 0, got 0"),
    ("train-fp16-bf16", lambda w: train("--fp16", "--bf16"), "--fp16 and --bf16"),
    ("train-min-lr", lambda w: train("--min-lr", "0.1", "--lr", "0.01"), "--min-lr 0.1"),
    ("train-config-missing", lambda w: ["train", "--config", "nope.yaml"], "--config nope.yaml"),
    ("train-config-not-yaml", lambda w: ["train", "--config", "bad.yaml"], "bad.yaml is not valid YAML"),
    ("train-config-typo", lambda w: ["train", "--config", "typo.yaml"], "unknown key 'num_layer'"),
    (
        "train-yaml-vocab",
        lambda w: ["train", "--config", "recipe.yaml", *TINY[:-4], "--data-path", "good_text_document", *tok(w)],
        "vocab_size 50257",
    ),  # fmt: skip
    ("train-vocab-too-small", lambda w: [*train(*tok(w)), "--vocab-size", "100"], "--vocab-size 100"),
    ("train-missing-vocab-file", lambda w: train("--vocab-file", "missing.json"), "--vocab-file missing.json"),
    (
        "train-impossible-pair",
        lambda w: ["train", *TINY, "--vocab-size", "300", "--data-path", "mixed_text_document"],
        "mixed_text_document.bin' holds",
    ),  # fmt: skip
    (
        "train-garbage-idx",
        lambda w: ["train", *TINY, "--vocab-size", "300", "--data-path", "garbage_text_document"],
        "garbage_text_document.idx",
    ),  # fmt: skip
    ("train-rotary-compat-learned", lambda w: train("--rotary-compat", "megatron-deepspeed-441"), "--rotary-compat"),
    (
        "train-rotary-compat-value",
        lambda w: train("--position-embedding-type", "rope", "--rotary-compat", "neox"),
        "--rotary-compat 'neox' is not one of",
    ),  # fmt: skip
    ("train-overwrite-own-load", lambda w: train("--save", "run", "--load", "run", "--overwrite"), "--overwrite would"),
    (
        "train-overwrite-own-iter",
        lambda w: train("--save", "run", "--load", "run/iter_0000002", "--overwrite"),
        "--load run/iter_0000002 names (it is inside --save run)",
    ),  # fmt: skip
    ("train-finetune-own-run", lambda w: train("--save", "run", "--load", "run", "--finetune"), "--finetune --load"),
    # --load into another model (the checkpoint's config.yaml against the run's), with any tensor shapes
    ("train-load-stop-before", lambda w: train("--load", "run", "--train-iters", "1"), "--load run is at iteration 2"),
    ("train-load-fewer-layers", lambda w: train("--load", "moe_ckpt"), "with --num-layers 2 --num-experts 2;"),
    ("train-load-rope", lambda w: train("--load", "run", "--position-embedding-type", "rope"), "learned_absolute;"),
    ("train-load-rmsnorm", lambda w: train("--load", "run", "--normalization", "rmsnorm"), "--normalization layernorm"),
    ("train-load-heads", lambda w: train("--load", "run", "--num-attention-heads", "4"), "--num-attention-heads 2;"),
    ("train-load-dropout", lambda w: train("--load", "run", "--hidden-dropout", "0"), "or add --finetune"),
    ("train-save-name-too-long", lambda w: train("--save", "x" * 300), "File name too long"),
    ("train-ep-no-moe", lambda w: train("--moe-expert-parallel-size", "2"), "--moe-expert-parallel-size 2 has no"),
    ("train-etp-no-moe", lambda w: train("--expert-tensor-parallel-size", "2"), "--expert-tensor-parallel-size 2 has"),
    (
        "train-cp-world",
        lambda w: train("--context-parallel-size", "2"),
        "--context-parallel-size 2; change the process",
    ),
    (
        "train-distributed-optimizer-zero-3",
        lambda w: train("--use-distributed-optimizer", "--zero-stage", "3"),
        "--use-distributed-optimizer is Megatron's sharded optimizer state (ZeRO stage 1) and --zero-stage 3",
    ),  # fmt: skip
    ("train-peak-tflops", lambda w: train("--peak-tflops", "-3"), "--peak-tflops -3 must be a positive"),
    ("train-peak-tflops-nan", lambda w: train("--peak-tflops", "nan"), "--peak-tflops nan must be a positive"),
    ("train-mla-learned", lambda w: train("--multi-latent-attention"), "--multi-latent-attention puts rotary"),
    ("train-mla-unused", lambda w: train("--kv-lora-rank", "512"), "--kv-lora-rank 512 has no effect without --multi"),
    (
        "train-mla-odd-rope",
        lambda w: train("--multi-latent-attention", "--position-embedding-type", "rope", "--qk-pos-emb-head-dim", "3"),
        "--qk-pos-emb-head-dim must be even and >= 2 (RoPE rotates channel pairs), got 3",
    ),  # fmt: skip
    ("train-mtp-past-sequence", lambda w: train("--mtp-num-layers", "8"), "--mtp-num-layers must be in [0, --seq"),
    ("train-replicas-no-ep", lambda w: train("--moe-expert-replicas", "1"), "--moe-expert-replicas 1 needs --moe-exp"),
    ("train-replicas-negative", lambda w: train("--moe-expert-replicas", "-1"), "--moe-expert-replicas -1 must be >="),
    ("train-ep-dispatch-no-ep", lambda w: train("--moe-ep-dispatch", "static"), "--moe-ep-dispatch static needs --moe"),
    ("train-ep-dispatch-name", lambda w: train("--moe-ep-dispatch", "fixed"), "--moe-ep-dispatch 'fixed' is not one"),
    ("train-ep-buffer-small", lambda w: train("--moe-ep-buffer-factor", "0.5"), "--moe-ep-buffer-factor 0.5 must be"),
    ("train-ep-overlap-no-ep", lambda w: train("--moe-ep-overlap-chunks", "2"), "--moe-ep-overlap-chunks 2 needs"),
    ("train-async-save-no-save", lambda w: train("--async-save"), "--async-save is set without --save"),
    ("train-optimizer", lambda w: train("--optimizer", "sgd"), "--optimizer 'sgd' is not one of adam, muon"),
    ("train-muon-momentum", lambda w: train("--optimizer", "muon", "--muon-momentum", "1"), "--muon-momentum 1.0 must"),
    ("train-muon-scale-mode", lambda w: train("--muon-scale-mode", "rms"), "--muon-scale-mode 'rms' is not one of"),
    (
        "train-load-other-optimizer",
        lambda w: train("--load", "run", "--optimizer", "muon"),
        "saved with --optimizer adam",
    ),
    ("train-memory-snapshot-no-dir", lambda w: train("--memory-snapshot-steps", "5"), "--memory-snapshot-steps writes"),
    # ---- preprocess
    ("preprocess-missing-input", lambda w: preprocess(w, inputs="missing.jsonl"), "--input 'missing.jsonl'"),
    ("preprocess-wrong-key", lambda w: preprocess(w, "--json-keys", "content"), "for key 'content'"),
    ("preprocess-empty-input", lambda w: preprocess(w, inputs="empty.jsonl"), "--input empty.jsonl gave no document"),
    ("preprocess-prefix-under-file", lambda w: preprocess(w, prefix="a_file/x"), "'a_file' is a file"),
    (
        "preprocess-tokenizer-type",
        lambda w: [*preprocess(w)[:6], "WordPiece", *preprocess(w)[7:]],
        "--tokenizer-type 'WordPiece'",
    ),  # fmt: skip
    ("preprocess-garbage-vocab", lambda w: [*preprocess(w), "--vocab-file", "a_file"], "--vocab-file 'a_file'"),
    ("preprocess-workers", lambda w: preprocess(w, "--workers", "0"), "--workers 0"),
    (
        "preprocess-parquet-no-column",
        lambda w: preprocess(w, "--text-key", "content", inputs="docs.parquet"),
        "--input 'docs.parquet' has no column 'content' (columns: text)",
    ),  # fmt: skip
    (
        "preprocess-parquet-garbage",
        lambda w: preprocess(w, inputs="garbage.parquet"),
        "--input 'garbage.parquet' is not a readable Parquet file",
    ),  # fmt: skip
    ("preprocess-dir-no-data", lambda w: preprocess(w, inputs="tok"), "--input 'tok' is a directory with no .parquet"),
    ("preprocess-hub-unreachable", lambda w: preprocess(w, inputs="hf://datasets/nobody/nothing"), "nobody/nothing'"),
    # ---- inspect
    ("inspect-missing", lambda w: ["inspect", "nothing_here"], "nothing_here.idx"),
    ("inspect-garbage", lambda w: ["inspect", "garbage_text_document"], "garbage_text_document.idx"),
    ("inspect-mixed", lambda w: ["inspect", "mixed_text_document"], "come from different datasets"),
    # ---- train-tokenizer
    (
        "tokenizer-vocab-size",
        lambda w: ["train-tokenizer", "--input", "docs.jsonl", "--vocab-size", "10", "--output-dir", "newtok"],
        "--vocab-size 10",
    ),  # fmt: skip
    (
        "tokenizer-output-is-file",
        lambda w: ["train-tokenizer", "--input", "docs.jsonl", "--vocab-size", "300", "--output-dir", "a_file"],
        "--output-dir 'a_file'",
    ),  # fmt: skip
    (
        "tokenizer-no-text",
        lambda w: ["train-tokenizer", "--input", "empty.jsonl", "--vocab-size", "300", "--output-dir", "newtok"],
        "--input empty.jsonl holds no usable text",
    ),  # fmt: skip
    # ---- generate
    ("generate-missing-load", lambda w: ["generate", "--load", "no_run", "--prompt", "hi"], "--load no_run"),
    (
        "generate-garbage-ckpt",
        lambda w: ["generate", "--load", "garbage_ckpt", "--prompt", "hi"],
        "--load garbage_ckpt",
    ),  # fmt: skip
    ("generate-top-p", lambda w: ["generate", "--load", "run", "--prompt", "hi", "--top-p", "0"], "--top-p"),
    ("generate-prompt-file", lambda w: ["generate", "--load", "run", "--prompt-file", "none.txt"], "none.txt"),
    (
        "generate-prompt-latin1",
        lambda w: ["generate", "--load", "run", "--prompt-file", "latin1.txt"],
        "--prompt-file latin1.txt is not UTF-8",
    ),  # fmt: skip
    (
        "generate-vocab-file",
        lambda w: [
            "generate",
            "--load",
            "run",
            "--prompt",
            "hi",
            "--vocab-file",
            "a_file",
            "--merge-file",
            "tok/merges.txt",
        ],
        "a_file' is not a",
    ),  # fmt: skip
    # ---- eval
    ("eval-missing-load", lambda w: ["eval", "--load", "no_run"], "--load no_run"),
    ("eval-garbage-ckpt", lambda w: ["eval", "--load", "garbage_ckpt"], "--load garbage_ckpt"),
    ("eval-missing-data", lambda w: ["eval", "--load", "run", "--data-path", "nowhere"], "--data-path nowhere"),
    (
        "eval-mixed-data",
        lambda w: ["eval", "--load", "run", "--data-path", "mixed_text_document"],
        "mixed_text_document.bin' holds",
    ),  # fmt: skip
    ("eval-iters", lambda w: ["eval", "--load", "run", "--eval-iters", "0"], "--eval-iters must be >= 1, got 0"),
    ("eval-json-dir", lambda w: ["eval", "--load", "run", "--json", "nodir/e.json"], "--json nodir/e.json"),
    # ---- export
    ("export-missing-load", lambda w: ["export", "--load", "no_run", "--output", "hf"], "--load no_run"),
    ("export-garbage-ckpt", lambda w: ["export", "--load", "garbage_ckpt", "--output", "hf"], "garbage_ckpt"),
    (
        "export-output-under-file",
        lambda w: ["export", "--load", "run", "--output", "a_file/sub"],
        "--output a_file/sub: 'a_file' exists and is not a directory",
    ),  # fmt: skip
    ("export-output-is-file", lambda w: ["export", "--load", "run", "--output", "a_file"], "--output a_file exists"),
    (
        "export-shard-size-zero",
        lambda w: ["export", "--load", "run", "--output", "hf", "--max-shard-size", "0"],
        "--max-shard-size '0'",
    ),  # fmt: skip
    (
        "export-shard-size-word",
        lambda w: ["export", "--load", "run", "--output", "hf", "--max-shard-size", "big"],
        "--max-shard-size 'big'",
    ),  # fmt: skip
    # ---- import
    ("import-hf-not-a-model", lambda w: ["import", "--hf", "garbage_ckpt", "--save", "new"], "--hf garbage_ckpt"),
    (
        "import-mds-not-a-checkpoint",
        lambda w: ["import", "--megatron-deepspeed", "garbage_ckpt", "--save", "new"],
        "--megatron-deepspeed garbage_ckpt",
    ),  # fmt: skip
    (
        "import-save-under-file",
        lambda w: ["import", "--hf", "garbage_ckpt", "--save", "a_file/run"],
        "--save a_file/run: 'a_file' exists and is not a directory",
    ),  # fmt: skip
    # ---- eval-harness
    ("eval-harness-limit", lambda w: [*harness(), "--limit", "-1"], "--limit -1: give a number of documents"),
    ("eval-harness-batch-size", lambda w: [*harness(), "--batch-size", "0"], "--batch-size 0: must be 1 or more"),
    ("eval-harness-fewshot", lambda w: [*harness(), "--num-fewshot", "-2"], "--num-fewshot -2: must be 0 or more"),
    # ---- launch
    ("launch-nproc-zero", lambda w: ["launch", "--nproc-per-node", "0", "train"], "--nproc-per-node 0: a node runs"),
    ("launch-nproc-word", lambda w: ["launch", "--nproc-per-node", "two", "train"], "--nproc-per-node two: not a"),
    ("launch-no-command", lambda w: ["launch", "--nproc-per-node", "2"], "launch: give torchrun's flags, then a"),
    ("launch-unknown-flag", lambda w: ["launch", "--nprocs", "2", "train"], "unrecognized arguments: --nprocs"),
    # the command's flags and train's config are checked by the launcher at its world size, before any worker
    ("launch-train-flag", lambda w: ["launch", "--nproc-per-node", "2", *train("--num-layer", "4")], "--num-layer"),
    (
        "launch-train-config",
        lambda w: ["launch", "--nproc-per-node", "3", *train("--tensor-model-parallel-size", "2")],
        "world size 3 is not divisible by --tensor-model-parallel-size 2",
    ),
    # ---- plan
    ("plan-gpus", lambda w: ["plan", "--config", "quickstart", "--gpus", "0"], "--gpus must be >= 1, got 0"),
    (
        "plan-efficiency",
        lambda w: ["plan", "--config", "quickstart", "--efficiency", "30"],
        "--efficiency is a fraction",
    ),
    ("plan-gpu-memory", lambda w: ["plan", "--config", "quickstart", "--gpu-memory", "lots"], "--gpu-memory 'lots'"),
    (
        "plan-explicit-ep",
        lambda w: ["plan", "--config", "quickstart", "--gpus", "1", "--moe-expert-parallel-size", "2"],
        "--moe-expert-parallel-size 2",
    ),  # fmt: skip
    ("plan-gpu-memory-zero", lambda w: ["plan", "--config", "quickstart", "--gpu-memory", "0GB"], "--gpu-memory '0GB'"),
    ("plan-peak-negative", lambda w: ["plan", "--config", "quickstart", "--peak-tflops", "-3"], "--peak-tflops -3"),
    ("plan-peak-nan", lambda w: ["plan", "--config", "quickstart", "--peak-tflops", "nan"], "--peak-tflops nan"),
    ("plan-peak-inf", lambda w: ["plan", "--config", "quickstart", "--peak-tflops", "inf"], "--peak-tflops inf"),
    (
        "plan-zero-with-pipeline",  # train refuses it: so does plan
        lambda w: ["plan", "--config", "quickstart", *PIPELINED_ZERO.split()],
        "--use-distributed-optimizer is Megatron's sharded optimizer state (ZeRO stage 1) and --zero-stage 3",
    ),
    (
        "plan-qk-norm-all-heads-tp",  # per head is exact under TP; over all heads it would need every rank's heads
        lambda w: ["plan", "--config", "quickstart", "--gpus", "2", *QK_NORM_ALL_HEADS_TP2.split()],
        "--qk-layernorm-scope all_heads with --tensor-model-parallel-size 2 is not supported",
    ),  # fmt: skip
    # ---- quickstart
    ("quickstart-nproc", lambda w: ["quickstart", "--nproc", "3"], "--nproc 3"),
    (
        "quickstart-output-under-file",
        lambda w: ["quickstart", "--output-dir", "a_file/run"],
        "--output-dir a_file/run",
    ),  # fmt: skip
    (
        "quickstart-config",
        lambda w: ["quickstart", "--config", "nope.yaml", "--output-dir", "qs"],
        "--config nope.yaml",
    ),
]


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_battery_is_broad():
    assert len(CASES) >= 30 and len({case[0] for case in CASES}) == len(CASES)
    assert len({case[0].split("-")[0] for case in CASES}) >= 8  # every command


@pytest.mark.parametrize("argv_of, names", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_fails_with_one_clear_line_and_touches_nothing(world, monkeypatch, capsys, argv_of, names):
    monkeypatch.chdir(world)
    argv = argv_of(world)
    before = snapshot(world)
    code, out, err = run_cli(argv, capsys)
    assert code not in (0, None), f"exit {code}: {out}{err}"
    error_lines = [line for line in err.splitlines() if "error:" in line]
    assert len(error_lines) == 1, err
    assert names in error_lines[0], error_lines[0]
    assert "Traceback" not in err and "Traceback" not in out
    assert snapshot(world) == before


def problem_lines(err: str) -> list[str]:
    """The problems of a several-problem error (`error: N configuration problem(s):` then `  - ...` lines)."""
    return [line.removeprefix("  - ") for line in err.splitlines()[1:]]


def test_tokenizer_vocabulary_is_validated_with_every_other_problem(world, monkeypatch, capsys):
    """The tokenizer sizes the vocabulary before validation, so TP's padded-vocabulary rule sees the tokenizer's 300
    tokens (not the default 50257) and is reported in the same list as the rest, before anything starts."""
    monkeypatch.chdir(world)
    monkeypatch.setenv("WORLD_SIZE", "8")  # only read: validation fails before any process group
    tp8 = ["--tensor-model-parallel-size", "8", "--num-attention-heads", "8", "--make-vocab-size-divisible-by", "1"]
    before = snapshot(world)
    argv = ["train", *TINY, "--data-path", "good_text_document", *tok(world), *tp8, "--peak-tflops", "-3"]
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and err.startswith("error: 2 configuration problem(s):\n"), err
    vocab, peak = problem_lines(err)
    assert vocab.startswith("the padded vocabulary 300 (--vocab-size 300 rounded up to a multiple of ")
    assert "is not divisible by --tensor-model-parallel-size 8" in vocab and peak.startswith("--peak-tflops -3")
    assert out == "" and snapshot(world) == before  # nothing printed (no banner), nothing written


def test_another_model_on_load_is_reported_with_the_config_problems(world, monkeypatch, capsys):
    monkeypatch.chdir(world)
    argv = train("--load", "run", "--normalization", "rmsnorm", "--moe-expert-parallel-size", "2")
    code, _, err = run_cli([*argv, "--save", "x" * 300], capsys)
    assert code == 2 and err.startswith("error: 3 configuration problem(s):\n"), err
    ep, save, load = problem_lines(err)
    assert ep.startswith("--moe-expert-parallel-size 2 has no effect") and "File name too long" in save
    assert load.startswith("--load run: the checkpoint was trained with --normalization layernorm; this run has ")


def test_what_may_change_on_resume_still_resumes(world, monkeypatch, capsys, tmp_path):
    """Batch, schedule, activation recompute and a default spelled out (--ffn-hidden-size 64 = 4·hidden) load."""
    monkeypatch.chdir(world)
    changes = ["--micro-batch-size", "1", "--train-iters", "3", "--lr", "1e-4", "--override-opt-param-scheduler"]
    changes += ["--checkpoint-activations", "--ffn-hidden-size", "64", "--eval-iters", "0"]
    where = ["--load", "run", "--save", str(tmp_path / "resumed"), "--data-cache-path", str(tmp_path / "cache")]
    before = snapshot(world)
    code, out, err = run_cli(train(*changes, *where), capsys)
    assert code == 0, err
    assert "loaded checkpoint" in out and "iteration 2" in out
    assert (tmp_path / "resumed" / "latest").read_text().strip() == "iter_0000003"
    assert snapshot(world) == before


CP2 = ("--context-parallel-size", "2")
# (world size torchrun would announce, extra train flags, what the one error line names): what context
# parallelism cannot run, refused before launch (the world size is read before any process group exists)
CONTEXT_PARALLEL_CASES = {
    "seq": (2, [*CP2, "--seq-length", "6"], "--seq-length 6 is not divisible by 2 × --context-parallel-size 2 = 4"),
    "mtp": (2, [*CP2, "--mtp-num-layers", "1"], "with --mtp-num-layers 1 is not supported yet; drop --mtp-num-layers"),
    "mla": (
        2,
        [*CP2, "--multi-latent-attention", "--position-embedding-type", "rope"],
        "--context-parallel-size 2 with --multi-latent-attention is not supported yet; use grouped-query attention",
    ),  # fmt: skip
    "comm-type": (2, [*CP2, "--cp-comm-type", "ring"], "--cp-comm-type 'ring' is not one of all_gather, p2p, a2a"),
    "p2p-dropout": (
        2,
        [*CP2, "--cp-comm-type", "p2p", "--attention-dropout", "0.1"],
        "--cp-comm-type p2p with --attention-dropout 0.1 is not supported",
    ),  # fmt: skip
    "a2a-heads": (
        2,
        [*CP2, "--cp-comm-type", "a2a", "--num-attention-heads", "4", "--num-key-value-heads", "1"],
        "--cp-comm-type a2a needs the query heads (4) and key/value heads (1) of a rank divisible by",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", CONTEXT_PARALLEL_CASES)
def test_context_parallel_problems_are_one_line_before_launch(world, monkeypatch, capsys, case):
    world_size, extra, names = CONTEXT_PARALLEL_CASES[case]
    monkeypatch.chdir(world)
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    before = snapshot(world)
    code, out, err = run_cli(train(*extra, "--save", "cp_run"), capsys)
    assert code not in (0, None), f"exit {code}: {out}{err}"
    error_lines = [line for line in err.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and names in error_lines[0], err
    assert "Traceback" not in err and snapshot(world) == before
