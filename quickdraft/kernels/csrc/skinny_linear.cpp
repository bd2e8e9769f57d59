// Skinny (small-M) linear layer for CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// Batch-1 / few-token decoding is bound by reading W.  The kernels below
// stream every weight row once per call, keep the x rows in L1/L2, and hold an
// MB x NB tile of 512-bit fp32 accumulators (MB rows of x times NB rows of W)
// in registers.  The tile loops over K with full-width loads and a masked tail,
// the MB*NB horizontal sums are done together with a transpose-and-add tree,
// and weight rows are software-prefetched into L2 a fixed distance ahead
// (the hardware prefetchers alone leave ~40% of the bandwidth on the table when
// NB rows are streamed at once).
//
// bf16 weights use vdpbf16ps (AVX512_BF16) or, on CPUs without it, widen
// bf16 -> fp32 in registers and FMA in fp32 (one of the two for every M).
//
// The translation unit itself is compiled for the baseline ISA so that the
// module can be imported on any x86-64 machine; the kernels are compiled for
// AVX-512 (+BF16) through `#pragma GCC target` and only run after a runtime
// CPUID check (`__builtin_cpu_supports`).
//
// Define QD_KERNELS_ONLY to compile the kernels without torch (standalone
// micro-benchmarks / experiments).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifndef QD_KERNELS_ONLY
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#endif

