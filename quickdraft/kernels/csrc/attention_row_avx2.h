// attention_row.h's one query row of one head against S keys, for CPUs with AVX2 and FMA but no
// AVX-512 (AMD Zen 2/3, older Intel): 8 lanes instead of 16, the same fixed order (dot products
// in key order, one horizontal sum per dot, max, exp and the total in key order, the weighted
// values key after key per lane), so a row's bits do not depend on the other rows of the call,
// the mask's other rows or the threads.  The bits differ from the AVX-512 build's (other lane
// sums): invariance holds within one build, which is what verification needs.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace qd_attention_avx2 {

#pragma GCC push_options
#pragma GCC target("avx2,fma")

// Fixed-order dot product of two rows of D floats (D % 8 == 0).
inline float dot(const float* a, const float* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  // One fixed tree: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two.
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

// The weighted sum of the visible values over W x 8 floats of the head (from column c), kept
// in registers; every lane adds its keys in key order whatever W is.
template <int W>
inline void weighted_values(const float* v, const int64_t* rows, int64_t S, const bool* visible,
                            const float* weights, float inv_total, int64_t c, float* out) {
  __m256 acc[W];
  for (int j = 0; j < W; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    if (visible != nullptr && !visible[s]) continue;
    const __m256 pv = _mm256_set1_ps(weights[s]);
    const float* vs = v + rows[s] + c;
    for (int j = 0; j < W; ++j) acc[j] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vs + 8 * j), acc[j]);
  }
  const __m256 inv = _mm256_set1_ps(inv_total);
  for (int j = 0; j < W; ++j) _mm256_storeu_ps(out + c + 8 * j, _mm256_mul_ps(acc[j], inv));
}

// One query row of one head against S keys (scores: a scratch row of S rounded up to 8).
inline void attend_row(const float* q, const float* k, const float* v, const int64_t* rows, int64_t S, int64_t D,
                       const bool* visible, float scale, float* scores, float* out) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float max_score = neg_inf;
  for (int64_t s = 0; s < S; ++s) {
    if (visible != nullptr && !visible[s]) {
      scores[s] = neg_inf;
      continue;
    }
    scores[s] = dot(q, k + rows[s], D) * scale;
    max_score = std::max(max_score, scores[s]);
  }
  if (max_score == neg_inf) {  // sees nothing: zeros
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + d, _mm256_setzero_ps());
    return;
  }
  const __m256 max_v = _mm256_set1_ps(max_score);
  int64_t s = 0;
  for (; s + 8 <= S; s += 8) _mm256_storeu_ps(scores + s, exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + s), max_v)));
  if (s < S) {  // the tail through a padded copy: each lane's exp is the same function
    alignas(32) float tail[8];
    for (int64_t i = 0; i < 8; ++i) tail[i] = s + i < S ? scores[s + i] : max_score;
    _mm256_store_ps(tail, exp8(_mm256_sub_ps(_mm256_load_ps(tail), max_v)));
    for (int64_t i = 0; s + i < S; ++i) scores[s + i] = tail[i];
  }
  float total = 0.0f;
  for (int64_t t = 0; t < S; ++t)
    if (visible == nullptr || visible[t]) total += scores[t];
  const float inv_total = 1.0f / total;
  // 8 registers of values at a time (64 floats of the head), fewer for a narrow remainder.
  int64_t c = 0;
  for (; c + 64 <= D; c += 64) weighted_values<8>(v, rows, S, visible, scores, inv_total, c, out);
  for (; c < D; c += 8) weighted_values<1>(v, rows, S, visible, scores, inv_total, c, out);
}

#pragma GCC pop_options

}  // namespace qd_attention_avx2
