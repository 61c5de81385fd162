"""Every command block of README.md and docs/*.md, run as a newcomer would run it: in README order (then the guide's,
…), in one directory holding what
the README assumes (`my.yaml`, `corpus.jsonl`, GPT-2's `gpt2-vocab.json` / `gpt2-merges.txt`,
`data/pile_text_document`, a Megatron-DeepSpeed checkpoint at `mds/checkpoint`), with tiny overrides appended where
a command would run long (later flags win), asserting exit 0 and what the README says the command does.

Every command must be classified here (`RULES`): a new README command without a rule fails the test, so the README
cannot drift from the code. Only commands that need GPUs, several nodes, the network or the suite itself are
skipped, each with its reason. Quoted outputs (```text blocks starting with `$ `) must equal what the command prints.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from moetron.cli import main

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = [README, *(REPO / "docs" / name for name in ("guide.md", "testing.md", "performance.md", "architecture.md"))]
GENERATED = REPO / "docs" / "reference.md"  # `--help` texts, no commands to run (tests/unit/test_reference_doc.py)
SHARED_DATA = REPO.parent / "shared" / "data"
MDS_CHECKPOINT = REPO / "tests" / "fixtures" / "megatron_deepspeed" / "moe_top1_ep2" / "checkpoint"

QUICKSTART_TINY = "--max-corpus-mb 0.1 --train-iters 4 --nproc 1 --vocab-size 300"
MY_YAML = """\
model: {num_layers: 2, hidden_size: 32, num_attention_heads: 4, seq_length: 32, num_experts: 4, topk: 2,
        hidden_dropout: 0.0, attention_dropout: 0.0}
data: {data_path: data/pile_text_document, vocab_file: gpt2-vocab.json, merge_file: gpt2-merges.txt, split: '90,10,0'}
train: {micro_batch_size: 4, global_batch_size: 4, train_iters: 4, lr: 3.0e-3, lr_warmup_iters: 1, log_interval: 1,
        eval_iters: 1, eval_interval: 2}
"""


@dataclass(frozen=True)
class Rule:
    """How to run a README command matching `pattern`: `extra` flags appended, `expect` printed (or a file made), or
    `skip` with its reason."""

    pattern: str
    extra: str = ""
    expect: str = ""
    skip: str = ""


RULES = [
    Rule(r"^pip install ", skip="installs packages (network); the test suite runs from an installed checkout"),
    Rule(r"^python -m pytest", skip="the test suite itself"),
    Rule(r"^torchrun --nnodes", skip="needs several nodes"),
    Rule(r"^torchrun .*--nproc-per-node 8", skip="needs 8 GPUs (the layouts run on gloo in tests/distributed)"),
    Rule(r"^torchrun .*seed-2x4090", skip="needs two GPUs (the layouts run on gloo in tests/distributed)"),
    Rule(r"^#!/bin/bash", skip="a SLURM batch script for 8 nodes"),
    Rule(r"^--", skip="a flag list, run by tests/unit/test_readme_mixtral_flags.py"),
    Rule(r"^moetron quickstart$", extra=QUICKSTART_TINY + " --output-dir runs/quickstart", expect="Continue with:"),
    Rule(r"^moetron train .*--scale-down", extra="--train-iters 2", expect="scaled     --scale-down changed"),
    Rule(r"^moetron train --config seed-2x4090", extra="--scale-down --train-iters 2 --save runs/seed", expect="saved"),
    Rule(r"^moetron train .*--finetune", extra="--train-iters 2", expect="saved checkpoint"),
    Rule(r"^moetron train .*--load runs/moe", expect="4/4 | consumed tokens"),
    Rule(r"^moetron train .*--async-save", extra="--train-iters 2", expect="saving checkpoint (in the background)"),
    Rule(r"^moetron train ", extra="--train-iters 2", expect="saved checkpoint"),
    Rule(r"^moetron train-tokenizer ", extra="--vocab-size 300", expect="tok/vocab.json"),
    Rule(r"^moetron preprocess ", expect="_text_document.bin"),
    Rule(r"^moetron inspect runs/", expect="integrity: ok"),
    Rule(r"^moetron inspect ", expect="documents"),
    Rule(r"^moetron import --megatron-deepspeed", expect="weights and optimizer state"),
    Rule(r"^moetron import --hf", expect="runs/reimported"),
    Rule(r"^moetron plan .*--search.*--json", expect='"predicted_rank"'),
    Rule(r"^moetron plan .*--dry-run", extra="--num-layers 2", expect="verdict (dry run): "),
    Rule(r"^moetron plan .*--json", expect='"fits"'),
    Rule(r"^moetron plan .*--scale-down", expect="fits"),
    Rule(r"^moetron plan ", expect="memory per GPU"),
    Rule(r"^moetron eval ", expect="perplexity"),
    Rule(r"^moetron generate ", extra="--max-new-tokens 8", expect="Return the"),
    Rule(r"^moetron eval-harness ", expect="moetron_tiny"),
    Rule(r"^moetron export ", expect="quickstart-hf"),
    Rule(r"^moetron dry-run ", extra="--num-layers 2", expect="verdict: "),  # minutes per rank at full depth
]


# ---------------------------------------------------------------------------- reading the README
@dataclass(frozen=True)
class Block:
    kind: str  # bash | text | python
    text: str
    line: int
    doc: str = "README.md"


def readme_blocks() -> list[Block]:
    blocks = []
    for doc in DOCS:
        text = doc.read_text()
        for match in re.finditer(r"^```(\w+)\n(.*?)^```", text, re.S | re.M):
            kind, body = match.group(1), match.group(2)
            line = text.count("\n", 0, match.start()) + 1
            if kind == "bash" or kind == "python" or (kind == "text" and body.startswith("$ ")):
                blocks.append(Block(kind, body, line, doc.name))
    return blocks


def commands(block: Block) -> list[str]:
    """A bash block's commands: continuations joined, comments dropped, `a && b` split; a script stays whole."""
    if block.text.startswith("#!") or block.text.startswith("--"):
        return [block.text.strip()]
    joined = block.text.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out += [part.strip() for part in line.split(" && ")]
    return [re.sub(r"\s+", " ", c) for c in out]


