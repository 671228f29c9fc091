// Causal attention for a few new queries over the KV cache on the CPU.
//
// A work item is one kv head and up to 16 of the new queries (a verify pass's queries all in one item; a
// prefill chunk's in slices), for head sizes 64, 128 and 256 (others, as the tiny test models use, go one query
// at a time through plain loops). Keys and values are converted to f32 once per block of rows, in L1, and each
// block serves every query and query head of the item. Scores are computed for 16 keys at a time (one
// accumulator per key, the 16 sums taken across lanes together, not one horizontal sum per key), then a
// softmax with a vectorised exp over each query's own keys, then the weighted sum of value rows for several
// heads at a time, each value row loaded once for them.
// What a query gets does not depend on the other queries of its call: a key's score is summed by the same
// tree in every lane, whatever block it sits in; the softmax runs over the query's keys from its own first
// one; the value sums run key by key in order. So the verify pass of speculative decoding gets bitwise the
// result of single decode steps. (torch's SDPA splits work differently for different query counts, so it
// would have to be called once per query, which is too slow for a verify pass.)
// Grouping the queries and query heads of a kv head converts each key once per item instead of once per query
// head; what remains is mostly the multiply-adds themselves (BENCHMARKS.md, "A forward pass in one native call").
// The cache holds keys and values in f32 or f16 (half the bytes to read per step; converted to f32 on load,
// exactly, so the arithmetic is the same).

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"
#include "vecmath.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using c10::Half;
using namespace jllm;

inline vf load16(const float* p) { return vload(p); }
inline vf load16(const Half* p) { return vload_h(p); }

// Lane sums of four vectors: lane j (of each 128-bit quarter) holds the sum of a[j]'s lanes there. The first
// two levels of the tree below.
__attribute__((always_inline)) inline vf sum4(const vf* a) {
    const vf s0 = vadd(vunpacklo(a[0], a[1]), vunpackhi(a[0], a[1]));    // each 128-bit lane: a0 lanes 0+2, a1 0+2, a0 1+3, a1 1+3
    const vf s1 = vadd(vunpacklo(a[2], a[3]), vunpackhi(a[2], a[3]));
    return vadd(vunpacklo2(s0, s1), vunpackhi2(s0, s1));                 // each 128-bit lane: the lane sums of a0 .. a3
}

// Sums of 16 vectors a[0 .. 15] from sum4 of each four: lane j of the result is the sum of the lanes of a[j],
// by the same tree for every j.
__attribute__((always_inline)) inline vf sum16(const vf t[4]) {
    const vf u0 = vadd(vquads_even(t[0], t[1]), vquads_odd(t[0], t[1]));  // 128-bit lanes 0+1 and 2+3
    const vf u1 = vadd(vquads_even(t[2], t[3]), vquads_odd(t[2], t[3]));
    return vadd(vquads_even(u0, u1), vquads_odd(u0, u1));
}

// a[i] = lane products of q and key i (N keys D = 16 C apart), summed over the C vectors of a head.
template <int C, int N>
__attribute__((always_inline)) inline void dots(const float* q, const float* kb, vf* a) {
    const vf q0 = vload(q);
    for (int i = 0; i < N; ++i) a[i] = vmul(q0, vload(kb + i * 16 * C));
    for (int c = 1; c < C; ++c) {
        const vf qc = vload(q + 16 * c);
        for (int i = 0; i < N; ++i) a[i] = vfmadd(qc, vload(kb + i * 16 * C + 16 * c), a[i]);
    }
}

// The scores of 16 keys with one query head. AVX-512 runs 16 accumulators at once (its 32 registers); AVX2
// four at a time, as sixteen would take all of its 16 registers twice over and spill (BENCHMARKS.md, "AVX2
// kernels"). The same products and the same tree either way: bitwise the same scores.
template <int C>
__attribute__((always_inline)) inline vf scores16(const float* q, const float* kb) {
    vf t[4];
    if constexpr (kAvx512) {
        vf a[16];
        dots<C, 16>(q, kb, a);
        for (int g = 0; g < 4; ++g) t[g] = sum4(a + 4 * g);
    } else {
        for (int g = 0; g < 4; ++g) {
            vf a[4];
            dots<C, 4>(q, kb + g * 4 * 16 * C, a);
            t[g] = sum4(a);
        }
    }
    return sum16(t);
}

// Any head dimension: the same steps with scalar tails (the tiny test models use odd sizes).
template <typename E>
void item_any(const float* q, const E* k, const E* v, int64_t n, int64_t G, int64_t D, float scale,
              float* out, std::vector<float>& w) {
    w.resize((size_t)n);
    for (int64_t g = 0; g < G; ++g) {
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
            float s = 0.0f;
            for (int64_t d = 0; d < D; ++d) s += q[g * D + d] * static_cast<float>(k[j * D + d]);
            w[j] = s * scale;
            mx = std::max(mx, w[j]);
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < n; ++j) {
            w[j] = std::exp(w[j] - mx);
            sum += w[j];
        }
        float* o = out + g * D;
        for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
        for (int64_t j = 0; j < n; ++j)
            for (int64_t d = 0; d < D; ++d) o[d] += w[j] * static_cast<float>(v[j * D + d]);
        for (int64_t d = 0; d < D; ++d) o[d] /= sum;
    }
}

