// Row-wise operations of the forward pass, one call each instead of torch's chain of small operators
// (F.rms_norm on CPU runs pow, mean, add, rsqrt, mul, ... : ~27 us a call, 49 calls per token of the 0.5B).
// Every row is computed alone, in a fixed order, so results do not depend on how many rows a call holds.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"
#include "vecmath.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using namespace jllm;

// One row: y = x / sqrt(mean(x^2) + eps) * w (y may be x: the row is read whole before it is written).
inline void norm_row(const float* x, int64_t D, const float* w, float eps, float* y) {
    vf ss = vzero();
    for (int64_t i = 0; i < D; i += 16) {
        const vf v = vload_z(tail_mask(D - i), x + i);
        ss = vfmadd(v, v, ss);
    }
    const vf s = vset1(1.0f / std::sqrt(vsum(ss) / (float)D + eps));
    for (int64_t i = 0; i < D; i += 16) {
        const vmask m = tail_mask(D - i);
        vstore_m(y + i, m, vmul(vmul(vload_z(m, x + i), s), vload_z(m, w + i)));
    }
}

}  // namespace

void rms_norm_raw(const float* x, int64_t R, int64_t D, const float* w, float eps, float* y) {
    for (int64_t r = 0; r < R; ++r) norm_row(x + r * D, D, w, eps, y + r * D);
}

// The residual add and the next norm in one pass: x += a, then y = rms_norm(x) (the same sums, in the same
// order, as an add followed by rms_norm_raw). Without w (null) only the add.
void add_rms_norm_raw(float* x, const float* a, int64_t R, int64_t D, const float* w, float eps, float* y) {
    for (int64_t r = 0; r < R; ++r) {
        float* xr = x + r * D;
        const float* ar = a + r * D;
        for (int64_t i = 0; i < D; i += 16) {
            const vmask m = tail_mask(D - i);
            vstore_m(xr + i, m, vadd(vload_z(m, xr + i), vload_z(m, ar + i)));
        }
        if (w) norm_row(xr, D, w, eps, y + r * D);
    }
}

// x: [R, D] -> x / sqrt(mean(x^2) + eps) * w, per row (q/k norms pass [T * heads, head_dim]).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "float32 only");
    x = x.contiguous();
    const int64_t D = w.numel();
    TORCH_CHECK(x.numel() % D == 0, "rms_norm: width mismatch");
    auto y = torch::empty_like(x);
    rms_norm_raw(x.data_ptr<float>(), x.numel() / D, D, w.contiguous().data_ptr<float>(), (float)eps,
                 y.data_ptr<float>());
    return y;
}

void glu_raw(const float* p, int64_t T, int64_t F, bool gelu, float* yp) {
    const vf one = vset1(1.0f), half = vset1(0.5f), c0 = vset1(0.7978845608028654f), c1 = vset1(0.044715f);
    for (int64_t t = 0; t < T; ++t) {
        const float* g = p + t * 2 * F;
        const float* u = g + F;
        for (int64_t i = 0; i < F; i += 16) {
            const vmask m = tail_mask(F - i);
            const vf x = vload_z(m, g + i);
            vf a;
            if (gelu) {       // 0.5 x (1 + tanh(z)), tanh(z) = 1 - 2 / (e^{2z} + 1)
                const vf z = vmul(c0, vfmadd(vmul(c1, x), vmul(x, x), x));
                const vf th = vsub(one, vdiv(vset1(2.0f), vadd(vexp(vadd(z, z)), one)));
                a = vmul(vmul(half, x), vadd(one, th));
            } else {          // x / (1 + e^{-x})
                a = vdiv(x, vadd(one, vexp(vsub(vzero(), x))));
            }
            vstore_m(yp + t * F + i, m, vmul(a, vload_z(m, u + i)));
        }
    }
}

// gu: [T, 2F] (gate | up) -> act(gate) * up, act = silu, or gelu (tanh approximation) when gelu is true.
torch::Tensor glu(torch::Tensor gu, bool gelu) {
    TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == at::kFloat && gu.size(1) % 2 == 0, "gu [T, 2F] float32");
    gu = gu.contiguous();
    const int64_t T = gu.size(0), F = gu.size(1) / 2;
    auto y = torch::empty({T, F}, at::kFloat);
    glu_raw(gu.data_ptr<float>(), T, F, gelu, y.data_ptr<float>());
    return y;
}

void rope_store_raw(const float* q, int64_t qs, const float* k, int64_t ks, const float* v, int64_t vs, int64_t T,
                    int64_t H, int64_t Hk, int64_t D, const float* cp, const float* sp, bool neox, int64_t rope_dim,
                    void* kc, void* vc, bool half, int64_t L, int64_t start, float* qo) {
    TORCH_CHECK(D <= 1024, "head dimension above 1024");
    const int64_t hr = rope_dim / 2;
    auto rotate = [&](const float* x, float* y, int64_t t) {
        const float* c = cp + t * hr;
        const float* s = sp + t * hr;
        if (neox) {
            for (int64_t i = 0; i < hr; ++i) {
                const float a = x[i], b = x[i + hr];
                y[i] = a * c[i] - b * s[i];
                y[i + hr] = b * c[i] + a * s[i];
            }
        } else {
            for (int64_t i = 0; i < hr; ++i) {
                const float a = x[2 * i], b = x[2 * i + 1];
                y[2 * i] = a * c[i] - b * s[i];
                y[2 * i + 1] = b * c[i] + a * s[i];
            }
        }
        for (int64_t i = rope_dim; i < D; ++i) y[i] = x[i];
    };
    // a row of the cache: f32 as is, or f16 rounded to nearest even
    auto store = [&](const float* x, void* cache, int64_t at) {
        if (half) {
            c10::Half* d = static_cast<c10::Half*>(cache) + at;
            int64_t i = 0;
            for (; i + 16 <= D; i += 16)        // round to nearest even, as c10::Half below
                vstore_h(d + i, vload(x + i));
            for (; i < D; ++i) d[i] = c10::Half(x[i]);
        } else {
            std::copy(x, x + D, static_cast<float*>(cache) + at);
        }
    };
    alignas(64) float row[1024];
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < H; ++h) rotate(q + t * qs + h * D, qo + (t * H + h) * D, t);
        for (int64_t h = 0; h < Hk; ++h) {
            rotate(k + t * ks + h * D, row, t);
            store(row, kc, (h * L + start + t) * D);
            store(v + t * vs + h * D, vc, (h * L + start + t) * D);
        }
    }
}

