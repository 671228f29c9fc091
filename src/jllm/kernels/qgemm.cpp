// Block-quantized matrix multiply for x86 CPUs with AVX-512 VNNI or AVX2: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// Weights (made by jllm/model/qlinear.py): tiles of 16 output rows; a tile is a sequence of blocks of 32
// inputs, each holding 16 x 32 unsigned integer weights q with one (scale s, min m) pair per output row,
// the value being s * q - m. A tile is of one of four kinds:
//     8-bit   q in 0..255: per block 8 x 64 bytes (register g holds bytes o*4 + i = q[o][4g + i]),
//             then 16 x f16 scales, 16 x f16 mins.
//     4-bit   q in 0..15, two values per byte: per block 4 x 64 bytes (register j holds, for each of the 16
//             rows o, bytes o*4 .. o*4+3: the low nibbles are inputs 4j .. 4j+3 of the block, the high
//             nibbles inputs 4(j+4) .. 4(j+4)+3), then 16 x f16 scales, 16 x f16 mins.
//     compact 4-bit with Q4_K's scale layout: blocks come in super-blocks of g (the largest divisor of the
//             row's block count up to 8); a super-block starts with 16 x f16 scale units D and 16 x f16 min
//             units Dm, and each of its blocks holds the 4 x 64 bytes of weights, then 16 x int8 scale
//             codes and 16 x int8 min codes: s = D * code, m = Dm * code (exact in f32). 288 + 64 / g
//             bytes a block instead of 320: 7.5 % fewer bytes to read per token.
//     6-bit   q in 0..63 (Q6_K, requantized per block of 32): a compact 4-bit block's nibbles, then two
//             64-byte planes of the 2 high bits (plane 0 for the low-nibble registers, plane 1 for the high
//             ones; bits 2j, 2j+1 of a byte belong to register j), then the int8 codes; super-blocks as
//             compact. 416 + 64 / g bytes a block instead of 576.
// One `vpdpbusd` multiplies a register of weights with four activation bytes broadcast to all 16 rows (AVX2:
// each half of a register in its own pass, below).
//
// Activations: each row of x is quantized on its own, per block of 32, to int8 in [-127, 127] with scale
// dx = amax / 127; bsx = dx * sum(q) carries the min term. So
//     y[r][o] = sum_b ( s[o][b] * dx[r][b] * sum_i q_w * q_x  -  m[o][b] * bsx[r][b] ).
// Every row goes through the same instructions in the same order whatever the other rows are: the result is
// batch-invariant by construction (integer sums are exact; float sums run over blocks in a fixed order).
// The weights of a group of tiles are read once from memory and reused from cache for all rows.

#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "vecmath.h"

