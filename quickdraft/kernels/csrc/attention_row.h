// One query row of one head against S keys, in a fixed order (see attention.cpp): shared by the
// attention module and the fused decoder layer of quant_linear.cpp, so both give the same bits.
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
inline void weighted_values(const float* v, int64_t key_stride, int64_t S, const bool* visible,
                            const float* weights, float* out, float& total) {
  __m512 acc[DB];
  for (int j = 0; j < DB; ++j) acc[j] = _mm512_setzero_ps();
  total = 0.0f;
  for (int64_t s = 0; s < S; ++s) {
    if (visible != nullptr && !visible[s]) continue;
    total += weights[s];
    const __m512 pv = _mm512_set1_ps(weights[s]);
    const float* vs = v + s * key_stride;
    for (int j = 0; j < DB; ++j) acc[j] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(vs + 16 * j), acc[j]);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / total);
  for (int j = 0; j < DB; ++j) _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(acc[j], inv));
}

// One query row of one head against S keys (scores: a scratch row of S rounded up to 16).
// Keys are visited in order and masked ones skipped, so a query sees the same operations
// whatever range of keys the call spans.
inline void attend_row(const float* q, const float* k, const float* v, int64_t key_stride, int64_t S, int64_t D,
                       const bool* visible, float scale, float* scores, float* out) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float max_score = neg_inf;
  for (int64_t s = 0; s < S; ++s) {
    if (visible != nullptr && !visible[s]) {
      scores[s] = neg_inf;
      continue;
    }
    scores[s] = dot(q, k + s * key_stride, D) * scale;
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
    case 256: weighted_values<16>(v, key_stride, S, visible, scores, out, total); return;
    case 128: weighted_values<8>(v, key_stride, S, visible, scores, out, total); return;
    case 64: weighted_values<4>(v, key_stride, S, visible, scores, out, total); return;
    default: break;
  }
  total = 0.0f;
  for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(out + d, _mm512_setzero_ps());
  for (int64_t s = 0; s < S; ++s) {
    if (visible != nullptr && !visible[s]) continue;
    total += scores[s];
    const __m512 pv = _mm512_set1_ps(scores[s]);
    const float* vs = v + s * key_stride;
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(out + d, _mm512_fmadd_ps(pv, _mm512_loadu_ps(vs + d), _mm512_loadu_ps(out + d)));
  }
  const __m512 inv = _mm512_set1_ps(1.0f / total);
  for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_loadu_ps(out + d), inv));
}

#pragma GCC pop_options

}  // namespace qd_attention
