// Batch-invariant attention for CPU decoding and tree verification.
//
// out[t, h] = softmax(scale * q[t, h] . k[g, s] over the keys s that query t may see) @ v[g, s]
// with g = h / (H / Hkv).  Every (query, head) pair is computed on its own, by the same
// instructions, whatever the number of queries, the mask or the threads: the scores in key
// order (a dot product over D in 16 fp32 lanes, then one fixed horizontal sum), the max, exp and
// sum in key order, and the weighted values added key after key.  So a token's attention output
// is bit-identical whether it is decoded alone or verified inside a tree beside other requests,
// which torch's scaled_dot_product_attention does not promise (its CPU kernels block the keys
// and queries differently for one query and for many).
//
// Compiled for the baseline ISA; the kernel is AVX-512F code (or, built with -DQD_ISA_AVX2, AVX2
// and FMA code: attention_row_avx2.h) behind `#pragma GCC target` and a CPUID check.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include "attention_row.h"
#include "attention_row_avx2.h"

namespace qd_attention {

#if defined(QD_ISA_AVX2)
constexpr const char* kIsa = "avx2";
constexpr int64_t kLanes = 8;

inline bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

inline int64_t heads_for(int64_t group, int64_t rows_times_kv_heads, int64_t threads) {
  return qd_attention_avx2::heads_per_call(group, rows_times_kv_heads, threads);
}

inline void attend(int64_t G, const float* q, const float* k, const float* v, const int64_t* rows, int64_t S,
                   int64_t D, const bool* visible, AttentionScale scale, float* scores, float* out) {
  qd_attention_avx2::attend_heads_n(G, q, k, v, rows, S, D, visible, scale, scores, out);
}
#else
constexpr const char* kIsa = "avx512";
constexpr int64_t kLanes = 16;

inline bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
}

inline int64_t heads_for(int64_t group, int64_t rows_times_kv_heads, int64_t threads) {
  return heads_per_call(group, rows_times_kv_heads, threads);
}

inline void attend(int64_t G, const float* q, const float* k, const float* v, const int64_t* rows, int64_t S,
                   int64_t D, const bool* visible, AttentionScale scale, float* scores, float* out) {
  attend_heads_n(G, q, k, v, rows, S, D, visible, scale, scores, out);
}
#endif

// q [T, H, D]; k, v [Hkv, S, D] with unit stride over D and D between keys (a cache slot's
// range); mask [T, S] bool or None (every key visible).  Returns [T, H, D] float32.
at::Tensor attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& mask_opt, double scale, double softcap,
                     const c10::optional<at::Tensor>& sinks_opt) {
  TORCH_CHECK(cpu_supported(), "attention: this CPU lacks the instructions of the ", kIsa, " build");
  TORCH_CHECK(q_in.dim() == 3 && k.dim() == 3 && v.dim() == 3, "attention: q [T, H, D], k and v [Hkv, S, D]");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "attention: float32 only");
  const at::Tensor q = q_in.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(0), S = k.size(1);
  TORCH_CHECK(D % kLanes == 0, "attention: head_dim must be a multiple of ", kLanes);
  TORCH_CHECK(k.size(2) == D && v.size(0) == Hkv && v.size(1) == S && v.size(2) == D && H % Hkv == 0,
              "attention: shapes of q, k and v do not match");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == D && v.stride(1) == D &&
                  k.stride(0) == v.stride(0), "attention: k and v must be cache views with rows of D");
  const bool* mask = nullptr;
  at::Tensor mask_c;
  if (mask_opt.has_value() && mask_opt->defined()) {
    mask_c = mask_opt->contiguous();
    TORCH_CHECK(mask_c.scalar_type() == at::kBool && mask_c.dim() == 2 && mask_c.size(0) == T &&
                    mask_c.size(1) == S, "attention: mask must be bool [T, S]");
    mask = mask_c.const_data_ptr<bool>();
  }
  at::Tensor out = at::empty({T, H, D}, q.options());
  const float* qp = q.const_data_ptr<float>();
  const float* kp = k.const_data_ptr<float>();
  const float* vp = v.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t head_stride = k.stride(0), group = H / Hkv;
  at::Tensor sinks;
  if (sinks_opt.has_value() && sinks_opt->defined()) {
    sinks = sinks_opt->contiguous();
    TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.dim() == 1 && sinks.size(0) == H,
                "attention: sinks must be float32 [H]");
  }
  const AttentionScale fscale{static_cast<float>(scale), static_cast<float>(softcap),
                              sinks.defined() ? sinks.const_data_ptr<float>() : nullptr};
  // G query heads of a key head per call (they share its key and value reads).
  const int64_t G = heads_for(group, T * Hkv, at::get_num_threads()), calls = H / G;
  // Small problems (one decode token over a short context) stay on one thread.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, S * D * G));
  std::vector<int64_t> rows(static_cast<size_t>(S));  // key s at s * D: a contiguous range
  for (int64_t s = 0; s < S; ++s) rows[s] = s * D;
  at::parallel_for(0, T * calls, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(static_cast<size_t>(G * S + kLanes));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / calls, h = (i % calls) * G, g = h / group;
      attend(G, qp + (t * H + h) * D, kp + g * head_stride, vp + g * head_stride, rows.data(), S, D,
                     mask ? mask + t * S : nullptr, fscale.at_head(h), scores.data(), op + (t * H + h) * D);
    }
  });
  return out;
}

}  // namespace qd_attention

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("attention", &qd_attention::attention, "batch-invariant attention: q [T, H, D], k/v [Hkv, S, D]",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask") = py::none(), py::arg("scale"), py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.attr("isa") = qd_attention::kIsa;
  m.def("cpu_supported", &qd_attention::cpu_supported);
}