namespace {

// Activation rows computed together against one tile (up to kMaxRows when that covers the whole call: a
// verify pass of k + 1 <= 10 rows is one chunk). 8 also on AVX2, though 8 rows' sums spill some of its 16
// registers: for prefill chunks it beat 4-6 and 10 (BENCHMARKS.md, "Prefill"; -DJLLM_CHUNK_ROWS=N).
#ifndef JLLM_CHUNK_ROWS
#define JLLM_CHUNK_ROWS 8
#endif
constexpr int kRows = JLLM_CHUNK_ROWS;
constexpr int kMaxRows = 10;
#ifndef JLLM_PREFETCH
#define JLLM_PREFETCH 4096
#endif
constexpr int kPrefetch = JLLM_PREFETCH;   // bytes ahead of the block being computed, into L1 (several rows)
#ifndef JLLM_PREFETCH_L2
#define JLLM_PREFETCH_L2 16384
#endif
constexpr int kPrefetchL2 = JLLM_PREFETCH_L2;   // and far ahead (T1), when kFarRows or more rows are computed
#ifndef JLLM_FAR_ROWS
#define JLLM_FAR_ROWS 3
#endif
#ifndef JLLM_L1_ROWS
#define JLLM_L1_ROWS 1
#endif
constexpr int kL1Rows = JLLM_L1_ROWS;     // the L1 prefetch from this many rows (AVX-512 tiles)
constexpr int kFarRows = JLLM_FAR_ROWS;

#if defined(JLLM_GFNI) && defined(__AVX512F__)
constexpr bool kGfni = true;      // GFNI unpacks nibbles for one row (nibbles() says why not for more)
#else
constexpr bool kGfni = false;
#endif

using namespace jllm;

enum Kind { kEight = 0, kFour = 1, kCompact = 2, kSix = 3 };

#if defined(__AVX512F__)

// Output rows of a tile one pass computes: all 16 in one register (vpdpbusd sums four byte products a lane).
constexpr int kLanes = 16;
using fv = __m512;
using iv = __m512i;
inline iv i_zero() { return _mm512_setzero_si512(); }
inline fv f_zero() { return _mm512_setzero_ps(); }
inline fv f_set1(float x) { return _mm512_set1_ps(x); }
inline fv f_cvt(iv a) { return _mm512_cvtepi32_ps(a); }
inline fv f_load_h(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline fv f_load_i8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
inline fv f_mul(fv a, fv b) { return _mm512_mul_ps(a, b); }
inline fv f_fmadd(fv a, fv b, fv c) { return _mm512_fmadd_ps(a, b, c); }
inline fv f_fnmadd(fv a, fv b, fv c) { return _mm512_fnmadd_ps(a, b, c); }
inline void f_store(float* y, int valid, const float* bias, fv acc) {
    const __mmask16 mask = valid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(y, mask, _mm512_add_ps(acc, bv));
}

// Rounds 32 floats to the nearest integers (|x| <= 127), stores them as int8 and returns their sum.
inline int store_i8(vf a0, vf a1, int8_t* q) {
    const __m512i q0 = _mm512_cvt_roundps_epi32(a0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q1 = _mm512_cvt_roundps_epi32(a1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(q1));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
}

// The 2 high bits of register j's bytes (bits 2j, 2j+1 of each plane byte) moved to bits 4 and 5; the other
// bits are garbage for the caller to mask. 16-bit shifts: what crosses a byte boundary lands outside 4-5.
template <int J>
inline __m512i high_bits(__m512i plane) {
    if constexpr (J == 0) return _mm512_slli_epi16(plane, 4);
    else if constexpr (J == 1) return _mm512_slli_epi16(plane, 2);
    else if constexpr (J == 2) return plane;
    else return _mm512_srli_epi16(plane, 2);
}

// Register J of a block's nibbles: its low nibbles (inputs 4J .. 4J+3) and high nibbles (4(J+4) ..) as bytes,
// with the 2 high bits of 6-bit tiles put in place, each multiplied with its four activation bytes per row.
template <int J, int R, bool SIX>
inline void nibbles(const uint8_t* p, __m512i plane0, __m512i plane1, const int32_t* const* xb, __m512i* ia) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512i v = _mm512_loadu_si512(p + 64 * J);
    __m512i lo = _mm512_and_si512(v, low);
    __m512i hi;
    if constexpr (kGfni && R == 1) {
        // one row: each byte's high nibble moved down by one affine bit-matrix op (GF(2)) instead of shift
        // and mask, one instruction fewer, while the row waits on memory anyway. With more rows the
        // multiplies are the limit, and on Zen 4 the affine op takes a cycle of the multiply pipes where
        // shift and mask go elsewhere, so they use shift and mask (BENCHMARKS.md, "Where the kernel's time
        // goes").
        hi = _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(0x1020408000000000LL), 0);
    } else {
        hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    if constexpr (SIX) {                    // x | (bits & 0x30): one ternary-logic op per register
        const __m512i top = _mm512_set1_epi8(0x30);
        lo = _mm512_ternarylogic_epi32(lo, high_bits<J>(plane0), top, 0xF8);
        hi = _mm512_ternarylogic_epi32(hi, high_bits<J>(plane1), top, 0xF8);
    }
    _Pragma("GCC unroll 10") for (int r = 0; r < R; ++r) {
        ia[r] = _mm512_dpbusd_epi32(ia[r], lo, _mm512_set1_epi32(xb[r][J]));
        ia[r] = _mm512_dpbusd_epi32(ia[r], hi, _mm512_set1_epi32(xb[r][J + 4]));
    }
}

// The integer sums of one block for R activation rows: ia[r] lane o = sum_i q_w[o][i] q_x[r][i].
template <int R, int KIND>
inline void block_sums(const uint8_t* p, const int32_t* const* xb, iv* ia) {
    _Pragma("GCC unroll 10") for (int r = 0; r < R; ++r) ia[r] = i_zero();
    if constexpr (KIND != kEight) {
        __m512i plane0 = _mm512_setzero_si512(), plane1 = _mm512_setzero_si512();
        if constexpr (KIND == kSix) {
            plane0 = _mm512_loadu_si512(p + 256);
            plane1 = _mm512_loadu_si512(p + 320);
        }
        nibbles<0, R, KIND == kSix>(p, plane0, plane1, xb, ia);
        nibbles<1, R, KIND == kSix>(p, plane0, plane1, xb, ia);
        nibbles<2, R, KIND == kSix>(p, plane0, plane1, xb, ia);
        nibbles<3, R, KIND == kSix>(p, plane0, plane1, xb, ia);
    } else {
        for (int g = 0; g < 8; ++g) {
            const __m512i v = _mm512_loadu_si512(p + 64 * g);
            _Pragma("GCC unroll 10") for (int r = 0; r < R; ++r) ia[r] = _mm512_dpbusd_epi32(ia[r], v, _mm512_set1_epi32(xb[r][g]));
        }
    }
}

#else  // AVX2

// Output rows of a tile one pass computes: 8 (a tile takes two passes, one per half of each 64-byte
// register). Without VNNI, vpmaddubsw multiplies unsigned weight bytes with signed activation bytes and adds
// adjacent pairs to 16 bits, and vpmaddwd adds those pairs to 32. The pair sums stay below 2^15 (weights
// <= 63, activations <= 127 in magnitude), so nothing saturates: the integer sums are exactly vpdpbusd's, and
// the float work after them is the same per lane, so the results are bitwise those of the AVX-512 build.
constexpr int kLanes = 8;
using fv = __m256;
using iv = __m256i;
inline iv i_zero() { return _mm256_setzero_si256(); }
inline fv f_zero() { return _mm256_setzero_ps(); }
inline fv f_set1(float x) { return _mm256_set1_ps(x); }
inline fv f_cvt(iv a) { return _mm256_cvtepi32_ps(a); }
inline fv f_load_h(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline fv f_load_i8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline fv f_mul(fv a, fv b) { return _mm256_mul_ps(a, b); }
inline fv f_fmadd(fv a, fv b, fv c) { return _mm256_fmadd_ps(a, b, c); }
inline fv f_fnmadd(fv a, fv b, fv c) { return _mm256_fnmadd_ps(a, b, c); }
inline void f_store(float* y, int valid, const float* bias, fv acc) {
    if (valid >= 8) {
        // without a bias + 0 all the same, as the AVX-512 store adds its zeros (a -0 sum comes out +0 on both)
        _mm256_storeu_ps(y, _mm256_add_ps(acc, bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps()));
        return;
    }
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 bv = bias ? _mm256_maskload_ps(bias, m) : _mm256_setzero_ps();
    _mm256_maskstore_ps(y, m, _mm256_add_ps(acc, bv));
}

inline int store_i8(vf a0, vf a1, int8_t* q) {
    const __m256i q0 = _mm256_cvtps_epi32(a0.lo), q1 = _mm256_cvtps_epi32(a0.hi);    // nearest even (MXCSR)
    const __m256i q2 = _mm256_cvtps_epi32(a1.lo), q3 = _mm256_cvtps_epi32(a1.hi);
    // packs work within 128-bit lanes: dwords come out as q0[0:4] q1[0:4] q2[0:4] q3[0:4] q0[4:8] ...
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i t = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
    const __m128i u = _mm_add_epi32(_mm256_extracti128_si256(t, 1), _mm256_castsi256_si128(t));
    const __m128i w = _mm_add_epi32(u, _mm_shuffle_epi32(u, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(w) + _mm_extract_epi32(w, 1);
}

template <int J>
inline __m256i high_bits(__m256i plane) {     // as the AVX-512 high_bits
    if constexpr (J == 0) return _mm256_slli_epi16(plane, 4);
    else if constexpr (J == 1) return _mm256_slli_epi16(plane, 2);
    else if constexpr (J == 2) return plane;
    else return _mm256_srli_epi16(plane, 2);
}

// Register J of a block for H halves of the tile (p at the first half's bytes; the second, if any, 32 bytes
// on): low nibbles are inputs 4J .. 4J+3, high ones 4(J+4) .. . s[h * R + r]: half h's sums for row r, in 16 bits
// for 4-bit tiles, 32 for 6-bit ones. With H = 2 each broadcast of activation bytes serves both halves.
template <int J, int R, bool SIX, int H>
__attribute__((always_inline)) inline void nibbles(const uint8_t* p, const int32_t* const* xb, __m256i* s) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), top = _mm256_set1_epi8(0x30);
    __m256i lo[H], hi[H];
    _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(p + 64 * J + 32 * h));
        lo[h] = _mm256_and_si256(v, low);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        if constexpr (SIX) {    // the planes of high bits, read again for each register (loads are cheap here)
            const auto plane = [&](int at) {
                return _mm256_and_si256(high_bits<J>(_mm256_loadu_si256((const __m256i*)(p + at + 32 * h))), top);
            };
            lo[h] = _mm256_or_si256(lo[h], plane(256));
            hi[h] = _mm256_or_si256(hi[h], plane(320));
        }
    }
    _Pragma("GCC unroll 10") for (int r = 0; r < R; ++r) {
        const __m256i xa = _mm256_set1_epi32(xb[r][J]), xc = _mm256_set1_epi32(xb[r][J + 4]);
        _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h) {
            __m256i& sum = s[h * R + r];
            const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xa), _mm256_maddubs_epi16(hi[h], xc));
            if constexpr (SIX)  // 2 pairs of <= 63 * 127 each: to 32 bits at once
                sum = J ? _mm256_add_epi32(sum, _mm256_madd_epi16(t, ones)) : _mm256_madd_epi16(t, ones);
            else                // 8 pairs of <= 15 * 127 over the block: below 2^15
                sum = J ? _mm256_add_epi16(sum, t) : t;
        }
        // The empty asm keeps each sum in a register, in this order: otherwise GCC regroups the integer adds
        // into one tree over all the block's products, which keeps them all live and spills most of them
        // (AVX2 has 16 registers; BENCHMARKS.md, "AVX2 kernels"). A row's 16 vpmaddubsw issue in 8 cycles, but
        // the other ops of a block share the same four FP pipes (tile_both says which, and how it spends fewer).
        if constexpr (H == 1)
            __asm__("" : "+x"(s[r]));
        else
            __asm__("" : "+x"(s[r]), "+x"(s[R + r]));
    }
}

