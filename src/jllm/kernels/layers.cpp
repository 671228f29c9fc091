// A whole forward pass in one call: the decoder layers, then the final norm and the output layer. The same
// kernels, in the same order and on the same shapes, as the Python loop of Transformer.forward
// (jllm/model/transformer.py), so the results are bitwise equal. What goes is everything between the
// kernels: the interpreter, torch's operator dispatch and ~10 tensor allocations a layer. The activations live
// in buffers of the stack, grown to the largest call and kept; the residual add is fused into the next norm.
// On the draft model that work was about a sixth of a step (BENCHMARKS.md, "A forward pass in one native call").
// The GIL is released for the whole pass; a mutex keeps two callers of one stack apart.

#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

namespace {

const float* ptr(const torch::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; }

struct Layer {
    const float *attn_norm, *q_norm, *k_norm, *post_attn_norm, *ffn_norm, *post_ffn_norm;   // null: absent
    QView qkv, o, gate_up, down;
    const float *cos, *sin;        // the rotary table of this layer (global, or local for sliding layers)
    int64_t positions;             // rows of the table
    int64_t window;                // sliding window, 0: full attention
};

}  // namespace

class Stack {
public:
    Stack(int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, double eps, double attn_scale, bool neox,
          int64_t rope_dim, bool gelu, int64_t group_bytes)
        : H(n_heads), Hk(n_kv_heads), hd(head_dim), eps((float)eps), attn_scale((float)attn_scale), neox(neox),
          rope_dim(rope_dim), gelu(gelu), group(group_bytes) {}