// The queries t0 .. t1 - 1 of one kv head, for a head dimension D of 64, 128 or 256. Keys are converted 16 at
// a time, values VB at a time; the value sums of a query head wait in `out` between blocks (storing a float
// and loading it back is exact, so the sums are those of one pass over the keys).
template <int D>
struct Grouped {
    static constexpr int C = D / 16;
    // query heads whose value sums fit the registers; on AVX2 (16 registers of 8 floats) one, and a quarter
    // of a head's vectors at a time for D = 128 (two passes over the value rows; each sum is still over the
    // keys in order)
    static constexpr int P = kAvx512 ? (C >= 28 ? 1 : 28 / C) : 1;
    static constexpr int CC = kAvx512 ? C : (C < 4 ? C : 4);
    static constexpr int VB = 32;                       // value rows converted at a time

    // out[p] += sum_{j < cnt} w[p][j] v_j for P heads (their weights `stride` apart; v rows in f32)
    template <int PP>
    static void values(const float* w, int64_t stride, const float* v, int64_t cnt, float* out) {
        for (int c0 = 0; c0 < C; c0 += CC) {
            vf acc[PP][CC];
            for (int p = 0; p < PP; ++p)
                for (int c = 0; c < CC; ++c) acc[p][c] = vload(out + p * D + 16 * (c0 + c));
            for (int64_t j = 0; j < cnt; ++j) {
                const float* vj = v + j * D + 16 * c0;
                for (int p = 0; p < PP; ++p) {
                    const vf wj = vset1(w[p * stride + j]);
                    for (int c = 0; c < CC; ++c) acc[p][c] = vfmadd(wj, vload(vj + 16 * c), acc[p][c]);
                }
            }
            for (int p = 0; p < PP; ++p)
                for (int c = 0; c < CC; ++c) vstore(out + p * D + 16 * (c0 + c), acc[p][c]);
        }
    }

    template <typename E>
    static void run(const float* qp, const E* k, const E* v, int64_t t0, int64_t t1, int64_t start, int64_t window,
                    int64_t H, int64_t hk, int64_t G, float scale, float* op, std::vector<float>& buf) {
        auto first = [&](int64_t t) { return window > 0 ? std::max<int64_t>(0, start + t - window + 1) : 0; };
        const int64_t jlo = first(t0), jhi = start + t1;           // keys any of the queries sees
        const int64_t nq = t1 - t0, stride = jhi - jlo + 32;       // a score row: 16 floats of slack each side
        buf.resize((size_t)(nq * G * stride + nq * G));
        float* scores = buf.data();
        float* inv = scores + nq * G * stride;
        alignas(64) thread_local float kb[16 * D];                 // 16 keys in f32 (aligned: whole-line loads)
        alignas(64) thread_local float vb[VB * D];                 // VB values in f32
        auto row = [&](int64_t t, int64_t g) { return scores + ((t - t0) * G + g) * stride + 16; };
        const vf vscale = vset1(scale);
        for (int64_t j0 = jlo; j0 < jhi; j0 += 16) {
            for (int i = 0; i < 16; ++i)
                for (int c = 0; c < C; ++c)
                    vstore(kb + i * D + 16 * c, j0 + i < jhi ? load16(k + (j0 + i) * D + 16 * c) : vzero());
            for (int64_t t = t0; t < t1; ++t) {
                const int64_t lo = first(t), end = start + t + 1;      // this query's keys: lo .. end - 1
                if (j0 + 16 <= lo || j0 >= end) continue;
                // lanes of the keys it sees; the row holds key j at j - lo
                const vmask m = mask_and_not(tail_mask(end - j0), tail_mask(std::max<int64_t>(0, lo - j0)));
                for (int64_t g = 0; g < G; ++g) {
                    const float* qg = qp + (t * H + hk * G + g) * D;
                    vstore_m(row(t, g) + (j0 - lo), m, vmul(scores16<C>(qg, kb), vscale));
                }
            }
        }
        // softmax of each query head's scores over its own keys
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t n = start + t + 1 - first(t);
            for (int64_t g = 0; g < G; ++g) {
                float* wg = row(t, g);
                vf mx = vset1(-INFINITY);
                for (int64_t j = 0; j < n; j += 16)
                    mx = vmax(mx, vload_or(vset1(-INFINITY), tail_mask(n - j), wg + j));
                const vf vmx = vset1(vmaxval(mx));
                vf sum = vzero();
                for (int64_t j = 0; j < n; j += 16) {
                    const vmask m = tail_mask(n - j);
                    const vf e = vkeep(m, vexp(vsub(vload_z(m, wg + j), vmx)));
                    vstore_m(wg + j, m, e);
                    sum = vadd(sum, e);
                }
                inv[(t - t0) * G + g] = 1.0f / vsum(sum);
                float* o = op + (t * H + hk * G + g) * D;
                for (int c = 0; c < C; ++c) vstore(o + 16 * c, vzero());
            }
        }
        // values, VB keys at a time; each query head's sums run over its keys in order
        for (int64_t j0 = jlo; j0 < jhi; j0 += VB) {
            const int64_t nb = std::min<int64_t>(VB, jhi - j0);
            for (int64_t i = 0; i < nb; ++i)
                for (int c = 0; c < C; ++c) vstore(vb + i * D + 16 * c, load16(v + (j0 + i) * D + 16 * c));
            for (int64_t t = t0; t < t1; ++t) {
                const int64_t lo = first(t), end = start + t + 1;
                const int64_t a = std::max(j0, lo), b = std::min(j0 + nb, end);
                if (a >= b) continue;
                float* o = op + (t * H + hk * G) * D;
                int64_t g = 0;
                for (; g + P <= G; g += P) values<P>(row(t, g) + (a - lo), stride, vb + (a - j0) * D, b - a, o + g * D);
                for (; g < G; ++g) values<1>(row(t, g) + (a - lo), stride, vb + (a - j0) * D, b - a, o + g * D);
            }
        }
        for (int64_t t = t0; t < t1; ++t)
            for (int64_t g = 0; g < G; ++g) {
                float* o = op + (t * H + hk * G + g) * D;
                const vf s = vset1(inv[(t - t0) * G + g]);
                for (int c = 0; c < C; ++c) vstore(o + 16 * c, vmul(vload(o + 16 * c), s));
            }
    }
};

