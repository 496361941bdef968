"""Hugging Face tokenizer files: transformers' AutoTokenizer gives exactly gptlab's ids for any
text, and decodes them back, for char, a trained BPE and GPT-2."""

import json
import random
import sys

import pytest
from test_data_tokenizers import HOSTILE, bpe_ranks  # noqa: F401 - a BPE trained once per module

from gptlab.data import CharTokenizer
from gptlab.data import tokenizers as tk
from gptlab.data.hf_tokenizer import hf_tokenizer, recover_merges, write_hf_tokenizer

SPACING = [
    "",
    " ",
    "   ",
    " leading space",
    "trailing space ",
    "trailing spaces   ",
    "many    spaces   between words",
    "\n",
    "\n\nROMEO:\nBut soft, what light\n\n\n",
    "  \n  indented\n\tand tabbed\n",
    "digits 0 1 12 123 1234 12345 3.14159 1,000,000 2024-01-01",
    "punctuation!? ... -- ;:,. 'quoted' \"double\" (parens) [brackets] {braces}",
    "contractions: don't, I'll, we've, they're, she'd, I'm, it's, IT'S",
]
UNICODE = [
    "café — naïve 😀",
    "exotic spaces:\u00a0nbsp\u2009thin\u3000ideographic\u2028line\u0085next\u200bzw\ufeffbom",
    "numerals ٣ Ⅻ ½ ², letters ﬁ ǅ ß",
]


def shakespeare_texts(text, n=200, seed=0):
    """Lines, and slices starting and ending anywhere (mid-word, mid-space)."""
    rng = random.Random(seed)
    lines = [line for line in text.splitlines() if line][:100]
    slices = []
    for _ in range(n):
        start = rng.randrange(len(text) - 400)
        slices.append(text[start : start + rng.randint(1, 400)])
    return lines + slices + [text[:20_000]]


def fuzz_texts(text, n=1000, seed=1):
    """Random joins of words, whitespace runs, digits, unicode and special-looking text."""
    rng = random.Random(seed)
    parts = [*SPACING, *UNICODE, *HOSTILE, "<|eos|>", "<|endoftext|>", "'s", "'S", "\r\n", "\t "]

    def part():
        if rng.random() < 0.5:
            return rng.choice(parts)
        start = rng.randrange(len(text) - 40)
        return text[start : start + rng.randint(1, 40)]

    return ["".join(part() for _ in range(rng.randint(1, 12))) for _ in range(n)]


def load(tokenizer, folder, block_size=64):
    transformers = pytest.importorskip("transformers")
    write_hf_tokenizer(tokenizer, folder, block_size)
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def assert_same(ours, hf, texts):
    for text in texts:
        ids = ours.encode(text)
        got = hf.encode(text)
        assert got == ids, repr(text[:80])
        assert hf.decode(got) == ours.decode(ids), repr(text[:80])


def test_recover_merges_is_tiktoken_bpe_on_each_tokens_bytes():
    # "bc" ranks below "ab": BPE on b"abc" makes "bc" first, so "abc" is "a" + "bc"
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b"bc": 256, b"ab": 257, b"abc": 258, b"xyz": 259})
    assert recover_merges(ranks) == [(b"b", b"c"), (b"a", b"b"), (b"a", b"bc")]  # no way to xyz
    ranks[b"ab"], ranks[b"bc"] = 256, 257
    assert recover_merges(ranks)[-1] == (b"ab", b"c")


@pytest.mark.integration
def test_a_token_bpe_cannot_reach_is_still_the_token_of_a_piece_that_is_it(tmp_path):
    """tiktoken returns a piece that is a token as that token, without merging; "xyz" has no
    merge (no "xy" or "yz"), so only that rule makes it one token."""
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b"bc": 256, b"ab": 257, b"abc": 258, b"xyz": 259})
    tok = tk.TiktokenTokenizer(
        "bpe", tk.format_ranks(ranks), {"<|eos|>": 260, "<|bos|>": 261}, tk.GPT2_PAT, "<|eos|>",
        "<|bos|>"
    )  # fmt: skip
    hf = load(tok, tmp_path)
    assert tok.encode("xyz") == [259] and tok.encode("xyzxyz") == list(b"xyzxyz")
    assert_same(tok, hf, ["xyz", "xyzxyz", "xyz abc xyz", "abcabc ab bc xyzabc", "axyz"])


