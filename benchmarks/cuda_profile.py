"""Where a GPU decode step of the blocks precision spends its time: the kernels of one eager step by GPU time
(torch's profiler), how many launches a step is, and a step's wall time eager against replayed from a CUDA graph
(jllm.cuda.graphs), beside the floor of reading the weights once at the device's copy bandwidth; then a
prefill (the context's tokens in jllm's chunks, as `jllm bench` times it): its wall time against its kernels'
GPU time, and those kernels by GPU time; then, with --chunks, a prefill of --sweep tokens in chunks of each
size, in a cache of `jllm bench`'s 4,096 positions, eager and from the prefill graphs (--tiled: also with the
tiled prefill attention): wall and GPU time and the launches of each.

    python benchmarks/cuda_profile.py MODEL.gguf [--context 512] [--rows 1 5] [--chunks 256 512 1024] [--tiled]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from jllm.model.loader import load_model


def copy_bandwidth() -> float:
    """Bytes a second of a large device-to-device copy (read + written)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (time.perf_counter() - t)


def step_ms(m, cache, ids: torch.Tensor, at: int, reps: int = 50) -> float:
    times = []
    for _ in range(reps):
        cache.truncate(at)
        torch.cuda.synchronize()
        t = time.perf_counter()
        m.forward(ids, cache)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def kernel_table(prof, per: int, top: int, what: str) -> None:
    """The profiled CUDA kernels by GPU time, over `per` repetitions of `what`."""
    events = cuda_events(prof)
    total = sum(e.self_device_time_total for e in events) / per
    launches = sum(e.count for e in events) / per
    print(f"\n{what}: {launches:.0f} kernel launches, {total / 1e3:.3f} ms of GPU time")
    print(f"{'kernel':<70} {'calls':>6} {'us/each':>9} {'share':>6}")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        us = e.self_device_time_total / per
        print(f"{e.key[:70]:<70} {e.count / per:>6.0f} {us:>9.1f} {us / total:>6.1%}")


def prefill_runner(m, ctx: torch.Tensor, cache, chunk: int):
    """-> run(): a prefill of ctx from an empty cache in calls of `chunk` tokens, waited for."""
    def run():
        cache.truncate(0)
        for s in range(0, ctx.shape[0], chunk):
            m.forward(ctx[s:s + chunk], cache, last_only=True)
        torch.cuda.synchronize()
    return run


def median_wall(run, reps: int) -> float:
    """Seconds of run()'s median over `reps` runs, after one to warm up."""
    run()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cuda_events(prof) -> list:
    """The profiled CUDA kernels (not the GPU-side spans of record_function labels, which torch lists as CUDA
    events too)."""
    return [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False)]


def prefill(m, ctx: torch.Tensor, top: int, reps: int = 5) -> None:
    """A prefill of ctx in the model's chunks (m.prefill_chunk), eager and from the prefill graphs: wall time,
    and the eager pass's kernels by GPU time."""
    graphs = m.prefill_graphs
    run = prefill_runner(m, ctx, m.new_cache(ctx.shape[0] + 64), m.prefill_chunk)
    for label, use in (("eager", None), ("graphs", graphs)):
        if label == "graphs" and use is None:
            continue
        m.prefill_graphs = use
        wall = median_wall(run, reps)
        print(f"\nprefill of {ctx.shape[0]} tokens in chunks of {m.prefill_chunk}, {label}: {wall * 1e3:.2f} ms "
              f"({ctx.shape[0] / wall:,.0f} tok/s)")
    m.prefill_graphs = None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
    m.prefill_graphs = graphs
    kernel_table(prof, reps, top, "one eager prefill")


