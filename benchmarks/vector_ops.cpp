// What each instruction of the matmul kernel's inner loop costs next to 8 `vpdpbusd`, the multiplies of one
// activation row against one block of 16 x 32 weights (jllm/kernels/qgemm.cpp). Each line times a loop of 8
// independent multiply-accumulates plus the named extra work and prints cycles per iteration at the clock
// given (default 3.6 GHz, this machine's; pass another as the first argument).
//
//     g++ -O2 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mgfni benchmarks/vector_ops.cpp \
//         -o /tmp/vector_ops && /tmp/vector_ops
//
// Every accumulator starts from a different value and every extra result is forced out of the compiler's
// reach (`opaque`), so nothing folds away; loop-carried chains are kept shorter than the loop.

#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define opaque(v) asm volatile("" : "+v"(v))

static int32_t mem[1 << 16];
static double ghz = 3.6;

#define DOT(i) a##i = _mm512_dpbusd_epi32(a##i, w, x##i);
#define DOTS DOT(0) DOT(1) DOT(2) DOT(3) DOT(4) DOT(5) DOT(6) DOT(7)
#define CASE(name, ...)                                                                                      \
    {                                                                                                        \
        __m512i a0 = _mm512_set1_epi32(1), a1 = _mm512_set1_epi32(2), a2 = _mm512_set1_epi32(3),             \
                a3 = _mm512_set1_epi32(4), a4 = _mm512_set1_epi32(5), a5 = _mm512_set1_epi32(6),             \
                a6 = _mm512_set1_epi32(7), a7 = _mm512_set1_epi32(8);                                        \
        __m512i x0 = _mm512_set1_epi8(1), x1 = _mm512_set1_epi8(2), x2 = _mm512_set1_epi8(3),                \
                x3 = _mm512_set1_epi8(4), x4 = _mm512_set1_epi8(5), x5 = _mm512_set1_epi8(6),                \
                x6 = _mm512_set1_epi8(7), x7 = _mm512_set1_epi8(8);                                          \
        __m512i w = _mm512_set1_epi8(3), v = _mm512_set1_epi32(5), c = _mm512_set1_epi32(11);                 \
        __m512i s = _mm512_set1_epi32(7), s2 = _mm512_set1_epi32(9);                                         \
        __m512 f0 = _mm512_set1_ps(1), f1 = _mm512_set1_ps(2), sc = _mm512_set1_ps(0.5f), t;                 \
        const long n = 100000000;                                                                            \
        auto start = std::chrono::steady_clock::now();                                                       \
        for (long i = 0; i < n; ++i) {                                                                       \
            const int32_t* p = mem + (i & 1023) * 16;                                                        \
            opaque(w);                                                                                       \
            opaque(v);                                                                                       \
            __VA_ARGS__                                                                                      \
        }                                                                                                    \
        double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();       \
        opaque(a0); opaque(a1); opaque(a2); opaque(a3); opaque(a4); opaque(a5); opaque(a6); opaque(a7);      \
        opaque(f0); opaque(f1); opaque(s); opaque(s2); opaque(t);                                            \
        printf("%-58s %6.2f cycles\n", name, sec / n * ghz * 1e9);                                           \
    }

int main(int argc, char** argv) {
    if (argc > 1) ghz = atof(argv[1]);
    CASE("8 vpdpbusd", DOTS)
    CASE("+ 8 activation broadcasts from memory",
         x0 = _mm512_set1_epi32(p[0]); x1 = _mm512_set1_epi32(p[1]); x2 = _mm512_set1_epi32(p[2]);
         x3 = _mm512_set1_epi32(p[3]); x4 = _mm512_set1_epi32(p[4]); x5 = _mm512_set1_epi32(p[5]);
         x6 = _mm512_set1_epi32(p[6]); x7 = _mm512_set1_epi32(p[7]); DOTS)
    CASE("+ the kernel's per-row float work (mul, cvt, fma, fnmadd)", DOTS
         t = _mm512_mul_ps(sc, _mm512_set1_ps(*(const float*)p));
         f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), t, f0);
         f1 = _mm512_fnmadd_ps(sc, _mm512_set1_ps(((const float*)p)[1]), f1);)
    CASE("+ 1 fma", DOTS f0 = _mm512_fmadd_ps(f1, sc, f0);)
    CASE("+ 1 cvtdq2ps", DOTS t = _mm512_cvtepi32_ps(v); opaque(t);)
    CASE("+ 1 vpmulld, 1 vpaddd", DOTS s = _mm512_add_epi32(s, _mm512_mullo_epi32(v, c));)
    CASE("+ 2 vpmulld, 2 vpaddd", DOTS s = _mm512_add_epi32(s, _mm512_mullo_epi32(v, c));
         s2 = _mm512_add_epi32(s2, _mm512_mullo_epi32(v, w));)
    CASE("+ 1 vpdpwssd", DOTS s2 = _mm512_dpwssd_epi32(s2, v, c);)
    CASE("+ 4 gf2p8affineqb (nibble unpack, GFNI)", DOTS
         s = _mm512_gf2p8affine_epi64_epi8(v, w, 0); opaque(s); s = _mm512_gf2p8affine_epi64_epi8(s, w, 0);
         opaque(s); s = _mm512_gf2p8affine_epi64_epi8(s, w, 0); opaque(s);
         s = _mm512_gf2p8affine_epi64_epi8(s, w, 0); opaque(s);)
    CASE("+ 4 x (vpsrlw, vpandd) (nibble unpack, plain)", DOTS
         s = _mm512_and_si512(_mm512_srli_epi16(v, 4), w); opaque(s);
         s = _mm512_and_si512(_mm512_srli_epi16(s, 4), w); opaque(s);
         s = _mm512_and_si512(_mm512_srli_epi16(s, 4), w); opaque(s);
         s = _mm512_and_si512(_mm512_srli_epi16(s, 4), w); opaque(s);)
    CASE("+ 2 vpternlogd, 2 shifts (6-bit planes)", DOTS
         s = _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(w, 4), s, 0xF8); opaque(s);
         s2 = _mm512_ternarylogic_epi32(s2, _mm512_slli_epi16(w, 2), s, 0xF8); opaque(s2);)
    CASE("+ 1 zmm load", DOTS s = _mm512_loadu_si512(p + 4096); opaque(s);)
    return 0;
}
