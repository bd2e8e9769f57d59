// One query row of one head against S keys, in a fixed order (attention_row_body.h): shared by
// the attention module and the fused decoder layer of quant_linear.cpp, so both give the same
// bits.  This is the AVX-512 build (16 lanes); attention_row_avx2.h is the AVX2 one.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "attention_scale.h"

namespace qd_attention {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,fma")

// exp(x) for 16 lanes: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial
// (relative error ~2e-7); inputs clamped to [-87, 87].  Elementwise: a key's weight does not
// depend on which other keys share its vector.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0.5f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

struct Vec {
  using F = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kAccumulators = 16;  // of 32 registers
  // as the AVX2 build (not measured on an AVX-512 CPU: 12 accumulators leave registers spare)
  static constexpr int kKeysAtOnce = 3;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load_half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
  static F exp(F x) { return exp16(x); }
};

#include "attention_row_body.h"

// Heads per attend_heads call for `group` query heads per key head.  Sharing the reads pays
// where many rows read the same keys (prefill, wide trees: 1.4-1.7x at 256 rows over 512 keys);
// a decode step's one row is split head by head instead, to keep every thread busy (measured:
// grouped it was slower there).  At most 4 heads (the registers of the weighted sum).
inline int64_t heads_per_call(int64_t group, int64_t rows_times_kv_heads, int64_t threads) {
  if (rows_times_kv_heads < 4 * threads) return 1;
  int64_t g = 1;
  while (g < 4 && group % (2 * g) == 0) g *= 2;
  return g;
}

#pragma GCC pop_options

}  // namespace qd_attention
