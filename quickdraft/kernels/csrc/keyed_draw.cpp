// Position-keyed draws from rows of logits, in one pass per row: temperature, top_k, top_p,
// min_p and the exponential race, the same numbers as the torch reference in
// quickdraft/verify/sampler.py (`sampling_weights` then `sample_keyed`).
//
// Why: a sampled row drawn with torch costs ~7 ms on a 262k vocabulary (softmax, a top-1024
// probe, float64 sums, a 262k-value noise draw and its log, the race), once per decoded token and
// once per walked tree node, half of a speculative step on a 2-core CPU.  Here the row is read
// twice at memory speed, the top_p nucleus comes from a histogram of exponents and a sort of the
// few values above its cut, and the race computes the noise of an entry only where the entry
// could win.
//
// What is computed (each step exactly as the reference does it, so the bits agree):
//   z = x / T (float32), m = max z, w = exp(z - m) by Cephes' expf polynomial in float32
//   (separate multiplies and adds: -ffp-contract=off), 0 where z - m < -86;
//   top_k: w < k-th largest w -> 0;  top_p: the float64 total is eight running sums (i mod 8) added in order,
//   the cut is the first value of the descending order whose running float64 sum reaches
//   top_p * total, w below it -> 0;  min_p: w < min_p -> 0 (the largest w is exactly 1);
//   the token is the first index of the largest w / E, E = -log((h + 0.5) / 2^32) in float64,
//   h a 32-bit hash of (key, token id).
// Rows are independent and computed alike whatever else is in the call: batch-invariant.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <queue>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/extension.h>

namespace qd_keyed {

constexpr float kExpCutoff = -86.0f;  // exp below it is < 5e-38 of the top token: weight 0
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
}

inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// Exp(1) noise of token `v` under `key`: U = (h + 0.5) / 2^32 lies in (0, 1), never 0 or 1.
inline double uniform_of(uint64_t key, uint32_t v) {
  const uint32_t a = v * 0x9E3779B9u + static_cast<uint32_t>(key);
  const uint32_t h = fmix32(fmix32(a) ^ static_cast<uint32_t>(key >> 32));
  return (static_cast<double>(h) + 0.5) * (1.0 / 4294967296.0);
}

inline float exp_scalar(float d) {  // d <= 0
  if (!(d >= kExpCutoff)) return 0.0f;  // also -inf
  const float n = std::floor(d * kLog2e + 0.5f);
  float r = d - n * kLn2Hi;
  r = r - n * kLn2Lo;
  const float rr = r * r;
  float p = r * kP0 + kP1;
  p = p * r + kP2;
  p = p * r + kP3;
  p = p * r + kP4;
  p = p * r + kP5;
  p = p * rr + r;
  p = p + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#pragma GCC push_options
#pragma GCC target("avx2")

// w = x / T; returns max w, or NaN when a value is NaN.
float scale_and_max(const float* x, float* w, int64_t n, float temperature) {
  const __m256 t = _mm256_set1_ps(temperature);
  __m256 best = _mm256_set1_ps(-INFINITY);
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 z = _mm256_div_ps(_mm256_loadu_ps(x + i), t);
    _mm256_storeu_ps(w + i, z);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(z, z, _CMP_UNORD_Q));
    best = _mm256_max_ps(best, z);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
  float m = -INFINITY;
  for (float lane : lanes) m = std::max(m, lane);
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (; i < n; ++i) {
    const float z = x[i] / temperature;
    w[i] = z;
    any_nan |= std::isnan(z);
    m = std::max(m, z);
  }
  return any_nan ? NAN : m;
}

// exp(d) for d <= 0 (or -inf), the same operations as exp_scalar in 8 lanes.
inline __m256 exp8(__m256 d) {
  const __m256 cutoff = _mm256_set1_ps(kExpCutoff);
  const __m256 live = _mm256_cmp_ps(d, cutoff, _CMP_GE_OQ);
  const __m256 dc = _mm256_max_ps(d, cutoff);  // keeps -inf out of the polynomial
  const __m256 nf = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(dc, _mm256_set1_ps(kLog2e)), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_sub_ps(dc, _mm256_mul_ps(nf, _mm256_set1_ps(kLn2Hi)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(nf, _mm256_set1_ps(kLn2Lo)));
  const __m256 rr = _mm256_mul_ps(r, r);
  __m256 p = _mm256_add_ps(_mm256_mul_ps(r, _mm256_set1_ps(kP0)), _mm256_set1_ps(kP1));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kP2));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kP3));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kP4));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kP5));
  p = _mm256_add_ps(_mm256_mul_ps(p, rr), r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(nf), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), live);
}