@pytest.mark.integration
def test_a_trained_bpe_gives_tiktokens_ids(bpe_ranks, shakespeare, tmp_path):  # noqa: F811
    tok = tk.bpe_from_ranks(bpe_ranks)
    hf = load(tok, tmp_path, block_size=128)
    text = shakespeare.read_text()
    assert_same(tok, hf, [*SPACING, *UNICODE, *HOSTILE, *shakespeare_texts(text)])
    assert_same(tok, hf, fuzz_texts(text))
    # merges were recovered, not just the vocabulary: words are whole tokens
    assert len(hf.encode("the king and the queen")) <= len("the king and the queen") / 2
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (509, 510, 511)
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert hf.model_max_length == 128
    # special-looking text is ordinary text, as gptlab encodes it; the ids decode to the specials
    assert all(i < 509 for i in hf.encode("<|eos|>")) and hf.decode([510]) == "<|eos|>"
    assert hf.decode(hf.encode(" spaced .  out ,")) == " spaced .  out ,"  # no space clean-up


@pytest.mark.integration
def test_the_r50k_split_pattern_and_a_gpt2_style_special(bpe_ranks, shakespeare, tmp_path):  # noqa: F811
    """GPT-2's own encoding splits with tiktoken's r50k pattern and has one <|endoftext|>: the same
    conversion with the trained ranks, offline."""
    tok = tk.TiktokenTokenizer(
        "gpt2", bpe_ranks, {"<|endoftext|>": 509}, tk.R50K_PAT, "<|endoftext|>", "<|endoftext|>"
    )
    hf = load(tok, tmp_path)
    text = shakespeare.read_text()
    assert_same(tok, hf, [*SPACING, *UNICODE, *HOSTILE, *fuzz_texts(text, n=500, seed=2)])
    assert hf.bos_token == hf.eos_token == "<|endoftext|>" and hf.eos_token_id == 509
    assert hf.pad_token is None


def test_gpt2_gives_tiktokens_ids(shakespeare, tmp_path):
    if not tk.gpt2_cache_path().is_file():
        pytest.skip(f"tiktoken's GPT-2 file is not at {tk.gpt2_cache_path()} (no download here)")
    tok = tk.gpt2_tokenizer()
    hf = load(tok, tmp_path, block_size=1024)
    text = shakespeare.read_text()
    assert_same(tok, hf, [*SPACING, *UNICODE, *HOSTILE, *fuzz_texts(text, n=300, seed=3)])
    assert hf.encode("Hello world") == [15496, 995] and hf.eos_token_id == 50256


@pytest.mark.integration
def test_char_tokenizer_gives_the_same_ids_and_joins_without_spaces(shakespeare, tmp_path):
    text = shakespeare.read_text()
    tok = CharTokenizer.fit(text, specials=["<|eos|>"])
    hf = load(tok, tmp_path)
    spacing = [t for t in SPACING if set(t) <= set(tok.chars)]  # Shakespeare has no digits, tabs
    assert len(spacing) >= 8
    assert_same(tok, hf, [*spacing, *shakespeare_texts(text)])
    assert hf.decode(tok.encode("a b\n\n  c ") + [tok.eos_id]) == "a b\n\n  c <|eos|>"
    assert (hf.eos_token, hf.eos_token_id, hf.bos_token) == ("<|eos|>", tok.eos_id, None)
    with pytest.raises(Exception, match="WordLevel"):  # not in the vocabulary, as in gptlab
        hf.encode("café")


def test_writing_needs_no_transformers(bpe_ranks, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setitem(sys.modules, "transformers", None)  # any import of it now fails
    files = write_hf_tokenizer(tk.bpe_from_ranks(bpe_ranks), tmp_path, 32)
    assert [f.name for f in files] == ["tokenizer.json", "tokenizer_config.json"]
    config = json.loads(files[1].read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["model_max_length"] == 32
    assert not config["add_prefix_space"] and not config["clean_up_tokenization_spaces"]
    char = hf_tokenizer(CharTokenizer.fit("ab "))  # the tokenizers object alone
    assert char.encode("ba b").ids == [2, 1, 0, 2] and char.decode([2, 1, 0, 2]) == "ba b"
