// The k best tokens of a copy-path draft head's mixture, for rows that all copy from the same
// sources (CopyPath.draft_top_k in quickdraft/models/heads.py), in one call per draft depth.
//
// Why: the torch version is ~25 small ops (norm, two projections, softmax over the sources, an
// index_add by distinct token, a log_softmax over the draft vocabulary, gathers, two top-k),
// ~10 us each on a 2-core CPU: 0.3-0.4 ms per depth, a sixth of an EAGLE step's drafting, for
// arithmetic worth a few microseconds.  Drafting precision never changes the output (the target
// verifies every token), so this computes the same quantities in float32 with the compiler free
// to reorder sums (-ffast-math: vectorized exp and reductions), not the torch bits.
//
// Per row r, with x = the head's output, logits = its draft-vocabulary logits [Vd]:
//   lp = logits - logsumexp(logits)                         (vocabulary log-probabilities)
//   u = x / rms(x); q = u Wq^T [C]; g = sigmoid(u . wg + bg)  (query and copy gate)
//   w = softmax(q K^T / sqrt(C)) over the n sources; copied[j] = sum of w over sources of token j
//   copy candidate j: log((1 - g) exp(lp[draft id of j]) [0 outside the vocabulary] + g copied[j])
//   vocabulary candidate: log(1 - g) + lp[v] for the k best v, dropped when v is also copied
// and the k best of both candidate lists, best first (ties: vocabulary before copies, lower
// index first).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <torch/extension.h>

#include "draft_mixture.h"