// w = exp(w - m)
void exp_shifted(float* w, int64_t n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(w + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(w + i), vm)));
  for (; i < n; ++i) w[i] = exp_scalar(w[i] - m);
}

// The sum of exp(x - m) over x[0, n), m its maximum, in eight double lanes (float lanes would
// lose ~1e-5 of the sum over a 262k vocabulary).
double sum_exp_shifted(const float* x, int64_t n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double lanes[8];
  _mm256_store_pd(lanes, low);
  _mm256_store_pd(lanes + 4, high);
  double total = 0.0;
  for (double lane : lanes) total += lane;
  for (; i < n; ++i) total += exp_scalar(x[i] - m);
  return total;
}

// One read of a row for its logprobs: the maximum, how many values exceed the chosen token's,
// and the k largest (by value, then the smaller index) into top_values / top_ids, sorted.
float scan_row(const float* x, int64_t n, float chosen, int64_t k, float* top_values, int64_t* top_ids,
               int64_t* greater) {
  const __m256 vc = _mm256_set1_ps(chosen);
  __m256 best = _mm256_set1_ps(-INFINITY);
  __m256i above = _mm256_setzero_si256();
  int64_t held = 0;  // entries of the top list
  auto insert = [&](float v, int64_t index) {
    if (held == k && !(v > top_values[k - 1])) return;  // ties keep the earlier index
    int64_t at = held < k ? held++ : k - 1;
    while (at > 0 && v > top_values[at - 1]) {
      top_values[at] = top_values[at - 1];
      top_ids[at] = top_ids[at - 1];
      --at;
    }
    top_values[at] = v;
    top_ids[at] = index;
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    best = _mm256_max_ps(best, v);
    above = _mm256_sub_epi32(above, _mm256_castps_si256(_mm256_cmp_ps(v, vc, _CMP_GT_OQ)));  // -(-1) per lane
    if (k == 0) continue;
    const float floor = held < k ? -INFINITY : top_values[k - 1];
    const int mask = held < k ? 0xFF : _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(floor), _CMP_GT_OQ));
    if (mask == 0) continue;
    for (int lane = 0; lane < 8; ++lane) insert(x[i + lane], i + lane);
  }
  alignas(32) float best_lanes[8];
  alignas(32) int32_t above_lanes[8];
  _mm256_store_ps(best_lanes, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(above_lanes), above);
  float m = -INFINITY;
  int64_t count = 0;
  for (int lane = 0; lane < 8; ++lane) {
    m = std::max(m, best_lanes[lane]);
    count += above_lanes[lane];
  }
  for (; i < n; ++i) {
    m = std::max(m, x[i]);
    count += x[i] > chosen;
    if (k > 0) insert(x[i], i);
  }
  *greater = count;
  return m;
}

// w < threshold -> 0
void zero_below(float* w, int64_t n, float threshold) {
  const __m256 t = _mm256_set1_ps(threshold);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(w + i);
    _mm256_storeu_ps(w + i, _mm256_and_ps(v, _mm256_cmp_ps(v, t, _CMP_GE_OQ)));
  }
  for (; i < n; ++i) w[i] = w[i] >= threshold ? w[i] : 0.0f;
}

#pragma GCC pop_options

// The k-th largest value of w[0, n) (k in [1, n)), counted with multiplicity.
float kth_largest(const float* w, int64_t n, int64_t k, std::vector<float>& scratch) {
  if (k <= 4096) {
    std::priority_queue<float, std::vector<float>, std::greater<float>> heap;  // the k largest so far
    for (int64_t i = 0; i < n; ++i) {
      if (static_cast<int64_t>(heap.size()) < k) {
        heap.push(w[i]);
      } else if (w[i] > heap.top()) {
        heap.pop();
        heap.push(w[i]);
      }
    }
    return heap.top();
  }
  scratch.assign(w, w + n);
  std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(), std::greater<float>());
  return scratch[k - 1];
}