// The sums of a block's four registers for H halves; 4-bit ones widened to 32 bits.
template <int R, bool SIX, int H>
__attribute__((always_inline)) inline void nibble_sums(const uint8_t* p, const int32_t* const* xb, __m256i* s) {
    nibbles<0, R, SIX, H>(p, xb, s);
    nibbles<1, R, SIX, H>(p, xb, s);
    nibbles<2, R, SIX, H>(p, xb, s);
    nibbles<3, R, SIX, H>(p, xb, s);
    if constexpr (!SIX)
        _Pragma("GCC unroll 20") for (int i = 0; i < H * R; ++i) s[i] = _mm256_madd_epi16(s[i], _mm256_set1_epi16(1));
}

// p points at the block's first register plus this pass's half (32 bytes in).
template <int R, int KIND>
inline void block_sums(const uint8_t* p, const int32_t* const* xb, iv* ia) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    if constexpr (KIND == kEight) {
        // bytes 0..255 would overflow the pair sums: their nibbles go separately, the high ones weighted 16
        __m256i lo16[R], hi16[R];
        for (int g = 0; g < 8; ++g) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(p + 64 * g));
            const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            _Pragma("GCC unroll 10") for (int r = 0; r < R; ++r) {
                const __m256i x = _mm256_set1_epi32(xb[r][g]);
                const __m256i a = _mm256_maddubs_epi16(lo, x), b = _mm256_maddubs_epi16(hi, x);
                lo16[r] = g ? _mm256_add_epi16(lo16[r], a) : a;      // 8 pairs of <= 15 * 127: below 2^15
                hi16[r] = g ? _mm256_add_epi16(hi16[r], b) : b;
                __asm__("" : "+x"(lo16[r]), "+x"(hi16[r]));          // in order (nibbles() says why)
            }
        }
        const __m256i sixteen = _mm256_set1_epi16(16);
        _Pragma("GCC unroll 10") for (int r = 0; r < R; ++r)
            ia[r] = _mm256_add_epi32(_mm256_madd_epi16(lo16[r], ones), _mm256_madd_epi16(hi16[r], sixteen));
    } else {
        nibble_sums<R, KIND == kSix, 1>(p, xb, ia);
    }
}

