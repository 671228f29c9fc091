"""The `jllm` command line. Flags follow llama.cpp's where they exist (-m, -p, -n, -c, --temp, --top-k ...).

Every user mistake ends as one line on stderr, `jllm: <what was wrong>`, and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import codecs
import errno
import json
import os
import sys
import time

from jllm import console
from jllm.errors import JllmError
from jllm.paths import check_writable
from jllm.spec import DRAFT_MAX, DRAFT_MIN, LEAF_P, P_MIN
from jllm.tokenizer.unicode import well_formed


def _model_args(p: argparse.ArgumentParser) -> None:
    from jllm.catalog import DEFAULT_TARGET

    p.add_argument("-m", "--model", default=DEFAULT_TARGET, help=f"alias or .gguf path (default {DEFAULT_TARGET})")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--precision", default=None,
                   choices=["exact", "native", "native4", "int8", "int8-fast", "bf16", "f16", "blocks"],
                   help="compute representation (default: native on CPUs with AVX-512 VNNI or AVX2, else int8; "
                        "on CUDA blocks, the GGUF's own quant blocks, where triton is installed, else bf16)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens (default 4096)")
    p.add_argument("--mem-limit", type=parse_size, default=None,
                   help="refuse to load a configuration whose planned memory exceeds this (see jllm plan)")


def _sampler_flags(p: argparse.ArgumentParser, temp_help: str = "temperature; 0 = greedy (default)",
                   when: str | None = None) -> None:
    """--temp, --top-k, --top-p, --min-p: generation's and bench's (`when` says when bench reads them)."""
    p.add_argument("--temp", type=float, default=0.0, help=temp_help)
    for flag, kind, default in (("--top-k", int, 0), ("--top-p", float, 1.0), ("--min-p", float, 0.0)):
        p.add_argument(flag, type=kind, default=default, help=when)


def _sampling_args(p: argparse.ArgumentParser, n_predict: int | None = 256) -> None:
    default = ("-1 with a chat template, 256 for a base model" if n_predict is None else str(n_predict))
    p.add_argument("-n", "--n-predict", type=int, default=n_predict,
                   help=f"max tokens to generate; -1: until the end of the answer or a full context (default "
                        f"{default})")
    _sampler_flags(p)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _params(a: argparse.Namespace):
    from jllm.sampling import SamplingParams

    _check_ctx_size(a)                        # before -n -1's budget is taken from it
    if a.n_predict is not None and a.n_predict < -1:
        raise JllmError(f"-n/--n-predict must be -1 (until the answer ends or the context is full) or a count of "
                        f"tokens (got {a.n_predict})")
    return SamplingParams(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                          repeat_penalty=a.repeat_penalty, seed=a.seed,
                          max_tokens=a.n_predict if a.n_predict is not None and a.n_predict >= 0
                          else a.ctx_size,                                   # -1: the context bounds it
                          stop=tuple(a.stop))


def _engine(a: argparse.Namespace, kv_cache: bool = False, default_head: bool = False):
    """default_head (chat, serve): with no -md, the head shipped for this target drafts on the CPU and on a GPU
    in the blocks precision (the kernels it is made for there), unless --spec or JLLM_SPEC_DECODE turn
    speculation off or to n-grams."""
    from jllm.engine import Engine
    from jllm.catalog import default_head as head_for, needs_download, resolve

    kv_dir = str(_cache_dir(a)) if kv_cache else None
    _check_sizes(a)
    url = getattr(a, "kv_store", None)
    if url is not None:                         # a bad URL fails before any download or load
        from jllm.cache.shared import check_url

        check_url(url)
        if not kv_cache:
            raise JllmError("--kv-store shares the persistent KV cache between servers; drop --no-kv-cache")
    if default_head and a.draft_model is None and a.spec in (None, "auto", "draft", "draft+ngram") and \
            os.environ.get("JLLM_SPEC_DECODE") != "0":
        from jllm.model.loader import default_precision, resolve_device

        dev = resolve_device(a.device)
        if dev.type == "cpu" or (a.precision or default_precision(dev)) == "blocks":
            a.draft_model = head_for(a.model)
    spec = _spec_config(a)
    draft = getattr(a, "draft_model", None) if spec is None or spec.mode != "none" else None   # --spec none: unused
    if a.device == "cpu" and a.precision in (None, "native", "native4") and \
            any(needs_download(m) for m in (a.model, draft) if m):
        from jllm.kernels import build_in_background

        build_in_background()                   # a first start: compile while the models download
    if a.mem_limit is not None:                 # (the machine's own memory the engine checks itself)
        from jllm.plan import check_limit, plan

        check_limit(plan(str(resolve(a.model)), str(resolve(draft)) if draft else None, a.ctx_size, _precision(a)),
                    a.mem_limit)
    return Engine(str(resolve(a.model)), device=a.device, precision=a.precision, ctx_size=a.ctx_size,
                  threads=a.threads, kv_store_dir=kv_dir, kv_store_bytes=getattr(a, "cache_size", 1 << 30),
                  draft_path=str(resolve(draft)) if draft else None, spec=spec,
                  kv_store_url=url,
                  kv_store_shared_bytes=getattr(a, "kv_store_size", 4 << 30))


def _check_ctx_size(a: argparse.Namespace) -> None:
    if a.ctx_size < 1:
        raise JllmError(f"-c/--ctx-size must be at least 1 (got {a.ctx_size})")


def _check_sizes(a: argparse.Namespace) -> None:
    _check_ctx_size(a)
    if a.threads is not None and a.threads < 1:
        raise JllmError(f"-t/--threads must be at least 1 (got {a.threads})")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if a.threads is not None and cores and a.threads > cores:
        console.warn(f"-t {a.threads} is more threads than the {cores} cores this process may use: slower, "
                     f"not faster")


def _precision(a: argparse.Namespace) -> str:
    from jllm.model.loader import default_precision, resolve_device

    return a.precision or default_precision(resolve_device(a.device))


def _spec_config(a: argparse.Namespace):
    """--spec, or JLLM_SPEC_DECODE=1|0 as the default; with a draft model, speculation is on unless turned off."""
    from jllm.spec.config import SpecConfig

    if not hasattr(a, "spec"):
        return None
    mode = a.spec
    if mode is None:
        env = os.environ.get("JLLM_SPEC_DECODE")
        if env not in (None, "", "0", "1"):
            raise JllmError(f"JLLM_SPEC_DECODE must be 1 or 0, not {env!r}")
        on = env == "1" if env in ("0", "1") else bool(a.draft_model)
        mode = "auto" if on else "none"
    _check_spec_values(a, mode, "--spec")
    return SpecConfig(mode=mode, draft_max=a.draft_max, draft_min=a.draft_min, p_min=a.draft_p_min,
                      leaf_p=a.draft_leaf_p, tree_width=a.draft_tree)


def _check_spec_values(a: argparse.Namespace, mode: str | None, mode_flag: str) -> None:
    """The speculation settings generation and bench share: a mode that needs a draft model has one, the draft
    bounds and probabilities are in range, a tree width is one."""
    from jllm.spec.config import check_tree

    if mode in ("draft", "draft+ngram") and not a.draft_model:
        raise JllmError(f"{mode_flag} {mode} needs a draft model (-md/--draft-model)")
    if a.draft_min < 1 or a.draft_max < a.draft_min:
        raise JllmError(f"need 1 <= --draft-min <= --draft-max (got {a.draft_min}, {a.draft_max})")
    for flag, v in (("--draft-p-min", a.draft_p_min), ("--draft-leaf-p", a.draft_leaf_p)):
        if not 0.0 <= v <= 1.0:
            raise JllmError(f"{flag} must be between 0 and 1 (got {v})")
    check_tree(a.draft_tree)


def _spec_args(p: argparse.ArgumentParser) -> None:
    from jllm.spec.config import MODES

    p.add_argument("-md", "--draft-model", default=None, help="draft model (alias or .gguf) for speculative "
                   "decoding; must share the target's tokenizer")
    p.add_argument("--spec", default=None, choices=MODES, help="speculation: auto (draft+ngram with a draft "
                   "model, else ngram), draft, ngram, draft+ngram, none (default: on with -md, or per "
                   "JLLM_SPEC_DECODE=1|0)")
    p.add_argument("--draft-max", type=int, default=DRAFT_MAX,
                   help=f"most tokens drafted per round (default {DRAFT_MAX})")
    p.add_argument("--draft-min", type=int, default=DRAFT_MIN,
                   help=f"fewest tokens drafted per round (default {DRAFT_MIN})")
    p.add_argument("--draft-p-min", type=float, default=P_MIN,
                   help="draft on while the product of the draft's probabilities of its tokens stays above this "
                   f"(default {P_MIN})")
    p.add_argument("--draft-leaf-p", type=float, default=LEAF_P,
                   help="greedy: also verify the draft's second choice where its least confident token's "
                   f"probability is below this, in the same pass (default {LEAF_P}; 0: never)")
    p.add_argument("--draft-tree", type=int, default=0, metavar="W",
                   help="greedy with an EAGLE-3 head: draft a tree, each expanded node's W best children, where "
                   "verify rows pay for them, instead of a chain with a side leaf (default 0: a chain; "
                   "BENCHMARKS.md measures it)")


def _cache_dir(a: argparse.Namespace):
    from pathlib import Path

    from jllm.cache.conversations import default_cache_dir

    d = Path(a.cache_dir) if getattr(a, "cache_dir", None) else default_cache_dir()
    if d.exists() and not d.is_dir():
        raise JllmError(f"the KV cache directory {d} is not a directory (--cache-dir, or JLLM_CACHE_DIR)")
    blocker = next((p for p in d.absolute().parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise JllmError(f"the KV cache directory {d} cannot be made: {blocker} is a file, not a directory "
                        f"(--cache-dir, or JLLM_CACHE_DIR)")
    return d


def parse_size(text: str) -> int:
    """'1073741824', '1G', '512M', '64k' (binary units) -> bytes."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        value = int(float(num) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (use bytes or a suffix: 512M, 1G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: negative")
    return value


