"""Native CPU kernels, compiled on first use with torch's C++ extension builder and cached on disk.

Why hand-written: no library offers a batch-invariant matrix multiply over 4-bit block-quantized weights on
x86. FBGEMM's int8 linear reads 1 byte per weight and picks one activation scale per call; torch's int4
kernels grow with the number of rows. The verify pass of speculative decoding needs the cost of k + 1 rows
to stay near that of one and every row's result to be independent of the others (qgemm.cpp explains how).

The build needs a C++ compiler (g++) and the Python headers, which is what `pip install` of any package with
native code needs; it takes ~30 s on 2 cores once per torch version (kernels.h says why the sources include
only ATen's headers), after which the module loads in well under a
second. The build targets AVX-512 VNNI where the CPU has it, else AVX2 with FMA and F16C (the same results
bit for bit; vecmath.h and qgemm.cpp say how); `JLLM_ISA=avx2` builds the AVX2 path on an AVX-512 CPU. Without
a compiler, or on a CPU with neither, `qgemm()` returns None and callers fall back to the FBGEMM int8 path,
after one line on stderr saying why.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import threading
from pathlib import Path

_SOURCES = [Path(__file__).with_name(n) for n in ("qgemm.cpp", "attention.cpp", "rowwise.cpp", "layers.cpp",
                                                          "sampling.cpp")]
_HEADERS = [Path(__file__).with_name(n) for n in ("vecmath.h", "kernels.h")]
_ISA_FLAGS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mf16c"],
              "avx2": ["-mavx2", "-mfma", "-mf16c"]}
_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]    # OpenMP: at::parallel_for shares torch's own thread pool
_lock = threading.Lock()
_module = None
_tried = False
_why_not: str | None = None
_builder: threading.Thread | None = None        # build_in_background's thread
_abandoned = False                               # the command ended while it built


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read), read once."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())


def isa() -> str | None:
    """The instruction set the kernels are built for on this CPU: "avx512" (with VNNI), "avx2" (with FMA and
    F16C), or None. JLLM_ISA=avx2 asks for the AVX2 build where AVX-512 is there too."""
    flags = cpu_flags()
    avx2 = {"avx2", "fma", "f16c"} <= flags
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags and avx2 \
            and os.environ.get("JLLM_ISA") != "avx2":
        return "avx512"
    return "avx2" if avx2 else None


def native_possible() -> bool:
    """Whether qgemm() will try to build the kernels here (the CPU and the environment allow it), without
    building them."""
    return not os.environ.get("JLLM_NO_KERNELS") and isa() is not None


def _flags() -> list[str]:
    """Compiler flags for this CPU. With AVX-512 and GFNI (Ice Lake, Zen 4 and later; not Cascade Lake) the
    4-bit unpacking of one activation row takes one instruction fewer per register (qgemm.cpp). JLLM_NO_GFNI=1
    builds the other path (the tests check that both give the same bits). JLLM_TWO_PASS=1 makes the AVX2 build
    compute every tile a half at a time, without its one-pass path for 4- and 6-bit tiles (the same bits, slower)."""
    target = isa() or "avx2"
    gfni = target == "avx512" and "gfni" in cpu_flags() and not os.environ.get("JLLM_NO_GFNI")
    two_pass = target == "avx2" and os.environ.get("JLLM_TWO_PASS")
    return (_FLAGS + _ISA_FLAGS[target] + (["-mgfni", "-DJLLM_GFNI"] if gfni else [])
            + (["-DJLLM_BOTH_ROWS=0"] if two_pass else []))


def build_dir() -> Path:
    import torch

    from jllm.paths import cache_dir

    ident = hashlib.sha256(b"".join(s.read_bytes() for s in _SOURCES + _HEADERS) + " ".join(_flags()).encode()
                           + torch.__version__.encode())
    return cache_dir("kernels", "JLLM_KERNELS_DIR") / ident.hexdigest()[:16]


@contextlib.contextmanager
def _build_lock(out: Path):
    """jllm's own lock around torch's builder. torch's lock file (`out/lock`) is a plain file that its
    builder waits on for as long as it exists, so a build killed outright (SIGKILL, a closed terminal, the
    OOM killer) would stop every later start. An flock dies with its process: whoever holds this one knows
    that no build is running, and that a torch lock file still there is a dead build's."""
    import fcntl

    with open(out / ".jllm-build.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        (out / "lock").unlink(missing_ok=True)
        yield


class _BuildProgress:
    """A progress bar over the build's compile units (the object files as they appear in the build directory)
    while torch's builder runs; one plain line where stderr is not a terminal."""

    def __init__(self, out: Path, units: int):
        self.out, self.units = out, units
        self.done = threading.Event()

    def __enter__(self):
        if not sys.stderr.isatty():
            print("jllm: compiling the CPU kernels (once, about 30 s)...", file=sys.stderr, flush=True)
            return self
        from tqdm import tqdm

        self.bar = tqdm(total=self.units + 1, desc="jllm: compiling the CPU kernels (once, ~30 s)", unit="file",
                        file=sys.stderr, leave=False, bar_format="{desc}: {n}/{total} files [{elapsed}]")
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self) -> None:
        while not self.done.wait(0.5):
            n = sum(1 for _ in self.out.glob("*.o")) + any(self.out.glob("*.so"))
            self.bar.update(min(n, self.bar.total) - self.bar.n)

    def __exit__(self, *exc) -> None:
        self.done.set()
        if hasattr(self, "bar"):
            self.thread.join()
            self.bar.close()


