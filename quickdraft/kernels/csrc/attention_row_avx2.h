// attention_row.h's algorithm (attention_row_body.h) for CPUs with AVX2 and FMA but no AVX-512
// (AMD Zen 2/3, older Intel): 8 lanes instead of 16, the same fixed order, so a row's bits do
// not depend on the other rows of the call, the mask's other rows or the threads.  The bits
// differ from the AVX-512 build's (other lane sums): invariance holds within one build, which is
// what verification needs.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "attention_scale.h"

namespace qd_attention_avx2 {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// The 8 lanes' sum by one fixed tree: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two.
inline float sum8(__m256 acc) {
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 0x55)));
}

// exp(x) for 8 lanes: 2^n * p(r), x = n ln2 + r, the polynomial of attention_row.h's exp16;
// inputs clamped to [-87, 87], so 2^n is a normal float built from its exponent bits.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(0.5f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

struct Vec {
  using F = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kAccumulators = 8;  // of 16 registers
  // 3 keys x 4 heads = 12 score accumulators beside the keys and a query (A/B on Zen 2, 300-1000
  // keys: the scores ~25% faster than 1 key, 4 keys spill)
  static constexpr int kKeysAtOnce = 3;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load_half(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(F v) { return sum8(v); }
  static F exp(F x) { return exp8(x); }
};

#include "attention_row_body.h"

// Heads per attend_heads call for `group` query heads per key head: as many as keep every
// thread busy (rows x key heads x calls per key head >= threads), at most 4.
inline int64_t heads_per_call(int64_t group, int64_t rows_times_kv_heads, int64_t threads) {
  int64_t g = 1;
  while (g < 4 && group % (2 * g) == 0 && rows_times_kv_heads * (group / (2 * g)) >= threads) g *= 2;
  return g;
}

#pragma GCC pop_options

}  // namespace qd_attention_avx2
