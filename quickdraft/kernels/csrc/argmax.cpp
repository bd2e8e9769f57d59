// Row argmax of float32 logits, with torch.argmax's answer: the first index of the maximum,
// or of the first NaN when a row has one.
//
// Why not torch.argmax: on a [16, 262144] verification tree it runs one thread per row at
// ~1.4 GB/s single-threaded (11 ms; 4.5 ms on two threads, a tenth of a wide step); this reads
// the logits once at ~16 GB/s per thread (1 ms), wide trees split in chunks over the threads.  The answer cannot depend on the
// split: each chunk keeps the first index of its maximum, and chunks are combined in order.
//
// The translation unit is compiled for the baseline ISA; the AVX-512 loop and its 8-lane AVX2
// twin carry `#pragma GCC target` and run only after the CPUID checks (AVX2 at least).

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/extension.h>

namespace qd_argmax {

constexpr int64_t kChunk = 16384;  // values per task: 64 KiB
// Tasks per thread at least: one thread reads a 262k-vocabulary row in ~60 us, less than
// waking a second one costs on a busy machine, so only wide trees are split.
constexpr int64_t kGrain = 32;

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
}

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

struct Best {
  float value;
  int64_t index;  // -1: not set
  bool nan;       // index is the first NaN of the chunk
};

#pragma GCC push_options
#pragma GCC target("avx512f")

// The first maximum (or first NaN) of x[begin, end).  Lane l of the vector loop sees the
// indices congruent to l (mod 16) in order and keeps the first of its maximum (strict >);
// the lanes are then combined by value and, for equal values, by smallest index.
Best chunk_argmax(const float* x, int64_t begin, int64_t end) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_index = _mm512_set1_epi32(-1);
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);  // from begin
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 any_nan = 0;
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    any_nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    // First visit of a lane takes its value even when it is -inf, so an all -inf row answers 0.
    const __mmask16 take = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ) |
                           _mm512_cmpeq_epi32_mask(best_index, _mm512_set1_epi32(-1));
    best = _mm512_mask_mov_ps(best, take, v);
    best_index = _mm512_mask_mov_epi32(best_index, take, index);
    index = _mm512_add_epi32(index, step);
  }
  Best out{-INFINITY, -1, false};
  if (any_nan) {
    for (int64_t j = begin; j < end; ++j) {
      if (std::isnan(x[j])) return Best{x[j], j, true};
    }
  }
  alignas(64) float values[16];
  alignas(64) int32_t indices[16];
  _mm512_store_ps(values, best);
  _mm512_store_si512(indices, best_index);
  for (int lane = 0; lane < 16; ++lane) {
    if (indices[lane] < 0) continue;
    const int64_t at = begin + indices[lane];
    if (out.index < 0 || values[lane] > out.value || (values[lane] == out.value && at < out.index)) {
      out = Best{values[lane], at, false};
    }
  }
  for (; i < end; ++i) {  // the tail comes after every vector index: strict > keeps the first
    if (std::isnan(x[i])) return Best{x[i], i, true};
    if (out.index < 0 || x[i] > out.value) out = Best{x[i], i, false};
  }
  return out;
}

#pragma GCC pop_options

// Combines the lanes of a vector loop (each lane's first maximum, index -1 where unset) and the
// scalar tail; the same rule as the AVX-512 loop above.
Best finish_chunk(const float* x, int64_t begin, int64_t tail, int64_t end, const float* values,
                  const int32_t* indices, int lanes) {
  Best out{-INFINITY, -1, false};
  for (int lane = 0; lane < lanes; ++lane) {
    if (indices[lane] < 0) continue;
    const int64_t at = begin + indices[lane];
    if (out.index < 0 || values[lane] > out.value || (values[lane] == out.value && at < out.index)) {
      out = Best{values[lane], at, false};
    }
  }
  for (int64_t i = tail; i < end; ++i) {
    if (std::isnan(x[i])) return Best{x[i], i, true};
    if (out.index < 0 || x[i] > out.value) out = Best{x[i], i, false};
  }
  return out;
}

#pragma GCC push_options
#pragma GCC target("avx2")

// AVX2 CPUs (AMD Zen 2/3, older Intel): the AVX-512 loop in 8 lanes.
Best chunk_argmax_avx2(const float* x, int64_t begin, int64_t end) {
  __m256 best = _mm256_set1_ps(-INFINITY);
  __m256i best_index = _mm256_set1_epi32(-1);
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);  // from begin
  const __m256i step = _mm256_set1_epi32(8), unset = _mm256_set1_epi32(-1);
  __m256 any_nan = _mm256_setzero_ps();
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    any_nan = _mm256_or_ps(any_nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256 take = _mm256_or_ps(_mm256_cmp_ps(v, best, _CMP_GT_OQ),
                                     _mm256_castsi256_ps(_mm256_cmpeq_epi32(best_index, unset)));
    best = _mm256_blendv_ps(best, v, take);
    best_index = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(best_index), _mm256_castsi256_ps(index), take));
    index = _mm256_add_epi32(index, step);
  }
  if (_mm256_movemask_ps(any_nan)) {
    for (int64_t j = begin; j < i; ++j) {
      if (std::isnan(x[j])) return Best{x[j], j, true};
    }
  }
  alignas(32) float values[8];
  alignas(32) int32_t indices[8];
  _mm256_store_ps(values, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(indices), best_index);
  return finish_chunk(x, begin, i, end, values, indices, 8);
}

#pragma GCC pop_options

torch::Tensor argmax_rows(const torch::Tensor& logits) {  // logits [M, V] float32 -> [M] int64
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() &&
                  logits.device().is_cpu(),
              "argmax_rows: need a contiguous [M, V] float32 CPU tensor");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "argmax_rows: empty rows");
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  std::vector<Best> partial(rows * chunks);
  const float* x = logits.data_ptr<float>();
  const bool wide = has_avx512();
  at::parallel_for(0, rows * chunks, kGrain, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t row = task / chunks, chunk = task % chunks;
      const int64_t begin = chunk * kChunk, end = std::min(vocab, begin + kChunk);
      partial[task] = wide ? chunk_argmax(x + row * vocab, begin, end) : chunk_argmax_avx2(x + row * vocab, begin, end);
    }
  });
  torch::Tensor out = torch::empty({rows}, torch::kInt64);
  int64_t* result = out.data_ptr<int64_t>();
  for (int64_t row = 0; row < rows; ++row) {
    Best best = partial[row * chunks];
    for (int64_t chunk = 1; chunk < chunks && !best.nan; ++chunk) {
      const Best& b = partial[row * chunks + chunk];
      if (b.nan || b.value > best.value) best = b;  // equal values: the earlier chunk stays
    }
    result[row] = best.index;
  }
  return out;
}

}  // namespace qd_argmax

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpu_supported", &qd_argmax::cpu_supported);
  m.def("argmax_rows", &qd_argmax::argmax_rows);
}
