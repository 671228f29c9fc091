"""An emulator of the few PTX instructions that jllm's inline assembly uses (jllm.cuda.ptx), so that the CPU tests
run the assembly itself, element-wise over numpy arrays: `.reg` declarations, `mov.b32` (a register, an
immediate, or two 16-bit halves packed / unpacked with `{lo, hi}`), `shl.b32`, `shr.u32`, `lop3.b32` with any
truth table, and `mul.rn.f16x2` / `fma.rn.f16x2` (each half computed in float64, then rounded once to f16:
exact for fma where the true result needs no more than float64's 53 bits, as for the small integers and
dyadic fractions here), `dp4a.u32.s32` (jllm.cuda.dp4a: four unsigned bytes times four signed ones, plus an
int32, wrapping as the hardware does) and `cvt.rni.s32.f32` (round to nearest, ties to even). Operands `$i` are
Triton's numbering: outputs first, then inputs. Anything else is refused, so the emulator never silently skips
an instruction it does not know."""

from __future__ import annotations

import re

import numpy as np

_U32 = np.uint32


def _imm(text: str) -> np.ndarray:
    return np.array(int(text, 0) & 0xFFFFFFFF, dtype=_U32)


def _halves(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A 32-bit word -> its two f16 halves as float64 (low, high)."""
    lo = (v & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (v >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
    return lo, hi


def _pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Two float64 arrays -> the 32-bit word of their f16 roundings (round to nearest even)."""
    lo16 = lo.astype(np.float16).view(np.uint16).astype(_U32)
    hi16 = hi.astype(np.float16).view(np.uint16).astype(_U32)
    return lo16 | (hi16 << 16)


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    """Bit i of the result = bit ((a_i << 2) | (b_i << 1) | c_i) of the truth table lut (PTX's definition)."""
    out = np.zeros(np.broadcast(a, b, c).shape, dtype=_U32)
    for combo in range(8):
        if lut >> combo & 1:
            ma = a if combo & 4 else ~a
            mb = b if combo & 2 else ~b
            mc = c if combo & 1 else ~c
            out |= ma & mb & mc
    return out


def run(asm: str, inputs: list[np.ndarray], n_out: int) -> list[np.ndarray]:
    """Runs `asm` over the inputs (uint32 arrays of one shape; a 16-bit operand in its low half) -> the n_out
    outputs (uint32; a 16-bit output in the low half)."""
    regs: dict[str, np.ndarray] = {}
    for i, v in enumerate(inputs):
        regs[f"${n_out + i}"] = np.asarray(v, dtype=_U32)

    def val(op: str) -> np.ndarray:
        op = op.strip()
        if op in regs:
            return regs[op]
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", op):
            return _imm(op)
        raise ValueError(f"unknown operand {op!r}")

    body = asm.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise ValueError("expected one { ... } block")
    for stmt in body[1:-1].split(";"):
        stmt = stmt.strip()
        if not stmt:
            continue
        op, _, rest = stmt.partition(" ")
        if op == ".reg":
            kind, _, names = rest.strip().partition(" ")
            if kind != ".b32":
                raise ValueError(f"register kind {kind}")
            for name in names.split(","):
                regs[name.strip()] = np.array(0, dtype=_U32)
            continue
        if op == "mov.b32":
            m = re.fullmatch(r"\{\s*(\S+)\s*,\s*(\S+)\s*\}\s*,\s*(\S+)", rest.strip())
            if m:                                             # unpack: {lo, hi}, word
                word = val(m.group(3))
                regs[m.group(1)] = word & 0xFFFF
                regs[m.group(2)] = word >> 16
                continue
            m = re.fullmatch(r"(\S+)\s*,\s*\{\s*(\S+)\s*,\s*(\S+)\s*\}", rest.strip())
            if m:                                             # pack: word, {lo, hi}
                regs[m.group(1)] = (val(m.group(2)) & 0xFFFF) | ((val(m.group(3)) & 0xFFFF) << 16)
                continue
            d, a = (x.strip() for x in rest.split(","))
            regs[d] = val(a).copy()
            continue
        args = [x.strip() for x in rest.split(",")]
        if op == "shl.b32":
            regs[args[0]] = (val(args[1]) << (int(val(args[2])) & 31)).astype(_U32)
        elif op == "shr.u32":
            regs[args[0]] = val(args[1]) >> (int(val(args[2])) & 31)
        elif op == "lop3.b32":
            regs[args[0]] = _lop3(val(args[1]), val(args[2]), val(args[3]), int(args[4], 0))
        elif op == "mul.rn.f16x2":
            (alo, ahi), (blo, bhi) = _halves(val(args[1])), _halves(val(args[2]))
            regs[args[0]] = _pack(alo * blo, ahi * bhi)
        elif op == "fma.rn.f16x2":
            (alo, ahi), (blo, bhi), (clo, chi) = (_halves(val(a)) for a in args[1:4])
            regs[args[0]] = _pack(alo * blo + clo, ahi * bhi + chi)
        elif op == "dp4a.u32.s32":
            a, b, c = (val(x).astype(np.int64) for x in args[1:4])
            total = c.copy()
            for i in range(4):
                ua = (a >> (8 * i)) & 255
                sb = ((b >> (8 * i)) & 255) ^ 128                      # signed byte: (u ^ 128) - 128
                total = total + ua * (sb - 128)
            regs[args[0]] = (total & 0xFFFFFFFF).astype(_U32)
        elif op == "cvt.rni.s32.f32":
            f = val(args[1]).astype(_U32).view(np.float32)
            regs[args[0]] = (np.asarray(np.rint(f)).astype(np.int64) & 0xFFFFFFFF).astype(_U32)
        else:
            raise ValueError(f"instruction {op!r} is not emulated")
    return [regs[f"${i}"] for i in range(n_out)]
