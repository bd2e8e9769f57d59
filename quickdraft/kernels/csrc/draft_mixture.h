// The copy-path mixture's inputs as raw pointers, shared by the two modules that use it:
// draft_mixture.cpp computes the k best tokens (`mixture_top_k`, built with -ffast-math), and
// quant_linear.cpp's `draft_chain` calls that very function through its address at every depth
// of a chain, so a chain grown in one call picks with the bits of one grown depth by depth.
#pragma once

#include <cstdint>

namespace qd_mixture_abi {

struct MixtureInputs {
  const float* features;           // [m, D] the head's outputs
  const float* logits;             // [m, Vd] their draft-vocabulary logits
  int64_t m, D, Vd;
  const float* query_weight;       // [C, D]
  int64_t C;
  const float* gate_weight;        // [D]
  float gate_bias;
  const float* keys;               // [n, C] the sources' copy keys
  int64_t n;
  const int64_t* inverse;          // [n] index of each source's token in distinct
  const int64_t* distinct;         // [U] target ids copied
  int64_t U;
  const int64_t* distinct_draft_ids;  // [U]
  const float* distinct_in_vocab;  // [U] 1 inside the draft vocabulary
  const bool* copied_draft_id;     // [Vd]
  const int64_t* d2t;              // [Vd]
  int64_t k;
  float eps;
};

// ids [m, k] (-1 where fewer candidates) and log_probs [m, k] (-inf there), best first.
using MixtureTopK = void (*)(const MixtureInputs& in, int64_t* ids, float* log_probs);

}  // namespace qd_mixture_abi
