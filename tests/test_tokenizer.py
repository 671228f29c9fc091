"""jllm.tokenizer: ids equal to llama.cpp's, on tiny synthetic vocabularies and on the four real models.

About BOS in the reference fixtures: their `tokenize` ids come from llama-server's /tokenize, which adds no
BOS (add_special=false), so they are compared with encode(add_bos=False); their greedy `prompt_ids` were
tokenized with the model's default, so gemma's (add_bos_token=True) start with BOS 2 and the others have
none: those are compared with encode(add_bos=None).
"""

from __future__ import annotations

import random
import re
from functools import lru_cache

import pytest

from jllm.errors import JllmError
from jllm.gguf.reader import read_gguf
from jllm.tokenizer.bpe import BYTE_CHARS
from jllm.tokenizer.specials import SpecialSplitter
from jllm.tokenizer.tokenizer import Tokenizer

ALIASES = ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "gemma-3-270m", "smollm2-135m"]
NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6


# --- synthetic vocabularies -------------------------------------------------------------------------------

def bpe_metadata(**overrides) -> dict:
    """Byte-level BPE: the 256 byte symbols, a few merges, control tokens and one user-defined token."""
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "r l", "Ġwo rl", "Ġworl d"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>", *BYTE_CHARS,
              *[m.replace(" ", "") for m in merges]]
    md = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [CONTROL] * 3 + [USER_DEFINED] + [NORMAL] * (len(tokens) - 4),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": False,
    }
    md.update(overrides)
    return md


