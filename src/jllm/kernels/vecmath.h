// Vectors of 16 floats for the kernels, on two instruction sets: AVX-512 (one register) or AVX2 + FMA + F16C
// (two 8-lane halves; Zen 2/3, Haswell to Alder Lake, most laptops). The build picks one by the compiler's
// flags (jllm/kernels/__init__.py picks those by the CPU). Every operation is lane by lane, and the two
// horizontal ones (vsum, and transpose_sum in attention.cpp) add by the same tree on both, so a kernel written
// with these gives bitwise the same results on either instruction set.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace jllm {

#if defined(__AVX512F__)

constexpr bool kAvx512 = true;
using vf = __m512;
using vmask = __mmask16;

inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vabs(vf a) { return _mm512_abs_ps(a); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }      // a b + c
inline vf vfnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }    // c - a b
inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vscale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }               // p 2^n, n whole
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
inline float vmaxval(vf a) { return _mm512_reduce_max_ps(a); }
// 16 f16 -> f32 (exact); f32 -> f16 rounded to nearest even; 16 int8 -> f32
inline vf vload_h(const void* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline void vstore_h(void* p, vf v) { _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)); }
inline vf vload_i8(const void* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }

// Masks: lane i set in tail_mask(left) when i < left.
inline vmask tail_mask(int64_t left) { return left >= 16 ? (vmask)0xFFFF : left <= 0 ? (vmask)0 : (vmask)((1u << left) - 1); }
inline vmask mask_and_not(vmask a, vmask b) { return (vmask)(a & ~b); }
inline vmask mask_and(vmask a, vmask b) { return (vmask)(a & b); }
inline vmask mask_or(vmask a, vmask b) { return (vmask)(a | b); }
inline bool mask_any(vmask m) { return m != 0; }
inline vmask vgt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline vmask visnan(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline vf vload_z(vmask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }            // others 0
inline vf vload_or(vf fill, vmask m, const float* p) { return _mm512_mask_loadu_ps(fill, m, p); }
inline void vstore_m(float* p, vmask m, vf v) { _mm512_mask_storeu_ps(p, m, v); }
inline vf vkeep(vmask m, vf v) { return _mm512_maskz_mov_ps(m, v); }                          // others 0
inline vf vselect(vmask m, vf a, vf b) { return _mm512_mask_mov_ps(b, m, a); }                 // m ? a : b

// Within each 128-bit lane (as the instructions of those names), and across them: lanes (a0, a2, b0, b2) and
// (a1, a3, b1, b3) of four.
inline vf vunpacklo(vf a, vf b) { return _mm512_unpacklo_ps(a, b); }
inline vf vunpackhi(vf a, vf b) { return _mm512_unpackhi_ps(a, b); }
inline vf vunpacklo2(vf a, vf b) { return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); }
inline vf vunpackhi2(vf a, vf b) { return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); }
inline vf vquads_even(vf a, vf b) { return _mm512_shuffle_f32x4(a, b, 0x88); }
inline vf vquads_odd(vf a, vf b) { return _mm512_shuffle_f32x4(a, b, 0xDD); }

#else

constexpr bool kAvx512 = false;
struct vf { __m256 lo, hi; };        // lanes 0-7, 8-15
struct vmask { __m256 lo, hi; };     // all bits of a lane set, or none

