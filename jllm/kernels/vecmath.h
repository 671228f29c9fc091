// Vector math shared by the kernels.
#pragma once

#include <immintrin.h>

namespace jllm {

// e^x for 16 floats, x clamped to [-87, 88]: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6
// polynomial, scaled by 2^n. About 1 ulp; deterministic (no lookup tables, no library calls).
inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// Mask of the first min(left, 16) lanes.
inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

}  // namespace jllm
