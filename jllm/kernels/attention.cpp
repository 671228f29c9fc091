// Causal attention for a few new queries over the KV cache, one (query, head) at a time, on the CPU.
//
// Each (query, head) pair is computed by the same instructions in the same order whatever the number of
// queries in the call, so the verify pass of speculative decoding gets bitwise the result of single decode
// steps (torch's SDPA splits work differently for different query counts, so jllm called it once per query:
// ~50 us a call, 13 ms of a 9-token verify pass on the 1.5B). Keys are read once per (query, head) pair.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t d) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < d) {
        const __mmask16 m = (__mmask16)((1u << (d - i)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

// out[0:d] += w * v[0:d]
inline void axpy(float* out, float w, const float* v, int64_t d) {
    const __m512 vw = _mm512_set1_ps(w);
    int64_t i = 0;
    for (; i + 16 <= d; i += 16)
        _mm512_storeu_ps(out + i, _mm512_fmadd_ps(vw, _mm512_loadu_ps(v + i), _mm512_loadu_ps(out + i)));
    if (i < d) {
        const __mmask16 m = (__mmask16)((1u << (d - i)) - 1);
        _mm512_mask_storeu_ps(out + i, m, _mm512_fmadd_ps(vw, _mm512_maskz_loadu_ps(m, v + i),
                                                          _mm512_maskz_loadu_ps(m, out + i)));
    }
}

}  // namespace

// q: [T, H, D] f32; k, v: [Hk, L, D] f32 (one layer of the cache; rows start .. start+T-1 already written);
// query t sits at position start + t and sees keys max(0, p - window + 1) .. p (window 0: all). -> [T, H * D]
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t start, int64_t window,
                        double scale) {
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q [T, H, D], k and v [Hk, L, D]");
    TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
                v.scalar_type() == torch::kFloat32, "float32 only");
    q = q.contiguous();
    TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "the cache must be contiguous");
    const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hk = k.size(0), L = k.size(1);
    TORCH_CHECK(H % Hk == 0 && k.size(2) == D && start + T <= L, "shapes do not match");
    const int64_t group = H / Hk;
    auto out = torch::zeros({T, H * D}, torch::kFloat32);
    const float* qp = q.data_ptr<float>();
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const float sc = (float)scale;
    at::parallel_for(0, T * H, 1, [&](int64_t i0, int64_t i1) {
        std::vector<float> w;
        for (int64_t item = i0; item < i1; ++item) {
            const int64_t t = item / H, h = item % H, hk = h / group;
            const int64_t p = start + t;
            const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
            const int64_t n = p - lo + 1;
            w.resize(n);
            const float* qv = qp + (t * H + h) * D;
            const float* kh = kp + (hk * L + lo) * D;
            const float* vh = vp + (hk * L + lo) * D;
            float mx = -INFINITY;
            for (int64_t j = 0; j < n; ++j) {
                w[j] = dot(qv, kh + j * D, D) * sc;
                mx = std::max(mx, w[j]);
            }
            float sum = 0.0f;
            for (int64_t j = 0; j < n; ++j) {
                w[j] = std::exp(w[j] - mx);
                sum += w[j];
            }
            const float inv = 1.0f / sum;
            float* o = op + (t * H + h) * D;
            for (int64_t j = 0; j < n; ++j) axpy(o, w[j] * inv, vh + j * D, D);
        }
    });
    return out;
}