def _cache_args(p: argparse.ArgumentParser, shared: bool = False) -> None:
    """The local KV cache's options; `shared` (chat, serve, cache): also the Redis tier's."""
    p.add_argument("--cache-dir", default=None, help="persistent KV cache directory "
                   "(default: $JLLM_CACHE_DIR or the user cache dir)")
    p.add_argument("--cache-size", type=parse_size, default=1 << 30, help="KV cache size cap (default 1G)")
    if shared:
        p.add_argument("--kv-store", default=None, metavar="URL", help="a Redis shared by several jllm servers "
                       "behind the local KV cache: redis://[:PASSWORD@]HOST:PORT/DB, rediss:// for TLS")
        p.add_argument("--kv-store-size", type=parse_size, default=4 << 30, metavar="SIZE",
                       help="the shared KV store's cap (default 4G; jllm's own LRU across replicas)")


def cmd_generate(a: argparse.Namespace) -> int:
    params = _params(a)
    eng = _engine(a)
    ids = eng.chat_ids([{"role": "user", "content": a.prompt}]) if a.chat else eng.encode(a.prompt)
    if a.json:
        res = eng.generate(ids, params)
        out = {"text": res.text, "token_ids": res.token_ids, "prompt_tokens": res.prompt_tokens,
               "finish_reason": res.finish_reason, "timings": res.timings.as_dict()}
        if res.spec_stats is not None:
            out["spec"] = res.spec_stats.as_dict()
        print(json.dumps(out, ensure_ascii=False))
        return 0
    from jllm.engine import Timings

    timings = Timings(load_ms=eng.load_ms)
    for piece in eng.stream(ids, params, timings):
        console.answer(piece.text)
    console.end_answer()
    t = timings.as_dict()
    print(f"[prompt {t['prompt_tokens_evaluated']} tok, {t['prompt_tok_s']} tok/s | "
          f"decode {t['decode_tokens']} tok, {t['decode_tok_s']} tok/s]", file=sys.stderr)
    return 0