#endif

// x: [M, K] f32 -> xq [M, K] int8, dx [M, K/32], bsx [M, K/32]
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* bsx) {
    const int64_t nb = K / 32;
    for (int64_t r = 0; r < M; ++r) {
        for (int64_t b = 0; b < nb; ++b) {
            const float* p = x + r * K + b * 32;
            const vf a0 = vload(p), a1 = vload(p + 16);
            const float amax = vmaxval(vmax(vabs(a0), vabs(a1)));
            const float d = amax / 127.0f;
            const vf vid = vset1(amax > 0.0f ? 127.0f / amax : 0.0f);
            const int s = store_i8(vmul(a0, vid), vmul(a1, vid), xq + r * K + b * 32);
            dx[r * nb + b] = d;
            bsx[r * nb + b] = d * (float)s;
        }
    }
}

// Output rows half * kLanes .. + kLanes of one tile (half is 0 where a pass covers the tile) for R rows of x.
template <int R, int KIND>
inline void tile_rows(const uint8_t* w, int64_t nb, int64_t per_super, const int8_t* xq, const float* dx,
                      const float* bsx, int64_t K, float* y, int64_t ldy, int valid, const float* bias, int half) {
    constexpr bool units = KIND == kCompact || KIND == kSix;
    constexpr int lines = KIND == kEight ? 9 : KIND == kSix ? 7 : 5;   // cache lines of a block
    // this pass's first row of the tile (byte offsets 4, 2, 1 a row); AVX-512 has one pass: a constant 0
    const int lane0 = kAvx512 ? 0 : half * kLanes;
    fv acc[R];
    fv unit_s = f_zero(), unit_m = f_zero();   // compact: the super-block's D, Dm
    _Pragma("GCC unroll 10") for (int r = 0; r < R; ++r) acc[r] = f_zero();
    const uint8_t* p = w;
    for (int64_t b = 0, in_super = 0; b < nb; ++b) {
        if (units && in_super-- == 0) {
            unit_s = f_load_h(p + 2 * lane0);
            unit_m = f_load_h(p + 32 + 2 * lane0);
            p += 64;
            in_super = per_super - 1;
        }
        iv ia[R];
        // Ask for the weights a few blocks ahead into L1 (kPrefetch, 4 KiB), so memory streams while this block
        // computes, and much further ahead into L2 (kPrefetchL2) from kFarRows rows: the compute per block is
        // then long enough to starve the stream. For two rows the far prefetch costs more than it brings. One
        // row was once left to the hardware prefetcher alone; on a later Zen 4 host that made a one-row pass
        // 1.4x slower than a two-row one (-DJLLM_L1_ROWS=2 restores it). Measured distances and row counts:
        // BENCHMARKS.md, "Prefetch distance for several rows" and "Prefetch for one row". (AVX2: the second
        // half's pass reads what the first brought into cache.)
        if constexpr (R >= kL1Rows) {
            if (lane0 == 0)
                for (int l = 0; l < lines; ++l) _mm_prefetch((const char*)p + kPrefetch + 64 * l, _MM_HINT_T0);
        }
        if constexpr (R >= kFarRows) {
            if (lane0 == 0)
                for (int l = 0; l < lines; ++l) _mm_prefetch((const char*)p + kPrefetchL2 + 64 * l, _MM_HINT_T1);
        }
        const int32_t* xb[R];
        _Pragma("GCC unroll 10") for (int r = 0; r < R; ++r) xb[r] = (const int32_t*)(xq + r * K + b * 32);
        block_sums<R, KIND>(p + 4 * lane0, xb, ia);
        p += KIND == kEight ? 512 : KIND == kSix ? 384 : 256;
        fv sc, mn;
        if constexpr (units) {
            sc = f_mul(unit_s, f_load_i8(p + lane0));
            mn = f_mul(unit_m, f_load_i8(p + 16 + lane0));
            p += 32;
        } else {
            sc = f_load_h(p + 2 * lane0);
            mn = f_load_h(p + 32 + 2 * lane0);
            p += 64;
        }
        _Pragma("GCC unroll 10") for (int r = 0; r < R; ++r) {
            const fv t = f_mul(sc, f_set1(dx[r * nb + b]));
            acc[r] = f_fmadd(f_cvt(ia[r]), t, acc[r]);
            acc[r] = f_fnmadd(mn, f_set1(bsx[r * nb + b]), acc[r]);
        }
    }
    _Pragma("GCC unroll 10") for (int r = 0; r < R; ++r) f_store(y + r * ldy + lane0, valid - lane0, bias ? bias + lane0 : nullptr, acc[r]);
}

