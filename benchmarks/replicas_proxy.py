"""Two `jllm serve` replicas on one Redis behind nginx (issue 24, item 5: affinity, documented); prints a table.

    python3 benchmarks/replicas_proxy.py [--conversations 20] [--repeat 25] [-n 16]

Starts, all under a temp dir and on free loopback ports: a real redis-server (tests/redis_server.py), two
`jllm serve --kv-store redis://...` replicas over a tiny synthetic model (tests/synthetic.py, as
tests/test_kv_replicas.py does), each with its own local cache dir, and nginx with a generated config whose
upstream is the two replicas under `hash $http_x_prompt_cache_key consistent;`. Then it runs --conversations
two-turn conversations through nginx with the official `openai` client, one at a time, in three modes:

    header    the client sends `X-Prompt-Cache-Key: <conversation>`: nginx hashes it, turn 2 goes where turn 1 went
    body      the key in the body only (`prompt_cache_key`), which nginx cannot read: the empty hash key makes
              nginx round-robin, so turn 2 lands on the other replica and must come from the shared tier
    none      no key at all: round robin again, and the replicas find turn 1 by its longest token prefix

Turn 2 is sent once turn 1's entry is in Redis (a few ms after the reply; a person takes longer to answer).
Which replica answered: each replica's /metrics (jllm_completions_total, read directly, before and after the
request), checked against nginx's `$upstream_addr`, which this config returns as a header. Every reply is
compared with a no-cache engine's (greedy). Everything started is stopped at the end, also on errors.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests"), str(REPO / "benchmarks")]

import httpx  # noqa: E402
from openai import OpenAI  # noqa: E402

from replicas import free_port, start_replicas, stop  # noqa: E402

NGINX_CONF = """\
daemon off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/nginx-error.log warn;
{user}
events {{ worker_connections 64; }}
http {{
    access_log {d}/nginx-access.log;
    client_body_temp_path {d}/nginx-tmp/body;
    proxy_temp_path {d}/nginx-tmp/proxy;
    fastcgi_temp_path {d}/nginx-tmp/fastcgi;
    uwsgi_temp_path {d}/nginx-tmp/uwsgi;
    scgi_temp_path {d}/nginx-tmp/scgi;

    upstream jllm {{
        hash $http_x_prompt_cache_key consistent;   # one conversation, one replica; no header: round robin
        server 127.0.0.1:{a};
        server 127.0.0.1:{b};
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://jllm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;                        # streamed replies (SSE) pass as they come
            proxy_read_timeout 600s;
            add_header X-Upstream $upstream_addr always;  # for this benchmark's cross-check only
        }}
    }}
}}
"""


def completions(port: int) -> float:
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith("jllm_completions_total "):
            return float(line.split()[1])
    raise RuntimeError("jllm_completions_total missing from /metrics")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--repeat", type=int, default=25, help="turn 1 repeats a ~50-character sentence this often")
    p.add_argument("-n", "--max-tokens", type=int, default=16)
    a = p.parse_args()
    if shutil.which("nginx") is None or shutil.which("redis-server") is None:
        print("needs nginx and redis-server (Debian: apt-get install nginx redis-server)", file=sys.stderr)
        return 2

    with ExitStack() as stack:
        d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="jllm-replicas-")))
        from jllm.engine import Engine
        from jllm.sampling import SamplingParams

        reps = start_replicas(stack, d, ["-c", "4096", "-t", "1"])
        model, rc, ports = reps.model, reps.rc, reps.ports
        by_addr = {f"127.0.0.1:{port}": name for name, port in ports.items()}

        proxy_port = free_port()
        (d / "nginx-tmp").mkdir()
        conf = d / "nginx.conf"
        conf.write_text(NGINX_CONF.format(d=d, a=ports["A"], b=ports["B"], port=proxy_port,
                                          user="user root;" if os.geteuid() == 0 else ""))
        check = subprocess.run(["nginx", "-t", "-p", str(d), "-c", str(conf)], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"nginx -t: {check.stderr}")
        nginx = subprocess.Popen(["nginx", "-p", str(d), "-c", str(conf)], stdout=open(d / "nginx.out", "wb"),
                                 stderr=subprocess.STDOUT)
        stack.callback(stop, nginx, signal.SIGQUIT)          # graceful: workers finish, then the master exits
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", proxy_port), timeout=0.2).close()
                break
            except OSError:
                if nginx.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nginx did not start: {(d / 'nginx-error.log').read_text()[-800:]}")
                time.sleep(0.05)

        client = OpenAI(base_url=f"http://127.0.0.1:{proxy_port}/v1", api_key="none", max_retries=0, timeout=120)
        ref = Engine(str(model), ctx_size=4096, threads=1)      # no store: the oracle
        expected = lambda msgs: ref.generate(ref.chat_ids(msgs), SamplingParams(max_tokens=a.max_tokens)).text

        def entries() -> int:
            return sum(1 for _ in rc.scan_iter("jllm:kv:e:*"))

        def turn(msgs, mode, conv):
            headers = {"X-Prompt-Cache-Key": conv} if mode == "header" else {}
            body = {"prompt_cache_key": conv} if mode == "body" else {}
            before = {n: completions(p) for n, p in ports.items()}
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", messages=msgs, max_tokens=a.max_tokens, temperature=0,
                extra_headers=headers, extra_body=body)
            r = raw.parse()
            after = {n: completions(p) for n, p in ports.items()}
            served = [n for n in ports if after[n] > before[n]]
            upstream = by_addr.get(raw.headers.get("x-upstream", ""))
            assert served == [upstream], f"/metrics says {served}, nginx says {raw.headers.get('x-upstream')}"
            return upstream, r.choices[0].message.content, r.usage

        rows = []
        for mode in ("header", "body", "none"):
            same = identical = waited_out = 0
            cached, prompt, first_on = [], [], {"A": 0, "B": 0}
            for i in range(a.conversations):
                conv = f"{mode}-{i}"
                turn1 = [{"role": "user", "content": f"{mode} conversation {i}: tell me about caches and replicas. "
                                                     * a.repeat}]
                n_entries = entries()
                rep1, text1, _ = turn(turn1, mode, conv)
                first_on[rep1] += 1
                deadline = time.monotonic() + 5                 # turn 1's state in Redis before turn 2
                while entries() == n_entries and time.monotonic() < deadline:
                    time.sleep(0.005)
                waited_out += entries() == n_entries
                turn2 = turn1 + [{"role": "assistant", "content": text1},
                                 {"role": "user", "content": f"and what about replica {i}?"}]
                rep2, text2, usage2 = turn(turn2, mode, conv)
                same += rep2 == rep1
                cached.append(usage2.prompt_tokens_details.cached_tokens)
                prompt.append(usage2.prompt_tokens)
                identical += text1 == expected(turn1) and text2 == expected(turn2)
            if waited_out:
                print(f"{mode}: {waited_out} turn-1 entries not in Redis within 5 s", file=sys.stderr)
            rows.append((mode, a.conversations, f"A {first_on['A']} / B {first_on['B']}",
                         f"{same}/{a.conversations}", f"{sum(prompt) / len(prompt):.0f}",
                         f"{sum(cached) / len(cached):.0f}", f"{sum(cached) / sum(prompt):.1%}",
                         f"{identical}/{a.conversations}"))

        head = ("mode", "conversations", "turn 1 on", "turn 2 on turn 1's replica", "turn 2 prompt tokens",
                "turn 2 cached_tokens (mean)", "cached share", "both turns identical to no-cache")
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        for r in rows:
            print("| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
