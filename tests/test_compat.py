"""The draft/target tokenizer gate (jllm/spec/compat.py): synthetic vocabularies, and the real models."""

from __future__ import annotations

import copy
import re

import pytest

from jllm.errors import JllmError
from jllm.gguf.reader import read_gguf
from jllm.spec.compat import check_compatible, tokenizer_fingerprint

K = "tokenizer.ggml."


def vocab() -> dict:
    tokens = ["<|endoftext|>", "<|im_end|>", "a", "b", "ab", "\n", "\n\n", "abab"]
    return {"general.architecture": "qwen2", K + "model": "gpt2", K + "pre": "qwen2", K + "tokens": tokens,
            K + "token_type": [3, 3, 1, 1, 1, 1, 1, 1], K + "merges": ["a b", "ab ab"],
            K + "bos_token_id": 0, K + "eos_token_id": 1, "qwen2.embedding_length": 64}


def message(target: dict, draft: dict) -> str:
    with pytest.raises(JllmError) as e:
        check_compatible(target, draft, "big.gguf", "small.gguf")
    msg = str(e.value)
    assert "\n" not in msg and "small.gguf cannot draft for big.gguf" in msg
    return msg


def test_identical_copy_passes():
    check_compatible(vocab(), copy.deepcopy(vocab()), "big.gguf", "small.gguf")


def test_differences_outside_the_tokenizer_pass():
    draft = vocab()
    draft["qwen2.embedding_length"] = 32
    draft[K + "chat_template"] = "{{ messages }}"
    check_compatible(vocab(), draft, "big.gguf", "small.gguf")


def test_changed_token_is_named_with_its_id_and_both_texts():
    draft = vocab()
    draft[K + "tokens"][4] = "ba"
    assert "token 4 'ab' vs 'ba'" in message(vocab(), draft)


def test_newline_tokens_are_not_confused():
    draft = vocab()
    draft[K + "tokens"][5:7] = ["\n\n", "\n"]          # a joined-with-newlines hash would miss this swap
    assert "token 5 '\\n' vs '\\n\\n'" in message(vocab(), draft)


def test_extra_tokens_are_counted_and_named():
    draft = vocab()
    draft[K + "tokens"] = draft[K + "tokens"] + ["<pad>"]
    msg = message(vocab(), draft)
    assert "8 vs 9 tokens" in msg and "token 8 None vs '<pad>'" in msg


def test_changed_merge_is_caught():
    draft = vocab()
    draft[K + "merges"] = ["a b", "b a"]
    msg = message(vocab(), draft)
    assert "merges sha256" in msg and not re.search(r"token \d|tokens;", msg)


def test_changed_special_ids_are_caught():
    draft = vocab()
    draft[K + "eos_token_id"] = 0
    assert "eos id 1 vs 0" in message(vocab(), draft)
    draft = vocab()
    draft[K + "eot_token_id"] = 1
    assert "eot id None vs 1" in message(vocab(), draft)


def test_changed_pre_tokenizer_and_model_are_caught():
    draft = vocab()
    draft[K + "pre"], draft[K + "model"] = "llama-bpe", "llama"
    msg = message(vocab(), draft)
    assert "pre-tokenizer 'qwen2' vs 'llama-bpe'" in msg and "tokenizer model 'gpt2' vs 'llama'" in msg


def test_fingerprint_is_stable_and_short():
    fp = tokenizer_fingerprint(vocab())
    assert fp == tokenizer_fingerprint(copy.deepcopy(vocab()))
    assert len(fp["tokens"]) == 64 and fp["scores"] == "" and fp["n_tokens"] == 8


# ------------------------------------------------------------------------------------------ real models


@pytest.fixture(scope="module")
def meta(real_model):
    cache = {}

    def get(alias: str) -> dict:
        if alias not in cache:
            cache[alias] = read_gguf(real_model(alias)).metadata
        return cache[alias]

    return get


def test_qwen_half_billion_drafts_for_qwen_one_and_a_half(meta):
    check_compatible(meta("qwen2.5-coder-1.5b"), meta("qwen2.5-coder-0.5b"),
                     "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")


def test_smollm2_cannot_draft_for_qwen(meta):
    msg = message(meta("qwen2.5-coder-1.5b"), meta("smollm2-135m"))
    assert "pre-tokenizer 'qwen2' vs 'smollm'" in msg and "151936 vs 49152 tokens" in msg
    assert "token 0 '!' vs '<|endoftext|>'" in msg and "eos id 151645 vs 2" in msg


def test_gemma_cannot_draft_for_qwen(meta):
    msg = message(meta("qwen2.5-coder-1.5b"), meta("gemma-3-270m"))
    assert "tokenizer model 'gpt2' vs 'llama'" in msg and "151936 vs 262144 tokens" in msg