def _timings_line(t: dict) -> str:
    return (f"[prompt {t['prompt_tokens_evaluated']} tok evaluated, {t['cached_tokens']} cached, "
            f"{t['prompt_tok_s']} tok/s | decode {t['decode_tokens']} tok, {t['decode_tok_s']} tok/s]")


def cmd_chat(a: argparse.Namespace) -> int:
    """Interactive chat, or one turn of a stored conversation with -p (non-interactive)."""
    import time

    from jllm.cache.conversations import History
    from jllm.engine import Timings

    if a.prompt is not None and not a.prompt.strip():
        raise JllmError("the message (-p) is empty")
    if a.json and a.prompt is None:
        raise JllmError("--json prints one turn's result: it needs -p MESSAGE")
    params = _params(a)
    cache_dir = _cache_dir(a)
    conv_id = a.conversation          # a new chat gets its own id, so each turn replaces one cache entry
    if conv_id is None:
        conv_id = f"chat-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    history = History(cache_dir, conv_id) if conv_id else None   # saves merge turns of other processes
    messages = history.messages if history else []
    resumed = sum(m["role"] == "user" for m in messages)
    if a.system and not messages:
        messages.append({"role": "system", "content": a.system})
    elif a.system:
        began = next((m["content"] for m in messages if m["role"] == "system"), None)
        if a.system != began:
            how = "without a system message, as it began" if began is None else "with the system message it began with"
            console.warn(f"conversation {conv_id} goes on {how}; --system is not applied (/reset, or a new "
                         f"--conversation, starts over)")
    eng = _engine(a, kv_cache=not a.no_kv_cache, default_head=True)
    if a.n_predict is None:                     # a base model rarely ends its turn: it would fill the context
        a.n_predict = 256 if eng.chat_template.is_builtin else -1
        params = _params(a)

    def turn(text: str, echo: bool):
        """-> (the reply, its token ids, the Generation: finish reason, statistics, timings)."""
        messages.append({"role": "user", "content": text})
        parts, ids = [], []
        try:
            prompt = eng.chat_ids(messages)
            if len(prompt) >= eng.ctx_size:       # the history fills the context, not this message alone
                way_out = "" if a.prompt is None else (f"; `jllm cache rm {conv_id}` forgets it, or a new "
                                                       "--conversation starts afresh")
                raise JllmError(f"the conversation with this message is {len(prompt)} tokens, more than the context "
                                f"of {eng.ctx_size} holds (raise -c/--ctx-size{way_out})")
            run = eng.stream(prompt, params, Timings(load_ms=eng.load_ms), conv_id=conv_id)
            for piece in run:
                if echo:
                    console.answer(piece.text)
                parts.append(piece.text)
                if piece.token_id >= 0:
                    ids.append(piece.token_id)
        except KeyboardInterrupt:                 # Ctrl-C: an answer begun is kept as far as it got, with its question
            if not "".join(parts).strip():
                messages.pop()
                raise
            try:
                keep("".join(parts))
            except KeyboardInterrupt:             # a second Ctrl-C: the file keeps the turns before this one
                console.warn(f"conversation {conv_id}: this turn was not saved (interrupted)")
            raise
        except BaseException:
            messages.pop()
            raise
        reply = "".join(parts)
        keep(reply)
        return reply, ids, run

    def keep(reply: str) -> None:
        messages.append({"role": "assistant", "content": reply})
        if history:                               # a failure (a full disk) is one warning: the reply stays
            history.save()

    base_note = (f"note: {eng.gguf.path.name} carries no chat template, as base (pretrained) models do: it "
                 "continues text rather than answering, so answers stop at 256 tokens unless -n says otherwise (try "
                 "an instruct model; `jllm models` marks them)")
    if a.prompt is not None:                      # one turn, then exit
        if eng.chat_template.is_builtin:
            print(base_note, file=sys.stderr)
        reply, ids, run = turn(a.prompt, echo=not a.json)
        eng.wait_saves()
        if a.json:
            out = {"conversation": conv_id, "text": reply, "token_ids": ids, "finish_reason": run.finish_reason,
                   "turn": sum(m["role"] == "user" for m in messages), "timings": run.timings.as_dict()}
            if run.spec_stats is not None:
                out["spec"] = run.spec_stats.as_dict()
            print(json.dumps(out, ensure_ascii=False))
        else:
            console.end_answer()
            _after_reply(a, eng, run, ids, verbose=True)
        return 0

    name = eng.model.cfg.name or a.model
    print(f"jllm chat — {name}" + (f", conversation {conv_id}" if conv_id else "") +
          ". /help lists the commands, Ctrl-D or /exit quits.", file=sys.stderr)
    if eng.chat_template.is_builtin:
        print(base_note, file=sys.stderr)
    if resumed:
        print(f"(resumed conversation {conv_id}: {resumed} earlier turn{'s' * (resumed != 1)})", file=sys.stderr)
    while True:
        try:
            if sys.stdin is None:                 # started with stdin closed: as at the end of input
                raise EOFError
            line = well_formed(input("> "))
        except EOFError:
            print(file=sys.stderr)
            break
        command = line.strip()
        if command in ("/exit", "/quit"):
            break
        if command in ("/help", "/?"):
            print(CHAT_HELP, file=sys.stderr)
            continue
        if command.startswith("/") and command[1:].isalpha() and command != "/reset":
            print(f"unknown command {command} (/help lists them)", file=sys.stderr)
            continue
        if command == "/reset":
            had = any(m["role"] == "user" for m in messages)
            messages[:] = messages[:1] if messages and messages[0]["role"] == "system" else []
            if had and a.conversation:            # a named conversation's history is on disk: say what goes
                print(f"(conversation {conv_id} starts over: its saved turns are replaced at the next reply)",
                      file=sys.stderr)
            continue
        if not line.strip():
            continue
        before = len(messages)
        try:
            _, ids, run = turn(line, echo=True)
        except KeyboardInterrupt:
            console.end_answer()
            print("[stopped: the question and the answer so far are kept]" if len(messages) > before else
                  "[stopped before the answer began: the question is not kept]", file=sys.stderr)
            continue
        except JllmError as e:          # e.g. the conversation outgrew the context: keep the session
            print(f"\njllm: {e} — /reset starts over", file=sys.stderr)
            continue
        console.end_answer()
        _after_reply(a, eng, run, ids, verbose=a.verbose)
    eng.wait_saves()
    return 0