def rule_for(command: str) -> Rule:
    head = command.splitlines()[0]
    for rule in RULES:
        if re.search(rule.pattern, head):
            return rule
    raise AssertionError(f"README command without a rule in {__file__}: {head!r}; add one to RULES")


QUICKSTART_RUN = ("runs/quickstart", "quickstart-hf")  # what the (slow) quickstart command leaves for later commands


def _param(block: Block, command: str):
    dry = command.startswith(("moetron quickstart", "moetron dry-run")) or " --dry-run" in command  # a CPU step each
    slow = [pytest.mark.slow] if dry else []
    return pytest.param(block, command, id=f"{block.doc}:L{block.line}:{command.splitlines()[0][:50]}", marks=slow)


CASES = []
for _block in readme_blocks():
    if _block.kind == "bash":
        CASES += [_param(_block, c) for c in commands(_block)]
    else:
        CASES.append(pytest.param(_block, _block.text, id=f"{_block.doc}:L{_block.line}:{_block.kind}"))


# ---------------------------------------------------------------------------- the newcomer's directory
@pytest.fixture(scope="module")
def world(tmp_path_factory, one_thread):  # one thread: the in-process commands' tiny shapes
    vocab, merges = SHARED_DATA / "gpt2" / "gpt2-vocab.json", SHARED_DATA / "gpt2" / "gpt2-merges.txt"
    shakespeare = SHARED_DATA / "tinyshakespeare" / "input.txt"
    if not (vocab.exists() and shakespeare.exists()):
        pytest.skip(f"needs {SHARED_DATA} (the ../shared checkout beside the repository); not present")
    root = tmp_path_factory.mktemp("newcomer")
    (root / "gpt2-vocab.json").symlink_to(vocab)
    (root / "gpt2-merges.txt").symlink_to(merges)
    paragraphs = [p for p in shakespeare.read_text()[:40_000].split("\n\n") if p.strip()]
    lines = "".join(json.dumps({"text": p}) + "\n" for p in paragraphs)
    (root / "corpus.jsonl").write_text(lines)
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.table({"text": paragraphs}), root / "corpus.parquet")
    (root / "data").mkdir()
    with gzip.open(root / "data" / "part1.jsonl.gz", "wt") as f:
        f.write(lines)
    _preprocess(root / "data" / "pile_text_document", paragraphs, vocab, merges)
    (root / "my.yaml").write_text(MY_YAML)
    (root / "prompts.txt").write_text("Return the\nThe king\n")
    (root / "mds").mkdir()
    (root / "mds" / "checkpoint").symlink_to(MDS_CHECKPOINT)
    return root


