// The decoder layers of a forward pass in one call: the same kernels, in the same order and on the same
// shapes, as the Python loop of Transformer.forward (jllm/model/transformer.py), so the results are bitwise
// equal; what goes is the interpreter between them (measured: ~0.5 ms of a 0.5B draft step's ~10).
// The GIL is released for the whole pass.

#include <torch/extension.h>

#include "kernels.h"

#include <utility>
#include <vector>

namespace {

struct QMat {                      // a QLinear's tensors
    torch::Tensor data, offsets, kinds, bias;
    int64_t n = 0;
    torch::Tensor operator()(const torch::Tensor& x, int64_t group) const {
        return qmatmul(x, data, offsets, kinds, n, bias, group);
    }
};

struct Layer {
    torch::Tensor attn_norm, q_norm, k_norm, post_attn_norm, ffn_norm, post_ffn_norm;   // empty: absent
    QMat qkv, o, gate_up, down;
    torch::Tensor cos, sin;        // the rotary table of this layer (global, or local for sliding layers)
    int64_t window = 0;            // sliding window, 0: full attention
};

torch::Tensor present(const torch::Tensor& t) { return t.numel() ? t : torch::Tensor(); }

}  // namespace

class Stack {
public:
    Stack(int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, double eps, double attn_scale, bool neox,
          int64_t rope_dim, bool gelu, int64_t group_bytes)
        : H(n_heads), Hk(n_kv_heads), hd(head_dim), eps(eps), attn_scale(attn_scale), neox(neox),
          rope_dim(rope_dim), gelu(gelu), group(group_bytes) {}

    // norms: attn, q, k, post_attn, ffn, post_ffn (empty tensor: absent); mats: data, offsets, kinds, bias of
    // qkv, o, gate_up, down in turn; ns: their output features.
    void add_layer(std::vector<torch::Tensor> norms, std::vector<torch::Tensor> mats, std::vector<int64_t> ns,
                   torch::Tensor cos, torch::Tensor sin, int64_t window) {
        TORCH_CHECK(norms.size() == 6 && mats.size() == 16 && ns.size() == 4, "add_layer: 6 norms, 4 x 4 matrices");
        Layer L;
        L.attn_norm = norms[0], L.q_norm = present(norms[1]), L.k_norm = present(norms[2]);
        L.post_attn_norm = present(norms[3]), L.ffn_norm = norms[4], L.post_ffn_norm = present(norms[5]);
        QMat* m[4] = {&L.qkv, &L.o, &L.gate_up, &L.down};
        for (int i = 0; i < 4; ++i) *m[i] = QMat{mats[4 * i], mats[4 * i + 1], mats[4 * i + 2], mats[4 * i + 3], ns[i]};
        L.cos = cos, L.sin = sin, L.window = window;
        layers.push_back(std::move(L));
    }

    // x: [T, D] for positions start .. start + T - 1; kc, vc: [layers, Hk, L, hd] -> x after every layer.
    torch::Tensor forward(torch::Tensor x, torch::Tensor kc, torch::Tensor vc, int64_t start) const {
        const int64_t T = x.size(0), qd = H * hd, kvd = Hk * hd;
        for (size_t i = 0; i < layers.size(); ++i) {
            const Layer& L = layers[i];
            const torch::Tensor k_i = kc.select(0, (int64_t)i), v_i = vc.select(0, (int64_t)i);
            torch::Tensor h = rms_norm(x, L.attn_norm, eps);
            const torch::Tensor qkv = L.qkv(h, group);
            torch::Tensor qk = qkv.narrow(1, 0, qd + kvd).reshape({T, H + Hk, hd});
            const torch::Tensor v = qkv.narrow(1, qd + kvd, kvd).reshape({T, Hk, hd});
            if (L.q_norm.defined())
                qk = torch::cat({rms_norm(qk.narrow(1, 0, H), L.q_norm, eps),
                                 rms_norm(qk.narrow(1, H, Hk), L.k_norm, eps)}, 1);
            const torch::Tensor q = rope_store(qk.narrow(1, 0, H), qk.narrow(1, H, Hk), v, L.cos.narrow(0, start, T),
                                               L.sin.narrow(0, start, T), neox, rope_dim, k_i, v_i, start);
            torch::Tensor a = L.o(attention(q, k_i, v_i, start, L.window, attn_scale), group);
            if (L.post_attn_norm.defined()) a = rms_norm(a, L.post_attn_norm, eps);
            x = x + a;
            h = rms_norm(x, L.ffn_norm, eps);
            torch::Tensor m = L.down(glu(L.gate_up(h, group), gelu), group);
            if (L.post_ffn_norm.defined()) m = rms_norm(m, L.post_ffn_norm, eps);
            x = x + m;
        }
        return x;
    }

private:
    int64_t H, Hk, hd;
    double eps, attn_scale;
    bool neox;
    int64_t rope_dim;
    bool gelu;
    int64_t group;
    std::vector<Layer> layers;
};

void register_stack(pybind11::module& m) {
    pybind11::class_<Stack>(m, "Stack")
        .def(pybind11::init<int64_t, int64_t, int64_t, double, double, bool, int64_t, bool, int64_t>())
        .def("add_layer", &Stack::add_layer)
        .def("forward", &Stack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