namespace qd_skinny {

using bf16_t = uint16_t;

inline float bf16_to_float(bf16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even (same as c10::BFloat16's conversion); NaN stays NaN.
inline bf16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16_t>(u >> 16);
}

inline float load_scalar(const float* p) { return *p; }
inline float load_scalar(const bf16_t* p) { return bf16_to_float(*p); }
inline void store_scalar(float* p, float v) { *p = v; }
inline void store_scalar(bf16_t* p, float v) { *p = float_to_bf16(v); }

// --------------------------------------------------------------------------
// AVX-512 kernels
// --------------------------------------------------------------------------
// Everything up to the matching pop_options is compiled for AVX-512
// (F/BW/VL/DQ); only tile_bf16_dp additionally enables AVX512_BF16, so the
// float32 and widening-bf16 paths also run on AVX-512 CPUs without it.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2")

#define QD_INLINE __attribute__((always_inline)) inline
#define QD_UNROLL _Pragma("GCC unroll 32")

// [a0+a2, a1+a3, b0+b2, b1+b3] (128-bit lanes)
QD_INLINE __m512 fold_pair(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}

// Lane i holds 4 partial sums of input i.
QD_INLINE __m512 fold_quad(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = fold_pair(a, b), cd = fold_pair(c, d);
  return _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Returns the 16 horizontal sums of v[0..15], element i = sum(v[i]).
QD_INLINE __m512 reduce16(const __m512* v) {
  const __m512 p = fold_quad(v[0], v[1], v[2], v[3]);
  const __m512 q = fold_quad(v[4], v[5], v[6], v[7]);
  const __m512 r = fold_quad(v[8], v[9], v[10], v[11]);
  const __m512 s = fold_quad(v[12], v[13], v[14], v[15]);
  const __m512 u = _mm512_add_ps(_mm512_unpacklo_ps(p, q), _mm512_unpackhi_ps(p, q));
  const __m512 w = _mm512_add_ps(_mm512_unpacklo_ps(r, s), _mm512_unpackhi_ps(r, s));
  const __m512 res = _mm512_add_ps(_mm512_shuffle_ps(u, w, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(u, w, _MM_SHUFFLE(3, 2, 3, 2)));
  // res[4*L + j] = sum(v[4*j + L])  ->  out[i] = res[4*(i%4) + i/4]
  const __m512i perm = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(perm, res);
}

// Elements 0..7 are the horizontal sums of v[0..7] (8..15: garbage).
QD_INLINE __m512 reduce8(const __m512* v) {
  const __m512 p = fold_quad(v[0], v[1], v[2], v[3]);
  const __m512 q = fold_quad(v[4], v[5], v[6], v[7]);
  const __m512 u = _mm512_add_ps(_mm512_unpacklo_ps(p, q), _mm512_unpackhi_ps(p, q));
  const __m512 res = _mm512_add_ps(u, _mm512_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
  // res[4*L + j] = sum(v[4*j + L]) for j < 2
  const __m512i perm = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(perm, res);
}

// out[r] = sum(v[r]) for r < R.
template <int R>
QD_INLINE void hsum_many(const __m512* v, float* out) {
  constexpr int full = R / 16, rem = R % 16;
  QD_UNROLL
  for (int g = 0; g < full; ++g) _mm512_storeu_ps(out + 16 * g, reduce16(v + 16 * g));
  if constexpr (rem == 1) {
    out[16 * full] = _mm512_reduce_add_ps(v[16 * full]);
  } else if constexpr (rem > 1 && rem <= 8) {
    __m512 tmp[8];
    QD_UNROLL
    for (int i = 0; i < 8; ++i) tmp[i] = i < rem ? v[16 * full + i] : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(out + 16 * full, static_cast<__mmask16>((1u << rem) - 1u),
                          reduce8(tmp));
  } else if constexpr (rem > 8) {
    __m512 tmp[16];
    QD_UNROLL
    for (int i = 0; i < 16; ++i) tmp[i] = i < rem ? v[16 * full + i] : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(out + 16 * full, static_cast<__mmask16>((1u << rem) - 1u),
                          reduce16(tmp));
  }
}

QD_INLINE void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

// All tiles compute sums[m * NB + n] = dot(x[m * ldx : +K], w[n * ldw : +K]) for
// m < MB, n < NB.  Rows n with bit n of pfmask set are also prefetched into
// L2, pf elements ahead of the current position.

// ---- fp32 weights, fp32 activations --------------------------------------
template <int MB, int NB>
void tile_f32(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t ldw,
              int64_t K, int64_t pf, uint32_t pfmask, float* __restrict sums) {
  __m512 acc[MB][NB];
  QD_UNROLL
  for (int m = 0; m < MB; ++m)
    QD_UNROLL
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();

  auto step = [&](int64_t k, __mmask16 mask, bool full) __attribute__((always_inline)) {
    __m512 wv[NB];
    QD_UNROLL
    for (int n = 0; n < NB; ++n)
      wv[n] = full ? _mm512_loadu_ps(w + n * ldw + k) : _mm512_maskz_loadu_ps(mask, w + n * ldw + k);
    QD_UNROLL
    for (int m = 0; m < MB; ++m) {
      const __m512 xv =
          full ? _mm512_loadu_ps(x + m * ldx + k) : _mm512_maskz_loadu_ps(mask, x + m * ldx + k);
      QD_UNROLL
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  };

  int64_t k = 0;
  if (pfmask != 0) {
    for (; k + 16 <= K; k += 16) {
      QD_UNROLL
      for (int n = 0; n < NB; ++n)
        if (pfmask & (1u << n)) prefetch_l2(w + n * ldw + k + pf);
      step(k, 0, true);
    }
  } else {
    for (; k + 16 <= K; k += 16) step(k, 0, true);
  }
  if (k < K) step(k, static_cast<__mmask16>((1u << (K - k)) - 1u), false);
  hsum_many<MB * NB>(&acc[0][0], sums);
}

// ---- bf16 weights, bf16 activations: vdpbf16ps -----------------------------
// One vdpbf16ps multiplies 32 bf16 pairs (exact products) and adds them into
// 16 fp32 lanes.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,avx2")
template <int MB, int NB>
void tile_bf16_dp(const bf16_t* __restrict x, int64_t ldx, const bf16_t* __restrict w,
                  int64_t ldw, int64_t K, int64_t pf, uint32_t pfmask, float* __restrict sums) {
  __m512 acc[MB][NB];
  QD_UNROLL
  for (int m = 0; m < MB; ++m)
    QD_UNROLL
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();

  auto step = [&](int64_t k, __mmask32 mask, bool full) __attribute__((always_inline)) {
    __m512bh wv[NB];
    QD_UNROLL
    for (int n = 0; n < NB; ++n)
      wv[n] = (__m512bh)(full ? _mm512_loadu_si512(w + n * ldw + k)
                              : _mm512_maskz_loadu_epi16(mask, w + n * ldw + k));
    QD_UNROLL
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)(full ? _mm512_loadu_si512(x + m * ldx + k)
                                          : _mm512_maskz_loadu_epi16(mask, x + m * ldx + k));
      QD_UNROLL
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
    }
  };

  int64_t k = 0;
  if (pfmask != 0) {
    for (; k + 32 <= K; k += 32) {
      QD_UNROLL
      for (int n = 0; n < NB; ++n)
        if (pfmask & (1u << n)) prefetch_l2(w + n * ldw + k + pf);
      step(k, 0, true);
    }
  } else {
    for (; k + 32 <= K; k += 32) step(k, 0, true);
  }
  if (k < K) step(k, static_cast<__mmask32>((1ull << (K - k)) - 1ull), false);
  hsum_many<MB * NB>(&acc[0][0], sums);
}
#pragma GCC pop_options

// ---- bf16 weights, fp32 FMA after in-register widening (no AVX512_BF16) -----
// A 512-bit load holds 32 bf16 = 16 dwords; (dword << 16) is the even element
// as fp32 and (dword & 0xffff0000) the odd one.  The activations are pre-split
// (per 32-element chunk: the 16 even values, then the 16 odd values, as fp32,
// zero padded to a multiple of 32), so every product is an exact fp32 FMA.
template <int MB, int NB>
void tile_bf16_cvt(const float* __restrict xs, int64_t ldx, const bf16_t* __restrict w,
                   int64_t ldw, int64_t K, int64_t pf, uint32_t pfmask, float* __restrict sums) {
  __m512 acc[MB][NB];
  QD_UNROLL
  for (int m = 0; m < MB; ++m)
    QD_UNROLL
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));

  auto step = [&](int64_t k, __mmask32 mask, bool full) __attribute__((always_inline)) {
    __m512 we[NB], wo[NB];
    QD_UNROLL
    for (int n = 0; n < NB; ++n) {
      const __m512i raw = full ? _mm512_loadu_si512(w + n * ldw + k)
                               : _mm512_maskz_loadu_epi16(mask, w + n * ldw + k);
      we[n] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      wo[n] = _mm512_castsi512_ps(_mm512_and_si512(raw, hi_mask));
    }
    QD_UNROLL
    for (int m = 0; m < MB; ++m) {
      const __m512 xe = _mm512_loadu_ps(xs + m * ldx + k);
      const __m512 xo = _mm512_loadu_ps(xs + m * ldx + k + 16);
      QD_UNROLL
      for (int n = 0; n < NB; ++n) {
        acc[m][n] = _mm512_fmadd_ps(xe, we[n], acc[m][n]);
        acc[m][n] = _mm512_fmadd_ps(xo, wo[n], acc[m][n]);
      }
    }
  };

  int64_t k = 0;
  if (pfmask != 0) {
    for (; k + 32 <= K; k += 32) {
      QD_UNROLL
      for (int n = 0; n < NB; ++n)
        if (pfmask & (1u << n)) prefetch_l2(w + n * ldw + k + pf);
      step(k, 0, true);
    }
  } else {
    for (; k + 32 <= K; k += 32) step(k, 0, true);
  }
  if (k < K) step(k, static_cast<__mmask32>((1ull << (K - k)) - 1ull), false);
  hsum_many<MB * NB>(&acc[0][0], sums);
}

// ---- epilogue: + bias, convert, masked store of up to 16 outputs -----------
QD_INLINE __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
QD_INLINE __m512 load16(const bf16_t* p, __mmask16 m) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
QD_INLINE void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
// fp32 -> bf16, round to nearest even, NaN stays (quiet) NaN: as float_to_bf16.
QD_INLINE void store16(bf16_t* p, __m512 v, __mmask16 m) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
}

// --------------------------------------------------------------------------
// Driver.  Also compiled for AVX-512: only reached after the CPUID check.
// --------------------------------------------------------------------------
enum class Kind { F32, BF16_DP, BF16_CVT };

template <typename XT, typename WT>
using TileFn = void (*)(const XT*, int64_t, const WT*, int64_t, int64_t, int64_t, uint32_t, float*);

// Register blocking (accumulators MB x NB):
//   M == 1: 1 x 8,  M == 2: 2 x 8,  M >= 3: tiles of 4 x 6 (last tile 1..3 x 6).
// Rows of W left over at the end of N use NB == 1 tiles.
#define QD_TILE_TABLE(FN, XT, WT)                                      \
  using X = XT;                                                        \
  using W = WT;                                                        \
  static TileFn<XT, WT> get(int mb, int nb) {                          \
    if (nb == 8) {                                                     \
      if (mb == 1) return FN<1, 8>;                                    \
      if (mb == 2) return FN<2, 8>;                                    \
    } else if (nb == 6) {                                              \
      if (mb == 1) return FN<1, 6>;                                    \
      if (mb == 2) return FN<2, 6>;                                    \
      if (mb == 3) return FN<3, 6>;                                    \
      if (mb == 4) return FN<4, 6>;                                    \
    } else if (nb == 1) {                                              \
      if (mb == 1) return FN<1, 1>;                                    \
      if (mb == 2) return FN<2, 1>;                                    \
      if (mb == 3) return FN<3, 1>;                                    \
      if (mb == 4) return FN<4, 1>;                                    \
    }                                                                  \
    return nullptr;                                                    \
  }

template <Kind KIND>
struct Tiles;
template <>
struct Tiles<Kind::F32> {
  QD_TILE_TABLE(tile_f32, float, float)
};
template <>
struct Tiles<Kind::BF16_DP> {
  QD_TILE_TABLE(tile_bf16_dp, bf16_t, bf16_t)
};
template <>
struct Tiles<Kind::BF16_CVT> {
  QD_TILE_TABLE(tile_bf16_cvt, float, bf16_t)
};
#undef QD_TILE_TABLE

inline void choose_blocking(int64_t M, int& MB, int& NB) {
  if (M <= 2) {
    MB = static_cast<int>(M);
    NB = 8;
  } else {
    MB = 4;
    NB = 6;
  }
}

// Process W rows [b0 * NB, min(b1 * NB, N)) for all M rows of x.
// out: [M, N] row-major; bias may be null.
template <Kind KIND, typename OT, typename BT>
void run_blocks(const typename Tiles<KIND>::X* x, int64_t ldx, int64_t M,
                const typename Tiles<KIND>::W* w, int64_t N, int64_t K, const BT* bias, OT* out,
                int64_t pf, int MB, int NB, int64_t b0, int64_t b1) {
  alignas(64) float sums[64];
  // The prefetches for the next blocks are spread over the passes (m-tiles) of
  // this block: pass t prefetches the rows n with n % ntiles == t.
  const int64_t ntiles = (M + MB - 1) / MB;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * NB;
    const int64_t nrows = std::min<int64_t>(NB, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int mb = static_cast<int>(std::min<int64_t>(MB, M - m0));
      const auto* xm = x + m0 * ldx;
      const int64_t t = m0 / MB;
      uint32_t pfmask = 0;
      if (pf > 0)
        for (int n = 0; n < NB; ++n)
          if (n % ntiles == t) pfmask |= 1u << n;
      if (nrows == NB) {
        Tiles<KIND>::get(mb, NB)(xm, ldx, w + n0 * K, K, K, pf, pfmask, sums);
        const __mmask16 nmask = static_cast<__mmask16>((1u << NB) - 1u);
        const __m512 bv = bias ? load16(bias + n0, nmask) : _mm512_setzero_ps();
        for (int i = 0; i < mb; ++i)
          store16(out + (m0 + i) * N + n0, _mm512_add_ps(load16(sums + i * NB, nmask), bv), nmask);
      } else {
        const auto fn = Tiles<KIND>::get(mb, 1);
        for (int64_t j = 0; j < nrows; ++j) {
          fn(xm, ldx, w + (n0 + j) * K, K, K, pf, (t == 0 && pf > 0) ? 1u : 0u, sums);
          for (int i = 0; i < mb; ++i) {
            float v = sums[i];
            if (bias) v += load_scalar(bias + n0 + j);
            store_scalar(out + (m0 + i) * N + n0 + j, v);
          }
        }
      }
    }
  }
}