namespace qd_mixture {

bool cpu_supported() {  // built with -mavx2 -mfma (csrc's other kernels need AVX2 as well)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

struct Candidate {
  float score;
  int64_t id;     // target token id
  int64_t order;  // tie-break: vocabulary candidates first, then copies, each in index order
};

bool better(const Candidate& a, const Candidate& b) {
  return a.score > b.score || (a.score == b.score && a.order < b.order);
}

// The k largest entries of values [n] as (value, index), best first.
std::vector<std::pair<float, int64_t>> top_values(const float* values, int64_t n, int64_t k) {
  std::vector<std::pair<float, int64_t>> best;  // kept sorted, best first
  for (int64_t i = 0; i < n; ++i) {
    const float v = values[i];
    if (static_cast<int64_t>(best.size()) == k && !(v > best.back().first)) continue;
    auto at = std::find_if(best.begin(), best.end(), [&](const auto& e) { return v > e.first; });
    best.insert(at, {v, i});
    if (static_cast<int64_t>(best.size()) > k) best.pop_back();
  }
  return best;
}

float dot(const float* a, const float* b, int64_t n) {  // vectorized: -ffast-math reassociates
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The k best candidates of every row (see the top) into ids [m, k] and log_probs [m, k], which
// the caller fills with -1 / -inf.  Not inlined: the pybind entry and a chain grown in
// quant_linear.cpp (through this function's address) run the same machine code.
__attribute__((noinline)) void mixture_top_k(const qd_mixture_abi::MixtureInputs& in, int64_t* ids,
                                             float* out_lp) {
  const int64_t m = in.m, D = in.D, Vd = in.Vd, C = in.C, n = in.n, U = in.U, k = in.k;
  std::vector<float> unit(D), query(C), weights(n), copied(U);
  const float inv_sqrt_c = 1.0f / std::sqrt(static_cast<float>(C));
  for (int64_t r = 0; r < m; ++r) {
    const float* x = in.features + r * D;
    const float* lg = in.logits + r * Vd;
    float lmax = lg[0];  // no infinities in comparisons: -ffast-math assumes finite values
    for (int64_t v = 1; v < Vd; ++v) lmax = std::max(lmax, lg[v]);
    float total = 0.0f;
    for (int64_t v = 0; v < Vd; ++v) total += std::exp(lg[v] - lmax);
    const float lse = lmax + std::log(total);
    const float scale = 1.0f / std::sqrt(dot(x, x, D) / static_cast<float>(D) + in.eps);
    for (int64_t i = 0; i < D; ++i) unit[i] = x[i] * scale;
    for (int64_t c = 0; c < C; ++c) query[c] = dot(unit.data(), in.query_weight + c * D, D);
    const float gate = 1.0f / (1.0f + std::exp(-(dot(unit.data(), in.gate_weight, D) + in.gate_bias)));
    for (int64_t i = 0; i < n; ++i) weights[i] = dot(query.data(), in.keys + i * C, C) * inv_sqrt_c;
    float smax = weights[0];
    for (int64_t i = 1; i < n; ++i) smax = std::max(smax, weights[i]);
    float wsum = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      weights[i] = std::exp(weights[i] - smax);
      wsum += weights[i];
    }
    std::fill(copied.begin(), copied.end(), 0.0f);
    for (int64_t i = 0; i < n; ++i) copied[in.inverse[i]] += weights[i] / wsum;
    std::vector<Candidate> candidates;
    const float log_keep = std::log1p(-gate);
    for (const auto& [logit, v] : top_values(lg, Vd, k))
      if (!in.copied_draft_id[v]) candidates.push_back({log_keep + (logit - lse), in.d2t[v], v});
    for (int64_t j = 0; j < U; ++j) {
      const float vocab = in.distinct_in_vocab[j] > 0.0f ? std::exp(lg[in.distinct_draft_ids[j]] - lse) : 0.0f;
      candidates.push_back({std::log((1.0f - gate) * vocab + gate * copied[j]), in.distinct[j], Vd + j});
    }
    const int64_t kept = std::min<int64_t>(k, static_cast<int64_t>(candidates.size()));
    std::partial_sort(candidates.begin(), candidates.begin() + kept, candidates.end(), better);
    for (int64_t i = 0; i < kept; ++i) {
      ids[r * k + i] = candidates[i].id;
      out_lp[r * k + i] = candidates[i].score;
    }
  }
}

// features [m, D], logits [m, Vd] float32; query_weight [C, D], gate_weight [D], gate_bias [1];
// keys [n, C]; inverse [n] (index of each source's token in distinct); distinct [U] target ids;
// distinct_draft_ids [U] and distinct_in_vocab [U] (float, 0 where the token is outside the draft
// vocabulary: its draft id is then meaningless); copied_draft_id [Vd] bool; d2t [Vd]
// -> ids [m, k] int64, log_probs [m, k] float32.
std::vector<at::Tensor> draft_top_k(const at::Tensor& features, const at::Tensor& logits,
                                    const at::Tensor& query_weight, const at::Tensor& gate_weight,
                                    const at::Tensor& gate_bias, const at::Tensor& keys, const at::Tensor& inverse,
                                    const at::Tensor& distinct, const at::Tensor& distinct_draft_ids,
                                    const at::Tensor& distinct_in_vocab, const at::Tensor& copied_draft_id,
                                    const at::Tensor& d2t, int64_t k, double eps) {
  for (const at::Tensor* t : {&features, &logits, &query_weight, &gate_weight, &gate_bias, &keys, &distinct_in_vocab})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->is_cpu(),
                "draft_top_k: float tensors must be contiguous float32 on the CPU");
  for (const at::Tensor* t : {&inverse, &distinct, &distinct_draft_ids, &d2t})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->is_cpu(),
                "draft_top_k: index tensors must be contiguous int64 on the CPU");
  TORCH_CHECK(copied_draft_id.scalar_type() == at::kBool && copied_draft_id.is_contiguous(), "draft_top_k: bad mask");
  const int64_t m = features.size(0), D = features.size(1), Vd = logits.size(1), C = query_weight.size(0);
  const int64_t n = keys.size(0), U = distinct.size(0);
  TORCH_CHECK(logits.size(0) == m && query_weight.size(1) == D && gate_weight.numel() == D && keys.size(1) == C &&
                  inverse.numel() == n && distinct_draft_ids.numel() == U && distinct_in_vocab.numel() == U &&
                  copied_draft_id.numel() == Vd && d2t.numel() == Vd && k >= 1 && n >= 1,
              "draft_top_k: inconsistent shapes");
  const qd_mixture_abi::MixtureInputs in{
      features.const_data_ptr<float>(),
      logits.const_data_ptr<float>(),
      m,
      D,
      Vd,
      query_weight.const_data_ptr<float>(),
      C,
      gate_weight.const_data_ptr<float>(),
      gate_bias.const_data_ptr<float>()[0],
      keys.const_data_ptr<float>(),
      n,
      inverse.const_data_ptr<int64_t>(),
      distinct.const_data_ptr<int64_t>(),
      U,
      distinct_draft_ids.const_data_ptr<int64_t>(),
      distinct_in_vocab.const_data_ptr<float>(),
      copied_draft_id.const_data_ptr<bool>(),
      d2t.const_data_ptr<int64_t>(),
      k,
      static_cast<float>(eps),
  };
  at::Tensor ids = at::full({m, k}, -1, at::kLong);
  at::Tensor out_lp = at::full({m, k}, -std::numeric_limits<float>::infinity(), at::kFloat);
  mixture_top_k(in, ids.data_ptr<int64_t>(), out_lp.data_ptr<float>());
  return {ids, out_lp};
}

}  // namespace qd_mixture

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpu_supported", &qd_mixture::cpu_supported);
  m.def("draft_top_k", &qd_mixture::draft_top_k);
  // For quant_linear's draft_chain (same process, same compiler): where mixture_top_k starts.
  m.def("mixture_top_k_address", [] { return reinterpret_cast<int64_t>(&qd_mixture::mixture_top_k); });
}
