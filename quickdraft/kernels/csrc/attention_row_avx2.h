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

// The 8 lanes' sum by one fixed tree: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two.
inline float sum8(__m256 acc) {
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 0x55)));
}

// Fixed-order dot product of two rows of D floats (D % 8 == 0).
inline float dot(const float* a, const float* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  return sum8(acc);
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

// scores[s] = exp(scores[s] - max_score) for the S keys; returns 1 / (the visible ones' sum, in
// key order).
inline float exp_scores(float* scores, int64_t S, float max_score, const bool* visible) {
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
  return 1.0f / total;
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
  const float inv_total = exp_scores(scores, S, max_score, visible);
  // 8 registers of values at a time (64 floats of the head), fewer for a narrow remainder.
  int64_t c = 0;
  for (; c + 64 <= D; c += 64) weighted_values<8>(v, rows, S, visible, scores, inv_total, c, out);
  for (; c < D; c += 8) weighted_values<1>(v, rows, S, visible, scores, inv_total, c, out);
}

// G query heads of one query row that share a key head, against the same S keys and mask: each
// head gets attend_row's very bits (its dot products by dot's operations in key order, the same
// max, exp, total and weighted values key after key per lane); the heads only share the loads
// of the key and value rows, which bound attention over a long context (a decode step's four
// heads read the keys once instead of four times).  q, out: G heads of D floats one after the
// other; scores: G * S + 8 scratch.
template <int G>
inline void attend_heads(const float* q, const float* k, const float* v, const int64_t* rows, int64_t S, int64_t D,
                         const bool* visible, float scale, float* scores, float* out) {
  constexpr int W = 8 / G;  // value registers per head at a time: G * W = 8 accumulators
  if (D % (8 * W) != 0) {
    for (int g = 0; g < G; ++g) attend_row(q + g * D, k, v, rows, S, D, visible, scale, scores + g * S, out + g * D);
    return;
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float max_score[G];
  for (int g = 0; g < G; ++g) max_score[g] = neg_inf;
  for (int64_t s = 0; s < S; ++s) {
    if (visible != nullptr && !visible[s]) {
      for (int g = 0; g < G; ++g) scores[g * S + s] = neg_inf;
      continue;
    }
    const float* ks = k + rows[s];
    __m256 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 kd = _mm256_loadu_ps(ks + d);
      for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), kd, acc[g]);
    }
    for (int g = 0; g < G; ++g) {
      scores[g * S + s] = sum8(acc[g]) * scale;
      max_score[g] = std::max(max_score[g], scores[g * S + s]);
    }
  }
  if (max_score[0] == neg_inf) {  // the heads share the mask: none sees anything
    for (int64_t d = 0; d < G * D; d += 8) _mm256_storeu_ps(out + d, _mm256_setzero_ps());
    return;
  }
  float inv_total[G];
  for (int g = 0; g < G; ++g) inv_total[g] = exp_scores(scores + g * S, S, max_score[g], visible);
  for (int64_t c = 0; c < D; c += 8 * W) {
    __m256 acc[G][W];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < W; ++j) acc[g][j] = _mm256_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      if (visible != nullptr && !visible[s]) continue;
      const float* vs = v + rows[s] + c;
      __m256 vv[W];
      for (int j = 0; j < W; ++j) vv[j] = _mm256_loadu_ps(vs + 8 * j);
      for (int g = 0; g < G; ++g) {
        const __m256 pv = _mm256_set1_ps(scores[g * S + s]);
        for (int j = 0; j < W; ++j) acc[g][j] = _mm256_fmadd_ps(pv, vv[j], acc[g][j]);
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m256 inv = _mm256_set1_ps(inv_total[g]);
      for (int j = 0; j < W; ++j) _mm256_storeu_ps(out + g * D + c + 8 * j, _mm256_mul_ps(acc[g][j], inv));
    }
  }
}

// Heads per attend_heads call for `group` query heads per key head: as many as keep every
// thread busy (rows x key heads x calls per key head >= threads), at most 4.
inline int64_t heads_per_call(int64_t group, int64_t rows_times_kv_heads, int64_t threads) {
  int64_t g = 1;
  while (g < 4 && group % (2 * g) == 0 && rows_times_kv_heads * (group / (2 * g)) >= threads) g *= 2;
  return g;
}

inline void attend_heads_n(int64_t G, const float* q, const float* k, const float* v, const int64_t* rows, int64_t S,
                           int64_t D, const bool* visible, float scale, float* scores, float* out) {
  switch (G) {
    case 4: attend_heads<4>(q, k, v, rows, S, D, visible, scale, scores, out); return;
    case 2: attend_heads<2>(q, k, v, rows, S, D, visible, scale, scores, out); return;
    default: attend_row(q, k, v, rows, S, D, visible, scale, scores, out); return;
  }
}

#pragma GCC pop_options

}  // namespace qd_attention_avx2
