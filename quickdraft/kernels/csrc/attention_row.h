// One query row of one head against S keys, in a fixed order (see attention.cpp): shared by the
// attention module and the fused decoder layer of quant_linear.cpp, so both give the same bits.
// Key and value row s of a call start at k + rows[s] and v + rows[s] (float offsets): a paged
// cache's rows lie in blocks, a contiguous one's every D floats; where they lie changes no bit.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace qd_attention {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,fma")

// Fixed-order dot product of two rows of D floats (D % 16 == 0).
inline float dot(const float* a, const float* b, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  return _mm512_reduce_add_ps(acc);
}

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

// The weighted sum of the visible values, DB x 16 floats kept in registers.
template <int DB>
inline void weighted_values(const float* v, const int64_t* rows, int64_t S, const bool* visible,
                            const float* weights, float* out, float& total) {
  __m512 acc[DB];
  for (int j = 0; j < DB; ++j) acc[j] = _mm512_setzero_ps();
  total = 0.0f;
  for (int64_t s = 0; s < S; ++s) {
    if (visible != nullptr && !visible[s]) continue;
    total += weights[s];
    const __m512 pv = _mm512_set1_ps(weights[s]);
    const float* vs = v + rows[s];
    for (int j = 0; j < DB; ++j) acc[j] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(vs + 16 * j), acc[j]);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / total);
  for (int j = 0; j < DB; ++j) _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(acc[j], inv));
}

// One query row of one head against S keys (scores: a scratch row of S rounded up to 16).
// Keys are visited in order and masked ones skipped, so a query sees the same operations
// whatever range of keys the call spans.
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
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(out + d, _mm512_setzero_ps());
    return;
  }
  const __m512 max_v = _mm512_set1_ps(max_score);
  for (int64_t s = 0; s < S; s += 16) {
    const __mmask16 lanes = S - s >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (S - s)) - 1u);
    const __m512 x = _mm512_maskz_loadu_ps(lanes, scores + s);
    _mm512_mask_storeu_ps(scores + s, lanes, exp16(_mm512_sub_ps(x, max_v)));
  }
  float total;
  switch (D) {
    case 256: weighted_values<16>(v, rows, S, visible, scores, out, total); return;
    case 128: weighted_values<8>(v, rows, S, visible, scores, out, total); return;
    case 64: weighted_values<4>(v, rows, S, visible, scores, out, total); return;
    default: break;
  }
  total = 0.0f;
  for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(out + d, _mm512_setzero_ps());
  for (int64_t s = 0; s < S; ++s) {
    if (visible != nullptr && !visible[s]) continue;
    total += scores[s];
    const __m512 pv = _mm512_set1_ps(scores[s]);
    const float* vs = v + rows[s];
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(out + d, _mm512_fmadd_ps(pv, _mm512_loadu_ps(vs + d), _mm512_loadu_ps(out + d)));
  }
  const __m512 inv = _mm512_set1_ps(1.0f / total);
  for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_loadu_ps(out + d), inv));
}

// G query heads of one query row that share a key head (grouped-query attention), against the
// same S keys and mask: each (row, head) gets attend_row's very bits, since every head runs the
// same operations in the same order (its dot products in key order, max, exp, the total and the
// weighted values key after key, per lane); the heads only share the loads.  Each key and value
// row is read once for the G heads instead of G times: attention over a long context is bound
// by reading them.  q, out: G heads of D floats, one after the other; scores: G * S scratch.
template <int G>
inline void attend_heads(const float* q, const float* k, const float* v, const int64_t* rows, int64_t S, int64_t D,
                         const bool* visible, float scale, float* scores, float* out) {
  if (D % (256 / G) != 0) {  // the weighted sum below takes 256 / G lanes of every head at a time
    for (int g = 0; g < G; ++g)
      attend_row(q + g * D, k, v, rows, S, D, visible, scale, scores + g * S, out + g * D);
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
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 kd = _mm512_loadu_ps(ks + d);
      for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + d), kd, acc[g]);
    }
    for (int g = 0; g < G; ++g) {
      scores[g * S + s] = _mm512_reduce_add_ps(acc[g]) * scale;
      max_score[g] = std::max(max_score[g], scores[g * S + s]);
    }
  }
  if (max_score[0] == neg_inf) {  // the heads share the mask: none sees anything
    for (int64_t d = 0; d < G * D; d += 16) _mm512_storeu_ps(out + d, _mm512_setzero_ps());
    return;
  }
  float inv_total[G];
  for (int g = 0; g < G; ++g) {
    float* row = scores + g * S;
    const __m512 max_v = _mm512_set1_ps(max_score[g]);
    for (int64_t s = 0; s < S; s += 16) {
      const __mmask16 lanes = S - s >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (S - s)) - 1u);
      const __m512 x = _mm512_maskz_loadu_ps(lanes, row + s);
      _mm512_mask_storeu_ps(row + s, lanes, exp16(_mm512_sub_ps(x, max_v)));
    }
    float total = 0.0f;
    for (int64_t s = 0; s < S; ++s)
      if (visible == nullptr || visible[s]) total += row[s];
    inv_total[g] = 1.0f / total;
  }
  constexpr int W = 16 / G;  // value vectors per head at a time: G * W = 16 accumulators
  for (int64_t c = 0; c < D; c += 16 * W) {
    __m512 acc[G][W];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < W; ++j) acc[g][j] = _mm512_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      if (visible != nullptr && !visible[s]) continue;
      const float* vs = v + rows[s] + c;
      __m512 vv[W];
      for (int j = 0; j < W; ++j) vv[j] = _mm512_loadu_ps(vs + 16 * j);
      for (int g = 0; g < G; ++g) {
        const __m512 pv = _mm512_set1_ps(scores[g * S + s]);
        for (int j = 0; j < W; ++j) acc[g][j] = _mm512_fmadd_ps(pv, vv[j], acc[g][j]);
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 inv = _mm512_set1_ps(inv_total[g]);
      for (int j = 0; j < W; ++j) _mm512_storeu_ps(out + g * D + c + 16 * j, _mm512_mul_ps(acc[g][j], inv));
    }
  }
}

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

// attend_heads for a run-time G from heads_per_call.
inline void attend_heads_n(int64_t G, const float* q, const float* k, const float* v, const int64_t* rows, int64_t S,
                           int64_t D, const bool* visible, float scale, float* scores, float* out) {
  switch (G) {
    case 4: attend_heads<4>(q, k, v, rows, S, D, visible, scale, scores, out); return;
    case 2: attend_heads<2>(q, k, v, rows, S, D, visible, scale, scores, out); return;
    default: attend_row(q, k, v, rows, S, D, visible, scale, scores, out); return;
  }
}

#pragma GCC pop_options

}  // namespace qd_attention