CHAT_HELP = """commands:
  /help    this list
  /reset   start the conversation over (the system message stays)
  /exit    quit (also /quit, or Ctrl-D); Ctrl-C stops an answer
anything else is sent to the model"""


def _after_reply(a: argparse.Namespace, eng, run, ids: list[int], verbose: bool) -> None:
    """What follows a reply (run: its Generation) on stderr: a line when a limit cut it, and with verbose its
    statistics."""
    lines = []
    if run.finish_reason == "length":
        if a.n_predict >= 0 and len(ids) >= a.n_predict:
            lines.append(f"[answer cut at the -n limit of {a.n_predict} tokens]")
        else:
            over = "/reset starts over" if a.prompt is None else "a new --conversation starts afresh"
            lines.append(f"[answer cut: the context of {eng.ctx_size} tokens is full; {over}, a larger -c makes "
                         f"room]")
    if verbose:
        line = _timings_line(run.timings.as_dict())
        st = run.spec_stats.as_dict() if run.spec_stats is not None else None
        if st and st["drafted"]:
            leaves = f", {st['leaves_taken']}/{st['leaves']} side leaves taken" if st.get("leaves") else ""
            line += (f" [speculation: {st['accepted']}/{st['drafted']} drafts accepted "
                     f"({100 * st['acceptance_rate']:.0f} %){leaves}, {st['tokens_per_verify']} tokens a target "
                     f"pass]")
        lines.append(line)
    dim = sys.stderr.isatty()
    for line in lines:
        print(f"\033[2m{line}\033[0m" if dim else line, file=sys.stderr)


