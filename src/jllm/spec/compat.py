"""The draft/target tokenizer gate, checked once when a draft model is loaded.

A draft can only propose tokens the target reads the same way: same tokenizer model and pre-tokenizer, the
same token list (id for id), the same merges (BPE) or scores (SentencePiece), the same bos/eos/eot ids.
Lists are compared by sha256 fingerprints; only when the tokens differ is the list walked to name the first
differing id. Allowed: anything outside the tokenizer metadata, e.g. embedding or output rows padded beyond
the vocabulary (the tensors' row counts are never looked at), or a different chat template (the target's is
used). Token types are not compared: the draft reads and writes ids, it never tokenizes text itself.
"""

from __future__ import annotations

import hashlib
import json

from jllm.errors import JllmError

_SPECIAL_IDS = ("bos", "eos", "eot")


def _sha256(values) -> str:
    """json keeps the list unambiguous (tokens may hold newlines); 25 ms for 151,936 tokens."""
    return hashlib.sha256(json.dumps(values).encode()).hexdigest() if values else ""


def tokenizer_fingerprint(meta: dict) -> dict:
    """meta: a GGUF's metadata -> what the tokenizer is made of, lists reduced to sha256 hex digests."""
    key = "tokenizer.ggml."
    tokens = meta.get(key + "tokens") or []
    return {
        "model": meta.get(key + "model"),
        "pre": meta.get(key + "pre"),
        "n_tokens": len(tokens),
        "tokens": _sha256(tokens),
        "merges": _sha256(meta.get(key + "merges")),
        "scores": _sha256(meta.get(key + "scores")),
        **{f"{s}_id": meta.get(f"{key}{s}_token_id") for s in _SPECIAL_IDS},
    }


def _first_token_difference(a: list[str], b: list[str]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"token {i} {x!r} vs {y!r}"
    i = min(len(a), len(b))                              # one list extends the other
    return f"token {i} {(a[i] if i < len(a) else None)!r} vs {(b[i] if i < len(b) else None)!r}"


def check_compatible(target_meta: dict, draft_meta: dict, target_name: str, draft_name: str) -> None:
    """Raise JllmError naming every tokenizer difference (target's value first) unless the draft may draft."""
    t, d = tokenizer_fingerprint(target_meta), tokenizer_fingerprint(draft_meta)
    diffs = []
    for field, label in (("model", "tokenizer model"), ("pre", "pre-tokenizer")):
        if t[field] != d[field]:
            diffs.append(f"{label} {t[field]!r} vs {d[field]!r}")
    if t["n_tokens"] != d["n_tokens"]:
        diffs.append(f"{t['n_tokens']} vs {d['n_tokens']} tokens")
    if t["tokens"] != d["tokens"]:
        diffs.append(_first_token_difference(target_meta["tokenizer.ggml.tokens"],
                                             draft_meta["tokenizer.ggml.tokens"]))
    for field in ("merges", "scores"):
        if t[field] != d[field]:
            diffs.append(f"{field} sha256 {t[field][:12] or 'none'} vs {d[field][:12] or 'none'}")
    for s in _SPECIAL_IDS:
        if t[f"{s}_id"] != d[f"{s}_id"]:
            diffs.append(f"{s} id {t[f'{s}_id']} vs {d[f'{s}_id']}")
    if diffs:
        raise JllmError(f"draft model {draft_name} cannot draft for {target_name}, their tokenizers differ "
                        f"({target_name} vs {draft_name}): {'; '.join(diffs)}; "
                        f"choose a draft from the target's model family, with the same tokenizer")


def check_draft(target, draft) -> None:
    """Refuse (JllmError, one line) a draft that cannot draft for this target, from the two files' headers
    (jllm.gguf.reader.GGUFFile): a draft model's tokenizer (check_compatible), or everything an EAGLE-3 head
    depends on (eagle3.format.check_target). The engine runs it before any weights load; `jllm plan` too."""
    from jllm.eagle3.format import check_target, is_head, read_d2t, read_head_config
    from jllm.model.config import config_from_gguf

    if is_head(draft):
        cfg = config_from_gguf(target.metadata, set(target.tensors), str(target.path))
        check_target(read_head_config(draft), draft, cfg, target, read_d2t(draft))
    else:
        check_compatible(target.metadata, draft.metadata, target.path.name, draft.path.name)