constexpr int64_t kQueries = 16;     // queries of a kv head in one work item (verify passes: all of them)

template <typename E>
void attend(const float* qp, const E* kp, const E* vp, float* op, int64_t T, int64_t H, int64_t Hk, int64_t D,
            int64_t L, int64_t start, int64_t window, float sc) {
    const int64_t G = H / Hk;
    if (D == 64 || D == 128 || D == 256) {
        const int64_t chunks = (T + kQueries - 1) / kQueries;
        at::parallel_for(0, Hk * chunks, 1, [&](int64_t i0, int64_t i1) {
            thread_local std::vector<float> buf;        // scores and converted rows, kept between calls
            for (int64_t it = i0; it < i1; ++it) {
                const int64_t hk = it / chunks, t0 = it % chunks * kQueries, t1 = std::min(T, t0 + kQueries);
                const E* kh = kp + hk * L * D;
                const E* vh = vp + hk * L * D;
                switch (D) {
                    case 64: Grouped<64>::run(qp, kh, vh, t0, t1, start, window, H, hk, G, sc, op, buf); break;
                    case 128: Grouped<128>::run(qp, kh, vh, t0, t1, start, window, H, hk, G, sc, op, buf); break;
                    default: Grouped<256>::run(qp, kh, vh, t0, t1, start, window, H, hk, G, sc, op, buf);
                }
            }
        });
        return;
    }
    at::parallel_for(0, T * Hk, 1, [&](int64_t i0, int64_t i1) {
        thread_local std::vector<float> w;          // scores, kept between calls
        for (int64_t it = i0; it < i1; ++it) {
            const int64_t hk = it / T, t = it % T;      // a head's queries in a row: its keys stay in cache
            const int64_t p = start + t;
            const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
            const int64_t n = p - lo + 1;
            const float* qg = qp + (t * H + hk * G) * D;
            const E* kh = kp + (hk * L + lo) * D;
            const E* vh = vp + (hk * L + lo) * D;
            float* o = op + (t * H + hk * G) * D;
            item_any<E>(qg, kh, vh, n, G, D, sc, o, w);
        }
    });
}

}  // namespace

void attention_raw(const float* q, const void* k, const void* v, bool half, float* out, int64_t T, int64_t H,
                   int64_t Hk, int64_t D, int64_t L, int64_t start, int64_t window, float scale) {
    if (half)
        attend<Half>(q, static_cast<const Half*>(k), static_cast<const Half*>(v), out, T, H, Hk, D, L, start, window,
                     scale);
    else
        attend<float>(q, static_cast<const float*>(k), static_cast<const float*>(v), out, T, H, Hk, D, L, start,
                      window, scale);
}

// q: [T, H, D] f32; k, v: [Hk, L, D] f32 or f16 (one layer of the cache; rows start .. start+T-1 already written);
// query t sits at position start + t and sees keys max(0, p - window + 1) .. p (window 0: all). -> [T, H * D]
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t start, int64_t window,
                        double scale) {
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q [T, H, D], k and v [Hk, L, D]");
    TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be float32");
    q = q.contiguous();
    TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "the cache must be contiguous");
    const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hk = k.size(0), L = k.size(1);
    TORCH_CHECK(H % Hk == 0 && k.size(2) == D && start + T <= L, "shapes do not match");
    auto out = torch::empty({T, H * D}, at::kFloat);
    attention_raw(q.data_ptr<float>(), k.data_ptr(), v.data_ptr(), half_cache(k, v), out.data_ptr<float>(), T, H, Hk,
                  D, L, start, window, (float)scale);
    return out;
}