// The float64 sum of w that the reference computes: eight running sums over the entries
// i = l (mod 8), l = 0..7, then added in lane order (one vector add per 8 values; the reference
// takes the same sums with a cumsum over a [V / 8, 8] view).
#pragma GCC push_options
#pragma GCC target("avx2")
double lane_sum(const float* w, int64_t n) {
  __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(w + i);
    low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
  }
  alignas(32) double lanes[8];
  _mm256_store_pd(lanes, low);
  _mm256_store_pd(lanes + 4, high);
  for (int64_t lane = 0; i < n; ++i, ++lane) lanes[lane] += w[i];  // the tail: lanes 0.. (padding adds 0)
  double total = 0.0;
  for (double lane : lanes) total += lane;
  return total;
}
#pragma GCC pop_options

// The top_p cut: the first value of w's descending order whose running float64 sum reaches
// top_p * lane_sum(w); 0 (keep everything) when rounding leaves the running sum short.  Only the
// values of the exponent buckets that hold the target (with room for rounding) are sorted.
float top_p_cut(const float* w, int64_t n, double top_p, std::vector<float>& scratch) {
  const double target = top_p * lane_sum(w, n);
  // Mass by float exponent, only to choose the buckets: four tables, so consecutive values of
  // one bucket do not wait for each other's add.
  double bucket_mass[4][256] = {{0.0}};
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &w[i], sizeof(bits));
    bucket_mass[i & 3][bits >> 23] += w[i];  // w >= 0: no sign bit
  }
  int lowest = 0;
  double mass = 0.0;
  for (int e = 254; e > 0; --e) {
    mass += bucket_mass[0][e] + bucket_mass[1][e] + bucket_mass[2][e] + bucket_mass[3][e];
    if (mass >= target * (1.0 + 1e-9)) {
      lowest = e;
      break;
    }
  }
  for (;;) {
    uint32_t floor_bits = static_cast<uint32_t>(lowest) << 23;
    float floor_value;  // the smallest float of bucket `lowest` (0 for bucket 0)
    std::memcpy(&floor_value, &floor_bits, sizeof(floor_value));
    scratch.clear();
    for (int64_t i = 0; i < n; ++i) {
      if (w[i] >= floor_value) scratch.push_back(w[i]);
    }
    std::sort(scratch.begin(), scratch.end(), std::greater<float>());
    double running = 0.0;
    for (float value : scratch) {
      running += value;
      if (running >= target) return value;
    }
    if (lowest == 0) return 0.0f;  // every value was summed
    lowest = 0;                    // the margin was not enough: sort them all
  }
}

// The exact comparison of entry i against the best so far (first index of the largest ratio).
inline void challenge(const float* w, int64_t i, uint64_t key, int64_t& best, double& best_ratio) {
  const double ratio = static_cast<double>(w[i]) / -std::log(uniform_of(key, static_cast<uint32_t>(i)));
  if (ratio > best_ratio || (ratio == best_ratio && i < best)) {
    best_ratio = ratio;
    best = i;
  }
}

#pragma GCC push_options
#pragma GCC target("avx2")

