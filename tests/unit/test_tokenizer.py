import functools
import json
import random

import pytest
from data_helpers import CORPUS, make_tiny_tokenizer, tiny_tokenizer, write_jsonl

from moetron.cli import main
from moetron.data.tokenizer import build_tokenizer, train_bpe_tokenizer
from moetron.errors import UserError


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@functools.cache
def _gpt2(vocab, merges):
    return build_tokenizer("GPT2BPETokenizer", vocab, merges)


@pytest.fixture
def gpt2(gpt2_files):
    return _gpt2(*gpt2_files)


def test_gpt2_ids_match_gpt2(gpt2):
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode(" Hello") == [18435]
    assert gpt2.eod == 50256
    assert gpt2.vocab_size == 50257


def test_gpt2_round_trip_and_batch(gpt2):
    texts = ["Héllo  wörld\n\n  indented", "", "emoji 🙂 and 12345"]
    assert gpt2.encode_batch(texts) == [gpt2.encode(t) for t in texts]
    for text in texts:
        assert gpt2.decode(gpt2.encode(text)) == text


def test_gpt2_does_not_turn_eod_text_into_the_eod_id(gpt2):
    # Megatron's gpt2_tokenization has no special tokens: the literal text is ordinary bytes.
    assert gpt2.eod not in gpt2.encode("a<|endoftext|>b")


def test_unknown_type_names_the_flag():
    with pytest.raises(UserError, match="--tokenizer-type 'GPT3' is not supported; choose one of GPT2BPETokenizer"):
        build_tokenizer("GPT3")


def test_unreadable_files_name_the_flag(tmp_path):
    with pytest.raises(UserError, match="--vocab-file '.*missing.json' is not a readable"):
        build_tokenizer("GPT2BPETokenizer", tmp_path / "missing.json", tmp_path / "merges.txt")
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0}))
    with pytest.raises(UserError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", tmp_path / "vocab.json", tmp_path / "missing.txt")
    with pytest.raises(UserError, match="needs --vocab-file"):
        build_tokenizer("GPT2BPETokenizer")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="--tokenizer-model '.*bad.json' is not a readable tokenizer.json"):
        build_tokenizer("HFTokenizer", tokenizer_model=tmp_path / "bad.json")


def test_trained_tokenizer_round_trips_as_gpt2_files(tiny_tokenizer_dir):
    for name in ("vocab.json", "merges.txt", "tokenizer.json"):
        assert (tiny_tokenizer_dir / name).is_file()
    tok = tiny_tokenizer(tiny_tokenizer_dir)
    assert tok.vocab_size <= 300
    assert tok.eod == json.loads((tiny_tokenizer_dir / "vocab.json").read_text())["<|endoftext|>"]
    for text in CORPUS + ["unseen wörds 🙂"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    # the merges were learned: common words take fewer tokens than bytes
    assert len(tok.encode(CORPUS[0])) < len(CORPUS[0].encode())


def test_trained_tokenizer_json_loads_as_hf_tokenizer(tiny_tokenizer_dir):
    gpt2_style = tiny_tokenizer(tiny_tokenizer_dir)
    hf = build_tokenizer("HFTokenizer", tokenizer_model=tiny_tokenizer_dir)  # a directory holding tokenizer.json
    assert hf.encode(CORPUS[1]) == gpt2_style.encode(CORPUS[1])
    assert hf.eod == gpt2_style.eod


def test_train_on_plain_text_and_reject_tiny_vocab(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(CORPUS), encoding="utf-8")
    out = train_bpe_tokenizer([corpus], 280, tmp_path / "tok")
    assert build_tokenizer("GPT2BPETokenizer", out / "vocab.json", out / "merges.txt").vocab_size <= 280
    with pytest.raises(UserError, match="--vocab-size 100 is too small"):
        train_bpe_tokenizer([corpus], 100, tmp_path / "tok2")


def test_train_tokenizer_cli(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", CORPUS)
    assert (
        main(["train-tokenizer", "--input", str(corpus), "--vocab-size", "290", "--output-dir", str(tmp_path / "t")])
        == 0
    )
    assert "--tokenizer-type GPT2BPETokenizer" in capsys.readouterr().out
    assert (tmp_path / "t" / "merges.txt").read_text().startswith("#version")
    assert main(["train-tokenizer", "--input", str(tmp_path / "nope.jsonl"), "--vocab-size", "290",
                 "--output-dir", str(tmp_path / "t2")]) == 2  # fmt: skip
    assert "error: --input" in capsys.readouterr().err
    assert not (tmp_path / "t2").exists()


@pytest.mark.parametrize("source", ["tiny", "gpt2"])
def test_ascii_word_cache_equals_the_rust_pipeline(request, tiny_tokenizer_dir, source):
    # GPT2BPETokenizer splits ASCII text itself and caches words; it must agree with the full HF pipeline,
    # including contractions, digit runs, every ASCII whitespace and control characters.
    tok = tiny_tokenizer(tiny_tokenizer_dir) if source == "tiny" else _gpt2(*request.getfixturevalue("gpt2_files"))
    rng = random.Random(0)
    alphabet = "abZ09'sStlmrevd \t\n\r\x0b\x0c\x1c\x1f\x00\x7f.,!?-_~"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24))) for _ in range(3000)]
    texts += ["I'm  here\n\n  you've 123abc  ", "tail spaces   ", "\t\t\n x", "café mixed with ascii"]
    assert tok.encode_batch(texts) == [tok.core.encode(t).ids for t in texts]


def test_training_without_usable_text_is_an_error(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", CORPUS, key="body")
    with pytest.raises(UserError, match="holds no usable text"):
        train_bpe_tokenizer([corpus], 280, tmp_path / "tok")