CACHE_USAGE = "jllm cache {ls,rm ID...,clear,stats} [--cache-dir DIR] [--cache-size SIZE] [--kv-store URL]"


def _print_entries(rows: list[dict]) -> None:
    print(f"{'entry':<40} {'tokens':>7} {'MiB':>8}  last used")
    for e in sorted(rows, key=lambda e: -e["last_used"]):
        print(f"{e['name']:<40} {e['tokens']:>7} {e['bytes'] / 2**20:>8.1f}  "
              f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e['last_used']))}")


def cmd_cache(a: argparse.Namespace) -> int:
    from jllm.cache.store import KVStore, LockError, check_conversation_id

    if a.action is None:
        raise JllmError(f"usage: {CACHE_USAGE}")
    if a.action == "rm" and not a.ids:
        raise JllmError("usage: jllm cache rm ID [ID ...]")
    if a.action != "rm" and a.ids:
        raise JllmError(f"`cache {a.action}` takes no ids (usage: {CACHE_USAGE})")
    for conv in a.ids:                          # a bad id refuses the command before anything is removed
        check_conversation_id(conv)
    cache_dir = _cache_dir(a)
    shared = None
    if a.kv_store is not None:                  # the Redis tier too (its calls warn and miss while it is down)
        from jllm.cache.shared import RedisTier

        shared = RedisTier(a.kv_store, max_bytes=a.kv_store_size)
    if not cache_dir.exists() and shared is None:   # looking must not create it
        if a.action == "rm":
            raise JllmError(f"no such conversation: {', '.join(a.ids)} (no KV cache at {cache_dir})")
        print(f"no KV cache at {cache_dir} (nothing stored yet)")
        return 0
    try:
        return _cache_action(a, cache_dir, KVStore(cache_dir, max_bytes=a.cache_size), shared)
    except LockError as e:                      # not "nothing is cached": this command caches nothing
        raise JllmError(f"{e.problem}; `cache {a.action}` cannot run until it is {e.fix}") from None


