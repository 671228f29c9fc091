"""PTX of the tensor-core kernels' code unpacking (jllm.cuda.mma), kept apart from Triton so that the CPU tests
can run it through an emulator of these few instructions (tests/ptx_subset.py) where no GPU and no Triton is.

Both turn a 32-bit word of codes into f16 codes times their scale two at a time: one `lop3` masks two codes
into the mantissas of the f16 pair 0x6400 0x6400 (1024 + c; with the code 4 bits up, 1024 + 16 c), and one
`fma.rn.f16x2` removes the 1024 and applies the scale s to both: (1024 + c) s - 1024 s = c s, an integer
that f16 holds exactly, so the fused single rounding leaves it exact. Operands are numbered as Triton's
inline_asm_elementwise numbers them: the outputs, then the inputs.
"""

# Q4_K: a word ($8) of 8 nibbles (nibble p at bits 4p), its sub-block's scale s ($9, f16, 0..63) and s / 16
# ($10) -> nibble p times s ($p). A register holds nibbles p and p + 4 (bits 4p and 4p + 16).
Q4_K_CODES = (
    "{ .reg .b32 s, n, s4, n4, w8, p; mov.b32 s, {$9, $9}; mov.b32 s4, {$10, $10};"
    " mov.b32 n, 0xE400E400; mul.rn.f16x2 n, s, n; mov.b32 n4, 0xD400D400; mul.rn.f16x2 n4, s, n4;"  # -1024 s, -64 s
    " shr.u32 w8, $8, 8;"
    " lop3.b32 p, $8, 0x000F000F, 0x64006400, 0xea; fma.rn.f16x2 p, p, s, n; mov.b32 {$0, $4}, p;"
    " lop3.b32 p, $8, 0x00F000F0, 0x64006400, 0xea; fma.rn.f16x2 p, p, s4, n4; mov.b32 {$1, $5}, p;"
    " lop3.b32 p, w8, 0x000F000F, 0x64006400, 0xea; fma.rn.f16x2 p, p, s, n; mov.b32 {$2, $6}, p;"
    " lop3.b32 p, w8, 0x00F000F0, 0x64006400, 0xea; fma.rn.f16x2 p, p, s4, n4; mov.b32 {$3, $7}, p; }")

# Q6_K: a group of 16 weights (one scale): its ql words t = 0, 1 ($32, $33; byte i of word t holds weight
# 2 i + t's low 4 bits in its low nibble, 8 + 2 i + t's in its high one), its qh word ($34; byte i holds the
# high 2 bits of weights 2 i, 8 + 2 i, 2 i + 1, 9 + 2 i at bits 0, 2, 4, 6: jllm.cuda.q6_k.pack_codes), the
# halves a ($35) and b ($39) of its int8 scale (scale = 16 a + b), each also times -1056, 1 / 16 and -96
# ($36..$38, $40..$42; all exact) -> (code - 32) a at output 8 h + 4 t + P for half h of pair P of word t,
# and (code - 32) b at 16 + the same. Pair P: the codes of bytes P % 2 and P % 2 + 2, their low nibbles for
# P < 2, high ones after; each pair's two 4-bit and two 2-bit parts masked into place, pair 0 at bits 0-5
# (1024 + c: fma with a, -1056 a), pairs 1-3 at bits 4-9 (1024 + 16 c: fma with a / 16, -96 a), which spares
# most of the shifts. (q - 32) * scale itself can reach 4,064, past f16's exact integers: hence the halves.
Q6_K_CODES = (
    "{ .reg .b32 a0, a1, a2, a3, b0, b1, b2, b3, p, h;"
    " mov.b32 a0, {$35, $35}; mov.b32 a1, {$36, $36}; mov.b32 a2, {$37, $37}; mov.b32 a3, {$38, $38};"
    " mov.b32 b0, {$39, $39}; mov.b32 b1, {$40, $40}; mov.b32 b2, {$41, $41}; mov.b32 b3, {$42, $42};"
    # word 0: its high bits are qh's bits 0-1 (low nibbles) and 2-3 (high nibbles) of each byte
    " shl.b32 h, $34, 4; lop3.b32 h, h, 0x00300030, 0x64006400, 0xea; lop3.b32 p, $32, 0x000F000F, h, 0xea;"
    " fma.rn.f16x2 h, p, a0, a1; mov.b32 {$0, $8}, h; fma.rn.f16x2 h, p, b0, b1; mov.b32 {$16, $24}, h;"
    " lop3.b32 h, $34, 0x03000300, 0x64006400, 0xea; shr.u32 p, $32, 4; lop3.b32 p, p, 0x00F000F0, h, 0xea;"
    " fma.rn.f16x2 h, p, a2, a3; mov.b32 {$1, $9}, h; fma.rn.f16x2 h, p, b2, b3; mov.b32 {$17, $25}, h;"
    " shl.b32 h, $34, 6; lop3.b32 h, h, 0x03000300, 0x64006400, 0xea; lop3.b32 p, $32, 0x00F000F0, h, 0xea;"
    " fma.rn.f16x2 h, p, a2, a3; mov.b32 {$2, $10}, h; fma.rn.f16x2 h, p, b2, b3; mov.b32 {$18, $26}, h;"
    " shr.u32 h, $34, 2; lop3.b32 h, h, 0x03000300, 0x64006400, 0xea; shr.u32 p, $32, 8;"
    " lop3.b32 p, p, 0x00F000F0, h, 0xea;"
    " fma.rn.f16x2 h, p, a2, a3; mov.b32 {$3, $11}, h; fma.rn.f16x2 h, p, b2, b3; mov.b32 {$19, $27}, h;"
    # word 1: bits 4-5 and 6-7
    " lop3.b32 h, $34, 0x00300030, 0x64006400, 0xea; lop3.b32 p, $33, 0x000F000F, h, 0xea;"
    " fma.rn.f16x2 h, p, a0, a1; mov.b32 {$4, $12}, h; fma.rn.f16x2 h, p, b0, b1; mov.b32 {$20, $28}, h;"
    " shr.u32 h, $34, 4; lop3.b32 h, h, 0x03000300, 0x64006400, 0xea; shr.u32 p, $33, 4;"
    " lop3.b32 p, p, 0x00F000F0, h, 0xea;"
    " fma.rn.f16x2 h, p, a2, a3; mov.b32 {$5, $13}, h; fma.rn.f16x2 h, p, b2, b3; mov.b32 {$21, $29}, h;"
    " shl.b32 h, $34, 2; lop3.b32 h, h, 0x03000300, 0x64006400, 0xea; lop3.b32 p, $33, 0x00F000F0, h, 0xea;"
    " fma.rn.f16x2 h, p, a2, a3; mov.b32 {$6, $14}, h; fma.rn.f16x2 h, p, b2, b3; mov.b32 {$22, $30}, h;"
    " shr.u32 h, $34, 6; lop3.b32 h, h, 0x03000300, 0x64006400, 0xea; shr.u32 p, $33, 8;"
    " lop3.b32 p, p, 0x00F000F0, h, 0xea;"
    " fma.rn.f16x2 h, p, a2, a3; mov.b32 {$7, $15}, h; fma.rn.f16x2 h, p, b2, b3; mov.b32 {$23, $31}, h; }")
