"""The `jllm` command line (jllm/cli.py), run as a process of its own on a tiny synthetic model: forked by
tests/jllm_child.py (which paid for `import torch` once), or, where the interpreter's own start-up matters,
as `python -m jllm`.

Every user mistake must end as exactly one line on stderr, `jllm: <what was wrong>`, a non-zero exit status,
and no traceback.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from synthetic import write_tiny_model

from jllm.gguf.reader import read_gguf
from jllm.catalog import ALIASES

REPO = Path(__file__).resolve().parents[1]
TIMINGS = {"load_ms", "prompt_eval_ms", "prompt_tok_s", "decode_ms", "decode_tokens", "decode_tok_s"}


FORKS = None                    # the session's JllmForks (conftest.py), set by _forks for jllm() below


@pytest.fixture(scope="module", autouse=True)
def _forks(jllm_forks):
    global FORKS
    FORKS = jllm_forks


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A folder holding tiny.gguf (qwen2; ffn 256 so that ffn_down rows fit 256-value quant blocks)."""
    d = tmp_path_factory.mktemp("cli")
    write_tiny_model(d / "tiny.gguf", "qwen2", intermediate_size=256)
    return d


def jllm_env(home: Path) -> dict:
    """The environment of a jllm run in home: no JLLM_ settings of the caller's but the kernels' directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JLLM_") or k == "JLLM_KERNELS_DIR"}
    env.update(JLLM_CONVERTED_DIR=str(home / "converted"), JLLM_MODELS_DIR=str(home / "models"),
               JLLM_CACHE_DIR=str(home / "kv-default"), PYTHONPATH=str(REPO / "src"))
    return env


def jllm(home: Path, *args: str, stdin: str | bytes | None = None, env: dict | None = None,
         interpreter: bool = False):
    """`jllm args` in home, forked (interpreter=False) or as `python -m jllm` -> CompletedProcess (str output)."""
    full_env = jllm_env(home)
    full_env.update(env or {})
    stdin = stdin if isinstance(stdin, bytes) else (stdin or "").encode()
    if not interpreter:
        return FORKS.run(list(args), env=full_env, cwd=home, stdin=stdin)
    # bytes, not text=True: universal newlines would turn a progress bar's carriage returns into line breaks
    proc = subprocess.run([sys.executable, "-m", "jllm", *args], cwd=home, env=full_env, input=stdin,
                          capture_output=True, timeout=120)
    proc.stdout, proc.stderr = proc.stdout.decode(), proc.stderr.decode()
    return proc


def screen_lines(text: str) -> list[str]:
    """The non-blank lines a terminal would show: a carriage return starts its line over."""
    return [s for s in (ln.rsplit("\r", 1)[-1] for ln in text.split("\n")) if s.strip()]


def assert_user_error(proc, *words: str) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode != 0
    lines = screen_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("jllm: "), proc.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def derived(home: Path, name: str, data: bytes | bytearray) -> str:
    (home / name).write_bytes(bytes(data))
    return name


# --------------------------------------------------------------------------------------------- GGUF patching


def patch_string_value(data: bytearray, key: str, new: str) -> None:
    """Overwrite the string value of metadata `key` with `new`, which must have the same length."""
    k = struct.pack("<Q", len(key)) + key.encode()
    pos = data.index(k) + len(k)
    vtype, n = struct.unpack_from("<IQ", data, pos)
    assert vtype == 8 and n == len(new.encode())               # 8: string
    data[pos + 12:pos + 12 + n] = new.encode()


def patch_uint32_value(data: bytearray, key: str, new: int) -> None:
    k = struct.pack("<Q", len(key)) + key.encode()
    pos = data.index(k) + len(k)
    assert struct.unpack_from("<I", data, pos)[0] == 4            # 4: uint32
    struct.pack_into("<I", data, pos + 4, new)


def patch_tensor_type(path: Path, data: bytearray, name: str, new: GGMLQuantizationType) -> None:
    """Overwrite the ggml type code of tensor `name` in its header record (name, ndim, dims, type, offset)."""
    g = read_gguf(path)
    info = g.tensors[name]
    g.close()
    rec = struct.pack("<Q", len(name)) + name.encode()
    pos = data.index(rec) + len(rec)
    assert struct.unpack_from("<I", data, pos)[0] == len(info.shape)
    pos += 4 + 8 * len(info.shape)
    assert struct.unpack_from("<I", data, pos)[0] == int(info.ggml_type)
    struct.pack_into("<I", data, pos, int(new))


# --------------------------------------------------------------------------------------------- user mistakes


def test_truncated_file(home):
    data = (home / "tiny.gguf").read_bytes()
    name = derived(home, "half.gguf", data[:len(data) // 2])
    assert_user_error(jllm(home, "generate", "-m", name, "-p", "hi"), name, "truncated")


def test_truncated_header(home):
    data = (home / "tiny.gguf").read_bytes()
    name = derived(home, "head.gguf", data[:300])
    assert_user_error(jllm(home, "inspect", name), name, "truncated")


def test_wrong_magic(home):
    (home / "x.gguf").write_text("this is a text file, not a model; " * 4)
    assert_user_error(jllm(home, "generate", "-m", "x.gguf", "-p", "hi"), "x.gguf", "not a GGUF file")


def test_tiny_file(home):
    (home / "short.gguf").write_text("hi\n")
    assert_user_error(jllm(home, "inspect", "short.gguf"), "short.gguf", "not a GGUF file")


def test_missing_file(home):
    assert_user_error(jllm(home, "generate", "-m", "nowhere.gguf", "-p", "hi"), "nowhere.gguf", "not found")


def test_unknown_alias(home):
    line = assert_user_error(jllm(home, "generate", "-m", "llama-9000b", "-p", "hi"), "llama-9000b")
    assert all(alias in line for alias in ALIASES)              # it says what would have worked


def test_pull_unknown_alias(home):
    assert_user_error(jllm(home, "models", "pull", "llama-9000b"), "llama-9000b")


def test_unknown_architecture(home):
    data = bytearray((home / "tiny.gguf").read_bytes())
    patch_string_value(data, "general.architecture", "qwen9")
    name = derived(home, "qwen9.gguf", data)
    assert read_gguf(home / name).architecture == "qwen9"
    assert_user_error(jllm(home, "generate", "-m", name, "-p", "hi"), "qwen9", "not supported")
    assert_user_error(jllm(home, "inspect", name), "qwen9", "not supported")


@pytest.mark.parametrize("key, value, words", [
    ("qwen2.attention.head_count", 0, ["metadata is inconsistent"]),
    ("qwen2.attention.head_count_kv", 4, ["attn_k.weight", "does not match its tensors"]),
    ("qwen2.embedding_length", 128, ["does not match its tensors"]),
])
def test_metadata_that_contradicts_the_tensors(home, key, value, words):
    data = bytearray((home / "tiny.gguf").read_bytes())
    patch_uint32_value(data, key, value)
    name = derived(home, f"meta-{value}-{key.rsplit('.', 1)[1]}.gguf", data)
    assert_user_error(jllm(home, "generate", "-m", name, "-p", "hi", "-n", "1"), *words)
    assert_user_error(jllm(home, "generate", "-m", "tiny.gguf", "-md", name, "-p", "hi", "-n", "1"), *words)


def test_unsupported_tensor_type(home):
    data = bytearray((home / "tiny.gguf").read_bytes())
    patch_tensor_type(home / "tiny.gguf", data, "blk.0.ffn_down.weight", GGMLQuantizationType.IQ2_XS)
    name = derived(home, "iq2.gguf", data)
    assert read_gguf(home / name).tensors["blk.0.ffn_down.weight"].ggml_type == GGMLQuantizationType.IQ2_XS
    assert_user_error(jllm(home, "generate", "-m", name, "-p", "hi"), "IQ2_XS", "not supported")


def test_prompt_longer_than_context(home):
    proc = jllm(home, "generate", "-m", "tiny.gguf", "-c", "16", "-p", "hello world " * 20)
    assert_user_error(proc, "context size 16", "--ctx-size")


def test_failed_download(home):
    empty = home / "empty-index"
    empty.mkdir(exist_ok=True)
    proc = jllm(home, "models", "pull", "smollm2-135m",
                env={"JLLM_PIP_ARGS": f"--no-index --find-links {empty}"})
    assert_user_error(proc, "smollm2-135m", "could not download")
    left = {f.name for f in (home / "models").iterdir()}
    assert left <= {ALIASES["smollm2-135m"].file_name + ".lock"}, left   # no partial file, no temp folder


def test_unusable_models_dir(home):
    proc = jllm(home, "models", "pull", "smollm2-135m", env={"JLLM_MODELS_DIR": str(home / "tiny.gguf" / "m")})
    assert_user_error(proc, "models directory", "JLLM_MODELS_DIR")


def test_cuda_on_a_cpu_only_machine(home):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert_user_error(jllm(home, "generate", "-m", "tiny.gguf", "-p", "hi", "--device", "cuda"), "cuda")


def test_bad_sampling_value(home):
    assert_user_error(jllm(home, "generate", "-m", "tiny.gguf", "-p", "hi", "--top-p", "0"), "top-p")
    # the sampled corpus bench refuses it before loading anything (no draft model here to load)
    assert_user_error(jllm(home, "bench", "--spec", "-m", "tiny.gguf", "--temp", "-1"), "temperature")


@pytest.mark.parametrize("args, words", [
    (["--spec", "ngram", "--draft-leaf-p", "2"], ["--draft-leaf-p"]),
    (["--spec", "ngram", "--draft-tree", "-1"], ["--draft-tree"]),
    (["--spec", "ngram", "--draft-p-min", "nan"], ["--draft-p-min"]),
    (["-t", "0"], ["--threads"]),
    (["-c", "0"], ["--ctx-size"]),
    (["-c", "-5"], ["-c/--ctx-size must be at least 1 (got -5)"]),     # not a word about max tokens
    (["-c", "100000000000"], ["this machine's memory", "-c/--ctx-size"]),     # before allocating terabytes
])
def test_bad_sizes_and_spec_values(home, args, words):
    assert_user_error(jllm(home, "generate", "-m", "tiny.gguf", "-p", "hi", *args), *words)


@pytest.mark.parametrize("args, words", [
    (["--decode-tokens", "0"], ["--decode-tokens must be at least 1"]),
    (["--repeats", "-1"], ["--repeats must be at least 1"]),
    (["--max-k", "-3"], ["--max-k must be at least 1"]),
    (["--prompt-tokens", "-5"], ["--prompt-tokens must be at least 1"]),
    (["--spec", "-n", "0"], ["-n/--n-predict must be at least 1"]),
    (["--spec", "--limit", "0"], ["--limit must be at least 1"]),
    (["--spec", "--draft-max", "0"], ["--draft-min <= --draft-max"]),
    (["--spec", "--spec-mode", "draft"], ["needs a draft model"]),
    (["--multiturn", "--conversations", "0"], ["--conversations must be at least 1"]),
    (["--multiturn", "--first-tokens", "100000"], ["--first-tokens must be between 1 and"]),
    (["--perplexity", "missing.txt"], ["--perplexity missing.txt", "cannot read"]),
    (["--perplexity", "tiny.gguf"], ["--perplexity tiny.gguf", "UTF-8"]),
    (["--llamacpp", "/no/such/bin"], ["llama-bench not found"]),
    (["--json", "/no/such/dir/x.json"], ["--json /no/such/dir/x.json: cannot write there"]),
    (["--json", "."], ["cannot write there"]),
])
def test_bad_bench_settings_are_refused_before_it_runs(home, args, words):
    assert_user_error(jllm(home, "bench", "-m", "tiny.gguf", *args), *words)


@pytest.mark.parametrize("args, words", [
    (["chat", "-p", " "], ["the message (-p) is empty"]),
    (["chat", "--json"], ["--json prints one turn's result: it needs -p"]),
    (["generate", "-p", "hi", "-n", "-5"], ["-n/--n-predict must be -1"]),
])
def test_chat_and_generate_settings_that_make_no_sense(home, args, words):
    assert_user_error(jllm(home, args[0], "-m", "tiny.gguf", *args[1:]), *words)


def test_a_new_system_message_for_an_old_conversation_is_said_to_be_unused(home):
    first = jllm(home, "chat", "-m", "tiny.gguf", "-p", "hi", "-n", "2", "--conversation", "sys1", "--system", "A")
    assert first.returncode == 0 and "warning" not in first.stderr, first.stderr
    again = jllm(home, "chat", "-m", "tiny.gguf", "-p", "hi", "-n", "2", "--conversation", "sys1", "--system", "A")
    assert again.returncode == 0 and "warning" not in again.stderr, again.stderr
    other = jllm(home, "chat", "-m", "tiny.gguf", "-p", "hi", "-n", "2", "--conversation", "sys1", "--system", "B")
    assert other.returncode == 0 and "--system is not applied" in other.stderr, other.stderr


def test_output_to_a_full_disk_and_a_closed_stdin(home):
    """stdout on a full device: one line saying so, exit 1; chat with stdin closed: as at the end of input."""
    env = jllm_env(home)
    run = [sys.executable, "-m", "jllm"]
    with open("/dev/full", "w") as full:
        proc = subprocess.run(run + ["generate", "-m", "tiny.gguf", "-p", "hi", "-n", "4"], cwd=home, env=env,
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip() == "jllm: cannot write the output: No space left on device"
    r, w = os.pipe()                                  # a reader that has gone: `jllm ... | head`
    os.close(r)
    proc = subprocess.run(run + ["inspect", "tiny.gguf"], cwd=home, env=env, stdout=w, stderr=subprocess.PIPE,
                          text=True, timeout=120)
    os.close(w)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    proc = subprocess.run(run + ["chat", "-m", "tiny.gguf", "-n", "4"], cwd=home, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120, preexec_fn=lambda: os.close(0))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


def test_a_cache_dir_that_is_a_file(home):
    (home / "afile").write_text("")
    assert_user_error(jllm(home, "chat", "-m", "tiny.gguf", "-p", "hi", "--cache-dir", "afile", "--conversation",
                           "c1"), "afile is not a directory")
    assert_user_error(jllm(home, "chat", "-m", "tiny.gguf", "-p", "hi", "--cache-dir", "afile/sub"),
                      "afile/sub cannot be made", "afile is a file, not a directory")
    (home / "dir").mkdir(exist_ok=True)
    assert_user_error(jllm(home, "generate", "-m", "dir", "-p", "hi"), "dir is a directory")


def test_plan_refuses_a_context_size_below_one(home):
    assert_user_error(jllm(home, "plan", "-m", "tiny.gguf", "-c", "-5"), "--ctx-size")


# --------------------------------------------------------------------------------------------- success paths


def test_generate_json(home):
    proc = jllm(home, "generate", "-m", "tiny.gguf", "-p", "hi", "-n", "5", "--json", interpreter=True)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    res = json.loads(lines[0])
    assert {"text", "token_ids", "prompt_tokens", "timings"} <= set(res)
    assert isinstance(res["text"], str)
    assert 1 <= len(res["token_ids"]) <= 5 and all(isinstance(t, int) for t in res["token_ids"])
    assert res["prompt_tokens"] == 2                            # "h", "i": no merge joins them
    assert TIMINGS <= set(res["timings"])
    assert res["timings"]["load_ms"] > 0 and res["timings"]["decode_tokens"] == len(res["token_ids"])


def test_generate_chat_streams_text_and_prints_speeds(home):
    proc = jllm(home, "generate", "-m", "tiny.gguf", "-p", "hi", "-n", "4", "--chat", "--temp", "0.8",
                "--seed", "1", "--stop", "zzz")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n")
    lines = screen_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("[prompt ") and "decode" in lines[0], proc.stderr


def test_inspect(home):
    proc = jllm(home, "inspect", "tiny.gguf")
    assert proc.returncode == 0, proc.stderr
    fields = dict(ln.split(None, 1) for ln in proc.stdout.splitlines())
    assert fields["architecture"] == "qwen2" and fields["layers"] == "2" and fields["vocab_size"] == "300"


def test_inspect_json(home):
    proc = jllm(home, "inspect", "tiny.gguf", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["architecture"] == "qwen2" and info["gguf_version"] == 3
    assert info["layers"] == 2 and info["hidden"] == 64 and info["ffn"] == 256 and info["vocab_size"] == 300
    assert info["tensor_types"] == {"F32": len(read_gguf(home / "tiny.gguf").tensors)}
    assert info["chat_template"] is True and info["tied_embeddings"] is False


def test_models_lists_the_aliases(home):
    proc = jllm(home, "models")
    assert proc.returncode == 0, proc.stderr
    rows = {ln.split()[0]: ln.split() for ln in proc.stdout.splitlines()[2:] if ln.split()[0] in ALIASES}
    assert set(rows) == set(ALIASES) and len(ALIASES) == 5
    # nothing downloaded into this models dir; the head ships inside jllm
    assert {alias: row[2] for alias, row in rows.items()} == {a: "shipped" if s.bundled else "no"
                                                               for a, s in ALIASES.items()}
    assert {alias: row[1] for alias, row in rows.items()} == {
        "qwen2.5-coder-1.5b": "instruct", "qwen2.5-coder-0.5b": "instruct", "gemma-3-270m": "base",
        "smollm2-135m": "instruct", "qwen2.5-coder-1.5b-eagle3": "head"}
    assert "base: a pretrained model without chat tuning" in proc.stdout
    assert "head: an EAGLE-3 draft head" in proc.stdout


def test_chat_over_stdin(home):
    proc = jllm(home, "chat", "-m", "tiny.gguf", "-n", "4", stdin="hello\nhow are you\n")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    turns = proc.stdout.split("> ")                             # the prompt printed before each read
    assert turns[0] == "" and turns[-1] == ""                   # ends at the third prompt, on EOF
    answers = turns[1:-1]
    assert len(answers) == 2
    assert all(a.endswith("\n") and a.strip() for a in answers), answers


def test_bytes_that_are_not_utf8_are_read_as_replacement_characters(home):
    """Argument and stdin bytes that are not UTF-8 reach Python as lone surrogates, which the tokenizer and the
    stored conversation cannot take: they are read as U+FFFD."""
    proc = jllm(home, "generate", "-m", "tiny.gguf", "-n", "2", "-p", os.fsdecode(b"hi \xff there"), interpreter=True)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    proc = jllm(home, "chat", "-m", "tiny.gguf", "-n", "2", "--cache-dir", str(home / "kv-utf8"),
                "--conversation", "bytes", "--system", os.fsdecode(b"\xfe"), stdin=b"hi\n\xff\xfe bad\n",
                interpreter=True)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stdout.split("> ")) == 4                    # two answers, then EOF
    saved = json.loads((home / "kv-utf8" / "conversations" / "bytes.json").read_text())
    assert [m["content"] for m in saved["messages"] if m["role"] != "assistant"] == ["\ufffd", "hi", "\ufffd\ufffd bad"]


def test_reset_of_a_named_conversation_says_its_saved_turns_go(home):
    kv = str(home / "kv-reset")
    jllm(home, "chat", "-m", "tiny.gguf", "-n", "2", "--cache-dir", kv, "--conversation", "r", "-p", "first")
    proc = jllm(home, "chat", "-m", "tiny.gguf", "-n", "2", "--cache-dir", kv, "--conversation", "r",
                stdin="/reset\nsecond\n")
    assert proc.returncode == 0 and "starts over" in proc.stderr, proc.stderr
    saved = json.loads((home / "kv-reset" / "conversations" / "r.json").read_text())
    assert [m["content"] for m in saved["messages"] if m["role"] == "user"] == ["second"]


@pytest.mark.parametrize("action", [["ls"], ["stats"], ["clear"], ["rm", "c1"]])
def test_cache_commands_on_a_missing_directory_create_nothing(home, action):
    proc = jllm(home, "cache", *action, "--cache-dir", "no-such-dir")
    if action[0] == "rm":                                      # removing what is not there is a mistake
        assert_user_error(proc, "no such conversation: c1", "no KV cache at no-such-dir")
    else:
        assert proc.returncode == 0 and "no KV cache at no-such-dir" in proc.stdout, proc.stderr
    assert not (home / "no-such-dir").exists()



def test_chat_answers_until_the_context_is_full_and_says_so(home):
    """chat's default -n is -1: an answer ends at the end of its turn or when the context is full (this random
    model never ends its turn), and a cut answer is marked, at the context or at an -n limit."""
    proc = jllm(home, "chat", "-m", "tiny.gguf", "-c", "64", "-p", "hello", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["finish_reason"] == "length"
    t = out["timings"]
    assert t["prompt_tokens_evaluated"] + t["cached_tokens"] + len(out["token_ids"]) == 64
    proc = jllm(home, "chat", "-m", "tiny.gguf", "-c", "64", stdin="hello\n")
    assert proc.returncode == 0 and "[answer cut: the context of 64 tokens is full; /reset starts over" in \
        proc.stderr, proc.stderr
    # one turn at a time (-p) of a kept conversation: the cut says how to go on there, and the turn after the
    # full one names the conversation's length, not "the prompt", and how to leave it; its history is kept
    for turn in ("hello", "again"):
        proc = jllm(home, "chat", "-m", "tiny.gguf", "-c", "64", "-p", turn, "--conversation", "full")
        if turn == "hello":
            assert proc.returncode == 0 and "is full; a new --conversation starts afresh" in proc.stderr, proc.stderr
    line = assert_user_error(proc, "the conversation with this message is", "more than the context of 64 holds",
                             "`jllm cache rm full` forgets it")
    assert "prompt" not in line
    proc = jllm(home, "chat", "-m", "tiny.gguf", "-n", "3", stdin="hello\n")
    assert proc.returncode == 0 and "[answer cut at the -n limit of 3 tokens]" in proc.stderr, proc.stderr
    assert "decode 3 tok" not in proc.stderr                    # statistics only with --verbose
    proc = jllm(home, "chat", "-m", "tiny.gguf", "-n", "3", "--verbose", stdin="hello\n")
    assert proc.returncode == 0 and "decode 3 tok" in proc.stderr, proc.stderr


def test_chat_commands_stay_out_of_the_conversation(home):
    kv = str(home / "kv-commands")
    proc = jllm(home, "chat", "-m", "tiny.gguf", "-n", "2", "--cache-dir", kv, "--conversation", "cmd",
                stdin="/help\n/nosuch\nhello\n")
    assert proc.returncode == 0, proc.stderr
    assert "/reset" in proc.stderr and "/exit" in proc.stderr          # the help
    assert "unknown command /nosuch (/help lists them)" in proc.stderr
    assert len(proc.stdout.split("> ")) == 5                   # four prompts, one answer
    saved = json.loads((home / "kv-commands" / "conversations" / "cmd.json").read_text())
    assert [m["content"] for m in saved["messages"] if m["role"] == "user"] == ["hello"]
    proc = jllm(home, "chat", "-m", "tiny.gguf", "-n", "2", "--cache-dir", kv, "--conversation", "cmd",
                stdin="again\n")
    assert "(resumed conversation cmd: 1 earlier turn)" in proc.stderr, proc.stderr
    proc = jllm(home, "chat", "-m", "tiny.gguf", "-n", "2", "--cache-dir", kv, "--conversation", "cmd", stdin="")
    assert "(resumed conversation cmd: 2 earlier turns)" in proc.stderr, proc.stderr


def test_ctrl_c_keeps_the_answer_so_far_with_its_question(home, monkeypatch, capsys):
    """Interactive chat, in this process: Ctrl-C during the first answer (after three pieces), then a second
    question answered whole. The history keeps both questions, the first answer as far as it got; Ctrl-C
    before any text keeps nothing and says so."""
    import builtins

    from jllm import cli
    from jllm.engine import Engine

    monkeypatch.chdir(home)
    monkeypatch.setenv("JLLM_CONVERTED_DIR", str(home / "converted"))
    kv = home / "kv-ctrl-c"
    real_stream, calls = Engine.stream, []

    def stream(self, *args, **kw):
        calls.append(1)
        run = real_stream(self, *args, **kw)
        stop_after = {1: 3, 2: 0}.get(len(calls))
        if stop_after is None:
            return run

        def pieces():
            for i, piece in enumerate(run):
                if i == stop_after:
                    raise KeyboardInterrupt
                yield piece
        return pieces()

    lines = iter(["first", "never answered", "second"])

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(Engine, "stream", stream)
    monkeypatch.setattr(builtins, "input", fake_input)
    assert cli.main(["chat", "-m", "tiny.gguf", "-n", "6", "--cache-dir", str(kv), "--conversation", "cc"]) == 0
    err = capsys.readouterr().err
    assert "[stopped: the question and the answer so far are kept]" in err, err
    assert "[stopped before the answer began: the question is not kept]" in err, err
    saved = json.loads((kv / "conversations" / "cc.json").read_text())["messages"]
    assert [m["role"] for m in saved] == ["user", "assistant", "user", "assistant"]
    assert [saved[0]["content"], saved[2]["content"]] == ["first", "second"] and saved[1]["content"]


def test_chat_with_a_model_without_a_chat_template_says_it_is_a_base_model(home):
    data = bytearray((home / "tiny.gguf").read_bytes())
    template = read_gguf(home / "tiny.gguf").metadata["tokenizer.chat_template"]
    patch_string_value(data, "tokenizer.chat_template", " " * len(template.encode()))
    name = derived(home, "base.gguf", data)
    proc = jllm(home, "chat", "-m", name, "-n", "2", stdin="hello\n")
    assert proc.returncode == 0, proc.stderr
    assert "carries no chat template, as base (pretrained) models do" in proc.stderr
    write_tiny_model(home / "long.gguf", "qwen2", intermediate_size=256, seed=11)   # runs on past 256
    data = bytearray((home / "long.gguf").read_bytes())
    patch_string_value(data, "tokenizer.chat_template", " " * len(template.encode()))
    proc = jllm(home, "chat", "-m", derived(home, "long-base.gguf", data), "-p", "hello", "--json")
    out = json.loads(proc.stdout)
    assert len(out["token_ids"]) == 256 and out["finish_reason"] == "length"      # no -n: 256 at most
    assert "carries no chat template" in proc.stderr                            # said for one turn (-p) too
    assert "carries no chat template" not in jllm(home, "chat", "-m", "tiny.gguf", "-n", "2", stdin="").stderr


def test_an_unknown_flag_prints_the_subcommand_usage(home):
    proc = jllm(home, "chat", "-m", "tiny.gguf", "--no-such-flag", interpreter=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "jllm chat: error: unrecognized arguments: --no-such-flag" in proc.stderr, proc.stderr
    assert "usage: jllm chat" in proc.stderr


@pytest.mark.parametrize("args, env, want_head", [
    ([], None, True),                                   # chat and serve draft with the shipped head
    (["--spec", "auto"], None, True),
    (["--spec", "none"], None, False),
    (["--spec", "ngram"], None, False),
    ([], "0", False),                                   # JLLM_SPEC_DECODE=0: speculation off
    (["-md", "OTHER"], None, False),                    # -md wins
])
@pytest.mark.parametrize("command", ["chat", "serve"])
def test_chat_and_serve_use_the_shipped_head_for_its_target(tmp_path, monkeypatch, command, args, env,
                                                            want_head):
    import jllm.engine
    from jllm import catalog, cli

    target = tmp_path / ALIASES["qwen2.5-coder-1.5b"].file_name     # the target's file, by name
    target.write_bytes(b"GGUF")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    made = {}
    monkeypatch.setattr(jllm.engine, "Engine", lambda *a, **kw: made.update(kw))
    if env is None:
        monkeypatch.delenv("JLLM_SPEC_DECODE", raising=False)
    else:
        monkeypatch.setenv("JLLM_SPEC_DECODE", env)
    argv = [command, "-m", str(target), *[str(other) if x == "OTHER" else x for x in args]]
    a = cli.build_parser().parse_args(argv)
    cli._engine(a, kv_cache=False, default_head=True)
    head = str(catalog.resolve("qwen2.5-coder-1.5b-eagle3"))
    assert (made["draft_path"] == head) == want_head
    assert made["draft_path"] == (head if want_head else str(other) if "-md" in args else None)
    # the other commands keep drafting opt-in
    made.clear()
    cli._engine(cli.build_parser().parse_args(["generate", "-m", str(target), "-p", "hi"]))
    assert made["draft_path"] is None


@pytest.mark.parametrize("args, default, want_head", [
    ([], "blocks", True),                               # a GPU's default where triton is: the head's kernels
    ([], "bf16", False),                                # no triton: no head by default
    (["--precision", "bf16"], "blocks", False),
    (["--precision", "blocks"], "bf16", True),
])
def test_on_a_gpu_the_shipped_head_drafts_in_the_blocks_precision(tmp_path, monkeypatch, args, default,
                                                                  want_head):
    import jllm.engine
    import jllm.model.loader as loader
    from jllm import catalog, cli

    target = tmp_path / ALIASES["qwen2.5-coder-1.5b"].file_name
    target.write_bytes(b"GGUF")
    made = {}
    monkeypatch.setattr(jllm.engine, "Engine", lambda *a, **kw: made.update(kw))
    monkeypatch.delenv("JLLM_SPEC_DECODE", raising=False)
    monkeypatch.setattr(loader, "resolve_device", lambda d: torch.device("cuda"))   # no GPU needed: not run
    monkeypatch.setattr(loader, "default_precision", lambda d: default)
    a = cli.build_parser().parse_args(["serve", "-m", str(target), "--device", "cuda", *args])
    cli._engine(a, kv_cache=False, default_head=True)
    head = str(catalog.resolve("qwen2.5-coder-1.5b-eagle3"))
    assert made["device"] == "cuda" and made["draft_path"] == (head if want_head else None)