inline __m256i fmix32x8(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int32_t>(0x85EBCA6Bu)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int32_t>(0xC2B2AE35u)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

// The exponential race over w > 0: the first index of the largest w / E.  -log(u) >= 1 - u, and
// 1 - u > ~h / 2^32, so an entry with w < bar * ~h / 2^32 cannot reach the bar: eight entries
// are ruled out at once in float32 (with a 2^-16 margin for its roundings), and only the others
// are computed exactly, in float64.
int64_t race(const float* w, int64_t n, uint64_t key) {
  int64_t best = -1;
  double best_ratio = -1.0;
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n && best < 0; i += 8) {  // start from the most likely token: a high bar prunes most
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(w + i), one, _CMP_EQ_OQ));
    if (hit) best = i + __builtin_ctz(hit);
  }
  for (; i < n && best < 0; ++i) {
    if (w[i] == 1.0f) best = i;
  }
  if (best >= 0) {
    best_ratio = -1.0;
    challenge(w, best, key, best, best_ratio);
  }
  const __m256i k0 = _mm256_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(key)));
  const __m256i k1 = _mm256_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(key >> 32)));
  const __m256i golden = _mm256_set1_epi32(static_cast<int32_t>(0x9E3779B9u));
  const __m256i all = _mm256_set1_epi32(-1);
  const __m256 zero = _mm256_setzero_ps(), two = _mm256_set1_ps(2.0f);
  const __m256i low_bit = _mm256_set1_epi32(1);
  i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(w + i);
    const int positive = _mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_GT_OQ));
    if (!positive) continue;
    const __m256i ids = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(i)),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i a = _mm256_add_epi32(_mm256_mullo_epi32(ids, golden), k0);
    const __m256i h = fmix32x8(_mm256_xor_si256(fmix32x8(a), k1));
    const __m256i not_h = _mm256_xor_si256(h, all);  // 2^32 - 1 - h, as uint32
    // uint32 -> float: (x >> 1) * 2 + (x & 1), each step within float32 rounding.
    const __m256 not_h_f = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(not_h, 1)), two),
                                         _mm256_cvtepi32_ps(_mm256_and_si256(not_h, low_bit)));
    const float bar = static_cast<float>(best_ratio * (1.0 / 4294967296.0) * (1.0 - 1.0 / 65536.0));
    const __m256 bound = _mm256_mul_ps(not_h_f, _mm256_set1_ps(bar));
    int open = positive & ~_mm256_movemask_ps(_mm256_cmp_ps(v, bound, _CMP_LT_OQ));
    while (open) {
      const int lane = __builtin_ctz(open);
      open &= open - 1;
      challenge(w, i + lane, key, best, best_ratio);
    }
  }
  for (; i < n; ++i) {
    if (w[i] > 0.0f) challenge(w, i, key, best, best_ratio);
  }
  return best;
}

#pragma GCC pop_options

// w[0, n) = the row's sampling weights; 0, or -1 for a NaN, -2 for no finite logit.
int weigh_row(const float* x, int64_t n, float temperature, int64_t top_k, double top_p, float min_p, float* w,
              std::vector<float>& scratch) {
  const float m = scale_and_max(x, w, n, temperature);
  if (std::isnan(m)) return -1;
  if (!std::isfinite(m)) return -2;
  exp_shifted(w, n, m);
  if (top_k > 0 && top_k < n) zero_below(w, n, kth_largest(w, n, top_k, scratch));
  if (top_p < 1.0) zero_below(w, n, top_p_cut(w, n, top_p, scratch));
  if (min_p > 0.0f) zero_below(w, n, min_p);
  return 0;
}

struct RowParams {
  const float* temperature;
  const int64_t* top_k;
  const double* top_p;
  const float* min_p;
};

RowParams check_params(const torch::Tensor& logits, const torch::Tensor& temperature, const torch::Tensor& top_k,
                       const torch::Tensor& top_p, const torch::Tensor& min_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() &&
                  logits.device().is_cpu(),
              "keyed_draw: need a contiguous [R, V] float32 CPU tensor");
  const int64_t vocab = logits.size(1);
  TORCH_CHECK(vocab > 0 && vocab <= (int64_t{1} << 32), "keyed_draw: vocabulary of ", vocab);
  for (const auto* t : {&temperature, &top_k, &top_p, &min_p}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == logits.size(0) && t->is_contiguous(), "keyed_draw: one value per row");
  }
  TORCH_CHECK(temperature.scalar_type() == torch::kFloat32 && top_k.scalar_type() == torch::kInt64 &&
                  top_p.scalar_type() == torch::kFloat64 && min_p.scalar_type() == torch::kFloat32,
              "keyed_draw: parameter dtypes");
  return RowParams{temperature.data_ptr<float>(), top_k.data_ptr<int64_t>(), top_p.data_ptr<double>(),
                   min_p.data_ptr<float>()};
}

// The weights the draws race, for tests (bit-equal to the reference's sampling_weights).
torch::Tensor sampling_weights_rows(const torch::Tensor& logits, const torch::Tensor& temperature,
                                    const torch::Tensor& top_k, const torch::Tensor& top_p,
                                    const torch::Tensor& min_p) {
  const RowParams p = check_params(logits, temperature, top_k, top_p, min_p);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  torch::Tensor out = torch::empty({rows, vocab}, torch::kFloat32);
  std::vector<int> status(rows);
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    thread_local std::vector<float> scratch;
    for (int64_t r = first; r < last; ++r) {
      status[r] = weigh_row(logits.data_ptr<float>() + r * vocab, vocab, p.temperature[r], p.top_k[r], p.top_p[r],
                            p.min_p[r], out.data_ptr<float>() + r * vocab, scratch);
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(status[r] == 0, "sampling_weights_rows: row ", r, " has a NaN or no finite logit");
  }
  return out;
}

