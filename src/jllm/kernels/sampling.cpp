// Top-p's set of a distribution without sorting all of it, for jllm.sampling.nucleus: the same set, bit for bit,
// from one pass that gathers the likely ids and a sort of those alone (torch's way runs topk, cumsum and masks
// over the whole row; BENCHMARKS.md, "top-p's set in one native pass").
//
// The set: in the order of falling probability, ties by ascending id (a stable sort's), the tokens whose running
// mass before them, computed in double as (sum up to and including them) - (their own), is below top_p. The
// ids whose probability is at least tau are exactly the first ones of that order, ties included (a tie of one
// of them is as large), so their running mass in that order is the whole sort's, addition for addition; if the
// set ends inside them it is the whole sort's. Else tau falls (by 2^-7 a try) until it does, or tau is 0 and
// every id is in the sort.

#include "kernels.h"

#include <ATen/ops/zeros.h>

#include "vecmath.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace {

using namespace jllm;

// The largest of p[0 .. V - 1].
float row_max(const float* p, int64_t V) {
    vf m = vset1(-INFINITY);
    for (int64_t i = 0; i < V; i += 16) m = vmax(m, vload_or(vset1(-INFINITY), tail_mask(V - i), p + i));
    return vmaxval(m);
}

// c <- (p[i], i) for every i with p[i] >= tau (tau > 0, or 0: every i), in ascending i: sixteen compared at a
// time, the rare lanes that pass read one by one.
void gather(const float* p, int64_t V, float tau, std::vector<std::pair<float, int64_t>>& c) {
    c.clear();
    if (tau == 0.0f) {                           // every id (no compare: with denormals flushed the float below 0
        for (int64_t i = 0; i < V; ++i) c.emplace_back(p[i], i);   // would read as -0, and 0 > -0 fails)
        return;
    }
    const vf below = vset1(std::nextafter(tau, -INFINITY));       // p >= tau as p > the float below tau
    for (int64_t i = 0; i < V; i += 16) {
        const vmask t = tail_mask(V - i);
        if (!mask_any(mask_and(vgt(vload_or(vset1(-INFINITY), t, p + i), below), t))) continue;
        for (int64_t j = i; j < std::min(V, i + 16); ++j)
            if (p[j] >= tau) c.emplace_back(p[j], j);
    }
}

}  // namespace

torch::Tensor nucleus(torch::Tensor pr, double top_p) {
    TORCH_CHECK(pr.dim() == 1 && pr.scalar_type() == at::kFloat && pr.numel() > 0 && pr.device().is_cpu(),
                "pr must be [V] float32 on the CPU");
    pr = pr.contiguous();
    const float* p = pr.data_ptr<float>();
    const int64_t V = pr.numel();
    const float top = row_max(p, V);
    auto mask = at::zeros({V}, at::kBool);
    bool* keep = mask.data_ptr<bool>();
    thread_local std::vector<std::pair<float, int64_t>> c;
    for (int shift = 7;; shift += 7) {
        const float tau = shift > 160 ? 0.0f : std::ldexp(top, -shift);
        gather(p, V, tau, c);
        std::sort(c.begin(), c.end(), [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
            return a.first > b.first || (a.first == b.first && a.second < b.second);
        });
        // the mass before a token never falls along the order (adding e_j rounds by less than e_j, and
        // e_j <= e_{j-1}), so the tokens whose mass before is below top_p are the first m
        double mass = 0.0;
        size_t m = 0;
        for (const auto& e : c) {
            mass += (double)e.first;
            m += mass - (double)e.first < top_p;
        }
        if (m < c.size() || tau == 0.0f) {               // the set ends inside, or every id is sorted
            for (size_t j = 0; j < m; ++j) keep[c[j].second] = true;
            return mask;
        }
    }
}
