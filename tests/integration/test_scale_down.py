"""`--scale-down`: every shipped recipe becomes a tiny run of the same kind that trains on a CPU with no warning.

The config checks (validate, startup warnings, the shape kept) run for every recipe without training; every recipe
then trains a few iterations in process on a small tinyshakespeare corpus, and two (a pyramid PR-MoE and a dense
one) train the full 20 iterations with no warning and a falling loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cli_support import shakespeare_corpus_flags

from moetron.cli import main
from moetron.config_cli import load_config
from moetron.data.tokenizer import train_bpe_tokenizer
from moetron.model.flops import count_parameters
from moetron.plan.estimate import layout_problems
from moetron.recipes import list_recipes
from moetron.recipes.scale_down import ITERS, scale_down
from moetron.train.run import resolve_vocab_size
from moetron.train.startup import startup_banner, startup_warnings
from moetron.train.tensorboard_dir import tensorboard_follows_the_run

RECIPES = list_recipes()
pytestmark = pytest.mark.usefixtures("one_thread")  # in-process training of tiny shapes (tests/conftest.py)
SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"  # ../shared beside the checkout


def scaled(recipe: str, overrides: dict | None = None):
    cfg, explicit = load_config(recipe, overrides or {})
    return cfg, explicit, scale_down(cfg, explicit, on_gpu=False)


# ---------------------------------------------------------------------------- the config, every recipe
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_scales_to_a_valid_small_run_without_warnings(recipe):
    full, _ = load_config(recipe, {})
    cfg, explicit, changed = scaled(recipe)
    assert layout_problems(cfg, 1) == []  # validate() but for this machine's files (the recipes' example paths)
    assert startup_warnings(cfg, "cpu") == []
    counts = count_parameters(cfg.model)
    assert counts.total - counts.embedding < 1_000_000  # the body is tiny; the vocabulary is the tokenizer's
    assert cfg.total_iters(1) == ITERS and not (cfg.train.fp16 or cfg.train.bf16)
    # the same kind of model: MoE stays MoE (with the recipe's router), dense stays dense
    assert bool(cfg.model.moe_layer_indices()) == bool(full.model.moe_layer_indices())
    assert cfg.model.mlp_type == full.model.mlp_type
    moe = [e for e in cfg.model.num_experts if e > 1]
    if moe:  # the recipe's top-k, or half the scaled experts where that is fewer: routing stays sparse
        assert cfg.model.topk == min(full.model.topk, max(1, min(moe) // 2)) and cfg.model.topk < min(moe)
    assert explicit.scaled == changed and all(old != new for old, new in changed.values())


def test_a_pyramid_keeps_its_shape_and_the_banner_lists_the_changes():
    cfg, explicit, _ = scaled("gpt-1.3B-pr-moe-64x10-128x2")
    assert cfg.model.num_experts == [4, 8] and cfg.model.experts_per_layer() == [1, 4, 1, 8]
    banner = startup_banner(cfg, 1, "cpu", explicit)
    assert "model      " in banner and "4 layers, hidden 64, 4 heads, seq 64, 2 MoE layers of 4/8 experts" in banner
    scaled_line = next(line for line in banner.splitlines() if line.startswith("scaled     "))
    assert "num_experts 64/64/64/64/64/64/64/64/64/64/128/128→4/8" in scaled_line
    assert "fp16 True→False" in scaled_line and "train_iters 858306→20" in scaled_line
    assert "train_tokens 300000000000→unset" in scaled_line and "None" not in banner  # no None noise
    assert cfg.train.save.endswith("-scaled-down") and cfg.train.tensorboard_dir == f"{cfg.train.save}/tensorboard"
    assert "precision  fp32 on cpu" in banner and "warmup 2 iterations" in banner


def test_flags_given_on_the_command_line_win_and_keep_their_group():
    cfg, _, changed = scaled("gpt-1.3B-moe128", {"hidden_size": 128, "train_iters": 200, "lr_warmup_tokens": 4096})
    assert cfg.model.hidden_size == 128 and "hidden_size" not in changed
    assert cfg.train.train_iters == 200 and cfg.train.train_tokens is None  # the flag replaced the YAML's tokens
    assert cfg.train.lr_warmup_tokens == 4096 and cfg.train.lr_warmup_iters == 0  # the warmup group as given
    assert cfg.train.lr_decay_tokens is None  # the decay group was not given: it decays over the run
    assert startup_warnings(cfg, "cpu") == []
    cfg, _, _ = scaled("gpt-125M-moe64", {"fp16": True})
    assert cfg.train.fp16  # asked for explicitly: kept (and warned about on a CPU, as without --scale-down)
    cfg, _ = load_config("gpt-125M-moe64", {})
    scale_down(cfg, set(), on_gpu=True)
    assert cfg.train.fp16  # on a GPU the recipe's precision stays


@pytest.mark.parametrize(
    ("recipe", "world_size", "ep"),
    [("seed-2x4090-moe128", 2, 2), ("seed-2x4090-moe128", 1, 1), ("gpt-1.3B-moe128", 2, 2), ("gpt-1.3B-moe128", 4, 4)],
)
def test_under_torchrun_the_recipes_expert_parallelism_is_kept_where_it_can_run(recipe, world_size, ep):
    """The recipe's EP stays where it divides the processes and the scaled experts (8), else the largest that does
    (gpt-1.3B-moe128's EP 64 on 2 or 4 processes); every layout check passes on that many processes."""
    cfg, explicit = load_config(recipe, {})
    scale_down(cfg, explicit, on_gpu=False, world_size=world_size)
    assert cfg.parallel.moe_expert_parallel_size == ep and layout_problems(cfg, world_size) == []


def test_the_global_batch_holds_a_micro_batch_per_data_parallel_rank():
    """The README's two-process line with --micro-batch-size 8: 16 samples, not the one-process default's 8 that
    two ranks of micro-batch 8 cannot split."""
    cfg, explicit = load_config("seed-2x4090-moe128", {"micro_batch_size": 8})
    scale_down(cfg, explicit, on_gpu=False, world_size=2)
    assert cfg.train.global_batch_size == 16 and layout_problems(cfg, 2) == []
    cfg, explicit = load_config("seed-2x4090-moe128", {})
    scale_down(cfg, explicit, on_gpu=False, world_size=4)
    assert cfg.train.global_batch_size == 16  # micro-batch 4 on 4 ranks


def test_the_tokenizer_sizes_the_vocabulary(tmp_path):
    tok = train_bpe_tokenizer([_corpus_file(tmp_path)], 300, tmp_path / "tok")
    files = {"vocab_file": str(tok / "vocab.json"), "merge_file": str(tok / "merges.txt")}
    cfg, explicit = load_config("gpt-125M-moe64", files)
    with pytest.raises(Exception, match="vocab_size 50257 differs from the tokenizer's"):
        resolve_vocab_size(cfg, explicit)  # without --scale-down: the recipe's GPT-2 size is an error
    cfg, explicit, _ = scaled("gpt-125M-moe64", files)
    resolve_vocab_size(cfg, explicit)
    assert cfg.model.vocab_size < 400


def _corpus_file(directory: Path) -> Path:
    path = directory / "corpus.txt"
    path.write_text("The experts route every token. A router picks the top expert.\n\n" * 20)
    return path


# ---------------------------------------------------------------------------- training, in process
@pytest.fixture(scope="module")
def data_flags(tmp_path_factory):
    """Tinyshakespeare's first 60k characters in a 512-token byte-level BPE trained on them: every recipe's 20
    scaled-down iterations then cost ~2 s (with GPT-2's 50257 the output layer dominates a 64-wide model 5x over)."""
    shakespeare = SHARED_DATA / "tinyshakespeare" / "input.txt"
    if not shakespeare.exists():
        pytest.skip(f"needs {SHARED_DATA} (the ../shared checkout beside the repository); not present")
    directory = tmp_path_factory.mktemp("scale")
    text = directory / "shakespeare.txt"
    text.write_text(shakespeare.read_text()[:60_000])
    tok = train_bpe_tokenizer([text], 512, directory / "tok")
    flags = shakespeare_corpus_flags(directory, text, (tok / "vocab.json", tok / "merges.txt"), 60_000)
    return [*flags, "--tokenizer-type", "GPT2BPETokenizer"]  # recipes with an HF tokenizer.json name a file of theirs


def train(capsys, recipe: str, save: Path, data_flags: list, *extra: str) -> str:
    code = main(["train", "--config", recipe, "--scale-down", *data_flags, "--save", str(save), *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out + err


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# in the quick subset: the seed user's recipe, a pyramid and latent attention; every recipe in the full suite
QUICK_TRAINING = ("seed-2x4090-moe128", "gpt-1.3B-pr-moe-64x10-128x2", "deepseek-v3-tiny")


@pytest.mark.parametrize(
    "recipe", [pytest.param(r, marks=[] if r in QUICK_TRAINING else [pytest.mark.slow]) for r in RECIPES]
)
def test_every_recipe_trains_twenty_iterations_without_a_warning_and_the_loss_falls(
    recipe, tmp_path, capsys, data_flags
):
    output = train(capsys, recipe, tmp_path / "run", data_flags)
    assert "warning" not in output.lower()
    assert "scaled     --scale-down changed" in output and "precision  fp32 on cpu" in output
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == list(range(5, ITERS + 1, 5))
    losses = [m["lm_loss"] for m in metrics]
    assert losses[-1] < losses[0] - 0.3, losses
    valid = [e["valid_loss"] for e in read_jsonl(tmp_path / "run" / "eval.jsonl")]
    assert len(valid) == 2 and valid[1] < valid[0]
    assert (tmp_path / "run" / "latest").exists()
    if load_config(recipe, {})[0].train.tensorboard_dir:  # the recipe's relative tensorboard_dir: inside the run
        assert any((tmp_path / "run" / "tensorboard").iterdir())


def test_a_recipes_tensorboard_dir_follows_a_save_given_on_the_command_line(tmp_path, capsys, data_flags):
    """One TensorBoard directory per run: the recipe's relative tensorboard/NAME goes inside `--save RUN` (two runs
    of one recipe never share it); a flag, an absolute path (a run's own config.yaml) or no --save keep theirs."""
    base = ["train", "--config", "gpt-125M-moe64", "--moe-expert-parallel-size", "1", "--vocab-size", "512"]
    base += [*data_flags, "--print-config"]

    def board(*flags: str) -> str:
        assert main([*base, *flags]) == 0
        return yaml.safe_load(capsys.readouterr().out)["train"]["tensorboard_dir"]

    assert board("--save", str(tmp_path / "a")) == str(tmp_path / "a" / "tensorboard")
    assert board("--save", str(tmp_path / "b")) == str(tmp_path / "b" / "tensorboard")
    assert board() == str(Path.cwd() / "tensorboard" / "gpt-125M-moe64")  # the recipe's own pair of paths
    assert board("--save", str(tmp_path / "a"), "--tensorboard-dir", "tb") == str(Path.cwd() / "tb")
    cfg, explicit = load_config("gpt-125M-moe64", {"save": "runs/a"})
    tensorboard_follows_the_run(cfg, explicit)
    banner = startup_banner(cfg, 8, "cpu", explicit)
    assert "replaced the config file's tensorboard_dir: tensorboard/gpt-125M-moe64" in banner
    assert f"TensorBoard {Path.cwd() / 'runs' / 'a' / 'tensorboard'}" in banner
    saved = tmp_path / "config.yaml"
    saved.write_text("train:\n  tensorboard_dir: /elsewhere/tb\n")  # a run's saved config: absolute, kept
    cfg, explicit = load_config(str(saved), {"save": "runs/c"})
    tensorboard_follows_the_run(cfg, explicit)
    assert cfg.train.tensorboard_dir == "/elsewhere/tb"


def test_without_scale_down_every_schedule_warning_comes_at_once():
    """The recipe shrunk by hand: its token warmup AND its token decay are longer than the run, said together (the
    decay warning used to wait until the warmup was fixed: one round of warnings per fix)."""
    sizes = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, max_position_embeddings=64)
    cfg, _ = load_config("gpt-125M-moe64", sizes | dict(moe_expert_parallel_size=1, train_iters=20))
    warnings = startup_warnings(cfg, "cpu")
    assert any("LR warmup (--lr-warmup-tokens 375000000" in w for w in warnings)
    assert any("LR decay horizon (--lr-decay-tokens 300000000000" in w for w in warnings)
    assert any("--fp16 on a CPU" in w for w in warnings)