    // norms: attn, q, k, post_attn, ffn, post_ffn (empty tensor: absent); mats: data, offsets, kinds, bias of
    // qkv, o, gate_up, down in turn; ns: their output features.
    void add_layer(std::vector<torch::Tensor> norms, std::vector<torch::Tensor> mats, std::vector<int64_t> ns,
                   torch::Tensor cos, torch::Tensor sin, int64_t window) {
        TORCH_CHECK(norms.size() == 6 && mats.size() == 16 && ns.size() == 4, "add_layer: 6 norms, 4 x 4 matrices");
        TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == rope_dim / 2, "rotary tables");
        for (auto& t : norms) TORCH_CHECK(!t.numel() || t.is_contiguous(), "contiguous norm weights");
        QView m[4];
        for (int i = 0; i < 4; ++i) m[i] = qview(mats[4 * i], mats[4 * i + 1], mats[4 * i + 2], ns[i], mats[4 * i + 3]);
        TORCH_CHECK(m[0].n == (H + 2 * Hk) * hd && m[2].n % 2 == 0, "add_layer: qkv or gate_up of the wrong width");
        if (layers.empty()) D = m[1].n, F = m[2].n / 2;
        TORCH_CHECK(m[1].n == D && m[3].n == D && m[2].n == 2 * F, "add_layer: layers of different widths");
        layers.push_back(Layer{ptr(norms[0]), ptr(norms[1]), ptr(norms[2]), ptr(norms[3]), ptr(norms[4]), ptr(norms[5]),
                               m[0], m[1], m[2], m[3], cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(0),
                               window});
        TORCH_CHECK(layers.back().attn_norm && layers.back().ffn_norm, "add_layer: attn and ffn norms are required");
        keep.insert(keep.end(), norms.begin(), norms.end());
        keep.insert(keep.end(), mats.begin(), mats.end());
        keep.push_back(cos), keep.push_back(sin);
    }

    // The final norm and the output layer (required before forward).
    void set_head(torch::Tensor norm, torch::Tensor data, torch::Tensor offsets, torch::Tensor kinds, int64_t n,
                  torch::Tensor bias) {
        TORCH_CHECK(norm.is_contiguous() && norm.numel() == D, "set_head: the norm's width");
        head = qview(data, offsets, kinds, n, bias);
        head_norm = norm.data_ptr<float>();
        keep.insert(keep.end(), {norm, data, offsets, kinds, bias});
    }

    // x: [T, D] for positions start .. start + T - 1; kc, vc: [layers, Hk, L, hd]. -> logits [T, n] (only the last
    // row's, [1, n], with last_only).
    // tree: the parents of the last tree.size() rows, the rows of a speculative tree (each parent a row before
    // it in this call); the rows before them are a chain, as without a tree. A tree row stands at the position
    // of its depth, start + depth (its parent's depth plus one; chain row t has depth t), and sees the cache
    // before start, its ancestors and itself, never another branch. Its key and value go to its own slot,
    // start + row. For its attention its ancestors' and its own keys and values are copied into the slots of
    // their depths, and those slots' own contents put back after, so it runs on the same keys in the same
    // places as a decode step along its path: the same bits (its other work is row by row).
    // capture (layer ids, each 0 .. layers): cap [T, ids * D] f32 gets, in block j of D columns, the residual
    // stream at the input of layer capture[j] (id == layers: the last layer's output, before the final norm),
    // every row, also with last_only (an EAGLE-3 head reads them). Empty: nothing is copied.
    torch::Tensor forward(torch::Tensor x_in, torch::Tensor kc, torch::Tensor vc, int64_t start, bool last_only,
                          std::vector<int64_t> tree, std::vector<int64_t> capture, torch::Tensor cap) {
        std::lock_guard<std::mutex> lock(mu);
        TORCH_CHECK(head_norm && !layers.empty(), "the stack needs its layers and head before forward");
        TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == D && x_in.scalar_type() == at::kFloat, "x must be [T, D] f32");
        TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.dim() == 4 && kc.sizes() == vc.sizes() &&
                    kc.size(0) == (int64_t)layers.size() && kc.size(1) == Hk && kc.size(3) == hd, "cache shape");
        const bool half = half_cache(kc, vc);
        const int64_t T = x_in.size(0), L = kc.size(2), qd = H * hd, kvd = Hk * hd, W = qd + 2 * kvd;
        TORCH_CHECK(start >= 0 && start + T <= L, "the cache is full");
        const int64_t Tt = (int64_t)tree.size(), Tc = T - Tt;                        // tree rows, chain rows
        TORCH_CHECK(Tt == 0 || Tc >= 1, "a tree needs a chain row to grow from");
        std::vector<int64_t> depth(T), parent(T, -1);
        for (int64_t t = 0; t < T; ++t) {
            parent[t] = t < Tc ? t - 1 : tree[t - Tc];
            TORCH_CHECK(t < Tc || (parent[t] >= 0 && parent[t] < t), "a tree row's parent is a row before it");
            depth[t] = t < Tc ? t : depth[parent[t]] + 1;
        }
        for (const Layer& l : layers) TORCH_CHECK(start + T <= l.positions, "past the rotary table");
        const int64_t nc = (int64_t)capture.size();
        for (int64_t id : capture)
            TORCH_CHECK(id >= 0 && id <= (int64_t)layers.size(), "capture: a layer id out of range");
        TORCH_CHECK(!nc || (cap.is_contiguous() && cap.scalar_type() == at::kFloat && cap.dim() == 2 &&
                            cap.size(0) == T && cap.size(1) == nc * D), "capture: cap must be [T, ids * D] f32");
        float* cp = nc ? cap.data_ptr<float>() : nullptr;
        float* x = grow(x_buf, T * D);                            // the residual stream
        const torch::Tensor xc = x_in.contiguous();
        std::copy(xc.data_ptr<float>(), xc.data_ptr<float>() + T * D, x);
        auto take = [&](int64_t layer) {          // the residual stream as it enters `layer`
            for (int64_t j = 0; j < nc; ++j)
                if (capture[j] == layer)
                    for (int64_t t = 0; t < T; ++t) std::copy(x + t * D, x + (t + 1) * D, cp + (t * nc + j) * D);
        };
        float* h = grow(h_buf, T * D);
        float* qkv = grow(qkv_buf, T * W);
        float* q = grow(q_buf, T * qd);
        float* att = grow(att_buf, T * qd);
        float* a = grow(a_buf, T * D);
        float* gu = grow(gu_buf, T * 2 * F);
        float* g = grow(g_buf, T * F);
        const int64_t layer_bytes = Hk * L * hd * (half ? 2 : 4);
        char* kb = static_cast<char*>(kc.data_ptr());
        char* vb = static_cast<char*>(vc.data_ptr());
        const int64_t hr = rope_dim / 2;
        rms_norm_raw(x, T, D, layers[0].attn_norm, eps, h);
        for (size_t i = 0; i < layers.size(); ++i) {
            const Layer& l = layers[i];
            if (nc) take((int64_t)i);
            char* ki = kb + (int64_t)i * layer_bytes;
            char* vi = vb + (int64_t)i * layer_bytes;
            qmatmul_raw(h, T, D, l.qkv, qkv, group);                                   // qkv: [T, W]
            if (l.q_norm)
                for (int64_t t = 0; t < T; ++t) {
                    rms_norm_raw(qkv + t * W, H, hd, l.q_norm, eps, qkv + t * W);
                    rms_norm_raw(qkv + t * W + qd, Hk, hd, l.k_norm, eps, qkv + t * W + qd);
                }
            rope_store_raw(qkv, W, qkv + qd, W, qkv + qd + kvd, W, Tc, H, Hk, hd, l.cos + start * hr,
                           l.sin + start * hr, neox, rope_dim, ki, vi, half, L, start, q);
            attention_raw(q, ki, vi, half, att, Tc, H, Hk, hd, L, start, l.window, attn_scale);
            for (int64_t r = Tc; r < T; ++r) {                  // tree rows: every key first, then attention
                const float* x_r = qkv + r * W;
                const int64_t pos = start + depth[r];
                rope_store_raw(x_r, W, x_r + qd, W, x_r + qd + kvd, W, 1, H, Hk, hd, l.cos + pos * hr,
                               l.sin + pos * hr, neox, rope_dim, ki, vi, half, L, start + r, q + r * qd);
            }
            for (int64_t r = Tc; r < T; ++r) {
                // the path's rows off the chain, by depth (each row stands in the slot of its depth)
                path.clear();
                for (int64_t a = r; a >= Tc; a = parent[a])
                    if (a != depth[a]) path.push_back(a);
                const int64_t n = (int64_t)path.size(), sz = half ? 2 : 4, slot = 2 * Hk * hd * sz;
                if ((int64_t)tree_buf.size() < 2 * n * slot) tree_buf.resize((size_t)(2 * n * slot));
                char* moved = tree_buf.data();                  // the path's keys and values, gathered first
                char* saved = moved + n * slot;                 // what the slots of their depths held
                for (int64_t j = 0; j < n; ++j) get_slot(ki, vi, sz, L, start + path[j], moved + j * slot);
                for (int64_t j = 0; j < n; ++j) get_slot(ki, vi, sz, L, start + depth[path[j]], saved + j * slot);
                for (int64_t j = 0; j < n; ++j) put_slot(ki, vi, sz, L, start + depth[path[j]], moved + j * slot);
                attention_raw(q + r * qd, ki, vi, half, att + r * qd, 1, H, Hk, hd, L, start + depth[r], l.window,
                              attn_scale);
                for (int64_t j = n - 1; j >= 0; --j) put_slot(ki, vi, sz, L, start + depth[path[j]], saved + j * slot);
            }
            qmatmul_raw(att, T, qd, l.o, a, group);
            if (l.post_attn_norm) rms_norm_raw(a, T, D, l.post_attn_norm, eps, a);
            add_rms_norm_raw(x, a, T, D, l.ffn_norm, eps, h);                           // x += a; h = norm(x)
            qmatmul_raw(h, T, D, l.gate_up, gu, group);
            glu_raw(gu, T, F, gelu, g);
            qmatmul_raw(g, T, F, l.down, a, group);
            if (l.post_ffn_norm) rms_norm_raw(a, T, D, l.post_ffn_norm, eps, a);
            // x += a, and the next layer's first norm in the same pass
            add_rms_norm_raw(x, a, T, D, i + 1 < layers.size() ? layers[i + 1].attn_norm : nullptr, eps, h);
        }
        if (nc) take((int64_t)layers.size());
        const int64_t rows = last_only ? 1 : T;
        rms_norm_raw(x + (T - rows) * D, rows, D, head_norm, eps, h);
        auto logits = torch::empty({rows, head.n}, at::kFloat);
        qmatmul_raw(h, rows, D, head, logits.data_ptr<float>(), group);
        return logits;
    }

