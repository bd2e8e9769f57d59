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
#pragma GCC target("avx512f,fma")

// Fixed-order dot product of two rows of D floats (D % 16 == 0).
inline float dot(const float* a, const float* b, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  return _mm512_reduce_add_ps(acc);
}

// One query row of one head against S keys.
void attend_row(const float* q, const float* k, const float* v, int64_t key_stride, int64_t S, int64_t D,
                const bool* visible, float scale, float* scores, float* out) {
  float max_score = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < S; ++s) {
    if (visible != nullptr && !visible[s]) {
      scores[s] = -std::numeric_limits<float>::infinity();
      continue;
    }
    scores[s] = dot(q, k + s * key_stride, D) * scale;
    max_score = std::max(max_score, scores[s]);
  }
  for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(out + d, _mm512_setzero_ps());
  if (max_score == -std::numeric_limits<float>::infinity()) return;  // sees nothing: zeros
  float total = 0.0f;
  for (int64_t s = 0; s < S; ++s) {
    if (visible != nullptr && !visible[s]) continue;
    const float p = std::exp(scores[s] - max_score);
    total += p;
    const __m512 pv = _mm512_set1_ps(p);
    const float* vs = v + s * key_stride;
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(out + d, _mm512_fmadd_ps(pv, _mm512_loadu_ps(vs + d), _mm512_loadu_ps(out + d)));
  }
  const __m512 inv = _mm512_set1_ps(1.0f / total);
  for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_loadu_ps(out + d), inv));
}

#pragma GCC pop_options

}  // namespace qd_attention