def _cache_action(a: argparse.Namespace, cache_dir, store, shared) -> int:
    from jllm.cache.conversations import clear_temps, list_conversations, remove_messages

    if a.action == "ls":
        rows = store.entries()
        convs = set(list_conversations(cache_dir))
        _print_entries(rows)
        only_msgs = sorted(convs - {e["name"] for e in rows})
        if only_msgs:
            print(f"conversations without a cached KV state: {', '.join(only_msgs)}")
        if shared is not None:
            print(f"shared ({shared.where}):")
            _print_entries(shared.entries())
    elif a.action == "rm":                      # the ones there are removed; the missing ones are an error
        missing = []
        for conv in a.ids:
            if store.remove(conv) | remove_messages(cache_dir, conv) | (shared is not None and shared.remove(conv)):
                print(f"removed: {conv}")
            else:
                missing.append(conv)
        if missing:
            raise JllmError(f"no such conversation: {', '.join(missing)} (`jllm cache ls` lists them)")
    elif a.action == "clear":
        n = store.clear()
        clear_temps(cache_dir)                  # histories stay; their dead writers' temp files go
        print(f"removed {n} cached state{'s' * (n != 1)}")
        if shared is not None:
            m = shared.clear()
            print(f"removed {m} cached state{'s' * (m != 1)} from {shared.where}")
    else:
        st = store.stats()
        if shared is not None:
            st["shared"] = shared.stats()
        for k, v in st.items():
            print(f"{k:<12} {v}")
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    """An OpenAI-compatible HTTP server over one engine (jllm/server/app.py), until Ctrl-C."""
    import logging

    from jllm.catalog import ALIASES

    if not 0 <= a.port <= 65535:
        raise JllmError(f"--port must be in 0..65535, got {a.port}")
    if a.api_key is not None and not a.api_key.strip():
        raise JllmError("--api-key is empty (leave it out to serve without a key)")
    import uvicorn

    from jllm.server import create_app

    sock = _listen(a.host, a.port)              # before the model loads: a taken port fails at once
    eng = _engine(a, kv_cache=not a.no_kv_cache, default_head=True)
    path = eng.gguf.path
    name = a.model if a.model in ALIASES else path.stem
    aliases = {a.model, path.name, path.stem, eng.model.cfg.name or path.stem}
    app = create_app(eng, name, api_key=a.api_key, aliases=aliases, strict_model=a.strict_model)
    server_log = logging.getLogger("jllm.server")
    if not server_log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        server_log.addHandler(handler)
        server_log.setLevel(logging.INFO)
        server_log.propagate = False
    cache = f"KV cache {eng.kv_store.dir}" if eng.kv_store is not None else "no persistent KV cache"
    spec = f"speculation {eng.spec.mode}" if eng.spec is not None else "no speculation"
    port = sock.getsockname()[1]
    print(f"jllm serve: {name} at http://{a.host}:{port}/v1 ({cache}, {spec}"
          f"{', API key required' if a.api_key else ''}); Ctrl-C stops", file=sys.stderr)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="info")).run(sockets=[sock])
    except KeyboardInterrupt:                   # uvicorn re-raises Ctrl-C once it has shut down
        pass
    return 0


def _listen(host: str, port: int):
    """A listening TCP socket on host:port, or a one-line error (unknown host, port taken, no permission)."""
    import socket

    sock = None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        if sock is not None:
            sock.close()
        raise JllmError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def cmd_models(a: argparse.Namespace) -> int:
    from jllm.catalog import list_models, models_dir, pull

    if a.action == "pull":
        if not a.alias:
            raise JllmError("usage: jllm models pull ALIAS")
        print(pull(a.alias))
        return 0
    print(f"models directory: {models_dir()}")
    print(f"{'alias':<26} {'kind':<9} {'downloaded':<11} {'size':>10}  file")
    for m in list_models():
        size = f"{m['size'] / 2**20:.0f} MiB" if m.get("size") else "?"
        have = "shipped" if m["bundled"] else "yes" if m["downloaded"] else "no"
        print(f"{m['alias']:<26} {m['kind']:<9} {have:<11} {size:>10}  {m['file_name']}")
    print("base: a pretrained model without chat tuning; it continues text (jllm generate) and makes a poor chat")
    print("head: an EAGLE-3 draft head, shipped inside jllm; chat and serve use it for its target unless -md or "
          "--spec say otherwise")
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    from collections import Counter

    from jllm.gguf.reader import read_gguf
    from jllm.model.config import config_from_gguf
    from jllm.catalog import resolve

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


