// The attention row algorithm, written once over a vector type `Vec` and included once per
// build (no include guard): attention_row.h includes it inside namespace qd_attention under the
// AVX-512 target with Vec = 16 lanes, attention_row_avx2.h inside qd_attention_avx2 under the
// AVX2 target with Vec = 8 lanes.  Each build thus keeps its own instructions (a function
// compiled for AVX-512 never reaches a CPU without it) and its own bits.
//
// Vec provides: F (the register type), kLanes, kAccumulators (value registers a weighted sum
// keeps live), kKeysAtOnce (keys whose scores share each load of the query), zero, load, store,
// set1, sub, mul, fmadd, sum (one fixed horizontal order) and exp (elementwise).
//
// Order, the same whatever the call holds (number of query rows, other rows' masks, threads):
// a dot product runs over D in lane-wide steps then sums its lanes one fixed way; the scores,
// their max, exp and the total run in key order; the weighted values add key after key per lane.
// Masked keys are skipped, so a query sees the same operations whatever range of keys the call
// spans.  How many value registers a pass keeps live, how many heads share a pass, or how many
// keys share a load of the query changes which loads are shared, never an operation of a lane:
// every path gives a (row, head) the same bits.
//
// Key and value row s of a call start at k + rows[s] and v + rows[s] (element offsets): a paged
// cache's rows lie in blocks, a contiguous one's every D elements; where they lie changes no bit.
//
// Keys and values are floats, or IEEE halves (Float16: a float16 KV cache, half the bytes a
// long context's attention reads); a half widens to its float exactly, and every operation
// after the load is the float path's, so a half cache gives every (row, head) one set of bits
// too (its own: the cache rounded each key and value once when it wrote them).
struct Float16 {
  uint16_t bits;
};

inline Vec::F load_kv(const float* p) { return Vec::load(p); }
inline Vec::F load_kv(const Float16* p) { return Vec::load_half(&p->bits); }

// Fixed-order dot product of a query row and a key row of D values (D % Vec::kLanes == 0).
template <typename KV>
inline float dot(const float* a, const KV* b, int64_t D) {
  Vec::F acc = Vec::zero();
  for (int64_t d = 0; d < D; d += Vec::kLanes) acc = Vec::fmadd(Vec::load(a + d), load_kv(b + d), acc);
  return Vec::sum(acc);
}

// scores[s] = exp(scores[s] - max_score) for the S keys; returns 1 / (the visible ones' sum, in
// key order).  The tail goes through a padded copy: each lane's exp is the same function.
inline float exp_scores(float* scores, int64_t S, float max_score, const bool* visible, const float* sink = nullptr) {
  constexpr int L = Vec::kLanes;
  const Vec::F max_v = Vec::set1(max_score);
  int64_t s = 0;
  for (; s + L <= S; s += L) Vec::store(scores + s, Vec::exp(Vec::sub(Vec::load(scores + s), max_v)));
  if (s < S) {
    alignas(64) float tail[L];
    for (int64_t i = 0; i < L; ++i) tail[i] = s + i < S ? scores[s + i] : max_score;
    Vec::store(tail, Vec::exp(Vec::sub(Vec::load(tail), max_v)));
    for (int64_t i = 0; s + i < S; ++i) scores[s + i] = tail[i];
  }
  float total = 0.0f;
  for (int64_t t = 0; t < S; ++t)
    if (visible == nullptr || visible[t]) total += scores[t];
  if (sink != nullptr) total += std::exp(*sink - max_score);  // the sink's share, after the keys'
  return 1.0f / total;
}

// The weighted sum of the visible values over W registers of the head from column c.
template <int W, typename KV>
inline void weighted_values(const KV* v, const int64_t* rows, int64_t S, const bool* visible,
                            const float* weights, float inv_total, int64_t c, float* out) {
  constexpr int L = Vec::kLanes;
  Vec::F acc[W];
  for (int j = 0; j < W; ++j) acc[j] = Vec::zero();
  for (int64_t s = 0; s < S; ++s) {
    if (visible != nullptr && !visible[s]) continue;
    const Vec::F pv = Vec::set1(weights[s]);
    const KV* vs = v + rows[s] + c;
    for (int j = 0; j < W; ++j) acc[j] = Vec::fmadd(pv, load_kv(vs + L * j), acc[j]);
  }
  const Vec::F inv = Vec::set1(inv_total);
  for (int j = 0; j < W; ++j) Vec::store(out + c + L * j, Vec::mul(acc[j], inv));
}

// Columns c .. D of the head in passes of W registers while they fit, then narrower ones (a
// head of 128 floats is one pass of 8 AVX-512 registers, not eight of one).
template <int W, typename KV>
inline void weighted_columns(const KV* v, const int64_t* rows, int64_t S, int64_t D, const bool* visible,
                             const float* weights, float inv_total, int64_t c, float* out) {
  for (; c + Vec::kLanes * W <= D; c += Vec::kLanes * W)
    weighted_values<W>(v, rows, S, visible, weights, inv_total, c, out);
  if constexpr (W > 1) weighted_columns<W / 2>(v, rows, S, D, visible, weights, inv_total, c, out);
}