#if !defined(__AVX512F__)
// AVX2, 4- and 6-bit tiles, few rows: both halves of the tile in one pass. Each broadcast of four activation
// bytes then serves the two halves' registers (8 broadcasts a row and block instead of 16), and so do dx and bsx.
// Every lane goes through the same integer sums and float operations in the same order as in tile_rows, so the
// results are bitwise the same. The sums of both halves take 2R registers: up to kBothRows rows.
// Why it pays: on Zen 3 vpmaddubsw issues two a cycle (FP0, FP3), and a row's block of 512 products needs 16 of
// them, 8 cycles; but every other vector op takes a slot of the same four FP pipes, and a broadcast from memory
// one of FP1 / FP2 (llvm-mca -mcpu=znver3 agrees). Two passes spend ~60 such ops a row and block: 16 products,
// 16 broadcasts, 14 adds, 14 for the scales. Sharing the broadcasts drops 10 of them (BENCHMARKS.md, "AVX2
// kernels").
template <int R, int KIND>
void tile_both(const uint8_t* w, int64_t nb, int64_t per_super, const int8_t* xq, const float* dx, const float* bsx,
               int64_t K, float* y, int64_t ldy, int valid, const float* bias, int) {
    constexpr bool six = KIND == kSix, units = KIND == kCompact || six;
    constexpr int lines = six ? 7 : 5;
    fv acc0[R], acc1[R];
    _Pragma("GCC unroll 10") for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = f_zero();
    const uint8_t* unit = w;    // compact and 6-bit: the super-block's D (16 x f16), then Dm
    const uint8_t* p = w;
    for (int64_t b = 0, in_super = 0; b < nb; ++b) {
        if (units && in_super-- == 0) {
            unit = p;
            p += 64;
            in_super = per_super - 1;
        }
        // Into L1 also for one row, unlike tile_rows on AVX-512: here one row's pass is long enough that the
        // hardware prefetcher alone falls behind. The far prefetch stays at kFarRows rows, as there
        // (BENCHMARKS.md, "AVX2 kernels").
        for (int l = 0; l < lines; ++l) _mm_prefetch((const char*)p + kPrefetch + 64 * l, _MM_HINT_T0);
        if constexpr (R >= kFarRows)
            for (int l = 0; l < lines; ++l) _mm_prefetch((const char*)p + kPrefetchL2 + 64 * l, _MM_HINT_T1);
        const int32_t* xb[R];
        _Pragma("GCC unroll 10") for (int r = 0; r < R; ++r) xb[r] = (const int32_t*)(xq + r * K + b * 32);
        __m256i s[2 * R];           // half 0's sums, then half 1's
        nibble_sums<R, six, 2>(p, xb, s);
        const __m256i* s0 = s;
        const __m256i* s1 = s + R;
        p += six ? 384 : 256;
        fv sc0, sc1, mn0, mn1;
        if constexpr (units) {
            sc0 = f_mul(f_load_h(unit), f_load_i8(p));
            sc1 = f_mul(f_load_h(unit + 16), f_load_i8(p + 8));
            mn0 = f_mul(f_load_h(unit + 32), f_load_i8(p + 16));
            mn1 = f_mul(f_load_h(unit + 48), f_load_i8(p + 24));
            p += 32;
        } else {
            sc0 = f_load_h(p);
            sc1 = f_load_h(p + 16);
            mn0 = f_load_h(p + 32);
            mn1 = f_load_h(p + 48);
            p += 64;
        }
        _Pragma("GCC unroll 10") for (int r = 0; r < R; ++r) {
            const fv d = f_set1(dx[r * nb + b]), m = f_set1(bsx[r * nb + b]);
            acc0[r] = f_fmadd(f_cvt(s0[r]), f_mul(sc0, d), acc0[r]);
            acc0[r] = f_fnmadd(mn0, m, acc0[r]);
            acc1[r] = f_fmadd(f_cvt(s1[r]), f_mul(sc1, d), acc1[r]);
            acc1[r] = f_fnmadd(mn1, m, acc1[r]);
        }
    }
    _Pragma("GCC unroll 10") for (int r = 0; r < R; ++r) {
        f_store(y + r * ldy, valid, bias, acc0[r]);
        f_store(y + r * ldy + kLanes, valid - kLanes, bias ? bias + kLanes : nullptr, acc1[r]);
    }
}
#endif

