"""The SASS of a GPU matvec kernel, compiled here without a GPU: instructions in its hot loop by opcode, and
per weight. A decode step's matvecs are bound by that count (integer ops issue at half the rate of float
ones on sm_80..sm_90), so a kernel change can be judged before a lease: fewer instructions a weight, fewer
microseconds on the chip. Needs triton (its ptxas and cuobjdump come with it); the torch may be a CPU one.

    python benchmarks/cuda_sass.py q4_k --block-n 16 --sb 2          # sm_90 (the H200)
    python benchmarks/cuda_sass.py q6_k --block-n 32 --sb 1 --arch 87  # the Jetson Orin
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")     # as the JIT compiles them (fused multiply-adds)

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from jllm.cuda import dp4a, imma, mma, q4_k, q6_k

_COMMON = {"b_ptr": "*fp32", "y_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "NB": "i32", "Y_STRIDE": "i32",
           "NB_PART": "i32", "P_STRIDE": "i32"}
# kernel, its pointer arguments' types, weights a program's step covers per output (SB = 1)
KERNELS = {"q4_k": (q4_k._q4_k_matvec, {"x_ptr": "*fp32", "qs_ptr": "*i32", "d_ptr": "*fp16", "dmin_ptr": "*fp16",
                                        "sc_ptr": "*u8", "mn_ptr": "*u8"}),
           "q6_k": (q6_k._q6_k_matvec, {"x_ptr": "*fp32", "ql_ptr": "*i32", "qh_ptr": "*i32", "sc_ptr": "*i8",
                                        "d_ptr": "*fp16"}),
           "q4_k_mma": (mma._q4_k_mma, {"xh_ptr": "*fp16", "xl_ptr": "*fp16", "sh_ptr": "*fp16", "sl_ptr": "*fp16",
                                        "inv_ptr": "*fp32",
                                        "qs_ptr": "*i32", "d_ptr": "*fp16", "dmin_ptr": "*fp16", "sc_ptr": "*u8",
                                        "mn_ptr": "*u8"}),
           "q6_k_mma": (mma._q6_k_mma, {"xh_ptr": "*fp16", "xl_ptr": "*fp16", "inv_ptr": "*fp32", "ql_ptr": "*i32", "qh_ptr": "*i32",
                                        "sc_ptr": "*i8", "d_ptr": "*fp16"}),
           # int8 x and dp4a (jllm.cuda.dp4a), compiled as launched: no fp fusion
           "q4_k_dp4a": (dp4a._q4_k_dp4a, {"xq_ptr": "*i32", "s4_ptr": "*fp32", "qs_ptr": "*i32",
                                           "d_ptr": "*fp16", "dmin_ptr": "*fp16", "sc_ptr": "*u8", "mn_ptr": "*u8"},
                         {"enable_fp_fusion": False}),
           "q6_k_dp4a": (dp4a._q6_k_dp4a, {"xq_ptr": "*i32", "s6_ptr": "*i32", "ql_ptr": "*i32",
                                           "qh_ptr": "*i32", "sc_ptr": "*i8", "d_ptr": "*fp16"},
                         {"enable_fp_fusion": False}),
           # dp4a's products for several rows on the int8 tensor cores (jllm.cuda.imma): all 16 rows a program
           "q4_k_imma": (imma._q4_k_imma, {"xq_ptr": "*i8", "s4_ptr": "*fp32", "qs_ptr": "*i32",
                                           "d_ptr": "*fp16", "dmin_ptr": "*fp16", "sc_ptr": "*u8", "mn_ptr": "*u8"},
                         {"enable_fp_fusion": False}),
           "q6_k_imma": (imma._q6_k_imma, {"xq_ptr": "*i8", "s6_ptr": "*i32", "ql_ptr": "*i32",
                                           "qh_ptr": "*i32", "sc_ptr": "*i8", "d_ptr": "*fp16"},
                         {"enable_fp_fusion": False})}
DIVISIBLE = ("N", "K", "Y_STRIDE")      # as triton's launcher specialises them for the real shapes (x 16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=sorted(KERNELS))
    ap.add_argument("--block-n", type=int, default=16)
    ap.add_argument("--sb", type=int, default=1)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=1, help="steps of loads in flight (num_stages)")
    ap.add_argument("--rows", type=int, default=1, help="rows of x a program (jllm.cuda.rows)")
    ap.add_argument("--num-stages", type=int, default=None, help="triton's software pipelining (launch option)")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--no-asm", action="store_true", help="the interpreter's shifts and masks instead of prmt")
    ap.add_argument("--file", help="the kernel from another copy of its module (an experiment)")
    ap.add_argument("--ragged", action="store_true", help="masked tiles (EVEN false)")
    ap.add_argument("--dump", action="store_true", help="print the SASS too")
    ap.add_argument("--maxnreg", type=int, default=None, help="registers a thread at most (launch option)")
    a = ap.parse_args()
    fn, ptrs, *more = KERNELS[a.kernel]
    options = more[0] if more else {}                # compile options the kernel is launched with
    if a.file:
        import importlib.util

        spec = importlib.util.spec_from_file_location("experiment", a.file)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod                  # dataclasses look their module up there
        spec.loader.exec_module(mod)
        fn = getattr(mod, fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__)
    sig = {**ptrs, **_COMMON}
    sig = {name: sig[name] for name in fn.arg_names if name in sig}
    consts = {"BLOCK_N": a.block_n, "SB": a.sb, "HAS_BIAS": False, "USE_ASM": not a.no_asm, "EVEN": not a.ragged,
              "STAGES": a.stages, "ROWS": a.rows}
    consts = {c: v for c, v in consts.items() if c in fn.arg_names}      # the tensor-core kernels take fewer
    sig.update({c: "constexpr" for c in consts})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
             for n, ty in sig.items() if ty.startswith("*") or n in DIVISIBLE}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", a.arch, 32),
                       options={"num_warps": a.warps, **options, **({"maxnreg": a.maxnreg} if a.maxnreg else {}),
                                **({"num_stages": a.num_stages} if a.num_stages else {})})
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    if a.dump:
        print(sass)
    ops = {int(at, 16): op for at, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass)}
    back = [(int(to, 16), int(at, 16)) for at, to in
            re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", sass)
            if int(to, 16) < int(at, 16)]
    regs = re.search(r"REG:(\d+)", usage)
    weights = a.block_n * a.sb * 256 / (32 * a.warps)           # a thread's weights in one step of the loop
    spills = sum(op in ("LDL", "STL") for op in ops.values())
    print(f"{a.kernel} block_n {a.block_n} sb {a.sb} warps {a.warps} rows {a.rows} sm_{a.arch}: {len(ops)} "
          f"instructions, {regs.group(1) if regs else '?'} registers, {k.metadata.shared} B shared, "
          f"{spills} local loads/stores (spills)")
    for lo, hi in back:
        count = collections.Counter(op for at, op in ops.items() if lo <= at <= hi)
        total = sum(count.values())
        print(f"  loop {lo:#06x}-{hi:#06x}: {total} instructions, {total / weights:.2f} a weight "
              f"({weights:.0f} weights a thread a step)")
        print("   ", "  ".join(f"{op} {c}" for op, c in count.most_common(16)))


if __name__ == "__main__":
    main()
