// The kernels each source file defines and the others call (the Python module binds them in qgemm.cpp).
// Each has a tensor form for Python and a pointer form ("_raw") that writes into memory the caller owns, for
// the native layer stack (layers.cpp), which runs a whole forward pass without allocating.
#pragma once

// ATen's tensor and parallel headers only, not <torch/extension.h>: that one costs ~35 s of compile time per
// source file, these ~2 s. The Python binding headers are included where the bindings are (qgemm.cpp,
// layers.cpp).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace torch { using namespace at; }     // torch::Tensor, torch::empty as torch/extension.h gives them
                                            // (dtype constants are spelled at::kFloat, at::kByte, ...)
namespace pybind11 { class module_; using module = module_; }

// A packed matrix's tiles (jllm/model/qlinear.py), checked once by qview.
struct QView {
    const uint8_t* data;
    const int64_t* offsets;        // [tiles + 1] byte offset of each tile
    const uint8_t* kinds;          // [tiles]
    int64_t tiles, n;              // n: output features
    const float* bias;             // [n] or null
};

// qgemm.cpp
QView qview(const torch::Tensor& data, const torch::Tensor& offsets, const torch::Tensor& kinds, int64_t n,
            const torch::Tensor& bias);
void qmatmul_raw(const float* x, int64_t M, int64_t K, const QView& w, float* y, int64_t group_bytes);  // y [M, n]
torch::Tensor qmatmul(torch::Tensor x, torch::Tensor data, torch::Tensor offsets, torch::Tensor kinds, int64_t n,
                      torch::Tensor bias, int64_t group_bytes);

// attention.cpp: q [T, H, D]; k, v: one layer of the cache, [Hk, L, D], f16 when half, else f32 -> out [T, H * D]
void attention_raw(const float* q, const void* k, const void* v, bool half, float* out, int64_t T, int64_t H,
                   int64_t Hk, int64_t D, int64_t L, int64_t start, int64_t window, float scale);
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t start, int64_t window,
                        double scale);

// rowwise.cpp
void rms_norm_raw(const float* x, int64_t R, int64_t D, const float* w, float eps, float* y);   // y may be x
void add_rms_norm_raw(float* x, const float* a, int64_t R, int64_t D, const float* w, float eps, float* y);
void glu_raw(const float* gu, int64_t T, int64_t F, bool gelu, float* y);
// q, k, v: element (t, h, i) at t * row + h * D + i, each with its own row stride (qs, ks, vs);
// cos, sin: [T, rope_dim / 2] from position start; kc, vc: [Hk, L, D]; qo: [T, H, D]
void rope_store_raw(const float* q, int64_t qs, const float* k, int64_t ks, const float* v, int64_t vs, int64_t T,
                    int64_t H, int64_t Hk, int64_t D, const float* cos, const float* sin, bool neox, int64_t rope_dim,
                    void* kc, void* vc, bool half, int64_t L, int64_t start, float* qo);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
std::tuple<int64_t, double> top_prob(torch::Tensor logits);
std::vector<int64_t> argmax_rows(torch::Tensor x);
torch::Tensor nucleus(torch::Tensor pr, double top_p);                                 // sampling.cpp
torch::Tensor glu(torch::Tensor gu, bool gelu);
torch::Tensor rope_store(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                         bool neox, int64_t rope_dim, torch::Tensor kc, torch::Tensor vc, int64_t start);

void register_stack(pybind11::module& m);                                             // layers.cpp

// Whether a cache's k and v hold f16 (else f32; any other pair of dtypes is refused). attention and rope_store.
inline bool half_cache(const torch::Tensor& k, const torch::Tensor& v) {
    TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
                (k.scalar_type() == at::kFloat || k.scalar_type() == torch::kHalf), "a float32 or float16 cache");
    return k.scalar_type() == torch::kHalf;
}
