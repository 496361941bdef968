"""Hugging Face tokenizer files for an export, which encode any text to exactly gptlab's ids.

``transformers.AutoTokenizer`` (and so ``lm_eval --model hf``) loads the folder and encodes with
them.

Written with the ``tokenizers`` library alone; transformers is needed to load the files, not to
write them. A byte-level BPE (``bpe``, ``gpt2``) becomes a BPE model in GPT-2's byte alphabet with
the merges recovered from its tiktoken ranks and the tokenizer's own split pattern; a ``char``
tokenizer becomes a word-level model over single characters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from gptlab.data.tokenizers import SPECIAL_TOKENS, Tokenizer, _bytes_to_unicode, parse_ranks

FILES = ("tokenizer.json", "tokenizer_config.json")
PAD = SPECIAL_TOKENS[2]


def write_hf_tokenizer(tokenizer: Tokenizer, folder: Path, block_size: int) -> List[Path]:
    """Write tokenizer.json and tokenizer_config.json into folder; returns their paths."""
    folder = Path(folder)
    hf_tokenizer(tokenizer).save(str(folder / FILES[0]))
    (folder / FILES[1]).write_text(json.dumps(tokenizer_config(tokenizer, block_size), indent=1))
    return [folder / name for name in FILES]


def special_tokens(tokenizer: Tokenizer) -> Dict[str, int]:
    """Special token text -> id."""
    if tokenizer.kind == "char":
        n = len(tokenizer.chars)
        return {s: n + i for i, s in enumerate(tokenizer.specials)}
    return dict(tokenizer.specials)


def special_token_ids(tokenizer: Tokenizer) -> Dict[str, Optional[int]]:
    """bos / eos / pad ids under transformers' config names (None: the tokenizer has none)."""
    return {
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": special_tokens(tokenizer).get(PAD),
    }


def tokenizer_config(tokenizer: Tokenizer, block_size: int) -> Dict[str, Any]:
    config: Dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # the class that only reads tokenizer.json
        "model_max_length": block_size,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,  # it would drop the space before "." on decode
        # gptlab reads special-token text in the input as ordinary text (a corpus can't inject one)
        "split_special_tokens": True,
    }
    text_of = {i: s for s, i in special_tokens(tokenizer).items()}
    for role, i in special_token_ids(tokenizer).items():
        if i is not None:
            config[role.replace("_id", "")] = text_of[i]
    return config


def hf_tokenizer(tokenizer: Tokenizer):
    """The ``tokenizers.Tokenizer`` that encodes and decodes as gptlab's tokenizer does."""
    from tokenizers import AddedToken

    hf = _char_level(tokenizer.chars) if tokenizer.kind == "char" else _byte_level(tokenizer)
    for text, i in sorted(special_tokens(tokenizer).items(), key=lambda kv: kv[1]):
        hf.add_special_tokens([AddedToken(text, special=True, normalized=False)])
        if hf.token_to_id(text) != i:  # specials follow the vocabulary in gptlab and in tokenizers
            raise RuntimeError(f"special token {text!r} got id {hf.token_to_id(text)}, not {i}")
    return hf


def _char_level(chars: str):
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    # no unk token: a character outside the vocabulary is an error, as in CharTokenizer.encode
    hf = HFTokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one char each
    hf.decoder = decoders.Fuse()  # joined as they are (word-level decoding would add spaces)
    return hf


def _byte_level(tokenizer: Tokenizer):
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    ranks = parse_ranks(tokenizer.ranks_text)
    alphabet = _bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {text(t): r for t, r in ranks.items()}
    merges = [(text(a), text(b)) for a, b in recover_merges(ranks)]
    # ignore_merges: a piece that is itself a token is that token, as tiktoken does
    hf = HFTokenizer(models.BPE(vocab, merges, ignore_merges=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            # the encoding's own pattern (GPT-2's or tiktoken's r50k), not ByteLevel's built-in one
            pre_tokenizers.Split(Regex(tokenizer.pat_str), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    return hf


def recover_merges(ranks: Dict[bytes, int]) -> List[Tuple[bytes, bytes]]:
    """The merge that makes each multi-byte token, in rank order.

    It is the last step of tiktoken's BPE on the token's own bytes.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank; a token always forms
    from the same pair, so one merge per token, ordered by the token's rank, is the same
    algorithm. A token BPE never reaches from its bytes gets no merge: tiktoken emits it only for a
    piece that is exactly that token, which ``ignore_merges`` covers.
    """
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            last = _last_merge(token, ranks)
            if last is not None:
                merges.append(last)
    return merges


def _last_merge(token: bytes, ranks: Dict[bytes, int]) -> Optional[Tuple[bytes, bytes]]:
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        pairs = [(ranks.get(a + b), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        found = [(r, i) for r, i in pairs if r is not None]
        if not found:
            return None
        _, i = min(found)  # lowest rank, leftmost on a tie
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None
