"""Byte-level BPE (`tokenizer.ggml.model == "gpt2"`): the pre-tokenizer regexes named by `tokenizer.ggml.pre`,
the GPT-2 byte <-> character table, and the encoder, a `tokenizers` BPE model built from the GGUF vocabulary
and merges.

The regexes are the ones llama.cpp (src/llama-vocab.cpp) uses for each pre-tokenizer name; several regexes in a
row split the pieces of the previous one further. Text is split by them, each piece is mapped byte by byte to
printable characters (the GPT-2 table), and rank-ordered merges join the characters into tokens.
"""

from __future__ import annotations

import tokenizers
from tokenizers import Regex, models, pre_tokenizers

from jllm.errors import JllmError

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

# tokenizer.ggml.pre -> the regexes applied one after another
_REGEXES: dict[str, tuple[str, ...]] = {}
for _names, _exprs in [
    (("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"), (_QWEN2,)),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "pixtral"), (_LLAMA3,)),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), (r"\p{N}", _GPT2)),
    (("gpt-2", "phi-2", "mpt", "olmo", "jais", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "exaone4"),
     (_GPT2,)),
    (("default",), _DEFAULT),
]:
    for _name in _names:
        _REGEXES[_name] = _exprs

# pre-tokenizers whose pieces are looked up whole in the vocabulary before any merge (llama.cpp's ignore_merges)
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"}


def _byte_chars() -> list[str]:
    """byte value -> the printable character GPT-2 byte-level BPE writes for it.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, a few gaps) are given the
    characters from U+0100 upward, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


BYTE_CHARS = _byte_chars()
# str.translate table: byte-level character -> the Latin-1 character of the byte it stands for
CHAR_TO_BYTE = {ord(c): b for b, c in enumerate(BYTE_CHARS)}


def piece_bytes(token: str) -> bytes:
    """The bytes a byte-level BPE token stands for ("Ġhello" -> b" hello")."""
    try:
        return token.translate(CHAR_TO_BYTE).encode("latin-1")
    except UnicodeEncodeError:  # a character outside the byte table (a malformed vocabulary): keep its UTF-8
        return b"".join(bytes([CHAR_TO_BYTE[ord(c)]]) if ord(c) in CHAR_TO_BYTE else c.encode() for c in token)


class BpeEncoder:
    """Byte-level BPE over one fragment of text, run by the `tokenizers` library."""

    def __init__(self, tokens: list[str], merges: list[str], pre: str | None):
        pre = pre or "default"
        if pre not in _REGEXES:
            known = ", ".join(sorted(_REGEXES))
            raise JllmError(f"the GGUF's pre-tokenizer '{pre}' is not supported (known: {known}); "
                            "use a model converted with one of these")
        vocab = dict(zip(tokens, range(len(tokens))))
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        try:
            model = models.BPE(vocab, pairs, ignore_merges=pre in _IGNORE_MERGES)
        except Exception as e:  # a merge that names a token the vocabulary lacks
            raise JllmError(f"the GGUF's tokenizer merges do not fit its vocabulary ({e}); the file is damaged "
                            "or was converted wrongly") from None
        self._engine = tokenizers.Tokenizer(model)
        splits = [pre_tokenizers.Split(Regex(expr), behavior="isolated") for expr in _REGEXES[pre]]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        self._engine.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])

    def encode(self, fragment: str) -> list[int]:
        """Ids of one fragment of text that holds no special token."""
        return self._engine.encode(fragment, add_special_tokens=False).ids
