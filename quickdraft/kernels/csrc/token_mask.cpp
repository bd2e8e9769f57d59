// Grammar masks on logits, in place: logits[r, t] = -inf where bit t of bitmask[r] is 0.
//
// Why not torch: unpacking a [N, V / 32] bitmask into a [N, V] bool tensor and masked_fill-ing
// costs ~1 ms per 262k-vocabulary row on these CPUs (a bool tensor, its negation and a full
// pass over the logits); this reads the bitmask once and writes only the forbidden entries:
// all-ones words (a free string allows most of the vocabulary) are skipped, all-zeros words
// (a forced position allows a handful of tokens) are filled with a plain loop.
//
// Portable C++ (no intrinsics): the compiler's baseline ISA is enough for a store-bound loop.

#include <cmath>
#include <cstdint>
#include <limits>

#include <ATen/Parallel.h>
#include <torch/extension.h>

namespace qd_token_mask {

constexpr uint32_t kMinusInfBits = 0xFF800000u;  // -inf as float32 bits

bool cpu_supported() { return true; }

void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(),
              "apply_token_bitmask: logits must be contiguous float32 [N, V]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous(),
              "apply_token_bitmask: bitmask must be contiguous int32 [N, W]");
  const int64_t rows = logits.size(0), vocab = logits.size(1), words = bitmask.size(1);
  TORCH_CHECK(bitmask.size(0) == rows && words * 32 >= vocab, "apply_token_bitmask: bitmask shape does not fit");
  float* x = logits.data_ptr<float>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float minus_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      float* out = x + row * vocab;
      const uint32_t* mask = bits + row * words;
      for (int64_t word = 0; word * 32 < vocab; ++word) {
        const uint32_t w = mask[word];
        if (w == 0xFFFFFFFFu) continue;
        const int64_t begin = word * 32, end = std::min<int64_t>(vocab, begin + 32);
        if (w == 0) {
          for (int64_t t = begin; t < end; ++t) out[t] = minus_inf;
          continue;
        }
        if (end - begin == 32) {  // branch-free on the bit patterns, in a loop the compiler vectorizes
          uint32_t* o = reinterpret_cast<uint32_t*>(out + begin);
          for (int i = 0; i < 32; ++i) {
            const uint32_t keep = (w & (1u << i)) ? 0xFFFFFFFFu : 0u;
            o[i] = (o[i] & keep) | (kMinusInfBits & ~keep);
          }
          continue;
        }
        for (int64_t t = begin; t < end; ++t) {
          if (!((w >> (t - begin)) & 1u)) out[t] = minus_inf;
        }
      }
    }
  });
}

}  // namespace qd_token_mask

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpu_supported", &qd_token_mask::cpu_supported);
  m.def("apply_token_bitmask", &qd_token_mask::apply_token_bitmask);
}
