"""What a GGUF says about its vocabulary: tokens, token types, special ids and the tokens that end a generation.

Token types (llama.cpp's llama_token_type): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
Control and unknown tokens are specials: matched in text only when asked to parse specials, and left out of
decoded text when asked to skip them. User-defined tokens (qwen's `<tool_call>`, gemma's runs of newlines and
spaces) are always matched as whole strings and always decoded as their text, as llama.cpp does.
"""

from __future__ import annotations

from dataclasses import dataclass

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Token texts that end a generation, whatever their type in the GGUF (llama.cpp's list of EOG tokens; it also
# forces these to control type). Converters seldom set eot/eom ids, so this is where most end markers come from.
# llama.cpp's list also has "</s>" (for one OCR model); it is left out here because qwen's vocabulary has "</s>"
# as ordinary text (id 128247), which would then end a generation and no longer read as text.
END_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
    "<｜end▁of▁sentence｜>",
})
# Fill-in-the-middle pad / repository / file separator tokens: llama.cpp also stops at these (a code model
# that starts a new file or repository has finished the one it was asked for).
FIM_END_TEXTS = frozenset({
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<reponame>",
    "<|file_sep|>",
})
_END_ID_KEYS = ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")
# byte-level BPE pre-tokenizers that llama.cpp gives a BOS when the GGUF does not say (SentencePiece always has one)
_BOS_BY_DEFAULT = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"}


@dataclass(frozen=True)
class Vocab:
    model: str                  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE)
    pre: str | None             # tokenizer.ggml.pre: names the pre-tokenizer regexes of "gpt2"
    tokens: list[str]
    types: list[int]            # after llama.cpp's overrides: end-of-generation texts are control tokens
    scores: list[float]         # "llama" merge priorities; empty for "gpt2"
    merges: list[str]           # "gpt2" merges, "left right" by rank; empty for "llama"
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    end_ids: frozenset[int]     # every token that ends a generation
    add_bos: bool               # default for encode(add_bos=None)
    add_space_prefix: bool      # "llama" only: a "▁" is prepended to text that starts a fragment

    @classmethod
    def from_metadata(cls, md: dict) -> "Vocab":
        model = md.get("tokenizer.ggml.model", "")
        tokens = list(md["tokenizer.ggml.tokens"])
        types = list(md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
        spm = model == "llama"

        def token_id(key: str, default: int | None = None) -> int | None:
            value = md.get(f"tokenizer.ggml.{key}_token_id", default)
            return value if value is not None and 0 <= value < len(tokens) else None

        end_ids = {i for key in _END_ID_KEYS if (i := token_id(key)) is not None}
        for i, text in enumerate(tokens):
            if text in END_TEXTS or text in FIM_END_TEXTS:
                end_ids.add(i)
                types[i] = CONTROL

        pre = md.get("tokenizer.ggml.pre")
        return cls(
            model=model,
            pre=pre,
            tokens=tokens,
            types=types,
            scores=list(md.get("tokenizer.ggml.scores") or []),
            merges=list(md.get("tokenizer.ggml.merges") or []),
            bos_id=token_id("bos", 1 if spm else None),
            eos_id=token_id("eos", 2 if spm else None),
            unk_id=token_id("unknown", 0 if spm else None),
            end_ids=frozenset(end_ids),
            add_bos=bool(md.get("tokenizer.ggml.add_bos_token", spm or pre in _BOS_BY_DEFAULT)),
            add_space_prefix=spm and bool(md.get("tokenizer.ggml.add_space_prefix", True)),
        )