// One query row of one head against S keys (scores: a scratch row of S).
template <typename KV>
inline void attend_row(const float* q, const KV* k, const KV* v, const int64_t* rows, int64_t S, int64_t D,
                       const bool* visible, AttentionScale scale, float* scores, float* out) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float max_score = neg_inf;
  for (int64_t s = 0; s < S; ++s) {
    if (visible != nullptr && !visible[s]) {
      scores[s] = neg_inf;
      continue;
    }
    scores[s] = scale.apply(dot(q, k + rows[s], D));
    max_score = std::max(max_score, scores[s]);
  }
  if (max_score == neg_inf) {  // sees nothing: zeros
    for (int64_t d = 0; d < D; d += Vec::kLanes) Vec::store(out + d, Vec::zero());
    return;
  }
  if (scale.sinks != nullptr) max_score = std::max(max_score, scale.sinks[0]);
  const float inv_total = exp_scores(scores, S, max_score, visible, scale.sinks);
  weighted_columns<Vec::kAccumulators>(v, rows, S, D, visible, scores, inv_total, 0, out);
}

// The G heads' scores of keys s .. s + P - 1 (scores[g * S + key]): per (head, key) a dot
// product over D in lane-wide steps from zero, then the lanes' fixed sum, then scaled (and capped).
// The P keys only share the loads of q.
template <int G, int P, typename KV>
inline void score_keys(const float* q, const KV* k, const int64_t* rows, int64_t s, int64_t D, AttentionScale scale,
                       int64_t S, float* scores) {
  Vec::F acc[P][G];
  for (int p = 0; p < P; ++p)
    for (int g = 0; g < G; ++g) acc[p][g] = Vec::zero();
  for (int64_t d = 0; d < D; d += Vec::kLanes) {
    Vec::F kd[P];
    for (int p = 0; p < P; ++p) kd[p] = load_kv(k + rows[s + p] + d);
    for (int g = 0; g < G; ++g) {
      const Vec::F qd = Vec::load(q + g * D + d);
      for (int p = 0; p < P; ++p) acc[p][g] = Vec::fmadd(qd, kd[p], acc[p][g]);
    }
  }
  for (int p = 0; p < P; ++p)
    for (int g = 0; g < G; ++g) scores[g * S + s + p] = scale.apply(Vec::sum(acc[p][g]));
}

template <int G, typename KV>
inline void score_key_or_unseen(const float* q, const KV* k, const int64_t* rows, int64_t s, int64_t D, AttentionScale scale,
                                int64_t S, float* scores, bool seen) {
  if (seen) return score_keys<G, 1>(q, k, rows, s, D, scale, S, scores);
  for (int g = 0; g < G; ++g) scores[g * S + s] = -std::numeric_limits<float>::infinity();
}