inline vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vf vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
#define JLLM_LANEWISE(name, op) \
    inline vf name(vf a, vf b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
JLLM_LANEWISE(vadd, _mm256_add_ps)
JLLM_LANEWISE(vsub, _mm256_sub_ps)
JLLM_LANEWISE(vmul, _mm256_mul_ps)
JLLM_LANEWISE(vdiv, _mm256_div_ps)
JLLM_LANEWISE(vmax, _mm256_max_ps)
JLLM_LANEWISE(vmin, _mm256_min_ps)
JLLM_LANEWISE(vunpacklo, _mm256_unpacklo_ps)
JLLM_LANEWISE(vunpackhi, _mm256_unpackhi_ps)
#undef JLLM_LANEWISE
inline vf vabs(vf a) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
inline vf vfmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf vfnmadd(vf a, vf b, vf c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf vround(vf a) {
    constexpr int r = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_round_ps(a.lo, r), _mm256_round_ps(a.hi, r)};
}
// p 2^n for whole n in [-126, 127] (vexp's range): 2^n is a normal float built from its exponent bits, and
// the product rounds as the AVX-512 scalef does.
inline __m256 scale2(__m256 p, __m256 n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline vf vscale2(vf p, vf n) { return {scale2(p.lo, n.lo), scale2(p.hi, n.hi)}; }
// The tree of GCC's _mm512_reduce_add_ps: halves, then 128-bit quarters, then pairs.
inline float vsum(vf a) {
    const __m256 t = _mm256_add_ps(a.hi, a.lo);
    const __m128 u = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    const __m128 w = _mm_add_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(w) + _mm_cvtss_f32(_mm_shuffle_ps(w, w, 1));
}
inline float vmaxval(vf a) {
    const __m256 t = _mm256_max_ps(a.hi, a.lo);
    const __m128 u = _mm_max_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    const __m128 w = _mm_max_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
    const float x = _mm_cvtss_f32(w), y = _mm_cvtss_f32(_mm_shuffle_ps(w, w, 1));
    return x > y ? x : y;
}
inline vf vload_h(const void* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p + 1))};
}
inline void vstore_h(void* p, vf v) {
    _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(v.lo, _MM_FROUND_TO_NEAREST_INT));
    _mm_storeu_si128((__m128i*)p + 1, _mm256_cvtps_ph(v.hi, _MM_FROUND_TO_NEAREST_INT));
}
inline __m256 load8_i8(const void* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline vf vload_i8(const void* p) { return {load8_i8(p), load8_i8((const int8_t*)p + 8)}; }

inline vmask tail_mask(int64_t left) {
    const __m256i n = _mm256_set1_epi32((int)(left < 0 ? 0 : left > 16 ? 16 : left));
    return {_mm256_castsi256_ps(_mm256_cmpgt_epi32(n, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))),
            _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)))};
}
inline vmask mask_and_not(vmask a, vmask b) { return {_mm256_andnot_ps(b.lo, a.lo), _mm256_andnot_ps(b.hi, a.hi)}; }
inline vmask mask_and(vmask a, vmask b) { return {_mm256_and_ps(a.lo, b.lo), _mm256_and_ps(a.hi, b.hi)}; }
inline vmask mask_or(vmask a, vmask b) { return {_mm256_or_ps(a.lo, b.lo), _mm256_or_ps(a.hi, b.hi)}; }
inline bool mask_any(vmask m) { return _mm256_movemask_ps(_mm256_or_ps(m.lo, m.hi)) != 0; }
inline vmask vgt(vf a, vf b) { return {_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)}; }
inline vmask visnan(vf a) { return {_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)}; }
inline vf vload_z(vmask m, const float* p) {      // masked-off lanes are not read (no fault past an array's end)
    return {_mm256_maskload_ps(p, _mm256_castps_si256(m.lo)), _mm256_maskload_ps(p + 8, _mm256_castps_si256(m.hi))};
}
inline vf vselect(vmask m, vf a, vf b) { return {_mm256_blendv_ps(b.lo, a.lo, m.lo), _mm256_blendv_ps(b.hi, a.hi, m.hi)}; }
inline vf vload_or(vf fill, vmask m, const float* p) { return vselect(m, vload_z(m, p), fill); }
inline void vstore_m(float* p, vmask m, vf v) {
    _mm256_maskstore_ps(p, _mm256_castps_si256(m.lo), v.lo);
    _mm256_maskstore_ps(p + 8, _mm256_castps_si256(m.hi), v.hi);
}
inline vf vkeep(vmask m, vf v) { return {_mm256_and_ps(m.lo, v.lo), _mm256_and_ps(m.hi, v.hi)}; }

inline vf vunpacklo2(vf a, vf b) {
    auto f = [](__m256 x, __m256 y) { return _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(x), _mm256_castps_pd(y))); };
    return {f(a.lo, b.lo), f(a.hi, b.hi)};
}
inline vf vunpackhi2(vf a, vf b) {
    auto f = [](__m256 x, __m256 y) { return _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(x), _mm256_castps_pd(y))); };
    return {f(a.lo, b.lo), f(a.hi, b.hi)};
}
// 128-bit lanes of a are (a.lo low, a.lo high, a.hi low, a.hi high)
inline vf vquads_even(vf a, vf b) { return {_mm256_permute2f128_ps(a.lo, a.hi, 0x20), _mm256_permute2f128_ps(b.lo, b.hi, 0x20)}; }
inline vf vquads_odd(vf a, vf b) { return {_mm256_permute2f128_ps(a.lo, a.hi, 0x31), _mm256_permute2f128_ps(b.lo, b.hi, 0x31)}; }

#endif

// e^x for 16 floats, x clamped to [-87, 88]: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6
// polynomial, scaled by 2^n. About 1 ulp; deterministic (no lookup tables, no library calls).
inline vf vexp(vf x) {
    x = vmin(vmax(x, vset1(-87.0f)), vset1(88.0f));
    const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
    vf r = vfnmadd(n, vset1(0.693145751953125f), x);
    r = vfnmadd(n, vset1(1.428606765330187045e-06f), r);
    vf p = vset1(1.0f / 720);
    p = vfmadd(p, r, vset1(1.0f / 120));
    p = vfmadd(p, r, vset1(1.0f / 24));
    p = vfmadd(p, r, vset1(1.0f / 6));
    p = vfmadd(p, r, vset1(0.5f));
    p = vfmadd(p, r, vset1(1.0f));
    p = vfmadd(p, r, vset1(1.0f));
    return vscale2(p, n);
}

}  // namespace jllm