def spm_metadata(extra: list[tuple[str, float]] = (), add_space_prefix: bool = False) -> dict:
    """SentencePiece BPE: specials, 256 byte tokens, then scored pieces (higher score merges first)."""
    pieces = [("▁", -1.0), ("a", -2.0), ("b", -3.0), ("c", -4.0), (">", -5.0), ("<", -6.0), ("/", -7.0),
              ("ab", -10.0), ("bc", -11.0), ("▁a", -12.0), ("abc", -13.0), ("▁ab", -14.0), ("</", -15.0),
              ("b>", -16.0), *extra]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n\n",
              *[f"<0x{b:02X}>" for b in range(256)], *[p for p, _ in pieces]]
    types = [CONTROL] * 6 + [USER_DEFINED] + [BYTE] * 256 + [NORMAL] * len(pieces)
    return {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": [-1000.0] * 6 + [0.0] * 257 + [s for _, s in pieces],
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


def spm_oracle(md: dict):
    """llama.cpp's SPM tokenization restated naively: user-defined tokens are cut out first (longest first);
    over each piece between them, merge the adjacent pair whose concatenation is the best-scored token, the
    leftmost on a tie, until none is left; unknown symbols become byte tokens. Returns
    encode(text, add_bos=False, parse_special=False)."""
    tokens, types, scores = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"], md["tokenizer.ggml.scores"]
    ids = {t: i for i, t in enumerate(tokens)}
    score = {t: scores[i] for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    user_defined = sorted((t for i, t in enumerate(tokens) if types[i] == USER_DEFINED), key=len, reverse=True)
    cut = re.compile("(" + "|".join(map(re.escape, user_defined)) + ")")

    def encode(text: str) -> list[int]:
        out = []
        for n, piece in enumerate(cut.split(text)):
            out += [ids[piece]] if n % 2 else merge(piece)
        return out

    def merge(text: str) -> list[int]:
        syms = list(text.replace(" ", "▁"))
        while True:
            best = None
            for i in range(len(syms) - 1):
                s = score.get(syms[i] + syms[i + 1])
                if s is not None and (best is None or s > best[0]):
                    best = (s, i)
            if best is None:
                break
            i = best[1]
            syms[i:i + 2] = [syms[i] + syms[i + 1]]
        out = []
        for s in syms:
            out += [ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()]
        return out

    return encode


def test_bpe_merges_by_rank_and_maps_bytes():
    tok = Tokenizer.from_metadata(bpe_metadata())
    t = tok.vocab.tokens
    assert [t[i] for i in tok.encode("hello world")] == ["hello", "Ġworld"]
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert tok.token_bytes(tok.encode(" world")[0]) == b" world"
    # a character outside the merges falls back to its UTF-8 bytes, each a byte symbol
    ids = tok.encode("é")
    assert len(ids) == 2 and b"".join(map(tok.token_bytes, ids)) == "é".encode()


def test_bpe_special_tokens_parse_or_not():
    tok = Tokenizer.from_metadata(bpe_metadata())
    text = "<|im_start|>hello<|im_end|>"
    assert tok.encode(text) == [1, tok.encode("hello")[0], 2]
    plain = tok.encode(text, parse_special=False)
    assert 1 not in plain and 2 not in plain and tok.decode(plain) == text
    # user-defined tokens are matched even when specials are not parsed (as llama.cpp does)
    assert tok.encode("a<tool>b", parse_special=False) == [*tok.encode("a"), 3, *tok.encode("b")]


def test_bos_default_comes_from_the_gguf():
    assert Tokenizer.from_metadata(bpe_metadata()).encode("hello") == [Tokenizer.from_metadata(bpe_metadata())
                                                                       .encode("hello")[0]]
    tok = Tokenizer.from_metadata(bpe_metadata(**{"tokenizer.ggml.add_bos_token": True}))
    assert tok.encode("hello")[0] == 0 and tok.encode("hello", add_bos=False)[0] != 0
    assert tok.encode("", add_bos=True) == [0] and tok.encode("", add_bos=False) == []


def test_decode_skip_special():
    tok = Tokenizer.from_metadata(bpe_metadata())
    ids = tok.encode("<|im_start|>hello<|im_end|>")
    assert tok.decode(ids) == "<|im_start|>hello<|im_end|>"
    assert tok.decode(ids, skip_special=True) == "hello"
    assert tok.is_special(1) and not tok.is_special(3)  # user-defined text is content, not markup


def test_end_of_generation_ids():
    tok = Tokenizer.from_metadata(bpe_metadata(**{"tokenizer.ggml.eot_token_id": 1}))
    # eos, eot from the GGUF; <|endoftext|> and <|im_end|> by their text
    assert tok.eot_ids == frozenset({0, 1, 2})
    tok = Tokenizer.from_metadata(spm_metadata())
    assert tok.eot_ids == frozenset({1, 5})  # <eos>, <end_of_turn>


def test_unsupported_models_say_so():
    with pytest.raises(JllmError, match="tokenizer model 'bert' is not supported"):
        Tokenizer.from_metadata(bpe_metadata(**{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(JllmError, match="pre-tokenizer 'klingon' is not supported"):
        Tokenizer.from_metadata(bpe_metadata(**{"tokenizer.ggml.pre": "klingon"}))
    with pytest.raises(JllmError, match="merges do not fit its vocabulary"):
        Tokenizer.from_metadata(bpe_metadata(**{"tokenizer.ggml.merges": ["h zz"]}))


def test_fingerprint_tells_vocabularies_apart():
    a, b = Tokenizer.from_metadata(bpe_metadata()), Tokenizer.from_metadata(bpe_metadata())
    assert a.fingerprint() == b.fingerprint()
    c = Tokenizer.from_metadata(bpe_metadata(**{"tokenizer.ggml.eos_token_id": 1}))
    assert c.fingerprint() != a.fingerprint()
    assert Tokenizer.from_metadata(spm_metadata()).fingerprint() != a.fingerprint()


def test_spm_best_score_first_leftmost_on_tie():
    md = spm_metadata()
    tok = Tokenizer.from_metadata(md)
    t = tok.vocab.tokens
    # "ab" (-10) beats "bc" (-11); then "abc" forms from "ab" + "c"
    assert [t[i] for i in tok.encode("abc", add_bos=False)] == ["abc"]
    assert [t[i] for i in tok.encode("a b", add_bos=False)] == ["a", "▁", "b"]
    oracle = spm_oracle(md)
    for text in ["abab", "bcbc", "aabbcc", " ab abc", "abcabc a"]:
        assert tok.encode(text, add_bos=False) == oracle(text), text


def test_spm_byte_fallback_and_bos():
    tok = Tokenizer.from_metadata(spm_metadata())
    ids = tok.encode("a🚀")
    assert ids[0] == 2 and [tok.token_text(i) for i in ids[2:]] == ["<0xF0>", "<0x9F>", "<0x9A>", "<0x80>"]
    assert tok.decode(ids) == "<bos>a🚀" and tok.decode(ids, skip_special=True) == "a🚀"


def test_spm_special_and_user_defined_tokens():
    tok = Tokenizer.from_metadata(spm_metadata())
    ids = tok.encode("<start_of_turn>ab\n\nc<end_of_turn>", add_bos=False)
    assert ids[0] == 4 and ids[-1] == 5 and 6 in ids
    plain = tok.encode("<start_of_turn>ab\n\nc", add_bos=False, parse_special=False)
    assert 4 not in plain and 6 in plain


def test_spm_space_prefix_on_every_fragment_and_dropped_by_decode():
    md = spm_metadata(add_space_prefix=True)
    tok = Tokenizer.from_metadata(md)
    t = tok.vocab.tokens
    assert [t[i] for i in tok.encode("ab", add_bos=False)] == ["▁ab"]
    ids = tok.encode("ab<end_of_turn>a", add_bos=False)
    assert [t[i] for i in ids] == ["▁ab", "<end_of_turn>", "▁a"]
    assert tok.decode(tok.encode("ab", add_bos=False)) == "ab"
    assert tok.decode(tok.encode("ab")) == "<bos> ab"  # after BOS the space stays, as in llama.cpp


def test_spm_word_split_respects_tokens_spanning_a_space():
    # ">▁</" joins across the word boundary before "▁": the text must not be cut there
    md = spm_metadata(extra=[(">▁", -20.0), (">▁</", -21.0)])
    tok = Tokenizer.from_metadata(md)
    oracle = spm_oracle(md)
    for text in ["ab> </b>", "a> </", "> </> </", "ab>  </"]:
        assert tok.encode(text, add_bos=False, parse_special=False) == oracle(text), text
    assert tok.vocab.tokens.index(">▁</") in tok.encode("a> </", add_bos=False)


def test_special_splitter_leftmost_longest():
    split = SpecialSplitter({"<a>": 1, "<a>b": 2, "b": 3, "x.y": 4}).split
    assert split("z<a>bc<a>") == ["z", 2, "c", 1]
    assert split("xxy x.y") == ["xxy ", 4]  # "." is literal, not a regex wildcard
    assert split("") == [] and SpecialSplitter({}).split("abc") == ["abc"]


# --- the real models against llama.cpp ------------------------------------------------------------------

@lru_cache(maxsize=None)
def _load(path: str) -> tuple[dict, Tokenizer]:
    md = read_gguf(path).metadata
    return md, Tokenizer.from_metadata(md)


@pytest.fixture(params=ALIASES)
def model(request, real_model, reference):
    md, tok = _load(str(real_model(request.param)))
    return request.param, md, tok, reference(request.param)


def test_tokenize_fixtures_match_llama_cpp(model):
    alias, _, tok, ref = model
    for case in ref["tokenize"]:
        text = case["text"]
        assert tok.encode(text, add_bos=False) == case["ids_parse_special"], text
        assert tok.encode(text, add_bos=False, parse_special=False) == case["ids_plain"], text
        assert tok.decode(case["ids_parse_special"]) == text
        assert tok.decode(case["ids_plain"]) == text


def test_greedy_prompts_match_llama_cpp(model):
    alias, _, tok, ref = model
    for case in ref["greedy"]:
        ids = tok.encode(case["prompt_text"])
        assert ids == case["prompt_ids"], case["prompt_text"]
        assert tok.decode(ids, skip_special=alias == "gemma-3-270m") == case["prompt_text"]
        assert "\ufffd" not in tok.decode(case["prompt_ids"] + case["generated_ids"])


def test_special_ids_of_real_models(model):
    alias, md, tok, _ = model
    assert tok.vocab_size == len(md["tokenizer.ggml.tokens"])
    assert tok.eos_id in tok.eot_ids and all(tok.is_special(i) for i in tok.eot_ids)
    ends = {tok.token_text(i) for i in tok.eot_ids}
    expected = {"qwen2.5-coder-1.5b": {"<|endoftext|>", "<|im_end|>"}, "qwen2.5-coder-0.5b": {"<|endoftext|>",
                "<|im_end|>"}, "gemma-3-270m": {"<eos>", "<end_of_turn>"}, "smollm2-135m": {"<|endoftext|>",
                                                                                           "<|im_end|>"}}[alias]
    assert expected <= ends
    assert tok.bos_id == md["tokenizer.ggml.bos_token_id"]


def test_qwen_sizes_share_one_tokenizer(real_model):
    small = _load(str(real_model("qwen2.5-coder-0.5b")))[1]
    large = _load(str(real_model("qwen2.5-coder-1.5b")))[1]
    gemma = _load(str(real_model("gemma-3-270m")))[1]
    assert small.fingerprint() == large.fingerprint() != gemma.fingerprint()


def test_gemma_matches_the_scored_merge_oracle(real_model):
    md, tok = _load(str(real_model("gemma-3-270m")))
    oracle = spm_oracle(md)
    rng = random.Random(0)
    alphabet = [*"abcdefghijklmnopqrstuvwxyz ABCXYZ.,;:!?'\"()<>/=-_0123456789éüß東京北市🚀👍ąЖп\n\t",
                "</", "> ", "the ", "tion", "<b>", "  "]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        assert tok.encode(text, add_bos=False, parse_special=False) == oracle(text), repr(text)
