// The kernels each source file defines and the others call (the Python module binds them in qgemm.cpp).
#pragma once

#include <torch/extension.h>

torch::Tensor qmatmul(torch::Tensor x, torch::Tensor data, torch::Tensor offsets, torch::Tensor kinds, int64_t n,
                      torch::Tensor bias, int64_t group_bytes);                       // qgemm.cpp
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t start, int64_t window,
                        double scale);                                                // attention.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);                 // rowwise.cpp
torch::Tensor glu(torch::Tensor gu, bool gelu);                                       // rowwise.cpp
torch::Tensor rope_store(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                         bool neox, int64_t rope_dim, torch::Tensor kc, torch::Tensor vc, int64_t start);
void register_stack(pybind11::module& m);                                             // layers.cpp

// Whether a cache's k and v hold f16 (else f32; any other pair of dtypes is refused). attention and rope_store.
inline bool half_cache(const torch::Tensor& k, const torch::Tensor& v) {
    TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
                (k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kHalf), "a float32 or float16 cache");
    return k.scalar_type() == torch::kHalf;
}
