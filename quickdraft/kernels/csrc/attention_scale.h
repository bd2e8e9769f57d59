// What turns a query-key dot product into its attention score, shared by both attention builds
// (attention_row.h, attention_row_avx2.h) and the fused decoder layer: the scale, then Gemma 2's
// soft cap where the model has one (softcap * tanh(score / softcap); 0: none).  One scalar
// function of the score alone, so a score's bits still do not depend on the keys, rows or heads
// beside it.
#pragma once

#include <cmath>
#include <cstdint>

struct AttentionScale {
  float scale;
  float softcap = 0.0f;
  // gpt-oss's attention sinks: per query head a logit that joins every softmax's denominator (its
  // share of the weight goes nowhere), for the call's heads from its first one; nullptr: none.
  const float* sinks = nullptr;

  float apply(float dot) const {
    const float score = dot * scale;
    return softcap > 0.0f ? softcap * std::tanh(score / softcap) : score;
  }

  // The same, for the heads from `head` on (a call's first head).
  AttentionScale at_head(int64_t head) const { return {scale, softcap, sinks == nullptr ? nullptr : sinks + head}; }
};