// Rotary position embedding of q and k for T new tokens at positions start.., and the cache write of k and v.
// q: [T, H, D], k, v: [T, Hk, D] (any row strides, heads D apart); cos, sin: [T, rope_dim / 2];
// kc, vc: [Hk, L, D] (one layer of the cache). neox: rotate halves (x_i, x_{i + rope_dim/2}); else adjacent
// pairs (x_{2i}, x_{2i+1}). Dimensions past rope_dim pass through. Returns the rotated q as [T, H, D].
torch::Tensor rope_store(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                         bool neox, int64_t rope_dim, torch::Tensor kc, torch::Tensor vc, int64_t start) {
    const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hk = k.size(1), L = kc.size(1);
    TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && q.stride(1) == D && k.stride(1) == D &&
                v.stride(1) == D, "heads D apart, unit stride in the head dimension");
    TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(),
                "contiguous cache and tables");
    TORCH_CHECK(start + T <= L, "the cache is full");
    auto qo = torch::empty({T, H, D}, at::kFloat);
    rope_store_raw(q.data_ptr<float>(), q.stride(0), k.data_ptr<float>(), k.stride(0), v.data_ptr<float>(),
                   v.stride(0), T, H, Hk, D, cos.data_ptr<float>(), sin.data_ptr<float>(), neox, rope_dim,
                   kc.data_ptr(), vc.data_ptr(), half_cache(kc, vc), L, start, qo.data_ptr<float>());
    return qo;
}

namespace {

// The index of the largest of p[0 .. V), the first one on ties, a NaN counting as the largest (torch.argmax's
// rules); every value -inf gives 0, as torch.
int64_t argmax_row(const float* p, int64_t V) {
    // per lane: the largest value and its index (as a float: exact below 2^24)
    vf best = vset1(-INFINITY), at = vset1(-1.0f);
    vf idx = vzero();
    {
        alignas(64) float first[16];
        for (int l = 0; l < 16; ++l) first[l] = (float)l;
        idx = vload(first);
    }
    const vf step = vset1(16.0f);
    vmask nan = tail_mask(0);
    for (int64_t i = 0; i < V; i += 16, idx = vadd(idx, step)) {
        const vmask m = tail_mask(V - i);
        const vf v = vload_z(m, p + i);
        nan = mask_or(nan, mask_and(m, visnan(v)));
        const vmask gt = mask_and(m, vgt(v, best));     // strictly: a lane keeps its first
        best = vselect(gt, v, best);
        at = vselect(gt, idx, at);
    }
    if (mask_any(nan)) {
        int64_t arg = 0;
        while (!std::isnan(p[arg])) ++arg;
        return arg;
    }
    alignas(64) float bv[16], bi[16];
    vstore(bv, best);
    vstore(bi, at);
    float mv = -INFINITY;
    int64_t mi = -1;
    for (int l = 0; l < 16; ++l) {              // the largest value; among equal ones the lowest index
        const int64_t li = (int64_t)bi[l];
        if (li >= 0 && (mi < 0 || bv[l] > mv || (bv[l] == mv && li < mi))) mv = bv[l], mi = li;
    }
    return mi < 0 ? 0 : mi;
}

}  // namespace

// logits: [V] f32 -> (argmax_row's index, its softmax probability 1 / sum_j e^{x_j - max}): what a greedy draft
// needs from each step, in two passes over the row instead of torch's softmax and max over the whole row.
std::tuple<int64_t, double> top_prob(torch::Tensor logits) {
    TORCH_CHECK(logits.dim() == 1 && logits.scalar_type() == at::kFloat && logits.numel() > 0, "logits [V] f32");
    logits = logits.contiguous();
    const float* x = logits.data_ptr<float>();
    const int64_t V = logits.numel();
    const int64_t arg = argmax_row(x, V);
    const vf vm = vset1(x[arg]);
    vf sum = vzero();
    for (int64_t i = 0; i < V; i += 16) {
        const vmask k = tail_mask(V - i);
        sum = vadd(sum, vkeep(k, vexp(vsub(vload_z(k, x + i), vm))));
    }
    return {arg, 1.0 / (double)vsum(sum)};
}

// x: [R, V] (or [V]) f32 -> argmax_row of each row (torch.argmax's rules, so greedy choices are the same as
// with it), vectorised: torch's CPU argmax is several times slower on a verify pass's rows of 151,936 logits.
std::vector<int64_t> argmax_rows(torch::Tensor x) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && (x.dim() == 1 || x.dim() == 2) && x.size(-1) > 0,
                "x must be [R, V] or [V] f32");
    x = x.contiguous();
    const int64_t V = x.size(-1), R = x.numel() / V;
    std::vector<int64_t> out((size_t)R);
    for (int64_t r = 0; r < R; ++r) out[(size_t)r] = argmax_row(x.data_ptr<float>() + r * V, V);
    return out;
}
