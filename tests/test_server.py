"""jllm serve (jllm/server/): a live uvicorn server on loopback, driven by the official `openai` client (and
httpx for raw requests), over a tiny synthetic model with n-gram speculation and the persistent KV cache on.

Greedy answers must equal the CLI's (`jllm generate --chat`) and a reference engine's, streamed or not, alone
or among concurrent requests; errors must be OpenAI-shaped JSON with the right status.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest
from live_server import serve_app
from openai import OpenAI
from synthetic import write_tiny_model

from jllm import cli
from jllm.engine import Engine
from jllm.sampling import SamplingParams
from jllm.server import create_app
from jllm.spec.config import SpecConfig

KEY = "sk-test-key"
CTX = 4096


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    path = d / "tiny.gguf"
    write_tiny_model(path, "qwen2", seed=10)              # seed 10 rarely ends its turn early: long answers
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JLLM_CONVERTED_DIR", str(d / "converted"))
        eng = Engine(str(path), ctx_size=CTX, threads=1, kv_store_dir=str(d / "kv"), spec=SpecConfig(mode="ngram"))
        ref = Engine(str(path), ctx_size=CTX, threads=1)     # plain decoding, no store: the oracle
        live = serve_app(create_app(eng, "tiny", api_key=KEY, aliases=["tiny-alias"]))
        base = live.base
        yield SimpleNamespace(base=base, path=path, kv=d / "kv", engine=eng, ref=ref, converted=d / "converted",
                              client=OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60),
                              http=httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"},
                                                timeout=60))
        live.stop()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def reference(srv, messages: list[dict], n: int) -> str:
    return srv.ref.generate(srv.ref.chat_ids(messages), SamplingParams(max_tokens=n)).text


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


# -- chat and completions -------------------------------------------------------------------------------------

def test_chat_streaming_equals_non_streaming(srv):
    msgs = user("tell me about the world")
    r = srv.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=64, temperature=0)
    text = r.choices[0].message.content
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 64                              # the streams compared are 64 tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens == len(srv.ref.chat_ids(msgs))
    assert {"drafted", "accepted", "acceptance_rate"} <= set(r.model_extra["spec"])

    chunks = list(srv.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=64, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [r.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_any_model_name_is_served_unless_strict(srv):
    msgs = user("tell me about the world")
    asked = srv.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    other = srv.client.chat.completions.create(model="gpt-4o", messages=msgs, max_tokens=8, temperature=0)
    assert other.model == "tiny" and other.choices[0].message.content == asked.choices[0].message.content
    assert srv.http.get("/v1/models/gpt-4o").status_code == 404      # a lookup names the served model only

    from fastapi.testclient import TestClient

    with TestClient(create_app(srv.engine, "tiny", aliases=["tiny-alias"], strict_model=True)) as strict:
        r = strict.post(CHAT, json={"model": "gpt-4o", "messages": msgs, "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert strict.post(CHAT, json={"model": "tiny-alias", "messages": msgs, "max_tokens": 2}).status_code == 200


def test_greedy_text_equals_jllm_generate_chat(srv, capsys, monkeypatch):
    monkeypatch.setenv("JLLM_CONVERTED_DIR", str(srv.converted))
    prompt = "request number 3: tell me about the world"
    assert cli.main(["generate", "-m", str(srv.path), "-p", prompt, "--chat", "--json", "-n", "64",
                     "-c", str(CTX), "-t", "1"]) == 0
    want = json.loads(capsys.readouterr().out)
    assert len(want["token_ids"]) == 64 and want["finish_reason"] == "length"
    r = srv.client.chat.completions.create(model="tiny", messages=user(prompt), max_tokens=64, temperature=0)
    assert r.choices[0].message.content == want["text"]
    assert r.usage.completion_tokens == len(want["token_ids"])
    assert r.choices[0].finish_reason == want["finish_reason"]


def test_two_turns_reuse_the_persistent_kv_cache(srv):
    turn1 = [{"role": "system", "content": "You are terse."}, *user("the history of caches " * 12)]
    r1 = srv.client.chat.completions.create(model="tiny", messages=turn1, max_tokens=16, temperature=0,
                                            extra_body={"prompt_cache_key": "conv1"})
    # another conversation in between: the engine's memory now holds other tokens, so turn 2 needs the store
    srv.client.chat.completions.create(model="tiny", messages=user("something else entirely"), max_tokens=4,
                                       temperature=0)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content}, *user("and then?")]
    r2 = srv.client.chat.completions.create(model="tiny", messages=turn2, max_tokens=16, temperature=0,
                                            extra_body={"prompt_cache_key": "conv1"})
    assert (srv.kv / "conv1.kv").is_file()
    assert r1.usage.prompt_tokens_details.cached_tokens < r1.usage.prompt_tokens // 2
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r1.usage.prompt_tokens
    assert r2.model_extra["timings"]["prompt_tokens_evaluated"] == r2.usage.prompt_tokens - cached
    assert r2.choices[0].message.content == reference(srv, turn2, 16)


def test_prompt_cache_key_from_a_header(srv):
    """`X-Prompt-Cache-Key` (what a proxy can route on) names the entry as the body's field does; the body's
    field wins when both are sent; a bad header value is a 400 like a bad field."""
    turn1 = user("caches behind a proxy " * 12)
    r1 = srv.client.chat.completions.create(model="tiny", messages=turn1, max_tokens=8, temperature=0,
                                            extra_headers={"X-Prompt-Cache-Key": "hdr1"})
    srv.engine.wait_saves()
    assert (srv.kv / "hdr1.kv").is_file()
    srv.client.chat.completions.create(model="tiny", messages=user("something else again"), max_tokens=4,
                                       temperature=0)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content}, *user("and then?")]
    r2 = srv.client.chat.completions.create(model="tiny", messages=turn2, max_tokens=8, temperature=0,
                                            extra_headers={"X-Prompt-Cache-Key": "hdr1"})
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    assert r2.choices[0].message.content == reference(srv, turn2, 8)
    srv.client.chat.completions.create(model="tiny", messages=user("both ways " * 8), max_tokens=4, temperature=0,
                                       extra_headers={"X-Prompt-Cache-Key": "hdr-loses"},
                                       extra_body={"prompt_cache_key": "body-wins"})
    srv.engine.wait_saves()
    assert (srv.kv / "body-wins.kv").is_file() and not (srv.kv / "hdr-loses.kv").exists()
    bad = srv.http.post(CHAT, json=OK, headers={"X-Prompt-Cache-Key": "../etc/passwd"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_cache_key"


def test_completions(srv):
    r = srv.client.completions.create(model="tiny", prompt="Hello world", max_tokens=20, temperature=0)
    want = srv.ref.generate(srv.ref.encode("Hello world"), SamplingParams(max_tokens=20))
    assert r.object == "text_completion" and r.choices[0].text == want.text
    assert r.usage.completion_tokens == len(want.token_ids) and r.choices[0].finish_reason == want.finish_reason
    chunks = list(srv.client.completions.create(model="default", prompt="Hello world", max_tokens=20,
                                                temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    stopped = srv.client.completions.create(model="tiny", prompt="Hello world", max_tokens=20, temperature=0,
                                            stop=[want.text[3:6]])
    assert stopped.choices[0].text == want.text[:want.text.index(want.text[3:6])]
    assert stopped.choices[0].finish_reason == "stop"
    for extra in ({"suffix": "end"}, {"best_of": 3}, {"echo": True}, {"logprobs": 2}):   # would change the
        r = srv.http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(extra)), r.text   # answer
    for neutral in ({"suffix": ""}, {"best_of": 1}):
        assert srv.http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2,
                                                      **neutral}).status_code == 200


def test_sampled_requests_repeat_with_a_seed(srv):
    args = dict(model="tiny", messages=user("roll the dice"), max_tokens=16, temperature=0.9, top_p=0.95, seed=7)
    a, b = (srv.client.chat.completions.create(**args).choices[0].message.content for _ in range(2))
    assert a == b


def test_models_health_metrics(srv):
    assert [m.id for m in srv.client.models.list().data] == ["tiny"]
    assert srv.client.models.retrieve("tiny-alias").id == "tiny"
    h = httpx.get(f"{srv.base}/health")                  # no key needed
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["model"] == "tiny"
    srv.client.chat.completions.create(model="tiny", messages=user("count me"), max_tokens=4, temperature=0)
    m = srv.http.get("/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    text = m.text
    assert metric(text, 'jllm_http_requests_total{path="/v1/chat/completions",status="200"}') >= 1
    assert metric(text, "jllm_completions_total") >= 1
    assert metric(text, "jllm_tokens_generated_total") >= 4
    assert metric(text, "jllm_prompt_tokens_evaluated_total") > 0
    assert metric(text, "jllm_decode_tokens_per_second") > 0
    assert metric(text, "jllm_kv_cache_entries") >= 1 and metric(text, "jllm_kv_cache_bytes") > 0
    assert metric(text, "jllm_queue_depth") == 0
    assert metric(text, "jllm_spec_accepted_tokens_total") <= metric(text, "jllm_spec_drafted_tokens_total")
    assert metric(text, "jllm_spec_leaves_taken_total") <= metric(text, "jllm_spec_leaves_total")
    for name in ("jllm_prompt_tokens_cached_total", "jllm_spec_drafted_tokens_total",
                 "jllm_spec_accepted_tokens_total", "jllm_spec_acceptance_rate", "jllm_requests_running",
                 "jllm_spec_leaves_total", "jllm_spec_leaves_taken_total"):
        metric(text, name)


# -- errors ---------------------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
OK = {"model": "tiny", "messages": user("hi"), "max_tokens": 2}


@pytest.mark.parametrize("body, status, param, code", [
    (b"{not json", 400, None, None),
    (b"[1, 2]", 400, None, None),
    (b"[" * 100000 + b"]" * 100000, 400, None, None),
    ({"model": "tiny"}, 400, "messages", None),
    ({"model": "tiny", "messages": []}, 400, "messages", None),
    ({**OK, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", None),
    ({**OK, "messages": user("word " * 5000)}, 400, "messages", "context_length_exceeded"),
    ({**OK, "messages": user("word " * 5000), "stream": True}, 400, "messages", "context_length_exceeded"),
    ({**OK, "temperature": -1}, 400, "temperature", None),
    ({**OK, "top_p": 0}, 400, "top_p", None),
    ({**OK, "top_p": 1.5}, 400, "top_p", None),
    ({**OK, "max_tokens": 0}, 400, "max_tokens", None),
    ({**OK, "seed": -3}, 400, "seed", None),
    ({**OK, "n": 2}, 400, "n", None),
    ({**OK, "stop": 5}, 400, "stop", None),
    ({**OK, "prompt_cache_key": "../etc/passwd"}, 400, "prompt_cache_key", None),
    ({**OK, "seed": 1e30}, 400, "seed", None),
    ({**OK, "stop": ["x"] * 1000}, 400, "stop", None),
    ({**OK, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", None),
    ({**OK, "functions": [{"name": "f"}]}, 400, "functions", None),
    ({**OK, "response_format": {"type": "json_object"}}, 400, "response_format", None),
    ({**OK, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages.0.content", None),
])
def test_bad_requests_get_openai_error_json(srv, body, status, param, code):
    r = (srv.http.post(CHAT, content=body, headers={"Content-Type": "application/json"}) if isinstance(body, bytes)
         else srv.http.post(CHAT, json=body))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    assert (err["param"] or "").split(".")[0] == (param or "").split(".")[0] and err["code"] == code
    assert "Traceback" not in r.text


def test_what_jllm_cannot_do_is_said_plainly(srv):
    """Tools, a JSON response format, image parts and batches of prompts: a 400 whose message names the thing,
    not the request model's internals; tools the request forbids using (tool_choice "none") are no obstacle."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for path, body, words in (
            (CHAT, {**OK, "tools": tools}, "tools: function calling is not supported"),
            (CHAT, {**OK, "messages": [{"role": "user", "content": [{"text": "hi"}]}]}, "messages.0.content: a "
             "content part needs a type"),
            (CHAT, {**OK, "response_format": {"type": "json_schema"}}, "response_format: 'json_schema' is not supported"),
            (CHAT, {**OK, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
             "messages.0.content: content parts of type 'image_url' are not supported (text only)"),
            ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}, "prompt: one prompt per request"),
            (CHAT, {**OK, "seed": 1e30}, "seed: the seed must be a whole number"),
            (CHAT, {**OK, "messages": [{"role": "user", "content": 5}]}, "messages.0.content: ")):
        r = srv.http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(words), r.text
    from jllm.server.schemas import ContentPart, Message

    assert Message(role="user", content=[ContentPart(type="text", text="hi")]).for_template()["content"] == "hi"
    for body in ({**OK, "tools": tools, "tool_choice": "none"}, {**OK, "response_format": {"type": "text"}},
                 {**OK, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}):
        assert srv.http.post(CHAT, json=body).status_code == 200


