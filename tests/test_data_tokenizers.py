"""Tokenizers: exact byte-level round trips, the tiktoken ranks file, and GPT-2 offline
behaviour."""

import hashlib

import pytest

from gptlab.data import CharTokenizer, load_tokenizer
from gptlab.data import tokenizers as tk
from gptlab.errors import GptlabError

HOSTILE = [
    "plain ASCII, with punctuation!?",
    "emoji 👋🏽👨‍👩‍👧‍👦 🇫🇷 and skin tones",
    "CJK 世界你好 日本語のテキスト 한국어",
    "combining e\u0301 a\u0308 o\u0302\u0323, zero width\u200b\u200d joiners, BOM \ufeff",
    "windows\r\nline\r\nendings\r\n\r\n",
    "\ttabs\t\tand   runs of    spaces   \n\n\n",
    "control \x00\x01\x07\x1b[0m\x7f chars",
    "right-to-left \u202eעברית العربية\u202c",
    "astral 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0010fffd and a lone high code point \U000e0001",
    "looks special: <|eos|> <|bos|> <|pad|> <|endoftext|>",
    "",
    " ",
]


@pytest.fixture(scope="module")
def bpe_ranks(shakespeare):
    text = shakespeare.read_text()[:200_000]
    return tk.train_bpe(iter(text.split("\n\n")), 512)


def test_bpe_round_trips_hostile_utf8_exactly(bpe_ranks):
    tok = tk.bpe_from_ranks(bpe_ranks)
    assert tok.vocab_size == 512 and tok.kind == "bpe"
    assert (tok.bos_id, tok.eos_id) == (509, 510)  # <|bos|> <|eos|> <|pad|> take the last ids
    corpus = "".join(HOSTILE)
    for text in [*HOSTILE, corpus, corpus * 3]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text, repr(text)
        assert all(0 <= i < 509 for i in ids)  # special-looking text is ordinary text
    # merges were learnt: Shakespeare's words take fewer tokens than bytes
    assert len(tok.encode("the king and the queen")) <= len("the king and the queen") / 2


def test_bpe_is_a_tiktoken_encoding_rebuilt_from_its_meta(bpe_ranks):
    import tiktoken

    tok = tk.bpe_from_ranks(bpe_ranks)
    assert isinstance(tok.enc, tiktoken.Encoding)
    lines = bpe_ranks.splitlines()
    assert len(lines) == 509 and lines[0].split()[1] == "0"  # base64(token) rank, ranks 0..n-1
    again = load_tokenizer(tok.to_meta())  # what a checkpoint stores
    assert again.encode(HOSTILE[3]) == tok.encode(HOSTILE[3])
    assert tok.sha256() == hashlib.sha256(bpe_ranks.encode()).hexdigest() == again.sha256()


def test_bpe_training_is_deterministic(shakespeare, bpe_ranks):
    text = shakespeare.read_text()[:200_000]
    assert tk.train_bpe(iter(text.split("\n\n")), 512) == bpe_ranks


def test_bpe_vocabulary_below_bytes_is_a_clear_error():
    with pytest.raises(GptlabError, match="data.tokenizer.vocab_size=100"):
        tk.train_bpe(iter(["abc"]), 100)


def test_char_tokenizer_separators_take_the_last_ids():
    tok = CharTokenizer.fit("hello", specials=["<|eos|>"])
    assert tok.vocab_size == 5 and tok.eos_id == 4 and tok.bos_id is None
    assert tok.decode(tok.encode("hole") + [tok.eos_id]) == "hole<|eos|>"
    assert load_tokenizer(tok.to_meta()).eos_id == 4


def _no_network(monkeypatch):
    import tiktoken.load

    def refuse(url):
        raise ConnectionError(f"no network in tests ({url})")

    monkeypatch.setattr(tiktoken.load, "read_file", refuse)


def test_gpt2_offline_without_cache_is_one_line_naming_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    _no_network(monkeypatch)
    with pytest.raises(GptlabError) as e:
        tk.gpt2_tokenizer()
    msg = str(e.value)
    assert "TIKTOKEN_CACHE_DIR" in msg and "r50k_base" in msg and "\n" not in msg


def test_gpt2_from_a_prefilled_cache_works_offline(tmp_path, monkeypatch, bpe_ranks):
    # A locally generated ranks file stands in for OpenAI's (whose hash we patch in): the point is
    # that a pre-filled TIKTOKEN_CACHE_DIR is read, and nothing is fetched.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    _no_network(monkeypatch)
    tk.gpt2_cache_path().write_text(bpe_ranks)
    monkeypatch.setattr(tk, "GPT2_RANKS_SHA256", hashlib.sha256(bpe_ranks.encode()).hexdigest())
    tok = tk.gpt2_tokenizer()
    assert tok.kind == "gpt2" and tok.eos_id == tok.bos_id == 50256 and tok.vocab_size == 50257
    assert tok.decode(tok.encode(HOSTILE[1])) == HOSTILE[1]
    assert load_tokenizer(tok.to_meta()).encode("to be") == tok.encode("to be")
    monkeypatch.setattr(tk, "GPT2_RANKS_SHA256", "0" * 64)  # a corrupt cache is named, not used
    with pytest.raises(GptlabError, match="SHA-256 mismatch"):
        tk.gpt2_tokenizer()


def test_char_tokenizer_round_trip(shakespeare):
    text = shakespeare.read_text()
    tok = CharTokenizer.fit(text)
    assert tok.vocab_size == 65
    sample = text[:5000]
    ids = tok.encode_array(sample)
    assert ids.tolist() == tok.encode(sample)
    assert tok.decode(ids.tolist()) == sample
    with pytest.raises(GptlabError, match="not in"):
        tok.encode("€")
