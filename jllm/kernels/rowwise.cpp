// Row-wise operations of the forward pass, one call each instead of torch's chain of small operators
// (F.rms_norm on CPU runs pow, mean, add, rsqrt, mul, ... : ~27 us a call, 49 calls per token of the 0.5B).
// Every row is computed alone, in a fixed order, so results do not depend on how many rows a call holds.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"
#include "vecmath.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using jllm::exp512;

using jllm::tail_mask;

}  // namespace

// x: [R, D] -> x / sqrt(mean(x^2) + eps) * w, per row (q/k norms pass [T * heads, head_dim]).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32, "float32 only");
    x = x.contiguous();
    const int64_t D = w.numel();
    TORCH_CHECK(x.numel() % D == 0, "rms_norm: width mismatch");
    const int64_t R = x.numel() / D;
    auto y = torch::empty_like(x);
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r) {
        const float* xr = xp + r * D;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) {
            const __m512 v = _mm512_maskz_loadu_ps(tail_mask(D - i), xr + i);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const float scale = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / (float)D + (float)eps);
        const __m512 s = _mm512_set1_ps(scale);
        for (int64_t i = 0; i < D; i += 16) {
            const __mmask16 m = tail_mask(D - i);
            _mm512_mask_storeu_ps(yp + r * D + i, m, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + i), s),
                                                                   _mm512_maskz_loadu_ps(m, wp + i)));
        }
    }
    return y;
}

// gu: [T, 2F] (gate | up) -> act(gate) * up, act = silu, or gelu (tanh approximation) when gelu is true.
torch::Tensor glu(torch::Tensor gu, bool gelu) {
    TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == torch::kFloat32 && gu.size(1) % 2 == 0, "gu [T, 2F] float32");
    gu = gu.contiguous();
    const int64_t T = gu.size(0), F = gu.size(1) / 2;
    auto y = torch::empty({T, F}, torch::kFloat32);
    const float* p = gu.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);
    const __m512 c0 = _mm512_set1_ps(0.7978845608028654f), c1 = _mm512_set1_ps(0.044715f);
    for (int64_t t = 0; t < T; ++t) {
        const float* g = p + t * 2 * F;
        const float* u = g + F;
        for (int64_t i = 0; i < F; i += 16) {
            const __mmask16 m = tail_mask(F - i);
            const __m512 x = _mm512_maskz_loadu_ps(m, g + i);
            __m512 a;
            if (gelu) {       // 0.5 x (1 + tanh(z)), tanh(z) = 1 - 2 / (e^{2z} + 1)
                const __m512 z = _mm512_mul_ps(c0, _mm512_fmadd_ps(_mm512_mul_ps(c1, x), _mm512_mul_ps(x, x), x));
                const __m512 th = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f),
                                                                   _mm512_add_ps(exp512(_mm512_add_ps(z, z)), one)));
                a = _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, th));
            } else {          // x / (1 + e^{-x})
                a = _mm512_div_ps(x, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
            }
            _mm512_mask_storeu_ps(yp + t * F + i, m, _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, u + i)));
        }
    }
    return y;
}

// Rotary position embedding of q and k for T new tokens at positions start.., and the cache write of k and v.
// q: [T, H, D], k, v: [T, Hk, D] (any row strides, unit stride in D); cos, sin: [T, rope_dim / 2];
// kc, vc: [Hk, L, D] (one layer of the cache). neox: rotate halves (x_i, x_{i + rope_dim/2}); else adjacent
// pairs (x_{2i}, x_{2i+1}). Dimensions past rope_dim pass through. Returns the rotated q as [T, H, D].
torch::Tensor rope_store(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                         bool neox, int64_t rope_dim, torch::Tensor kc, torch::Tensor vc, int64_t start) {
    TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "unit stride in the head dimension");
    TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(),
                "contiguous cache and tables");
    const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hk = k.size(1), L = kc.size(1);
    TORCH_CHECK(start + T <= L, "the cache is full");
    const int64_t half = rope_dim / 2;
    auto qo = torch::empty({T, H, D}, torch::kFloat32);
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    auto rotate = [&](const float* x, float* y, int64_t t) {
        const float* c = cp + t * half;
        const float* s = sp + t * half;
        if (neox) {
            for (int64_t i = 0; i < half; ++i) {
                const float a = x[i], b = x[i + half];
                y[i] = a * c[i] - b * s[i];
                y[i + half] = b * c[i] + a * s[i];
            }
        } else {
            for (int64_t i = 0; i < half; ++i) {
                const float a = x[2 * i], b = x[2 * i + 1];
                y[2 * i] = a * c[i] - b * s[i];
                y[2 * i + 1] = b * c[i] + a * s[i];
            }
        }
        for (int64_t i = rope_dim; i < D; ++i) y[i] = x[i];
    };
    const float* qp = q.data_ptr<float>();
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    float* qop = qo.data_ptr<float>();
    const bool f16 = half_cache(kc, vc);
    std::vector<float> row(D);
    // a row of the cache: f32 as is, or f16 rounded to nearest
    auto store = [&](const float* x, torch::Tensor& cache, int64_t at) {
        if (f16) {
            c10::Half* d = cache.data_ptr<c10::Half>() + at;
            int64_t i = 0;
            for (; i + 16 <= D; i += 16)        // round to nearest even, as c10::Half below
                _mm256_storeu_si256((__m256i*)(d + i), _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
            for (; i < D; ++i) d[i] = c10::Half(x[i]);
        } else {
            std::copy(x, x + D, cache.data_ptr<float>() + at);
        }
    };
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < H; ++h) rotate(qp + t * q.stride(0) + h * q.stride(1), qop + (t * H + h) * D, t);
        for (int64_t h = 0; h < Hk; ++h) {
            rotate(kp + t * k.stride(0) + h * k.stride(1), row.data(), t);
            store(row.data(), kc, (h * L + start + t) * D);
            store(vp + t * v.stride(0) + h * v.stride(1), vc, (h * L + start + t) * D);
        }
    }
    return qo;
}
