"""The memory floor of a decode step: every packed matrix of the draft and of the target read once, split as
the engine splits a one-token step (one parallel region per matrix, each of the two threads streaming its
contiguous half), timed beside the engine's own one-token forward passes, interleaved. The ratio of the two
models' floors is what the draft step can cost at best, in target steps.

    python benchmarks/stream_floor.py [--rounds 30] [--splits]

--splits also times other ways to share the bytes between the threads (each thread's half of the whole
model as one stream, chunks claimed dynamically, chunks interleaved statically), which all stream slower.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <atomic>
#include <vector>

// Read each buffer once with 64-byte loads, one parallel region of two threads per buffer. mode 0: each
// thread its contiguous half; 1: chunks claimed from a shared counter; 2: chunks dealt alternately.
double read_buffers(std::vector<torch::Tensor> bufs, int64_t mode, int64_t chunk) {
    long long sink[2] = {0, 0};
    const double t0 = omp_get_wtime();
    for (auto& b : bufs) {
        const uint8_t* p = b.data_ptr<uint8_t>();
        const int64_t n = b.numel() / 64 * 64;
        std::atomic<int64_t> next{0};
        #pragma omp parallel num_threads(2)
        {
            const int t = omp_get_thread_num();
            __m256i s = _mm256_setzero_si256();     // AVX2 loads: the stream is the same on either ISA
            auto read = [&](int64_t a, int64_t e) {
                for (int64_t o = a; o < e; o += 64)
                    s = _mm256_xor_si256(s, _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(p + o)),
                                                             _mm256_loadu_si256((const __m256i*)(p + o + 32))));
            };
            if (mode == 0) {
                const int64_t half = n / 128 * 64;
                t ? read(half, n) : read(0, half);
            } else if (mode == 1) {
                for (int64_t a; (a = next.fetch_add(chunk)) < n;) read(a, std::min(n, a + chunk));
            } else {
                for (int64_t a = t * chunk; a < n; a += 2 * chunk) read(a, std::min(n, a + chunk));
            }
            sink[t] ^= _mm256_extract_epi64(s, 0) | _mm256_extract_epi64(s, 3);
        }
    }
    const double dt = omp_get_wtime() - t0;
    volatile long long keep = sink[0] ^ sink[1];
    (void)keep;
    return dt;
}
"""


def matrices(model) -> list[torch.Tensor]:
    """The bytes of every packed matrix of a forward pass, in the order the stack reads them."""
    return [m.data[int(m.offsets[0]):int(m.offsets[-1])] for m in model.w.matrices()]


def main() -> None:
    from jllm.model.loader import load_model
    from jllm.spec import DRAFT_VOCAB
    from jllm.catalog import resolve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-md", "--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--splits", action="store_true")
    a = ap.parse_args()
    mod = load_inline("jllm_stream_floor", cpp_sources=SOURCE, functions=["read_buffers"],
                      extra_cflags=["-O2", "-mavx2", "-fopenmp"], extra_ldflags=["-fopenmp"])
    target = load_model(resolve(a.model), "cpu", None)
    draft = load_model(resolve(a.draft), "cpu", "native4", output_rows=DRAFT_VOCAB)
    if target.stack is None or draft.stack is None:
        raise SystemExit("the native kernels are unavailable on this machine")
    bufs = {"target": matrices(target), "draft": matrices(draft)}
    nbytes = {k: sum(b.numel() for b in v) for k, v in bufs.items()}
    whole = [torch.cat(bufs["draft"])]
    caches = {"target": target.new_cache(400), "draft": draft.new_cache(400)}
    ids = torch.randint(0, 1000, (300,))
    for name, model in (("target", target), ("draft", draft)):
        model.forward(ids, caches[name])
    tests = {
        "target: stream, halves": lambda: mod.read_buffers(bufs["target"], 0, 0),
        "draft: stream, halves": lambda: mod.read_buffers(bufs["draft"], 0, 0),
    }
    for name, model in (("target", target), ("draft", draft)):
        def step(model=model, cache=caches[name]):
            t = time.perf_counter()
            model.forward(ids[:1], cache, last_only=True)
            cache.truncate(300)
            return time.perf_counter() - t
        tests[f"{name}: engine's one-token forward"] = step
    if a.splits:
        tests["draft: one half of the whole model per thread"] = lambda: mod.read_buffers(whole, 0, 0)
        for kib in (64, 16):
            tests[f"draft: {kib} KiB chunks claimed"] = lambda c=kib * 1024: mod.read_buffers(bufs["draft"], 1, c)
            tests[f"draft: {kib} KiB chunks dealt alternately"] = lambda c=kib * 1024: mod.read_buffers(bufs["draft"], 2, c)
    times = {k: [] for k in tests}
    for _ in range(a.rounds):
        for k, f in tests.items():
            times[k].append(f())
    ms = {k: statistics.median(v) * 1000 for k, v in times.items()}
    print(f"medians of {a.rounds} interleaved rounds; target {nbytes['target'] / 1e6:.1f} MB, "
          f"draft {nbytes['draft'] / 1e6:.1f} MB of packed matrices (bytes ratio {nbytes['draft'] / nbytes['target']:.3f})")
    for k, v in ms.items():
        by = nbytes["draft" if k.startswith("draft") else "target"]
        print(f"  {k:<46} {v:8.3f} ms  {by / v / 1e6:6.1f} GB/s")
    streams = ms["draft: stream, halves"] / ms["target: stream, halves"]
    engine = ms["draft: engine's one-token forward"] / ms["target: engine's one-token forward"]
    print(f"draft / target: streams {streams:.3f}, engine {engine:.3f}")


if __name__ == "__main__":
    main()