def _check_bench(a: argparse.Namespace) -> None:
    """Every bench setting that can be wrong, refused in one line before a model loads."""
    from pathlib import Path

    _check_sizes(a)
    at_least = [("--prompt-tokens", a.prompt_tokens, 1), ("--decode-tokens", a.decode_tokens, 1),
                ("--max-k", a.max_k, 1), ("--repeats", a.repeats, 1), ("--ppl-tokens", a.ppl_tokens, 2)]
    if a.spec_corpus:
        at_least += [("-n/--n-predict", a.n_predict, 1)] + ([("--limit", a.limit, 1)] if a.limit is not None else [])
        _check_spec_values(a, a.spec_mode, "--spec-mode")
    if a.multiturn:
        at_least += [("--conversations", a.conversations, 1), ("-n/--n-predict", a.n_predict, 1)]
        if not 1 <= a.first_tokens <= MULTITURN_FIRST_MAX:
            raise JllmError(f"--first-tokens must be between 1 and {MULTITURN_FIRST_MAX} (the turns run at a "
                            f"4,096-token context; got {a.first_tokens})")
    for flag, v, low in at_least:
        if v < low:
            raise JllmError(f"{flag} must be at least {low} (got {v})")
    if a.perplexity:
        try:                                       # its start is what is measured: that much must be text
            with open(a.perplexity, "rb") as f:
                codecs.getincrementaldecoder("utf-8")().decode(f.read(1 << 20), final=False)
        except (OSError, UnicodeDecodeError) as e:
            raise JllmError(f"--perplexity {a.perplexity}: cannot read it as UTF-8 text "
                            f"({getattr(e, 'strerror', None) or e.__class__.__name__})") from None
    if a.llamacpp and not (Path(a.llamacpp) / "llama-bench").is_file():
        raise JllmError(f"--llamacpp: {Path(a.llamacpp) / 'llama-bench'} not found (build it with "
                        f"../shared/tools/build_llamacpp.sh)")
    if a.json:                                     # fail before the benchmark runs, not after
        try:
            check_writable(a.json)
        except OSError as e:
            raise JllmError(f"--json {a.json}: cannot write there ({e.strerror or e})") from None


MULTITURN_FIRST_MAX = 3584        # jllm.cache.bench's turns run at -c 4096, with room for the reply


def cmd_bench(a: argparse.Namespace) -> int:
    _check_bench(a)
    if a.spec_corpus:
        from jllm.spec import bench as spec_bench

        return spec_bench.run(a)
    if a.multiturn:
        from jllm.cache import bench as cache_bench

        return cache_bench.run(a)
    from jllm.bench import run_bench

    return run_bench(a)


def cmd_train_head(a: argparse.Namespace) -> int:
    """Everything after `train-head` goes to jllm.train.head, which has its own options."""
    from jllm.train.head import main as train_main

    return train_main(list(a.args))