using TileFn = void (*)(const uint8_t*, int64_t, int64_t, const int8_t*, const float*, const float*, int64_t,
                        float*, int64_t, int, const float*, int);
template <int KIND>
constexpr TileFn kByRows[kMaxRows + 1] = {nullptr, tile_rows<1, KIND>, tile_rows<2, KIND>, tile_rows<3, KIND>,
                                        tile_rows<4, KIND>, tile_rows<5, KIND>, tile_rows<6, KIND>,
                                        tile_rows<7, KIND>, tile_rows<8, KIND>, tile_rows<9, KIND>,
                                        tile_rows<10, KIND>};
constexpr const TileFn* kTile[4] = {kByRows<kEight>, kByRows<kFour>, kByRows<kCompact>, kByRows<kSix>};
// AVX2's one-pass tiles (tile_both); the AVX-512 build has none.
// Rows a one-pass group takes (-DJLLM_BOTH_ROWS=N): 4. With 5 or more the sums of both halves no longer fit
// AVX2's 16 registers and spill, which made one group of 5-8 rows no faster than two passes (BENCHMARKS.md,
// "AVX2 kernels").
#ifndef JLLM_BOTH_ROWS
#define JLLM_BOTH_ROWS 4
#endif
constexpr int kBothRows = JLLM_BOTH_ROWS;    // 0: tile_rows only
// 6-bit tiles (-DJLLM_BOTH_SIX=0 / 1 / 2: never / up to kBothRows rows / also in groups): up to kBothRows rows
// in one pass, more a half at a time; groups of 6-bit tiles did not pay (BENCHMARKS.md, "AVX2 kernels").
#ifndef JLLM_BOTH_SIX
#define JLLM_BOTH_SIX 1
#endif
constexpr int kBothSix = JLLM_BOTH_SIX;
static_assert(kBothRows >= 0 && kBothRows <= 4, "JLLM_BOTH_ROWS: 0 .. 4");
#if !defined(__AVX512F__)
template <int KIND>
constexpr TileFn kBothByRows[5] = {nullptr, tile_both<1, KIND>, tile_both<2, KIND>, tile_both<3, KIND>,
                                   tile_both<4, KIND>};