#undef QD_UNROLL
#undef QD_INLINE
#pragma GCC pop_options

// Split bf16 rows into the (even, odd) fp32 layout used by tile_bf16_cvt.
inline std::vector<float> split_bf16_rows(const bf16_t* x, int64_t M, int64_t K, int64_t kpad) {
  std::vector<float> xs(static_cast<size_t>(M * kpad), 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k)
      xs[m * kpad + (k / 32) * 32 + (k & 1) * 16 + (k % 32) / 2] = bf16_to_float(x[m * K + k]);
  return xs;
}


// --------------------------------------------------------------------------
// AVX2 + FMA (AMD Zen 2/3, older Intel): the same contract, batch invariance included.  Every
// output (m, n) is one 8-lane accumulator over K in steps of 8 (the tail zero-padded), then
// hsum8's one fixed lane order, whatever tile holds it: a row's bits do not depend on how many
// rows share the call (the tile shapes below only decide which loads are shared).  x is float32
// (bfloat16 rows are widened first, exactly); bfloat16 weights widen in registers, so every
// product is an exact float32 FMA, as the AVX-512 build's widening path computes them.
// --------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {

__attribute__((always_inline)) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

__attribute__((always_inline)) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((always_inline)) inline __m256 load8(const bf16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// The last n < 8 values, zero-padded.
template <typename T>
inline __m256 load_tail(const T* p, int64_t n) {
  alignas(32) float values[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t i = 0; i < n; ++i) values[i] = load_scalar(p + i);
  return _mm256_load_ps(values);
}

// sums[m * NB + n] = dot(x[m * ldx : +K], w[n * ldw : +K]) for m < MB, n < NB.
template <int MB, int NB, typename WT>
void tile(const float* __restrict x, int64_t ldx, const WT* __restrict w, int64_t ldw, int64_t K,
          float* __restrict sums) {
  __m256 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = load8(w + n * ldw + k);
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  if (k < K) {
    __m256 wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = load_tail(w + n * ldw + k, K - k);
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = load_tail(x + m * ldx + k, K - k);
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) sums[m * NB + n] = hsum8(acc[m][n]);
}

template <typename WT>
using Tile = void (*)(const float*, int64_t, const WT*, int64_t, int64_t, float*);

// 16 ymm registers: MB * NB accumulators, NB weight vectors and one x vector must fit.
template <typename WT>
inline Tile<WT> tile_for(int mb, int nb) {
  if (nb == 6 && mb == 1) return tile<1, 6, WT>;
  if (nb == 4 && mb == 2) return tile<2, 4, WT>;
  if (nb == 3) {
    if (mb == 1) return tile<1, 3, WT>;
    if (mb == 2) return tile<2, 3, WT>;
    if (mb == 3) return tile<3, 3, WT>;
    if (mb == 4) return tile<4, 3, WT>;
  }
  if (mb == 1) return tile<1, 1, WT>;
  if (mb == 2) return tile<2, 1, WT>;
  if (mb == 3) return tile<3, 1, WT>;
  return tile<4, 1, WT>;
}

// W rows [b0 * NB, min(b1 * NB, N)) for all M rows of x; out [M, N] row-major, bias may be null:
// the float32 sum plus the bias, rounded once to the output type.
template <typename WT>
inline void run_blocks(const float* x, int64_t M, const WT* w, int64_t N, int64_t K, const WT* bias, WT* out,
                       int MB, int NB, int64_t b0, int64_t b1) {
  float sums[16];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * NB, nrows = std::min<int64_t>(NB, N - n0);
    const int nb = nrows == NB ? NB : 1;
    for (int64_t j = 0; j < nrows; j += nb) {
      for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int mb = static_cast<int>(std::min<int64_t>(MB, M - m0));
        tile_for<WT>(mb, nb)(x + m0 * K, K, w + (n0 + j) * K, K, K, sums);
        for (int i = 0; i < mb; ++i)
          for (int c = 0; c < nb; ++c) {
            const float sum = sums[i * nb + c];
            store_scalar(out + (m0 + i) * N + n0 + j + c, bias ? sum + load_scalar(bias + n0 + j + c) : sum);
          }
      }
    }
  }
}

}  // namespace avx2
#pragma GCC pop_options

