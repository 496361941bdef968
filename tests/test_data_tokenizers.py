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


# ---- the byte counts behind bits per byte, and the tokenizers' own bookkeeping


def tiny_ranks() -> str:
    """A byte-level ranks file made by hand: the 256 bytes, then the merges th, the and ' the'."""
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b"th": 256, b"the": 257, b" the": 258})
    return tk.format_ranks(ranks)


def test_a_char_tokens_bytes_are_its_utf8_length_and_a_separators_none():
    tok = CharTokenizer.fit("€aé😀", specials=["<|eos|>", "<|bos|>"])
    assert tok.chars == "aé€😀" and (tok.eos_id, tok.bos_id) == (4, 5)
    lengths = tok.token_bytes()
    assert lengths.dtype == "int64" and lengths.tolist() == [1, 2, 3, 4, 0, 0]
    text = "a€😀éa"
    ids = tok.encode(text) + [tok.eos_id]
    assert int(lengths[ids].sum()) == len(text.encode("utf-8")) == 11
    assert tok.decode(ids) == text + "<|eos|>"
    assert tok.decode([5, 0]) == "<|bos|>a"


def test_a_bpe_tokens_bytes_are_what_it_decodes_to_and_a_special_tokens_none():
    tok = tk.bpe_from_ranks(tiny_ranks())
    assert tok.vocab_size == 262 and (tok.bos_id, tok.eos_id) == (259, 260)
    assert tok.specials == {"<|bos|>": 259, "<|eos|>": 260, "<|pad|>": 261}
    lengths = tok.token_bytes()
    assert lengths.dtype == "int64"
    assert lengths.tolist() == [1] * 256 + [2, 3, 4, 0, 0, 0]
    ids = tok.encode("the other, the end")
    assert ids[0] == 257 and 258 in ids  # the merges are used
    for text in [*HOSTILE, "the other, the end"]:
        assert int(lengths[tok.encode(text)].sum()) == len(text.encode("utf-8")), repr(text)


def test_an_id_no_merge_made_counts_no_bytes():
    """Specials placed above a gap (as a ranks file with an unused id has): the gap counts 0."""
    ranks = tiny_ranks()
    tok = tk.TiktokenTokenizer("bpe", ranks, {"<|eos|>": 260, "<|bos|>": 261}, tk.GPT2_PAT,
                               eos="<|eos|>", bos="<|bos|>")  # fmt: skip
    assert tok.vocab_size == 262 and (tok.eos_id, tok.bos_id) == (260, 261)
    assert tok.token_bytes().tolist()[255:] == [1, 2, 3, 4, 0, 0, 0]


def test_a_bpe_rebuilt_from_its_meta_is_the_same_tokenizer():
    ranks = tiny_ranks()
    tok = tk.bpe_from_ranks(ranks)
    meta = tok.to_meta()
    assert meta == {
        "kind": "bpe",
        "sha256": hashlib.sha256(ranks.encode()).hexdigest(),
        "ranks": ranks,
        "specials": {"<|bos|>": 259, "<|eos|>": 260, "<|pad|>": 261},
        "pat_str": tk.GPT2_PAT,
    }
    again = load_tokenizer(meta)
    assert (again.kind, again.vocab_size, again.bos_id, again.eos_id) == ("bpe", 262, 259, 260)
    assert again.encode(" the thee") == tok.encode(" the thee") == [258, 258, 101]
    assert again.decode([257, 258, 101]) == "the thee"
    assert tok.encode_ordinary_batch(["the", " the"]) == [[257], [258]]
    assert tok.encode("<|eos|>") == tok.encode_ordinary_batch(["<|eos|>"])[0] != [260]


def test_ranks_files_read_and_write_base64_tokens_in_rank_order():
    assert tk.format_ranks({b"b": 1, b"a": 0, b" the": 2}) == "YQ== 0\nYg== 1\nIHRoZQ== 2\n"
    assert tk.parse_ranks("YQ== 0\n\nYg== 1\nIHRoZQ== 2\n") == {b"a": 0, b"b": 1, b" the": 2}


def test_gpt2s_byte_alphabet_gives_every_byte_its_own_printable_character():
    table = tk._bytes_to_unicode()
    assert len(table) == len(set(table.values())) == 256
    assert table[ord("a")] == "a" and table[ord("!")] == "!" and table[ord("~")] == "~"
    assert table[ord("¡")] == "¡" and table[ord("¬")] == "¬" and table[ord("®")] == "®"
    assert table[ord("ÿ")] == "ÿ"
    assert table[0] == "Ā" and table[ord(" ")] == "Ġ" and table[0xAD] == "Ń"  # 256, 256+32, 256+67
    assert all(c.isprintable() for c in table.values())