def _preprocess(prefix: Path, paragraphs: list[str], vocab: Path, merges: Path) -> None:
    from moetron.data.indexed import IndexedDatasetBuilder
    from moetron.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("GPT2BPETokenizer", str(vocab), str(merges))
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    for paragraph in paragraphs:
        builder.add_document(tokenizer.encode(paragraph) + [tokenizer.eod])
    builder.finalize()


def run_moetron(command: str, extra: str, capsys) -> tuple[int, str]:
    argv = shlex.split(command)[1:] + shlex.split(extra)
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out + err


# ---------------------------------------------------------------------------- the test
@pytest.mark.parametrize(("block", "command"), CASES)
def test_readme_command(block: Block, command: str, world: Path, capsys, monkeypatch):
    monkeypatch.chdir(world)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a path that is not there must not become a hub download
    needs = [run for run in QUICKSTART_RUN if run in command]
    if needs and not (world / needs[0]).exists():
        pytest.skip(
            f"needs {needs[0]}, which this test's own run of the README's quickstart makes (a slow case, "
            f"outside -m quick; your runs/ is not used): run the file whole"
        )
    if block.kind == "python":
        pytest.importorskip("transformers", reason="the HF example needs transformers (pip install -e '.[hf]')")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(command, f"{block.doc}:{block.line}", "exec"), {})
        assert printed.getvalue().startswith("Return the")
        return
    if block.kind == "text":  # a quoted output: the command prints exactly these lines
        first, *expected = command.rstrip("\n").splitlines()
        code, output = run_moetron(first.removeprefix("$ "), "", capsys)
        assert code == 0 and output.rstrip("\n").splitlines() == expected
        return
    rule = rule_for(command)
    if rule.skip:
        pytest.skip(rule.skip)
    if command.startswith("moetron eval-harness"):
        pytest.importorskip("lm_eval", reason="eval-harness needs lm_eval (pip install -e '.[eval]')")
    code, output = run_moetron(command, rule.extra, capsys)
    assert code == 0, output[-2000:]
    assert rule.expect in output, output[-2000:]
    if command.startswith("moetron plan") and "--json" in command:
        json.loads(output[output.index("{") :])


def test_every_readme_command_has_a_rule():
    """Also when a case above was deselected: a new README command needs a rule (how to run it, or why not)."""
    for param in CASES:
        block, command = param.values
        if block.kind == "bash":
            rule_for(command)
    assert len(CASES) > 20 and os.path.exists(README)


COMMAND_WORDS = ("$ ", "moetron ", "python ", "pip ", "torchrun ", "srun ", "bash ", "#!")


def test_no_readme_block_escapes_the_test():
    """The cases above come from ```bash, ```python and ```text blocks that quote a `$ ` command; any other fenced
    block (another language, a text block without `$ `, or a bare fence) must not hold a command, else it would go
    untested: give it one of those kinds (and a rule) instead."""
    for doc in [*DOCS, GENERATED]:
        text = doc.read_text()
        for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            kind, body = match.group(1), match.group(2)
            at = f"{doc.name}:{text.count(chr(10), 0, match.start()) + 1}"
            if kind in ("bash", "python") or (kind == "text" and body.startswith("$ ")):
                continue
            first = [row.strip() for row in body.splitlines() if row.strip()][:1]
            assert not (first and first[0].startswith(COMMAND_WORDS)), f"{at}: a ```{kind} block with a command"
            assert kind in ("", "text"), f"{at}: a ```{kind} block the test does not know; use bash/python/text"


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation other than `-` and `_` dropped, spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    return {github_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_every_link_names_a_file_and_heading_that_exist():
    """README's contents and the docs' links between each other: `#heading`, `file.md#heading` and `file.md`."""
    for doc in DOCS:
        text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            assert file.exists(), f"{doc.name}: a link to {target}, which does not exist"
            if anchor and file.suffix == ".md":
                assert anchor in anchors(file), f"{doc.name}: a link to {target}, which names no heading there"