// Each row's logprobs in one read and one pass of exp (vLLM's logprobs and their ranks): the
// chosen token's value, the k largest values with their ids (by value, ties to the smaller id),
// the rank of the chosen token (1 + the values above it), the values less the row's logsumexp
// when `normalize` (the log_softmax), else as they are.  A row's numbers depend on that row alone.
std::vector<torch::Tensor> row_logprobs(const torch::Tensor& values,  // [R, V] float32
                                        const torch::Tensor& tokens,  // [R] int64
                                        int64_t k, bool normalize) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == torch::kFloat32 && values.is_contiguous() &&
                  values.device().is_cpu(),
              "row_logprobs: need a contiguous [R, V] float32 CPU tensor");
  const int64_t rows = values.size(0), vocab = values.size(1);
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == rows && tokens.scalar_type() == torch::kInt64 &&
                  tokens.is_contiguous(),
              "row_logprobs: one int64 token per row");
  TORCH_CHECK(vocab > 0 && k >= 0 && k <= vocab, "row_logprobs: k of ", k, " for a vocabulary of ", vocab);
  torch::Tensor chosen = torch::empty({rows}, torch::kFloat32);
  torch::Tensor top_values = torch::empty({rows, k}, torch::kFloat32);
  torch::Tensor top_ids = torch::empty({rows, k}, torch::kInt64);
  torch::Tensor ranks = torch::empty({rows}, torch::kInt64);
  const float* x = values.data_ptr<float>();
  const int64_t* token = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(token[r] >= 0 && token[r] < vocab, "row_logprobs: token ", token[r], " outside the vocabulary");
  }
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* row = x + r * vocab;
      const float value = row[token[r]];
      float* top_v = top_values.data_ptr<float>() + r * k;
      int64_t* top_i = top_ids.data_ptr<int64_t>() + r * k;
      int64_t greater = 0;
      const float m = scan_row(row, vocab, value, k, top_v, top_i, &greater);
      ranks.data_ptr<int64_t>()[r] = greater + 1;
      float shift = 0.0f;
      if (normalize) {
        shift = std::isfinite(m) ? static_cast<float>(m + std::log(sum_exp_shifted(row, vocab, m))) : m;
      }
      chosen.data_ptr<float>()[r] = value - shift;
      for (int64_t j = 0; j < k; ++j) top_v[j] -= shift;
    }
  });
  return {chosen, top_ids, top_values, ranks};
}

torch::Tensor keyed_draw_rows(const torch::Tensor& logits,       // [R, V] float32
                              const torch::Tensor& temperature,  // [R] float32 > 0
                              const torch::Tensor& top_k,        // [R] int64, 0 or >= V: off
                              const torch::Tensor& top_p,        // [R] float64 in (0, 1]
                              const torch::Tensor& min_p,        // [R] float32 in [0, 1]
                              const torch::Tensor& keys) {       // [R] int64 (uint64 bits)
  const RowParams p = check_params(logits, temperature, top_k, top_p, min_p);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(keys.dim() == 1 && keys.size(0) == rows && keys.is_contiguous() && keys.scalar_type() == torch::kInt64,
              "keyed_draw: one int64 key per row");
  torch::Tensor out = torch::empty({rows}, torch::kInt64);
  const float* x = logits.data_ptr<float>();
  const int64_t* key = keys.data_ptr<int64_t>();
  int64_t* result = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    // Kept by the thread: a fresh 1 MiB buffer per call would be page faults on every draw.
    thread_local std::vector<float> w, scratch;
    w.resize(vocab);
    for (int64_t r = first; r < last; ++r) {
      const int status = weigh_row(x + r * vocab, vocab, p.temperature[r], p.top_k[r], p.top_p[r], p.min_p[r],
                                   w.data(), scratch);
      result[r] = status < 0 ? status : race(w.data(), vocab, static_cast<uint64_t>(key[r]));
    }
  });
  return out;
}

}  // namespace qd_keyed

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpu_supported", &qd_keyed::cpu_supported);
  m.def("keyed_draw_rows", &qd_keyed::keyed_draw_rows);
  m.def("sampling_weights_rows", &qd_keyed::sampling_weights_rows);
  m.def("row_logprobs", &qd_keyed::row_logprobs);
}