// The one-pass tile for this kind and number of rows (<= kBothRows), or nullptr: tile_rows, a pass a half.
inline TileFn both_tile(int kind, int rows, int valid) {
    if (valid <= kLanes || kBothRows < 1) return nullptr;
    return kind == kCompact ? kBothByRows<kCompact>[rows] : kind == kFour ? kBothByRows<kFour>[rows]
         : kind == kSix && kBothSix ? kBothByRows<kSix>[rows] : nullptr;
}
#else
inline TileFn both_tile(int, int, int) { return nullptr; }
#endif
// Groups (-DJLLM_GROUPS=0 / 1 / 2: none, more rows then a pass a half / near-equal / as full as possible):
// near-equal groups, so that no group is left with one or two rows (BENCHMARKS.md, "AVX2 kernels").
#ifndef JLLM_GROUPS
#define JLLM_GROUPS 1
#endif
constexpr int kGroups = JLLM_GROUPS;
// Whether a tile's rows go through tile_both (in groups where there are more than kBothRows).
inline bool one_pass_groups(int kind, int rows, int valid) {
    if (!both_tile(kind, 1, valid)) return false;
    return rows <= kBothRows || (kGroups && (kind != kSix || kBothSix > 1));
}

// Decode steps and verify passes (one tile a group): each thread streams its own contiguous share, claiming
// JLLM_STEAL bytes of tiles at a time, and then takes what is left of the others' shares (0: static shares).
// Static halves left one thread idle at the end of every matrix while the other finished: the two halves,
// equal in bytes, do not stream at equal speed, and a draft step has ~100 matrices (BENCHMARKS.md, "AVX2
// kernels"). The tiles are independent, so which thread computes one does not change a bit.
#ifndef JLLM_STEAL
#define JLLM_STEAL 131072
#endif
constexpr int64_t kSteal = JLLM_STEAL;

// Blocks per super-block of a compact tile: the largest divisor of the row's block count up to 8 (8 for
// Q4_K rows, whose super-blocks are 256 inputs). qlinear.super_blocks is the same rule.
int64_t super_blocks(int64_t nb) {
    int64_t g = 8;
    while (nb % g) --g;
    return g;
}

}  // namespace

QView qview(const torch::Tensor& data, const torch::Tensor& offsets, const torch::Tensor& kinds, int64_t n,
            const torch::Tensor& bias) {
    TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous(), "data must be contiguous uint8");
    TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.is_contiguous() && offsets.numel() >= 2,
                "offsets must be int64 [T + 1]");
    const int64_t T = offsets.numel() - 1;
    TORCH_CHECK(n <= 16 * T && n > 16 * (T - 1), "n does not match the tiles");
    TORCH_CHECK(kinds.scalar_type() == at::kByte && kinds.numel() == T, "kinds must be uint8 [T]");
    const uint8_t* kind = kinds.data_ptr<uint8_t>();
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(kind[t] <= kSix, "unknown tile kind");
    TORCH_CHECK(!bias.numel() || (bias.scalar_type() == at::kFloat && bias.numel() == n), "bias must be [n] f32");
    return QView{data.data_ptr<uint8_t>(), offsets.data_ptr<int64_t>(), kind, T, n,
                 bias.numel() ? bias.data_ptr<float>() : nullptr};
}