def chunk_sweep(m, n: int, chunks: list[int], positions: int = 4096, reps: int = 5, tiled: bool = False) -> None:
    """A prefill of n tokens in chunks of each size (more tokens a call: fewer launches and fewer passes of
    the f16 dequantization of every matrix, more activation memory), eager and from the prefill graphs (and
    eager with the tiled attention, TILED, if asked): wall, GPU time and launches."""
    from jllm.cuda import attention

    was, graphs = attention.TILED, m.prefill_graphs
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(0, 1000, (n,), generator=g).to("cuda")
    cache = m.new_cache(positions)
    print(f"\nprefill of {n} tokens in a cache of {positions} positions, by chunk size")
    print(f"{'pass':>9} {'chunk':>6} {'wall ms':>9} {'tok/s':>9} {'GPU ms':>8} {'launches':>9} {'peak MiB':>9}")
    modes = ["eager"] + (["graphs"] if graphs is not None else []) + (["tiled"] if tiled else [])
    try:
        for mode, c in [(mode, c) for mode in modes for c in chunks]:
            attention.TILED = mode == "tiled"
            m.prefill_graphs = graphs if mode == "graphs" else None
            run = prefill_runner(m, ctx, cache, c)
            torch.cuda.reset_peak_memory_stats()
            wall = median_wall(run, reps)
            peak = torch.cuda.max_memory_allocated() / 2**20
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run()
            events = cuda_events(prof)
            gpu = sum(e.self_device_time_total for e in events) / 1e3
            print(f"{mode:>9} {c:>6} {wall * 1e3:>9.2f} {n / wall:>9,.0f} {gpu:>8.2f} "
                  f"{sum(e.count for e in events):>9} {peak:>9,.0f}")
    finally:
        attention.TILED, m.prefill_graphs = was, graphs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--chunks", type=int, nargs="*", default=[], help="prefill chunk sizes to sweep")
    ap.add_argument("--sweep", type=int, default=1024, help="tokens of the chunk sweep's prefill")
    ap.add_argument("--sweep-only", action="store_true")
    ap.add_argument("--tiled", action="store_true", help="the sweep also with the tiled prefill attention")
    a = ap.parse_args()
    m = load_model(a.model, "cuda", "blocks", max_positions=max(a.context + 64, 4096), cache_weights=False)
    if a.sweep_only:
        chunk_sweep(m, a.sweep, a.chunks, tiled=a.tiled)
        return
    cache = m.new_cache(a.context + 64)
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, 1000, (a.context,), generator=g).to("cuda")
    m.forward(ctx, cache)
    bw = copy_bandwidth()
    floor = m.w.nbytes() / bw * 1e3
    print(f"weights {m.w.nbytes() / 2**20:.0f} MiB, copy bandwidth {bw / 1e12:.2f} TB/s: floor {floor:.3f} ms a step")
    graphs = m.graphs
    for rows in a.rows:
        ids = torch.randint(0, 1000, (rows,), generator=g).to("cuda")
        m.graphs = None
        eager = step_ms(m, cache, ids, a.context)
        m.graphs = graphs
        replay = step_ms(m, cache, ids, a.context) if graphs is not None else float("nan")
        print(f"rows {rows}: eager {eager:.3f} ms, graph {replay:.3f} ms ({1e3 / replay:.0f} steps/s), "
              f"floor {floor:.3f} ms")
    m.graphs = None
    for rows in a.rows:                                   # where a verify pass's extra rows go
        ids = ctx[:rows]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                cache.truncate(a.context)
                m.forward(ids, cache)
            torch.cuda.synchronize()
        kernel_table(prof, 5, a.top, "one eager decode step" if rows == 1 else f"one eager pass of {rows} rows")
    m.graphs = graphs
    host_time(m, cache, a.context, a.top)
    prefill(m, ctx, a.top)
    if a.chunks:
        chunk_sweep(m, a.sweep, a.chunks, tiled=a.tiled)


def host_time(m, cache, at: int, top: int, steps: int = 48) -> None:
    """A decode step as jllm bench times it (token id in, argmax read back) against its graph's replay, and
    where the host's share goes: cProfile's functions by their own time over `steps` steps."""
    import cProfile
    import pstats

    tok = 1
    cache.truncate(at)
    for _ in range(3):                                     # the graph of one row exists after the first
        tok = int(torch.argmax(m.forward(torch.tensor([tok]), cache)[-1]))
    times = []
    prof = cProfile.Profile()
    for _ in range(steps):
        t = time.perf_counter()
        prof.enable()
        tok = int(torch.argmax(m.forward(torch.tensor([tok]), cache)[-1]))
        prof.disable()
        times.append(time.perf_counter() - t)
    print(f"\na decode step as jllm bench times it: {statistics.median(times) * 1e3:.3f} ms (median of {steps})")
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    print(f"{'function':<60} {'calls':>6} {'own us/step':>12}")
    for (path, line, name), (_, calls, own, _, _) in rows:
        print(f"{(path.split('/')[-1] + ':' + str(line) + ' ' + name)[:60]:<60} {calls / steps:>6.1f} "
              f"{own / steps * 1e6:>12.1f}")


if __name__ == "__main__":
    main()