def qgemm():
    """The compiled kernel module (qmatmul, attention, rms_norm, glu, rope_store), or None where it cannot run
    here. The CPU is checked before anything is compiled (/proc/cpuinfo), so a CPU without AVX2 never pays
    for a build."""
    global _module, _tried, _why_not
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("JLLM_NO_KERNELS"):
            _why_not = "JLLM_NO_KERNELS is set"
            return None
        if isa() is None:
            _why_not = "this CPU has neither AVX-512 VNNI nor AVX2 with FMA and F16C"
            return None
        try:
            import torch.utils.cpp_extension as ext

            out = build_dir()
            out.mkdir(parents=True, exist_ok=True)
            with _build_lock(out):
                fresh = not any(out.glob("*.so"))
                with _BuildProgress(out, len(_SOURCES)) if fresh else contextlib.nullcontext():
                    mod = ext.load(name="jllm_qgemm", sources=[str(s) for s in _SOURCES], extra_cflags=_flags(),
                                   extra_ldflags=["-fopenmp"], build_directory=str(out), verbose=False)
            _module = mod
        except Exception as e:                       # no compiler, no headers, read-only disk, ...
            _why_not = f"the kernels could not be built ({str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__})"
            if not _abandoned:                       # (a build cut short by the user's Ctrl-C says nothing)
                print(f"jllm: {_why_not}; using the slower FBGEMM int8 path", file=sys.stderr)
        return _module


def loaded():
    """The kernel module if it is built and loaded already, else None; never starts a build (for callers such
    as sampling that have a torch path of their own and must not wait for a compile)."""
    return _module if _tried else None


def build_in_background() -> None:
    """Start building the kernels on a thread when they are not built yet, so that a first start's downloads
    and the compile overlap (the compile is CPU-bound, a download network-bound); qgemm() then waits for it."""
    if _tried or not native_possible():
        return
    # not a daemon: at exit the interpreter lets it finish, so no compiler is left writing the build dir
    global _builder
    _builder = threading.Thread(target=qgemm, name="jllm-kernel-build")
    _builder.start()


def abandon_background_build(interrupted: bool) -> None:
    """The command ends early (an error, Ctrl-C) while the kernels build on their thread: a Ctrl-C has
    stopped the compiler too, and its failure is not worth a line; otherwise say why the exit waits."""
    global _abandoned
    _abandoned = True
    if _builder is not None and _builder.is_alive() and not interrupted:
        print("jllm: finishing the kernel build before exiting (once; the next start uses it)", file=sys.stderr)


def why_unavailable() -> str | None:
    qgemm()
    return _why_not
