"""The `jllm` command line. Flags follow llama.cpp's where they exist (-m, -p, -n, -c, --temp, --top-k ...).

Every user mistake ends as one line on stderr, `jllm: <what was wrong>`, and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import json
import sys

from jllm.errors import JllmError


def _model_args(p: argparse.ArgumentParser) -> None:
    from jllm.store import DEFAULT_TARGET

    p.add_argument("-m", "--model", default=DEFAULT_TARGET, help=f"alias or .gguf path (default {DEFAULT_TARGET})")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--precision", default=None, choices=["exact", "int8", "int8-fast", "bf16", "f16"],
                   help="compute representation (default: int8 on CPU, bf16 on CUDA)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens (default 4096)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--n-predict", type=int, default=256, help="max tokens to generate (default 256)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _params(a: argparse.Namespace):
    from jllm.sampling import SamplingParams

    return SamplingParams(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                          repeat_penalty=a.repeat_penalty, seed=a.seed, max_tokens=a.n_predict,
                          stop=tuple(a.stop))


def _engine(a: argparse.Namespace):
    from jllm.engine import Engine
    from jllm.store import resolve

    return Engine(str(resolve(a.model)), device=a.device, precision=a.precision, ctx_size=a.ctx_size,
                  threads=a.threads)


def cmd_generate(a: argparse.Namespace) -> int:
    params = _params(a)
    eng = _engine(a)
    ids = eng.chat_ids([{"role": "user", "content": a.prompt}]) if a.chat else eng.encode(a.prompt)
    if a.json:
        res = eng.generate(ids, params)
        print(json.dumps({"text": res.text, "token_ids": res.token_ids, "prompt_tokens": res.prompt_tokens,
                          "finish_reason": res.finish_reason, "timings": res.timings.as_dict()},
                         ensure_ascii=False))
        return 0
    from jllm.engine import Timings

    timings = Timings(load_ms=eng.load_ms)
    for piece in eng.stream(ids, params, timings):
        sys.stdout.write(piece.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    t = timings.as_dict()
    print(f"[prompt {t['prompt_tokens_evaluated']} tok, {t['prompt_tok_s']} tok/s | "
          f"decode {t['decode_tokens']} tok, {t['decode_tok_s']} tok/s]", file=sys.stderr)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    params = _params(a)
    eng = _engine(a)
    messages: list[dict] = []
    if a.system:
        messages.append({"role": "system", "content": a.system})
    print(f"jllm chat — {eng.model.cfg.name or a.model}. Ctrl-D or /exit to quit, /reset to start over.",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if a.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        parts = []
        try:
            for piece in eng.stream(eng.chat_ids(messages), params):
                sys.stdout.write(piece.text)
                sys.stdout.flush()
                parts.append(piece.text)
        except KeyboardInterrupt:
            pass
        except JllmError as e:          # e.g. the conversation outgrew the context: keep the session
            print(f"\njllm: {e} — /reset starts over", file=sys.stderr)
            messages.pop()
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(parts)})


def cmd_models(a: argparse.Namespace) -> int:
    from jllm.store import list_models, models_dir, pull

    if a.action == "pull":
        if not a.alias:
            raise JllmError("usage: jllm models pull ALIAS")
        print(pull(a.alias))
        return 0
    print(f"models directory: {models_dir()}")
    print(f"{'alias':<22} {'downloaded':<11} {'size':>10}  file")
    for m in list_models():
        size = f"{m['size'] / 2**20:.0f} MiB" if m.get("size") else "?"
        print(f"{m['alias']:<22} {'yes' if m['downloaded'] else 'no':<11} {size:>10}  {m['file_name']}")
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    from collections import Counter

    from jllm.gguf.reader import read_gguf
    from jllm.model.config import config_from_gguf
    from jllm.store import resolve

    g = read_gguf(resolve(a.file, progress=True))
    cfg = config_from_gguf(g.metadata, set(g.tensors), str(g.path))
    types = Counter(t.ggml_type.name for t in g.tensors.values())
    n_params = sum(t.n_elements for t in g.tensors.values())
    info = {
        "file": str(g.path), "size_bytes": g.size, "gguf_version": g.version, "name": cfg.name,
        "architecture": cfg.arch, "parameters": n_params, "layers": cfg.n_layers, "hidden": cfg.hidden,
        "ffn": cfg.ffn, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "context_length": cfg.context_length, "vocab_size": cfg.vocab_size,
        "tokenizer": g.metadata.get("tokenizer.ggml.model"), "pre_tokenizer": g.metadata.get("tokenizer.ggml.pre"),
        "tied_embeddings": cfg.tied_embeddings, "sliding_window": cfg.sliding_window,
        "chat_template": "tokenizer.chat_template" in g.metadata, "tensor_types": dict(types),
    }
    if a.json:
        print(json.dumps(info))
    else:
        for k, v in info.items():
            print(f"{k:<16} {v}")
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from jllm.bench import run_bench

    return run_bench(a)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jllm", description="Local LLM inference for GGUF models.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="complete a prompt")
    _model_args(g)
    _sampling_args(g)
    g.add_argument("-p", "--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as one user message in the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, ids and timings")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat")
    _model_args(c)
    _sampling_args(c)
    c.add_argument("--system", default=None, help="system message")
    c.set_defaults(func=cmd_chat)

    m = sub.add_parser("models", help="list model aliases; `models pull ALIAS` downloads one")
    m.add_argument("action", nargs="?", choices=["list", "pull"], default="list")
    m.add_argument("alias", nargs="?")
    m.set_defaults(func=cmd_models)

    i = sub.add_parser("inspect", help="show a GGUF file's architecture, tensor types, vocabulary")
    i.add_argument("file")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_inspect)

    b = sub.add_parser("bench", help="decode / prefill / batched-forward benchmark")
    _model_args(b)
    b.add_argument("--prompt-tokens", type=int, default=512)
    b.add_argument("--decode-tokens", type=int, default=64)
    b.add_argument("--max-k", type=int, default=8)
    b.add_argument("--repeats", type=int, default=5)
    b.add_argument("--json", default=None, help="also write results to this JSON file")
    b.add_argument("--llamacpp", default=None, metavar="BIN_DIR",
                   help="also run llama.cpp's llama-bench from BIN_DIR on the same file, side by side")
    b.add_argument("--perplexity", default=None, metavar="FILE", help="measure perplexity on FILE instead")
    b.add_argument("--ppl-tokens", type=int, default=1024, help="tokens of FILE for --perplexity")
    b.set_defaults(func=cmd_bench)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except JllmError as e:
        print(f"jllm: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