private:
    // The keys and values of one position of one layer's cache ([Hk, L, hd] elements of `size` bytes), every kv
    // head, to and from buf (2 * Hk * hd elements).
    void get_slot(const char* k, const char* v, int64_t size, int64_t L, int64_t pos, char* buf) const {
        const int64_t row = hd * size;
        for (const char* c : {k, v})
            for (int64_t h = 0; h < Hk; ++h, buf += row) std::memcpy(buf, c + (h * L + pos) * row, (size_t)row);
    }
    void put_slot(char* k, char* v, int64_t size, int64_t L, int64_t pos, const char* buf) const {
        const int64_t row = hd * size;
        for (char* c : {k, v})
            for (int64_t h = 0; h < Hk; ++h, buf += row) std::memcpy(c + (h * L + pos) * row, buf, (size_t)row);
    }

    // n floats starting on a cache line (a vector's own start is 16-byte aligned: the kernels' 64-byte loads
    // would straddle lines)
    static float* grow(std::vector<float>& buf, int64_t n) {
        if ((int64_t)buf.size() < n + 16) buf.resize((size_t)(n + 16));
        const uintptr_t p = reinterpret_cast<uintptr_t>(buf.data());
        return reinterpret_cast<float*>((p + 63) & ~(uintptr_t)63);
    }

    int64_t H, Hk, hd;
    float eps, attn_scale;
    bool neox;
    int64_t rope_dim;
    bool gelu;
    int64_t group;
    int64_t D = 0, F = 0;
    std::vector<Layer> layers;
    QView head{};
    const float* head_norm = nullptr;
    std::vector<torch::Tensor> keep;        // the tensors the pointers above point into
    std::vector<float> x_buf, h_buf, qkv_buf, q_buf, att_buf, a_buf, gu_buf, g_buf;
    std::vector<char> tree_buf;             // a tree row's path: its keys and values, and the slots they stand in
    std::vector<int64_t> path;
    std::mutex mu;
};

void register_stack(pybind11::module& m) {
    pybind11::class_<Stack>(m, "Stack")
        .def(pybind11::init<int64_t, int64_t, int64_t, double, double, bool, int64_t, bool, int64_t>())
        .def("add_layer", &Stack::add_layer)
        .def("set_head", &Stack::set_head)
        .def("forward", &Stack::forward, pybind11::arg("x"), pybind11::arg("kc"), pybind11::arg("vc"),
             pybind11::arg("start"), pybind11::arg("last_only") = false, pybind11::arg("tree") = std::vector<int64_t>{},
             pybind11::arg("capture") = std::vector<int64_t>{}, pybind11::arg("cap") = at::empty({0}, at::kFloat),
             pybind11::call_guard<pybind11::gil_scoped_release>());
}