inline bool cpu_has_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

inline bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2");
}

inline bool cpu_has_avx512_bf16() {
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
}

inline bool cpu_supported() { return cpu_has_avx512() || cpu_has_avx2_fma(); }

}  // namespace qd_skinny

#ifndef QD_KERNELS_ONLY
// --------------------------------------------------------------------------
// Torch binding
// --------------------------------------------------------------------------
namespace qd_skinny {

// Default software prefetch distance (bytes ahead of the row being read).
constexpr int64_t kDefaultPrefetchBytes = 24 * 1024;

template <Kind KIND, typename OT, typename BT>
void run_parallel(const typename Tiles<KIND>::X* x, int64_t ldx, int64_t M,
                  const typename Tiles<KIND>::W* w, int64_t N, int64_t K, const BT* bias, OT* out,
                  int64_t prefetch_bytes) {
  int MB, NB;
  choose_blocking(M, MB, NB);
  const int64_t w_elem = static_cast<int64_t>(sizeof(typename Tiles<KIND>::W));
  const int64_t pf = prefetch_bytes > 0 ? std::max<int64_t>(1, prefetch_bytes / w_elem) : 0;
  const int64_t nblocks = (N + NB - 1) / NB;
  // >= 64 KiB of weights per task, so that small layers do not wake up
  // threads for nothing.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, NB * K * w_elem));
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    run_blocks<KIND, OT, BT>(x, ldx, M, w, N, K, bias, out, pf, MB, NB, b0, b1);
  });
}

