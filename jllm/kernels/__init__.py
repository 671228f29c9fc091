"""Native CPU kernels, compiled on first use with torch's C++ extension builder and cached on disk.

Why hand-written: no library offers a batch-invariant matrix multiply over 4-bit block-quantized weights on
x86. FBGEMM's int8 linear reads 1 byte per weight and picks one activation scale per call; torch's int4
kernels grow with the number of rows. The verify pass of speculative decoding needs the cost of k + 1 rows
to stay near that of one and every row's result to be independent of the others (qgemm.cpp explains how).

The build needs a C++ compiler (g++) and the Python headers, which is what `pip install` of any package with
native code needs; it takes ~25 s once per torch version, after which the module loads in well under a
second. Without a compiler, or on a CPU without AVX-512 VNNI, `qgemm()` returns None and callers fall back
to the FBGEMM int8 path, after one line on stderr saying why.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from pathlib import Path

_SOURCES = [Path(__file__).with_name(n) for n in ("qgemm.cpp", "attention.cpp", "rowwise.cpp", "layers.cpp")]
_HEADERS = [Path(__file__).with_name(n) for n in ("vecmath.h", "kernels.h")]
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mf16c",
          "-ffp-contract=off", "-fopenmp"]    # OpenMP: at::parallel_for shares torch's own thread pool
_lock = threading.Lock()
_module = None
_tried = False
_why_not: str | None = None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())


def _cpu_has_vnni() -> bool:
    return {"avx512f", "avx512bw", "avx512_vnni"} <= _cpu_flags()


def native_possible() -> bool:
    """Whether qgemm() will try to build the kernels here (the CPU and the environment allow it), without
    building them."""
    return not os.environ.get("JLLM_NO_KERNELS") and _cpu_has_vnni()


def _flags() -> list[str]:
    """Compiler flags for this CPU: with GFNI (Ice Lake, Zen 4 and later; not Cascade Lake) the 4-bit
    unpacking of one activation row takes one instruction fewer per register (qgemm.cpp). JLLM_NO_GFNI=1
    builds the other path (the tests check that both give the same bits)."""
    gfni = "gfni" in _cpu_flags() and not os.environ.get("JLLM_NO_GFNI")
    return _FLAGS + (["-mgfni", "-DJLLM_GFNI"] if gfni else [])


def build_dir() -> Path:
    import torch

    from jllm.paths import cache_dir

    ident = hashlib.sha256(b"".join(s.read_bytes() for s in _SOURCES + _HEADERS) + " ".join(_flags()).encode()
                           + torch.__version__.encode())
    return cache_dir("kernels", "JLLM_KERNELS_DIR") / ident.hexdigest()[:16]


def qgemm():
    """The compiled kernel module (qmatmul, attention, rms_norm, glu, rope_store), or None where it cannot run
    here. The CPU is checked before anything is compiled (/proc/cpuinfo), so a CPU without VNNI never pays
    for a build."""
    global _module, _tried, _why_not
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("JLLM_NO_KERNELS"):
            _why_not = "JLLM_NO_KERNELS is set"
            return None
        if not _cpu_has_vnni():
            _why_not = "this CPU lacks AVX-512 VNNI"
            return None
        try:
            import torch.utils.cpp_extension as ext

            out = build_dir()
            out.mkdir(parents=True, exist_ok=True)
            fresh = not any(out.glob("*.so"))
            if fresh:
                print("jllm: compiling the CPU kernels (once, about 30 s)...", file=sys.stderr, flush=True)
            mod = ext.load(name="jllm_qgemm", sources=[str(s) for s in _SOURCES], extra_cflags=_flags(), extra_ldflags=["-fopenmp"],
                           build_directory=str(out), verbose=False)
            _module = mod
        except Exception as e:                       # no compiler, no headers, read-only disk, ...
            _why_not = f"the kernels could not be built ({str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__})"
            print(f"jllm: {_why_not}; using the slower FBGEMM int8 path", file=sys.stderr)
        return _module


def why_unavailable() -> str | None:
    qgemm()
    return _why_not