void qmatmul_raw(const float* x, int64_t M, int64_t K, const QView& w, float* y, int64_t group_bytes) {
    TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
    const int64_t nb = K / 32, T = w.tiles, n = w.n;
    // The quantized activations go to buffers of the calling thread, kept between calls (they grow to the
    // largest call, a few MB for a prefill chunk): three tensor allocations fewer a call, of which the draft
    // makes ~100 a step, each serial time with the other thread idle.
    thread_local std::vector<int8_t> xq_buf;
    thread_local std::vector<float> scale_buf;
    xq_buf.resize((size_t)(M * K));
    scale_buf.resize((size_t)(2 * M * nb));
    int8_t* const xqp = xq_buf.data();
    float* const dxp = scale_buf.data();
    float* const bsp = dxp + M * nb;
    quantize_rows(x, M, K, xqp, dxp, bsp);
    const uint8_t* const wp = w.data;
    const int64_t* const off = w.offsets;
    const uint8_t* const kind = w.kinds;
    const float* const bp = w.bias;
    const int64_t per_super = super_blocks(nb);
    // Tiles are processed in groups whose weights stay in cache while every row chunk passes over them.
    const int64_t tile_bytes = std::max<int64_t>(1, (off[T] - off[0]) / T);
    // With one chunk of rows (M <= kMaxRows: decode steps, verify passes) there is nothing to reuse: a group
    // is one tile, and the threads share them by stealing (kSteal). Groups of 96 KiB would split the draft's
    // smaller matrices unevenly (its attention projections are 7 groups: 4 : 3), and the thread with less work
    // would wait.
    const int64_t group = M <= kMaxRows ? 1 : std::max<int64_t>(1, group_bytes / tile_bytes);
    const int64_t ngroups = (T + group - 1) / group;
    const auto run_group = [&](int64_t g) {
        const int64_t t0 = g * group, t1 = std::min(T, t0 + group);
        const int64_t chunk = M <= kMaxRows ? M : kRows;
        for (int64_t r0 = 0; r0 < M; r0 += chunk) {
            const int rows = (int)std::min<int64_t>(chunk, M - r0);
            for (int64_t t = t0; t < t1; ++t) {
                const int valid = (int)std::min<int64_t>(16, n - 16 * t);
                if (one_pass_groups(kind[t], rows, valid)) {
                    // the rows in near-equal groups of up to kBothRows, each group one pass over both halves;
                    // the later groups read the tile's weights from cache
                    const int groups = (rows + kBothRows - 1) / std::max(kBothRows, 1);
                    for (int j = 0, q0 = 0; j < groups; ++j) {
                        const int q = kGroups == 2 ? std::min(kBothRows, rows - q0) : (rows - q0) / (groups - j);
                        both_tile(kind[t], q, valid)(wp + off[t], nb, per_super, xqp + (r0 + q0) * K,
                                                     dxp + (r0 + q0) * nb, bsp + (r0 + q0) * nb, K,
                                                     y + (r0 + q0) * n + 16 * t, n, valid,
                                                     bp ? bp + 16 * t : nullptr, 0);
                        q0 += q;
                    }
                    continue;
                }
                for (int half = 0; half * kLanes < valid; ++half)
                    kTile[kind[t]][rows](wp + off[t], nb, per_super, xqp + r0 * K, dxp + r0 * nb, bsp + r0 * nb,
                                         K, y + r0 * n + 16 * t, n, valid, bp ? bp + 16 * t : nullptr, half);
            }
        }
    };
    const int threads = at::get_num_threads();
    if (kSteal && group == 1 && threads > 1 && ngroups >= 2 * threads) {
        // Each thread streams its own contiguous share of the tiles, claiming kSteal bytes at a time from its
        // cursor; once done it takes what is left of the others' shares, so no thread waits idle at the end.
        // (Called inside a parallel region, parallel_for runs all of it on this thread: the same tiles.)
        struct alignas(64) Cursor { std::atomic<int64_t> next; int64_t end; };
        std::vector<Cursor> cursors(threads);
        for (int i = 0; i < threads; ++i) {
            cursors[i].next.store(ngroups * i / threads, std::memory_order_relaxed);
            cursors[i].end = ngroups * (i + 1) / threads;
        }
        const int64_t step = std::max<int64_t>(1, kSteal / tile_bytes);
        at::parallel_for(0, threads, 1, [&](int64_t i0, int64_t i1) {
            for (int64_t i = i0; i < i1; ++i)
                for (int o = 0; o < threads; ++o) {
                    Cursor& c = cursors[(i + o) % threads];
                    for (int64_t g; (g = c.next.fetch_add(step, std::memory_order_relaxed)) < c.end;)
                        for (int64_t e = std::min(c.end, g + step); g < e; ++g) run_group(g);
                }
        });
        return;
    }
    at::parallel_for(0, ngroups, 1, [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; ++g) run_group(g);
    });
}

// x: [M, K] f32; data: uint8 (all tiles); offsets: int64 [T + 1] byte offset of each tile; kinds: uint8 [T]
// (Kind above); n: output features (<= 16 T); bias: [n] f32 or empty. -> y [M, n] f32
torch::Tensor qmatmul(torch::Tensor x, torch::Tensor data, torch::Tensor offsets, torch::Tensor kinds,
                      int64_t n, torch::Tensor bias, int64_t group_bytes) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [M, K] float32");
    x = x.contiguous();
    const QView w = qview(data, offsets, kinds, n, bias);
    auto y = torch::empty({x.size(0), n}, at::kFloat);
    qmatmul_raw(x.data_ptr<float>(), x.size(0), x.size(1), w, y.data_ptr<float>(), group_bytes);
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("qmatmul", &qmatmul, "block-quantized matmul (AVX-512 VNNI, or AVX2)");
    m.attr("isa") = kAvx512 ? "avx512" : "avx2";
    m.def("attention", &attention, "causal attention over the cache, one (query, kv head) item at a time");
    m.def("rms_norm", &rms_norm, "RMS norm per row");
    m.def("glu", &glu, "act(gate) * up, act silu or gelu-tanh");
    m.def("argmax_rows", &argmax_rows, "index of each row's largest value (torch.argmax's rules)");
    m.def("top_prob", &top_prob, "argmax of a logits row and its softmax probability");
    m.def("nucleus", &nucleus, "top-p's set of a distribution (jllm.sampling.nucleus's, bit for bit)");
    m.def("rope_store", &rope_store, "rotary embedding of q and k, k and v written to the cache");
    register_stack(m);
}