// attend_heads<G> for one query row with its work shared between threads: a decode row at
// batch 1 is one item, so splitting a forward's rows into items would leave threads idle or
// (one head per item) read its keys once per head.  The scores of a range of keys per task, then the softmax over all
// of them on the calling thread, then the weighted values of a range of columns per task.  Every
// (head, key) score and (head, column) lane runs attend_heads's very operations in its order, so
// a row gets the same bits whichever way it is computed.  Needs D % (kLanes * kAccumulators / G)
// == 0.  `parallel(begin, end, grain, f)` runs f(b, e) over [begin, end), as at::parallel_for.
template <int G, typename KV, typename Parallel>
inline void attend_heads_shared(const float* q, const KV* k, const KV* v, const int64_t* rows, int64_t S, int64_t D,
                                const bool* visible, AttentionScale scale, float* scores, float* out,
                                const Parallel& parallel) {
  constexpr int L = Vec::kLanes;
  constexpr int W = Vec::kAccumulators / G;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  parallel(0, S, 32, [&](int64_t s0, int64_t s1) {
    const auto seen = [&](int64_t s) { return visible == nullptr || visible[s]; };
    // Vec::kKeysAtOnce keys where all are seen: each load of q serves as many products (one key
    // at a time, the loads of q outnumbered the multiplies and bounded the loop)
    constexpr int P = Vec::kKeysAtOnce;
    const auto all_seen = [&](int64_t s) {
      for (int p = 0; p < P; ++p)
        if (!seen(s + p)) return false;
      return true;
    };
    for (int64_t s = s0; s < s1;) {
      if (s + P <= s1 && all_seen(s)) {
        score_keys<G, P>(q, k, rows, s, D, scale, S, scores);
        s += P;
      } else {
        score_key_or_unseen<G>(q, k, rows, s, D, scale, S, scores, seen(s));
        ++s;
      }
    }
  });
  float max_score[G], inv_total[G];
  for (int g = 0; g < G; ++g) {
    max_score[g] = neg_inf;  // max is exact: the order of the keys does not matter
    for (int64_t s = 0; s < S; ++s)
      if (visible == nullptr || visible[s]) max_score[g] = std::max(max_score[g], scores[g * S + s]);
  }
  if (max_score[0] == neg_inf) {  // the heads share the mask: none sees anything
    for (int64_t d = 0; d < G * D; d += L) Vec::store(out + d, Vec::zero());
    return;
  }
  for (int g = 0; g < G; ++g) {
    const float* sink = scale.sinks == nullptr ? nullptr : scale.sinks + g;
    if (sink != nullptr) max_score[g] = std::max(max_score[g], *sink);
    inv_total[g] = exp_scores(scores + g * S, S, max_score[g], visible, sink);
  }
  parallel(0, D / (L * W), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0 * L * W; c < c1 * L * W; c += L * W) {
      Vec::F acc[G][W];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < W; ++j) acc[g][j] = Vec::zero();
      for (int64_t s = 0; s < S; ++s) {
        if (visible != nullptr && !visible[s]) continue;
        const KV* vs = v + rows[s] + c;
        Vec::F vv[W];
        for (int j = 0; j < W; ++j) vv[j] = load_kv(vs + L * j);
        for (int g = 0; g < G; ++g) {
          const Vec::F pv = Vec::set1(scores[g * S + s]);
          for (int j = 0; j < W; ++j) acc[g][j] = Vec::fmadd(pv, vv[j], acc[g][j]);
        }
      }
      for (int g = 0; g < G; ++g) {
        const Vec::F inv = Vec::set1(inv_total[g]);
        for (int j = 0; j < W; ++j) Vec::store(out + g * D + c + L * j, Vec::mul(acc[g][j], inv));
      }
    }
  });
}

// G query heads of one query row that share a key head (grouped-query attention), against the
// same S keys and mask: each head gets attend_row's very bits (the same operations in the same
// order); the heads only share the loads.  Each key and value row is read once for the G heads
// instead of G times: attention over a long context is bound by reading them.  q, out: G heads
// of D floats, one after the other; scores: G * S scratch.  (attend_heads_shared on this thread.)
template <int G, typename KV>
inline void attend_heads(const float* q, const KV* k, const KV* v, const int64_t* rows, int64_t S, int64_t D,
                         const bool* visible, AttentionScale scale, float* scores, float* out) {
  if (D % (Vec::kLanes * (Vec::kAccumulators / G)) != 0) {
    for (int g = 0; g < G; ++g)
      attend_row(q + g * D, k, v, rows, S, D, visible, scale.at_head(g), scores + g * S, out + g * D);
    return;
  }
  const auto serial = [](int64_t begin, int64_t end, int64_t, const auto& f) { f(begin, end); };
  attend_heads_shared<G>(q, k, v, rows, S, D, visible, scale, scores, out, serial);
}

// Heads per attend_heads_shared call for `group` query heads per key head (4, 2 or 1, the most
// that divide it), or 0 where a head of D floats is not whole passes of its value registers.
inline int64_t shared_heads(int64_t group, int64_t D) {
  int64_t g = 1;
  while (g < 4 && group % (2 * g) == 0) g *= 2;
  return D % (Vec::kLanes * (Vec::kAccumulators / g)) == 0 ? g : 0;
}

template <typename KV, typename Parallel>
inline void attend_heads_shared_n(int64_t G, const float* q, const KV* k, const KV* v, const int64_t* rows, int64_t S,
                                  int64_t D, const bool* visible, AttentionScale scale, float* scores, float* out,
                                  const Parallel& parallel) {
  switch (G) {
    case 4: attend_heads_shared<4>(q, k, v, rows, S, D, visible, scale, scores, out, parallel); return;
    case 2: attend_heads_shared<2>(q, k, v, rows, S, D, visible, scale, scores, out, parallel); return;
    default: attend_heads_shared<1>(q, k, v, rows, S, D, visible, scale, scores, out, parallel); return;
  }
}

// attend_heads for a run-time G (from the build's heads_per_call).
template <typename KV>
inline void attend_heads_n(int64_t G, const float* q, const KV* k, const KV* v, const int64_t* rows, int64_t S,
                           int64_t D, const bool* visible, AttentionScale scale, float* scores, float* out) {
  switch (G) {
    case 4: attend_heads<4>(q, k, v, rows, S, D, visible, scale, scores, out); return;
    case 2: attend_heads<2>(q, k, v, rows, S, D, visible, scale, scores, out); return;
    default: attend_row(q, k, v, rows, S, D, visible, scale, scores, out); return;
  }
}