def test_text_that_is_not_unicode_is_answered(srv):
    """A lone surrogate (JSON "\\ud800") is no character: it is read as U+FFFD, not a 500."""
    for path, body in ((CHAT, b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800 hi"}]}'),
                       ("/v1/completions", b'{"model": "tiny", "max_tokens": 2, "prompt": "\\udcff hi"}')):
        r = srv.http.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text
    parts = {**OK, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}
    r = srv.http.post(CHAT, content=json.dumps(parts), headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text


def test_errors_through_the_openai_client_and_other_routes(srv):
    with pytest.raises(openai.NotFoundError):
        srv.client.models.retrieve("nope")
    with pytest.raises(openai.BadRequestError, match="context"):
        srv.client.completions.create(model="tiny", prompt="word " * 5000, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        srv.client.completions.create(model="tiny", prompt=[10**9], max_tokens=2)
    for name in ("default", "tiny-alias"):
        assert srv.http.post(CHAT, json={**OK, "model": name}).status_code == 200
    r = srv.http.get("/v1/nowhere")
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_api_key(srv):
    assert httpx.post(f"{srv.base}{CHAT}", json=OK).status_code == 401
    r = httpx.post(f"{srv.base}{CHAT}", json=OK, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{srv.base}/metrics").status_code == 401
    bad = OpenAI(base_url=f"{srv.base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# -- concurrency ----------------------------------------------------------------------------------------------

def test_concurrent_requests_are_all_answered_without_mix_ups(srv):
    prompts = [f"request number {i}: tell me about the world" for i in range(40)]
    want = {p: reference(srv, user(p), 12) for p in prompts}      # each prompt's answer, run alone

    def ask(i: int) -> tuple[str, str]:
        p = prompts[i]
        if i % 2:
            chunks = srv.client.chat.completions.create(model="tiny", messages=user(p), max_tokens=12,
                                                        temperature=0, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = srv.client.chat.completions.create(model="tiny", messages=user(p), max_tokens=12,
                                                      temperature=0).choices[0].message.content
        return p, text

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(len(prompts))))
    assert len(results) == len(prompts)
    for p, text in results:
        assert text == want[p], p


class _Slow:
    """A generation that yields its tokens no faster than one per 2 ms (attributes: the generation's own)."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        return self

    def __next__(self):
        time.sleep(0.002)
        return next(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_client_disconnects_stop_their_generations(srv, monkeypatch):
    """A stream closed mid-way is stopped between two tokens; a request abandoned while queued behind it is
    never run; the server goes on serving. The tiny model's 3,500 tokens come in under a second with n-gram
    drafting, about when the client below lets go: paced at 2 ms a token, the stream is surely still running."""
    stream = srv.engine.stream
    monkeypatch.setattr(srv.engine, "stream", lambda *a, **kw: _Slow(stream(*a, **kw)))
    before = srv.http.get("/metrics").text
    long = {"model": "tiny", "messages": user("write forever"), "max_tokens": 3500, "temperature": 0}
    with httpx.Client(base_url=srv.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        with c.stream("POST", CHAT, json={**long, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines).startswith("data: ") and next(lines) == ""
            with pytest.raises(httpx.TimeoutException):     # waits behind the stream, then gives up
                srv.http.post(CHAT, json=long, timeout=0.5)
            time.sleep(0.5)                                  # its handler notices the disconnect
    deadline = time.monotonic() + 20
    while True:
        after = srv.http.get("/metrics").text
        if metric(after, "jllm_completions_cancelled_total") == metric(before, "jllm_completions_cancelled_total") + 2:
            break
        assert time.monotonic() < deadline, "a disconnected request was not cancelled"
        time.sleep(0.05)
    generated = metric(after, "jllm_tokens_generated_total") - metric(before, "jllm_tokens_generated_total")
    assert generated < 3500
    assert metric(after, "jllm_completions_total") == metric(before, "jllm_completions_total")
    msgs = user("are you still there?")
    r = srv.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, timeout=20)
    assert r.choices[0].message.content == reference(srv, msgs, 8)
    assert httpx.get(f"{srv.base}/health").json()["queue_depth"] == 0


def test_internal_error_is_a_500_without_traceback(srv, monkeypatch, caplog):
    def boom(messages):
        raise ValueError("boom")

    monkeypatch.setattr(srv.engine, "chat_ids", boom)
    r = srv.http.post(CHAT, json=OK)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "Traceback" not in r.text and "boom" not in r.text
    assert any("ValueError: boom" in rec.getMessage() for rec in caplog.records)
    monkeypatch.undo()
    assert srv.http.post(CHAT, json=OK).status_code == 200


def test_jllm_serve_command(srv, tmp_path, jllm_forks):
    """`jllm serve` as a process of its own (forked by tests/jllm_child.py): bad ports are one line, and a
    server comes up, answers as the reference engine does and stops cleanly on Ctrl-C."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JLLM_") or k == "JLLM_KERNELS_DIR"}
    env.update(JLLM_CONVERTED_DIR=str(srv.converted), JLLM_CACHE_DIR=str(tmp_path / "kv"))

    def serve(*args: str, timeout: int = 60) -> int:
        return jllm_forks.start(["serve", "-m", str(srv.path), *args], env=env, cwd=tmp_path, timeout=timeout)

    bad = jllm_forks.finish(serve("--port", "70000"))
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == ["jllm: --port must be in 0..65535, got 70000"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.listen()
        for host, p in (("127.0.0.1", port), ("999.1.1.1", 0)):      # a taken port, a host that is none
            bad = jllm_forks.finish(serve("--host", host, "--port", str(p)))
            lines = bad.stderr.strip().splitlines()
            assert bad.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"jllm: cannot listen on {host}")
    pid = serve("--port", str(port), "-c", "512", "-t", "1", "--api-key", "k2", timeout=300)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"jllm serve did not come up: {jllm_forks.output(pid)}"
            time.sleep(0.1)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k2", max_retries=0, timeout=30)
        msgs = user("tell me about the world")
        r = client.chat.completions.create(model=srv.path.stem, messages=msgs, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == reference(srv, msgs, 8)
        assert (tmp_path / "kv").is_dir()
    finally:
        os.kill(pid, signal.SIGINT)
        done = jllm_forks.finish(pid)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_metrics_add_up_the_speculation_of_requests():
    """Each request's speculation statistics, side leaves included, summed into the counters."""
    from jllm.server.metrics import Metrics
    from jllm.server.worker import Outcome

    m = Metrics()
    timings = {"prompt_tokens_evaluated": 5, "cached_tokens": 0, "decode_tokens": 8, "decode_tok_s": 40.0,
               "prompt_tok_s": 100.0}
    for leaves, taken in ((3, 1), (4, 2)):
        m.record(Outcome(5, 8, "length", timings, {"drafted": 10, "accepted": 6, "leaves": leaves,
                                                   "leaves_taken": taken}))
    m.record(Outcome(5, 8, "length", timings, None))              # a request that did not speculate
    text = m.render(0, 0, None)
    assert metric(text, "jllm_spec_drafted_tokens_total") == 20
    assert metric(text, "jllm_spec_accepted_tokens_total") == 12
    assert metric(text, "jllm_spec_leaves_total") == 7 and metric(text, "jllm_spec_leaves_taken_total") == 3
    assert metric(text, "jllm_spec_acceptance_rate") == 0.6