def test_a_bpe_vocabulary_of_exactly_the_bytes_and_specials_trains():
    ranks = tk.parse_ranks(tk.train_bpe(iter(["abab abab"]), 259))
    assert len(ranks) == 256 and sorted(ranks.values()) == list(range(256))
    with pytest.raises(GptlabError, match=r"vocab_size=258: a byte-level BPE needs at least 259"):
        tk.train_bpe(iter(["abab"]), 258)


def test_a_char_tokenizers_meta_and_vectorised_encoding():
    tok = CharTokenizer.fit("hello")
    assert tok.to_meta() == {"kind": "char", "chars": "ehlo"}
    assert CharTokenizer.fit("hello", ["<|eos|>"]).to_meta() == {
        "kind": "char",
        "chars": "ehlo",
        "specials": ["<|eos|>"],
    }
    assert tok.sha256() == hashlib.sha256(repr(tok.to_meta()).encode()).hexdigest()
    assert tok.sha256() != CharTokenizer.fit("hellp").sha256()
    assert tok.encode_array("hole").tolist() == [1, 3, 2, 0]
    assert [a.tolist() for a in tok.encode_ordinary_batch(["he", "", "o"])] == [[1, 0], [], [3]]
    for text, bad in [("hex", "x"), ("a", "a"), ("hf", "f"), ("hz", "z"), ("€", "€")]:
        with pytest.raises(GptlabError, match=f"^character '{bad}' is not in the vocabulary$"):
            tok.encode_array(text)  # below, between and above its characters
    empty = CharTokenizer("")
    assert empty.encode_array("").tolist() == [] and empty.vocab_size == 0
    assert empty.encode_array("").dtype == "int64" == tok.encode_array("").dtype  # joins ids
    with pytest.raises(GptlabError, match="^character 'q' is not in the vocabulary$"):
        empty.encode_array("q")
    with pytest.raises(GptlabError, match="^character 'x' is not in this model's vocabulary of 4 "):
        tok.encode("hex")


def test_an_unknown_tokenizer_kind_is_named():
    with pytest.raises(
        GptlabError, match="^unknown tokenizer kind 'sentencepiece' in dataset metadata$"
    ):
        load_tokenizer({"kind": "sentencepiece"})


def test_gpt2s_cache_folder_is_tiktokens(tmp_path, monkeypatch):
    import tempfile
    from pathlib import Path

    name = hashlib.sha1(tk.GPT2_RANKS_URL.encode()).hexdigest()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("DATA_GYM_CACHE_DIR", str(tmp_path / "b"))
    assert tk.gpt2_cache_path() == tmp_path / "a" / name
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR")
    assert tk.gpt2_cache_path() == tmp_path / "b" / name
    monkeypatch.delenv("DATA_GYM_CACHE_DIR")
    assert tk.gpt2_cache_path() == Path(tempfile.gettempdir()) / "data-gym-cache" / name


def test_a_bpe_decodes_a_cut_character_as_a_replacement_not_an_error():
    tok = tk.bpe_from_ranks(tiny_ranks())
    euro = tok.encode("€")  # three byte tokens
    assert euro == list(b"\xe2\x82\xac")
    assert tok.decode(euro[:2]) == "\ufffd" and tok.decode(euro[:2] + [101]) == "\ufffde"
    assert tok.decode(euro) == "€"


def test_gpt2_is_read_from_tiktoken_by_its_url_and_hash_and_named_in_its_meta(
    tmp_path, monkeypatch
):
    import tiktoken.load

    ranks = tiny_ranks()
    asked = []

    def read_file_cached(url, expected_hash=None):
        asked.append((url, expected_hash))
        return ranks.encode()

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setattr(tiktoken.load, "read_file_cached", read_file_cached)
    tok = tk.gpt2_tokenizer()
    assert asked == [(tk.GPT2_RANKS_URL, tk.GPT2_RANKS_SHA256)]
    assert tok.to_meta() == {"kind": "gpt2", "sha256": hashlib.sha256(ranks.encode()).hexdigest()}
    assert (tok.kind, tok.eos_id, tok.bos_id, tok.pat_str) == ("gpt2", 50256, 50256, tk.R50K_PAT)

    def offline(url, expected_hash=None):
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken.load, "read_file_cached", offline)
    with pytest.raises(GptlabError, match=r"could not be downloaded \(ConnectionError\); on a"):
        tk.gpt2_tokenizer()


def test_bpe_merges_pairs_seen_twice_without_a_space_before_the_first_word():
    """Each text's first word has no space before it (no prefix space added), and a merge needs a
    pair seen at least twice: exactly these 5 merges, in this order, with room for many more."""
    ranks = tk.parse_ranks(tk.train_bpe(iter(["the cat", "the hat", "a cat sat"]), 300))
    merges = sorted((rank, token) for token, rank in ranks.items() if rank >= 256)
    assert merges == [(256, b"at"), (257, b"cat"), (258, b"he"), (259, b"the"), (260, b" cat")]
    assert {ranks[bytes([b])] for b in range(256)} == set(range(256))  # every byte, ranks 0-255