// The AVX2 build's blocking: a decode row reads 6 weight rows a pass, two rows 4, more 3 per
// tile of 4 rows of x (every choice gives each output the same bits).
template <typename WT>
inline void run_avx2(const float* x, int64_t M, const WT* w, int64_t N, int64_t K, const WT* bias, WT* out) {
  const int MB = M == 1 ? 1 : (M == 2 ? 2 : 4), NB = M == 1 ? 6 : (M == 2 ? 4 : 3);
  const int64_t nblocks = (N + NB - 1) / NB;
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, NB * K * static_cast<int64_t>(sizeof(WT))));
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    avx2::run_blocks<WT>(x, M, w, N, K, bias, out, MB, NB, b0, b1);
  });
}

// bf16_mode: 0 = auto (vdpbf16ps when the CPU has AVX512_BF16, whatever M),
//            1 = vdpbf16ps, 2 = widen to fp32 + FMA.
// prefetch_bytes < 0: default distance; 0: no software prefetch.
at::Tensor skinny_linear(const at::Tensor& x_in, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& bias_opt, int64_t bf16_mode,
                         int64_t prefetch_bytes) {
  TORCH_CHECK(cpu_supported(), "skinny_linear: this CPU lacks AVX-512 and AVX2");
  TORCH_CHECK(x_in.device().is_cpu() && weight.device().is_cpu(),
              "skinny_linear: CPU tensors only");
  TORCH_CHECK(x_in.dim() >= 1 && weight.dim() == 2,
              "skinny_linear: x must be [..., K] and weight [N, K]");
  TORCH_CHECK(weight.is_contiguous(), "skinny_linear: weight must be contiguous");
  TORCH_CHECK(x_in.scalar_type() == weight.scalar_type(), "skinny_linear: x/weight dtype mismatch");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "skinny_linear: only float32 and bfloat16 are supported");
  const int64_t K = x_in.size(-1), N = weight.size(0);
  const int64_t M = K > 0 ? x_in.numel() / K : 0;
  TORCH_CHECK(weight.size(1) == K, "skinny_linear: x and weight shapes do not match");
  const bool has_bias = bias_opt.has_value() && bias_opt->defined();
  at::Tensor bias;
  if (has_bias) {
    bias = bias_opt->contiguous();
    TORCH_CHECK(bias.device().is_cpu(), "skinny_linear: bias must be on CPU");
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == N, "skinny_linear: bias shape mismatch");
    TORCH_CHECK(bias.scalar_type() == weight.scalar_type(), "skinny_linear: bias dtype mismatch");
  }
  if (prefetch_bytes < 0) prefetch_bytes = kDefaultPrefetchBytes;

  TORCH_CHECK(K > 0, "skinny_linear: K must be positive");
  std::vector<int64_t> out_sizes(x_in.sizes().begin(), x_in.sizes().end());
  out_sizes.back() = N;
  at::Tensor out = at::empty(out_sizes, x_in.options());
  if (M == 0 || N == 0) return out;
  const at::Tensor x = x_in.contiguous();  // row-major [M, K] in memory

  if (!cpu_has_avx512()) {
    if (weight.scalar_type() == at::kFloat) {
      run_avx2<float>(x.const_data_ptr<float>(), M, weight.const_data_ptr<float>(), N, K,
                      has_bias ? bias.const_data_ptr<float>() : nullptr, out.mutable_data_ptr<float>());
      return out;
    }
    const auto* xb = static_cast<const bf16_t*>(x.const_data_ptr());
    std::vector<float> widened(static_cast<size_t>(M * K));  // exact: a bfloat16 is a float's top half
    for (int64_t i = 0; i < M * K; ++i) widened[i] = bf16_to_float(xb[i]);
    run_avx2<bf16_t>(widened.data(), M, static_cast<const bf16_t*>(weight.const_data_ptr()), N, K,
                     has_bias ? static_cast<const bf16_t*>(bias.const_data_ptr()) : nullptr,
                     static_cast<bf16_t*>(out.mutable_data_ptr()));
    return out;
  }
  if (weight.scalar_type() == at::kFloat) {
    run_parallel<Kind::F32, float, float>(x.const_data_ptr<float>(), K, M,
                                          weight.const_data_ptr<float>(), N, K,
                                          has_bias ? bias.const_data_ptr<float>() : nullptr,
                                          out.mutable_data_ptr<float>(), prefetch_bytes);
    return out;
  }

  const auto* wp = static_cast<const bf16_t*>(weight.const_data_ptr());
  const auto* bp = has_bias ? static_cast<const bf16_t*>(bias.const_data_ptr()) : nullptr;
  const auto* xp = static_cast<const bf16_t*>(x.const_data_ptr());
  auto* op = static_cast<bf16_t*>(out.mutable_data_ptr());
  int mode = static_cast<int>(bf16_mode);
  // Auto: one mode for every M, so a row's bits never depend on the rows beside it (batch
  // invariance: the two modes round differently). vdpbf16ps (2x the MACs per instruction)
  // where the CPU has it; widening + fp32 FMA was ~10% faster for M <= 3 on Zen 4, which
  // invariance gives up.
  if (mode == 0) mode = cpu_has_avx512_bf16() ? 1 : 2;
  if (mode == 1) {
    TORCH_CHECK(cpu_has_avx512_bf16(), "skinny_linear: this CPU lacks AVX512_BF16");
    run_parallel<Kind::BF16_DP, bf16_t, bf16_t>(xp, K, M, wp, N, K, bp, op, prefetch_bytes);
  } else {
    const int64_t kpad = (K + 31) / 32 * 32;
    const std::vector<float> xs = split_bf16_rows(xp, M, K, kpad);
    run_parallel<Kind::BF16_CVT, bf16_t, bf16_t>(xs.data(), kpad, M, wp, N, K, bp, op,
                                                 prefetch_bytes);
  }
  return out;
}

}  // namespace qd_skinny

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("skinny_linear", &qd_skinny::skinny_linear,
        "y = x @ weight.T + bias for few rows of x (AVX-512). x [..., K], weight [N, K].",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("bf16_mode") = 0,
        py::arg("prefetch_bytes") = -1, py::call_guard<py::gil_scoped_release>());
  m.def("cpu_has_avx512", &qd_skinny::cpu_has_avx512);
  m.def("cpu_has_avx512_bf16", &qd_skinny::cpu_has_avx512_bf16);
  m.def("cpu_has_avx2_fma", &qd_skinny::cpu_has_avx2_fma);
  m.def("cpu_supported", &qd_skinny::cpu_supported);
}
#endif  // QD_KERNELS_ONLY