def cmd_plan(a: argparse.Namespace) -> int:
    from jllm.plan import check_limit, plan, print_plan
    from jllm.catalog import resolve

    _check_sizes(a)
    rows = plan(str(resolve(a.model)), str(resolve(a.draft_model)) if a.draft_model else None, a.ctx_size,
                _precision(a))
    print_plan(rows, a.ctx_size)
    check_limit(rows, a.mem_limit)                # --mem-limit: fail if the total exceeds it
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jllm", description="Local LLM inference for GGUF models.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="complete a prompt")
    _model_args(g)
    _sampling_args(g)
    _spec_args(g)
    g.add_argument("-p", "--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as one user message in the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, ids and timings")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="multi-turn chat: interactive, or one turn with -p (kept by --conversation)")
    _model_args(c)
    _sampling_args(c, n_predict=None)
    _cache_args(c, shared=True)
    _spec_args(c)
    c.add_argument("--system", default=None, help="system message (for a new conversation)")
    c.add_argument("--conversation", default=None, metavar="ID", help="conversation to continue or start")
    c.add_argument("-p", "--prompt", default=None, help="run one turn with this user message and exit")
    c.add_argument("--json", action="store_true", help="with -p: print one JSON object")
    c.add_argument("-v", "--verbose", action="store_true", help="after each reply: tokens, speed, speculation")
    c.add_argument("--no-kv-cache", action="store_true", help="keep the conversation but evaluate the whole "
                   "history (no persistent KV state)")
    c.set_defaults(func=cmd_chat)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, "
                        "/v1/models, /health, /metrics")
    _model_args(sv)
    _cache_args(sv, shared=True)
    _spec_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    sv.add_argument("--api-key", default=os.environ.get("JLLM_API_KEY"),
                    help="require `Authorization: Bearer KEY` on /v1/* and /metrics (default: $JLLM_API_KEY)")
    sv.add_argument("--no-kv-cache", action="store_true", help="no persistent KV cache (in-memory prefix "
                    "reuse only)")
    sv.add_argument("--strict-model", action="store_true", help="refuse requests whose `model` is not this "
                    "model's alias, file name or \"default\" (by default any name is served by the loaded model)")
    sv.set_defaults(func=cmd_serve)

    k = sub.add_parser("cache", help="the persistent KV cache: ls | rm ID... | clear | stats", usage=CACHE_USAGE,
                       description="ls: the cached states and the conversations; rm ID...: forget conversations "
                       "(their cached states and their histories); clear: drop every cached state (the histories "
                       "stay, their next turns recompute); stats: sizes and counts")
    k.add_argument("action", nargs="?", choices=["ls", "rm", "clear", "stats"])
    k.add_argument("ids", nargs="*", metavar="ID", help="conversations to forget (rm only): state and history")
    _cache_args(k, shared=True)
    k.set_defaults(func=cmd_cache)

    m = sub.add_parser("models", help="list model aliases; `models pull ALIAS` downloads one")
    m.add_argument("action", nargs="?", choices=["list", "pull"], default="list")
    m.add_argument("alias", nargs="?")
    m.set_defaults(func=cmd_models)

    pl = sub.add_parser("plan", help="memory budget of a configuration: weights, KV pools, scratch, total")
    _model_args(pl)
    pl.add_argument("-md", "--draft-model", default=None)
    pl.set_defaults(func=cmd_plan)

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
    b.add_argument("--spec", dest="spec_corpus", action="store_true",
                   help="speculative decoding on the prompt corpus: plain vs speculative, per category")
    b.add_argument("-md", "--draft-model", default=None, help="draft model for --spec")
    b.add_argument("--spec-mode", default=None, choices=["auto", "draft", "ngram", "draft+ngram"])
    b.add_argument("--draft-max", type=int, default=DRAFT_MAX)
    b.add_argument("--draft-min", type=int, default=DRAFT_MIN)
    b.add_argument("--draft-p-min", type=float, default=P_MIN)
    b.add_argument("--draft-leaf-p", type=float, default=LEAF_P)
    b.add_argument("--draft-tree", type=int, default=0, metavar="W")
    b.add_argument("-n", "--n-predict", type=int, default=128, help="tokens per prompt for --spec")
    b.add_argument("--limit", type=int, default=None, help="only the first N corpus prompts")
    _sampler_flags(b, "--spec: sample at this temperature in both runs (0: greedy, the default, where the "
                   "outputs must be identical)", when="--spec with --temp")
    b.add_argument("--seed", type=int, default=0, help="--spec with --temp: each prompt's runs start from it")
    b.add_argument("--wrong-draft", action="store_true",
                   help="--spec with a draft whose every proposal is wrong (at full draft cost): the worst case")
    b.add_argument("--multiturn", action="store_true",
                   help="persistent KV cache: second-turn prompt evaluation with and without the cache")
    b.add_argument("--conversations", type=int, default=3, help="conversations for --multiturn")
    b.add_argument("--first-tokens", type=int, default=1500, help="tokens in the first message (--multiturn)")
    b.add_argument("--kv-store", default=None, metavar="URL", help="--multiturn: also a shared-tier row, turn 2 "
                   "on a fresh replica (an empty cache dir) that loads turn 1 from this Redis")
    b.set_defaults(func=cmd_bench)

    t = sub.add_parser("train-head", add_help=False, prefix_chars="\0",
                       help="train an EAGLE-3 draft head for a target on a CUDA machine "
                       "(`jllm train-head --help` lists its options)")
    t.add_argument("args", nargs="*")
    t.set_defaults(func=cmd_train_head)
    ap.subcommands = sub.choices
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args, extra = ap.parse_known_args(argv)
    if extra:                                      # name the subcommand's own usage, not the top level's
        ap.subcommands[args.cmd].error(f"unrecognized arguments: {' '.join(extra)}")
    for name in ("prompt", "system"):              # bytes that are not UTF-8 arrive as lone surrogates
        if isinstance(getattr(args, name, None), str):
            setattr(args, name, well_formed(getattr(args, name)))
    try:
        rc = args.func(args)
        sys.stdout.flush()                         # inside the try: a full disk is reported here, once
        return rc
    except BrokenPipeError:                        # `jllm ... | head`: the reader has what it wanted
        return 0
    except OSError as e:
        if e.errno not in OUTPUT_ERRNOS:
            raise
        _abandon_build(interrupted=False)
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second failure at exit
            print(f"jllm: cannot write {e.filename or 'the output'}: {e.strerror}", file=sys.stderr)
        except OSError:                            # stderr on the same full disk: the exit status says it
            pass
        return 1
    except JllmError as e:
        print(f"jllm: {e}", file=sys.stderr)
        _abandon_build(interrupted=False)
        return 1
    except KeyboardInterrupt:
        print("\njllm: interrupted", file=sys.stderr)
        _abandon_build(interrupted=True)
        return 130


OUTPUT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)   # writing stdout or a file can fail so


def _abandon_build(interrupted: bool) -> None:
    kernels = sys.modules.get("jllm.kernels")      # imported only if this command got as far as the kernels
    if kernels is not None:
        kernels.abandon_background_build(interrupted)


if __name__ == "__main__":
    sys.exit(main())
