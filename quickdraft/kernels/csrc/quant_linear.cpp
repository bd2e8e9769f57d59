// Batch-invariant linear layers on GGUF-quantized weights (CPU: AVX-512 VNNI, or AVX2).
//
// y[M, N] = x[M, K] @ W[N, K]^T where W is stored quantized (Q8_0, Q4_0, Q5_0, Q4_K, Q5_K,
// Q6_K, IQ4_XS, IQ4_NL, Q3_K, Q4_1, Q5_1, Q2_K, MXFP4) or as 16-bit floats (F16, BF16), repacked at
// load time by quickdraft/models/quantized.py into tiles of 16 weight rows (the packed layouts are
// documented there; this file only reads them).
//
// Numerics (the same for every M, so a row's result never depends on the other rows):
//  - each row of x is quantized to int8 per 32 values: dx = amax / L, q = round(x * L / amax)
//    (round half to even), plus the integer sum of every 16 quants (bsum16), with L = 127 levels
//    (L = 63 where a caller asks for narrow quants: the LM head of quant_linear.py's
//    lm_head_activation_levels);
//  - each 32-wide block's dot product of quants is an exact int32 (the weights' offsets are
//    folded in as -offset * bsum where the instructions multiply unsigned weight quants);
//  - one fp32 accumulator per output, added block after block in K order:
//        acc = acc + (scale_w * dx) * float(idot)        (Q4_K/Q5_K subtract (min_w * dx) * bsum)
//    with separate multiplies and adds (built with -ffp-contract=off), so that
//    quickdraft/kernels/quant_linear.py's torch reference computes the very same bits.
// F16 / BF16 weights (float16_tile) multiply the float rows of x as they are, with float32
// products and sums in one fixed order per tile (no activation quantization, nothing rounded
// but the float32 arithmetic).
// Vectors run across 16 output rows (one lane per output), never across K: no horizontal sums,
// no order that depends on how the work is tiled or threaded.
//
// One source, two builds (quant_linear.py loads the one the CPU supports):
//  - default: AVX-512 VNNI, one vpdpbusd per 4 quants of 16 rows, plus the one-call decoder layer;
//  - -DQD_ISA_AVX2: AVX2 (+F16C for the fp16 scales), 16 rows as two 8-lane halves.  Integer
//    products go through vpmaddubsw, whose int16 pair sums saturate above 32767: the 4-6 bit
//    weight quants (<= 63) keep |2 * 63 * 127| < 2^15; Q8_0's 8-bit quants are made signed
//    (-128..127) and multiplied as |w| (<= 128, unsigned) times x * sign(w) (|x| <= 127, so the
//    sign flip never wraps): |2 * 128 * 127| = 32512 < 2^15; where x's quants are narrow
//    (|x| <= 63) the stored unsigned quants (w + 128 <= 255) multiply x as they are, one
//    instruction fewer per step: |2 * 255 * 63| = 32130 < 2^15.  The small quants' pair sums are
//    added as int16 for a few steps before vpmaddwd widens them (Partial: as many steps as
//    stay below 2^15).  Either way the block dots are the same exact integers, and the fp32
//    epilogue is the same operations on the same values, lane by lane.
// The tile code below is written once over a small vector type (VecI / VecF / VecB: 16 lanes).
//
// The translation unit is compiled for the baseline ISA so the module imports anywhere; the
// kernels carry `#pragma GCC target` and only run after a CPUID check.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

#include <optional>
#include <tuple>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include "attention_row.h"
#include "attention_row_avx2.h"
#include "draft_mixture.h"

namespace qd_quant {
// Internal linkage: the AVX-512 and the AVX2 module may both be loaded in one process, and
// their same-named functions must never bind to each other's code.
namespace {

enum Format : int {
  Q8_0 = 0, Q4_0 = 1, Q5_0 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5, IQ4_XS = 6, IQ4_NL = 7, Q3_K = 8, Q4_1 = 9, Q5_1 = 10,
  Q2_K = 11, MXFP4 = 12, F16 = 13, BF16 = 14
};
constexpr int kLastFormat = BF16;
// Weights kept as 16-bit floats: multiplied with the float rows of x, not with its int8 quants.
constexpr bool float16_format(int64_t format) { return format == F16 || format == BF16; }

// Weight quants covered by one tile (per 16 rows) and the tile's size in bytes.
constexpr int kTileK[] = {32, 32, 32, 256, 256, 256, 256, 32, 256, 32, 32, 256, 32, 32, 32};
constexpr int kTileBytes[] = {544, 288, 352, 2368, 2880, 3360, 2208, 288, 1824, 320, 384, 1344, 288, 1024, 1024};
// The AMX path covers the first six formats; the others run on VNNI whatever the row count.
constexpr bool amx_format(int64_t format) { return format <= Q6_K; }
// IQ4_XS's and IQ4_NL's 16 levels (ggml's kvalues_iq4nl)
constexpr int8_t kIq4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// MXFP4's 16 levels: FP4 E2M1's values times 2 (its tiles' d is half the block's power of two)
constexpr int8_t kMxfp4Levels[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
// The levels of a format whose quants are indices (IQ4_NL, IQ4_XS, MXFP4).
template <int FMT>
constexpr const int8_t* level_table() {
  return FMT == MXFP4 ? kMxfp4Levels : kIq4Levels;
}
constexpr int64_t kPrefetchBytes = 4096;
// F16 / BF16 tiles (1 KiB) are consumed faster per byte: 8 KiB ahead read a one-row matmul in
// 0.85-0.88 of the time 4 KiB did (16 KiB: 0.86-0.90; in-process A/B of BF16 [4096, 640],
// [640, 2048] and [1536, 640] weights streamed from DRAM, Zen 4), at 4 rows 0.92-0.94.
constexpr int64_t kFloat16PrefetchBytes = 8192;
constexpr int64_t tile_prefetch_bytes(int64_t format) {
  return float16_format(format) ? kFloat16PrefetchBytes : kPrefetchBytes;
}

#if defined(QD_ISA_AVX2)
constexpr const char* kIsa = "avx2";

inline bool cpu_supported() {
  __builtin_cpu_init();
  // F16C converts the fp16 scales, FMA is the decoder layer's attention; every CPU with AVX2 has both.
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
}
#else
constexpr const char* kIsa = "avx512";

inline bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
#endif

// Activation rows quantized for the kernels, and the float rows they were quantized from (what
// F16 / BF16 weights multiply; null where a caller has only the quants: those formats refuse).
struct QRows {
  const int8_t* q;       // [M, K]
  const float* dx;       // [M, K / 32]
  const int32_t* bsum;   // [M, K / 16]
  int64_t K;
  const float* xf = nullptr;  // [M, K]
  // [M, K / 32]: -128 * each block's quant sum where every quant is within +-63 (quantize_rows
  // with 63 levels: narrow quants, which Q8_0's AVX2 step multiplies without a sign flip); else null
  const int32_t* offset128 = nullptr;
};

#define QD_INLINE __attribute__((always_inline)) inline
#define QD_UNROLL _Pragma("GCC unroll 16")

#pragma GCC push_options
#if defined(QD_ISA_AVX2)
// No "fma": nothing can be contracted, whatever the flags.
#pragma GCC target("avx2,f16c")

// ------------------------------------------------------------------------------------------
// AVX2: 16 lanes as two halves, a = weight rows 0..7 of the group, b = rows 8..15
// ------------------------------------------------------------------------------------------

struct VecF { __m256 a, b; };  // 16 float: rows 0..7, 8..15

// Rows of x per pass over a group's weights (quant_tiles_avx2.h: one int16 sum register per
// row and half through a block, beside the weights).
constexpr int kRowsBlock32 = 8;  // Q8_0, Q4_0, Q5_0
constexpr int kRowsSuper = 8;    // K-quants
constexpr int kRowsQ2K = kRowsSuper;
constexpr int kRowsFloat16 = 2;  // F16, BF16: four float chains per row and half through a tile
// Where the tiles prefetch the weights: L1 (the AVX-512 build's L2 hint is not measured on
// an AVX2 machine yet).
constexpr auto kPrefetchHint = _MM_HINT_T0;

QD_INLINE __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
QD_INLINE __m128i load8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
QD_INLINE __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Steps of int16 pair sums of weight quants 0..max_q (<= 63) times activation quants that stay
// below 2^15 (vpmaddubsw's pair sums are at most 2 * max_q * 127 in magnitude): how many steps
// may be added as int16 before vpmaddwd widens them into the int32 block dots.
constexpr int partial_steps(int max_q) { return 32767 / (2 * 127 * max_q); }
static_assert(partial_steps(15) == 8 && partial_steps(31) == 4 && partial_steps(63) == 2);

// out[0 : nvalid] = v (nvalid <= 16)
QD_INLINE void store_lanes(float* out, VecF v, int64_t nvalid) {
  if (nvalid == 16) {
    _mm256_storeu_ps(out, v.a);
    _mm256_storeu_ps(out + 8, v.b);
    return;
  }
  float lanes[16];
  _mm256_storeu_ps(lanes, v.a);
  _mm256_storeu_ps(lanes + 8, v.b);
  std::memcpy(out, lanes, nvalid * sizeof(float));
}

QD_INLINE int32_t sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

QD_INLINE float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ps(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// x * inv in fp32 and round-half-even (the default rounding of vcvtps2dq), exactly as the torch
// reference (clamping before rounding to the integer bounds is the same); the 16-value sums are
// exact integers.
inline void quantize_row(const float* x, int64_t K, int8_t* q, float* dx, int32_t* bsum, float levels) {
  const __m256 lo = _mm256_set1_ps(-levels), hi = _mm256_set1_ps(levels);
  const __m256 sign_off = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  // packs leaves the 4-byte groups in the order 0, 2, 4, 6, 1, 3, 5, 7 (within-lane packing)
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / 32; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 32 * b + 8 * i);
    const float amax = max8(_mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], sign_off), _mm256_and_ps(v[1], sign_off)),
                                          _mm256_max_ps(_mm256_and_ps(v[2], sign_off), _mm256_and_ps(v[3], sign_off))));
    dx[b] = amax / levels;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? levels / amax : 0.0f);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i)
      qi[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(v[i], inv))));
    const __m256i q16 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * b), _mm256_permutevar8x32_epi32(q16, order));
    bsum[2 * b] = sum8(_mm256_add_epi32(qi[0], qi[1]));
    bsum[2 * b + 1] = sum8(_mm256_add_epi32(qi[2], qi[3]));
  }
}

#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,avx2,f16c")

// ------------------------------------------------------------------------------------------
// AVX-512 VNNI: one 16-lane register per vector
// ------------------------------------------------------------------------------------------

using VecI = __m512i;  // 16 int32
using VecF = __m512;   // 16 float
using VecB = __m512i;  // 64 bytes: 4 quants of each of the 16 rows (a step)

constexpr int kRowsBlock32 = 8;  // Q8_0, Q4_0, Q5_0
// K-quants, 8 rows a pass: Q5_K, Q6_K and Q3_K 7-13% faster than 4 at 8-64 rows (their
// weights' unpacking shared by twice the rows), Q4_K and IQ4_XS 2-4%; Q2_K's more temporaries
// spill at 8 (1-3% slower), so it keeps 4.  group_rows is not inlined (at 4 rows, the 8-row
// build's inlined remainder ran 5-7% slower).
constexpr int kRowsSuper = 8;
constexpr int kRowsQ2K = 4;
// F16, BF16: four float chains and an accumulator per row; 8 rows a pass spill some of them and
// still run 9-11% faster than 4 at 8-64 rows (the tile's conversions shared by twice the rows)
constexpr int kRowsFloat16 = 8;
// Where group_rows prefetches the weights: L2.  Into L1 (likely evicting the activation quants
// that 4-8 rows read at every step) a 4-token verification's LM head took 9.8 ms instead of 7.6
// on the AVX-512 + AMX machine (docs/performance-log.md, "Weights prefetched into L2").
constexpr auto kPrefetchHint = _MM_HINT_T1;

QD_INLINE VecI vi_set1(int32_t v) { return _mm512_set1_epi32(v); }
QD_INLINE VecI vi_add(VecI x, VecI y) { return _mm512_add_epi32(x, y); }
QD_INLINE VecI vi_mullo(VecI x, VecI y) { return _mm512_mullo_epi32(x, y); }
QD_INLINE VecF vf_zero() { return _mm512_setzero_ps(); }
QD_INLINE VecF vf_set1(float v) { return _mm512_set1_ps(v); }
QD_INLINE VecF vf_add(VecF x, VecF y) { return _mm512_add_ps(x, y); }
QD_INLINE VecF vf_sub(VecF x, VecF y) { return _mm512_sub_ps(x, y); }
QD_INLINE VecF vf_mul(VecF x, VecF y) { return _mm512_mul_ps(x, y); }
QD_INLINE VecF vf_from_i(VecI x) { return _mm512_cvtepi32_ps(x); }

QD_INLINE VecF half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

QD_INLINE VecF u8x16_to_f32(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

QD_INLINE VecI i8x16_to_i32(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

QD_INLINE VecB load_step(const uint8_t* p) { return _mm512_loadu_si512(p); }

// Step s of a nibble section holds k = 4s..4s+3 (low nibbles, s < 4) or 16 + 4(s-4).. (high).
QD_INLINE void nibbles(const uint8_t* p, int s, VecB& lo, VecB& hi) {
  const __m512i v = _mm512_loadu_si512(p + 64 * s);
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  lo = _mm512_and_si512(v, m4);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
}

// Steps s (k 4s..4s+3) and s + 4 (k 16 + 4s..) of a section of 2-bit quants: vectors 0 and 1, bits 2s.
QD_INLINE void crumbs(const uint8_t* p, int s, VecB& lo, VecB& hi) {
  const __m512i m2 = _mm512_set1_epi8(0x03);
  lo = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(p), 2 * s), m2);
  hi = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(p + 64), 2 * s), m2);
}

// Adds `bit` to the quants whose bit is set in the 64-bit mask of step s.
QD_INLINE VecB high_bits(VecB w, const uint8_t* masks, int s, char bit) {
  uint64_t bits;
  std::memcpy(&bits, masks + 8 * s, 8);
  return _mm512_mask_add_epi8(w, _cvtu64_mask64(bits), w, _mm512_set1_epi8(bit));
}

// idot += w (u8) . broadcast of the 4 activation bytes at p (s8), with the broadcast embedded
// in the instruction ({1to16}): GCC otherwise emits a separate vpbroadcastd per row and step,
// twice the micro-ops of the kernel's inner loop.
QD_INLINE VecI dp_bcast(VecI idot, VecB w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(idot) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return idot;
}

// vpdpbusd adds into int32 directly: the partial sums of the AVX2 build are the dots themselves.
using Partial = VecI;
constexpr int partial_steps(int) { return 1 << 20; }  // never flushed
QD_INLINE Partial partial_begin(VecI idot) { return idot; }
QD_INLINE VecI partial_end(Partial p) { return p; }
QD_INLINE Partial partial_flush(Partial p) { return p; }
QD_INLINE Partial partial_dot(Partial part, VecB w, const int8_t* p) { return dp_bcast(part, w, p); }

// Q8_0 step: vpdpbusd takes the stored unsigned quants (w + 128) as they are.
using Q8Step = VecB;
constexpr int32_t kQ8Offset = 128;

QD_INLINE Q8Step q8_step(const uint8_t* p) { return load_step(p); }
QD_INLINE VecI dp_q8(VecI idot, Q8Step w, const int8_t* p) { return dp_bcast(idot, w, p); }

// out[0 : nvalid] = v (nvalid <= 16)
QD_INLINE void store_lanes(float* out, VecF v, int64_t nvalid) {
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << nvalid) - 1u), v);
}

// x * inv in fp32 and round-half-even (the default rounding of vcvtps2dq), exactly as the torch
// reference (clamping before rounding to the integer bounds is the same); the 16-value sums are
// exact integers.
inline void quantize_row(const float* x, int64_t K, int8_t* q, float* dx, int32_t* bsum, float levels) {
  const __m512 lo = _mm512_set1_ps(-levels), hi = _mm512_set1_ps(levels);
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(x0, sign_off), _mm512_and_ps(x1, sign_off)));
    dx[b] = amax / levels;
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? levels / amax : 0.0f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_mul_ps(x0, inv))));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_mul_ps(x1, inv))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b + 16), _mm512_cvtepi32_epi8(q1));
    bsum[2 * b] = _mm512_reduce_add_epi32(q0);
    bsum[2 * b + 1] = _mm512_reduce_add_epi32(q1);
  }
}

#endif

// ------------------------------------------------------------------------------------------
// The kernels, once for both ISAs
// ------------------------------------------------------------------------------------------

// Every row of x [M, K]; rows are independent, so threads change nothing.
inline void quantize_rows_into(const float* x, int64_t M, int64_t K, int8_t* q, float* dx, int32_t* bsum,
                               int64_t levels = 127) {
  at::parallel_for(0, M, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, K)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(x + m * K, K, q + m * K, dx + m * (K / 32), bsum + m * (K / 16), static_cast<float>(levels));
  });
}

constexpr int kMaxPassRows = 8;  // activation rows a pass over a tile may take (Rows' arrays)
static_assert(kRowsBlock32 <= kMaxPassRows && kRowsSuper <= kMaxPassRows && kRowsQ2K <= kMaxPassRows &&
                  kRowsFloat16 <= kMaxPassRows,
              "a pass's rows must fit in Rows");

struct Rows {
  const int8_t* xq[kMaxPassRows];
  const float* dx[kMaxPassRows];
  const int32_t* bsum[kMaxPassRows];
  const float* xf[kMaxPassRows];
  const int32_t* offset128[kMaxPassRows];  // QRows::offset128's rows
};

#if defined(QD_ISA_AVX2)
#include "quant_tiles_avx2.h"
#else
// Dot products of weight quants 0..MAX_Q (<= 63) with the rows' activation quants: every
// step into part, every partial_steps(MAX_Q) steps widened into int32 (see Partial).
template <int MB, int MAX_Q>
struct SmallDots {
  static constexpr int kFlushSteps = partial_steps(MAX_Q);
  Partial part[MB];
  int steps = 0;

  QD_INLINE explicit SmallDots(const VecI* idot) {
    QD_UNROLL
    for (int m = 0; m < MB; ++m) part[m] = partial_begin(idot[m]);
  }

  QD_INLINE void step(VecB w, const int8_t* const* xq, int64_t k) {
    if (steps == kFlushSteps) {
      QD_UNROLL
      for (int m = 0; m < MB; ++m) part[m] = partial_flush(part[m]);
      steps = 0;
    }
    QD_UNROLL
    for (int m = 0; m < MB; ++m) part[m] = partial_dot(part[m], w, xq[m] + k);
    ++steps;
  }

  QD_INLINE void end(VecI* idot) const {
    QD_UNROLL
    for (int m = 0; m < MB; ++m) idot[m] = partial_end(part[m]);
  }
};

// acc = acc + (scale * dx) * float(idot): the per-block epilogue of every format but the
// K-quants with mins.
template <int MB>
QD_INLINE void add_scaled(VecF* acc, VecF scale, const VecI* idot, const float* const* dx, int64_t b) {
  QD_UNROLL
  for (int m = 0; m < MB; ++m)
    acc[m] = vf_add(acc[m], vf_mul(vf_mul(scale, vf_set1(dx[m][b])), vf_from_i(idot[m])));
}

// acc = acc + ((ds * dx) * float(idot) - (dm * dx) * float(bsum32)): the epilogue of the formats
// with mins (Q4_K, Q5_K per sub-block; Q4_1, Q5_1 per block).
template <int MB>
QD_INLINE void add_scaled_min(VecF* acc, VecF ds, VecF dm, const VecI* idot, const float* const* dx,
                              const int32_t* const* bsum, int64_t b) {
  QD_UNROLL
  for (int m = 0; m < MB; ++m) {
    const VecF dxv = vf_set1(dx[m][b]);
    const VecF bs = vf_set1(static_cast<float>(bsum[m][2 * b] + bsum[m][2 * b + 1]));
    const VecF term = vf_sub(vf_mul(vf_mul(ds, dxv), vf_from_i(idot[m])), vf_mul(vf_mul(dm, dxv), bs));
    acc[m] = vf_add(acc[m], term);
  }
}

template <int MB>
QD_INLINE void init_offset(VecI* idot, const int32_t* const* bsum, int64_t b, int32_t offset) {
  QD_UNROLL
  for (int m = 0; m < MB; ++m) idot[m] = vi_set1(-offset * (bsum[m][2 * b] + bsum[m][2 * b + 1]));
}

// A format's levels + 128 in every 128-bit lane: vpshufb maps each 4-bit index to its unsigned level.
template <int FMT>
QD_INLINE VecB iq4_table() {
  alignas(16) uint8_t levels[16];
  for (int i = 0; i < 16; ++i) levels[i] = static_cast<uint8_t>(level_table<FMT>()[i] + 128);
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(levels)));
}

// idot += the 32 k of a section of IQ4 indices from k0, as unsigned levels (the caller's offset:
// -128 * bsum, as Q8_0's).
template <int MB>
QD_INLINE void iq4_block(const uint8_t* section, VecB table, const int8_t* const* xq, int64_t k0, VecI* idot) {
  QD_UNROLL
  for (int s = 0; s < 4; ++s) {
    VecB lo, hi;
    nibbles(section, s, lo, hi);
    lo = _mm512_shuffle_epi8(table, lo);
    hi = _mm512_shuffle_epi8(table, hi);
    QD_UNROLL
    for (int m = 0; m < MB; ++m) idot[m] = dp_bcast(idot[m], lo, xq[m] + k0 + 4 * s);
    QD_UNROLL
    for (int m = 0; m < MB; ++m) idot[m] = dp_bcast(idot[m], hi, xq[m] + k0 + 16 + 4 * s);
  }
}

// Step s of a nibble section as unsigned quants: low nibbles k 4s..4s+3, high nibbles k 16 + 4s..,
// with bit 4 (FIVE_BITS, masks at +256) and bit 5 (SIX_BITS, masks at +320) added.
template <bool FIVE_BITS, bool SIX_BITS>
QD_INLINE void section_step(const uint8_t* section, int s, VecB& lo, VecB& hi) {
  nibbles(section, s, lo, hi);
  if constexpr (FIVE_BITS) {
    lo = high_bits(lo, section + 256, s, 0x10);
    hi = high_bits(hi, section + 256, s + 4, 0x10);
  }
  if constexpr (SIX_BITS) {
    lo = high_bits(lo, section + 320, s, 0x20);
    hi = high_bits(hi, section + 320, s + 4, 0x20);
  }
}

// The 32 k of a nibble section (and its bit-4 masks when FIVE_BITS) into idot, from k0.
template <int MB, bool FIVE_BITS>
QD_INLINE void nibble_block(const uint8_t* section, const int8_t* const* xq, int64_t k0, VecI* idot) {
  SmallDots<MB, FIVE_BITS ? 31 : 15> dots(idot);
  QD_UNROLL
  for (int s = 0; s < 4; ++s) {
    VecB lo, hi;
    section_step<FIVE_BITS, false>(section, s, lo, hi);
    dots.step(lo, xq, k0 + 4 * s);
    dots.step(hi, xq, k0 + 16 + 4 * s);
  }
  dots.end(idot);
}

// The 16 rows' values at one k of an F16 / BF16 tile (32 bytes), as floats (exactly).
template <int FMT>
QD_INLINE VecF float16_lanes(const uint8_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (FMT == F16) return _mm512_cvtph_ps(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// An F16 / BF16 tile (32 k, k-major: the 16 rows' values at k in 32 bytes) into the accumulators:
// per row, chain j (j < 4) adds the float32 products x[k] * w[k] of k = k0 + j, k0 + j + 4, ...
// in k order; acc += (chain 0 + chain 1) + (chain 2 + chain 3).  Separate multiplies and adds,
// the torch reference's operations (quant_linear.py), the same for any number of rows.
template <int FMT, int MB>
QD_INLINE void float16_tile(const uint8_t* t, int64_t k0, const float* const* xf, VecF* acc) {
  VecF chain[MB][4];
  QD_UNROLL
  for (int j = 0; j < 4; ++j) {
    const VecF w = float16_lanes<FMT>(t + 32 * j);
    QD_UNROLL
    for (int m = 0; m < MB; ++m) chain[m][j] = vf_mul(vf_set1(xf[m][k0 + j]), w);
  }
  QD_UNROLL
  for (int k = 4; k < 32; k += 4) {
    QD_UNROLL
    for (int j = 0; j < 4; ++j) {
      const VecF w = float16_lanes<FMT>(t + 32 * (k + j));
      QD_UNROLL
      for (int m = 0; m < MB; ++m) chain[m][j] = vf_add(chain[m][j], vf_mul(vf_set1(xf[m][k0 + k + j]), w));
    }
  }
  QD_UNROLL
  for (int m = 0; m < MB; ++m)
    acc[m] = vf_add(acc[m], vf_add(vf_add(chain[m][0], chain[m][1]), vf_add(chain[m][2], chain[m][3])));
}

// One tile (16 weight rows x kTileK values starting at k0) into the accumulators.
template <int FMT, int MB>
QD_INLINE void tile(const uint8_t* t, int64_t k0, const Rows& r, VecF* acc) {
  VecI idot[MB];
  const int64_t b = k0 / 32;
  if constexpr (float16_format(FMT)) {
    float16_tile<FMT, MB>(t, k0, r.xf, acc);
  } else if constexpr (FMT == Q8_0) {
    init_offset<MB>(idot, r.bsum, b, kQ8Offset);
    QD_UNROLL
    for (int s = 0; s < 8; ++s) {
      const Q8Step w = q8_step(t + 64 * s);
      QD_UNROLL
      for (int m = 0; m < MB; ++m) idot[m] = dp_q8(idot[m], w, r.xq[m] + k0 + 4 * s);
    }
    add_scaled<MB>(acc, half16(t + 512), idot, r.dx, b);
  } else if constexpr (FMT == Q4_0 || FMT == Q5_0) {
    init_offset<MB>(idot, r.bsum, b, FMT == Q4_0 ? 8 : 16);
    nibble_block<MB, FMT == Q5_0>(t, r.xq, k0, idot);
    add_scaled<MB>(acc, half16(t + (FMT == Q4_0 ? 256 : 320)), idot, r.dx, b);
  } else if constexpr (FMT == IQ4_NL || FMT == MXFP4) {
    init_offset<MB>(idot, r.bsum, b, 128);
    iq4_block<MB>(t, iq4_table<FMT>(), r.xq, k0, idot);
    add_scaled<MB>(acc, half16(t + 256), idot, r.dx, b);
  } else if constexpr (FMT == Q4_K || FMT == Q5_K) {
    const VecF d = half16(t), dmin = half16(t + 32);
    constexpr int sub_bytes = FMT == Q4_K ? 256 : 320;
    for (int j = 0; j < 8; ++j) {
      const uint8_t* sub = t + 320 + sub_bytes * j;
      QD_UNROLL
      for (int m = 0; m < MB; ++m) idot[m] = vi_set1(0);
      nibble_block<MB, FMT == Q5_K>(sub, r.xq, k0 + 32 * j, idot);
      const VecF ds = vf_mul(d, u8x16_to_f32(t + 64 + 16 * j));
      const VecF dm = vf_mul(dmin, u8x16_to_f32(t + 192 + 16 * j));
      add_scaled_min<MB>(acc, ds, dm, idot, r.dx, r.bsum, b + j);
    }
  } else if constexpr (FMT == Q4_1 || FMT == Q5_1) {
    QD_UNROLL
    for (int m = 0; m < MB; ++m) idot[m] = vi_set1(0);
    nibble_block<MB, FMT == Q5_1>(t, r.xq, k0, idot);
    constexpr int quant_bytes = FMT == Q4_1 ? 256 : 320;
    add_scaled_min<MB>(acc, half16(t + quant_bytes), half16(t + quant_bytes + 32), idot, r.dx, r.bsum, b);
  } else if constexpr (FMT == Q2_K) {
    // 16-wide sub-blocks, each with a 4-bit scale and a 4-bit min (one byte); quants 0..3:
    // acc += (d * dx) * float(sc_lo * dot_lo + sc_hi * dot_hi) - (dmin * dx) * float(m_lo * bsum_lo + m_hi * bsum_hi)
    const VecF d = half16(t), dmin = half16(t + 32);
    const VecI low4 = vi_set1(0x0F);
    for (int j = 0; j < 8; ++j) {
      const uint8_t* sub = t + 320 + 128 * j;
      const int64_t bj = b + j;
      VecI hi_dot[MB];
      QD_UNROLL
      for (int m = 0; m < MB; ++m) idot[m] = hi_dot[m] = vi_set1(0);
      QD_UNROLL
      for (int s = 0; s < 4; ++s) {
        VecB lo, hi;
        crumbs(sub, s, lo, hi);
        QD_UNROLL
        for (int m = 0; m < MB; ++m) idot[m] = dp_bcast(idot[m], lo, r.xq[m] + k0 + 32 * j + 4 * s);
        QD_UNROLL
        for (int m = 0; m < MB; ++m) hi_dot[m] = dp_bcast(hi_dot[m], hi, r.xq[m] + k0 + 32 * j + 16 + 4 * s);
      }
      const VecI sm_lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 64 + 32 * j)));
      const VecI sm_hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 80 + 32 * j)));
      const VecI sc_lo = _mm512_and_si512(sm_lo, low4), sc_hi = _mm512_and_si512(sm_hi, low4);
      const VecI m_lo = _mm512_srli_epi32(sm_lo, 4), m_hi = _mm512_srli_epi32(sm_hi, 4);
      QD_UNROLL
      for (int m = 0; m < MB; ++m) {
        const VecI dots = vi_add(vi_mullo(sc_lo, idot[m]), vi_mullo(sc_hi, hi_dot[m]));
        const VecI mins = vi_add(vi_mullo(m_lo, vi_set1(r.bsum[m][2 * bj])), vi_mullo(m_hi, vi_set1(r.bsum[m][2 * bj + 1])));
        const VecF dxv = vf_set1(r.dx[m][bj]);
        const VecF term = vf_sub(vf_mul(vf_mul(d, dxv), vf_from_i(dots)), vf_mul(vf_mul(dmin, dxv), vf_from_i(mins)));
        acc[m] = vf_add(acc[m], term);
      }
    }
  } else if constexpr (FMT == Q6_K || FMT == Q3_K) {
    // 16-wide sub-blocks with int8 scales; quants 0..63 offset by 32 (Q6_K), 0..7 offset by 4 (Q3_K)
    constexpr bool six = FMT == Q6_K;
    constexpr int32_t offset = six ? 32 : 4;
    const VecF d = half16(t);
    for (int j = 0; j < 8; ++j) {
      const uint8_t* sub = t + 288 + (six ? 384 : 192) * j;
      const int64_t bj = b + j;
      VecI hi_dot[MB];
      QD_UNROLL
      for (int m = 0; m < MB; ++m) {
        idot[m] = vi_set1(-offset * r.bsum[m][2 * bj]);
        hi_dot[m] = vi_set1(-offset * r.bsum[m][2 * bj + 1]);
      }
      SmallDots<MB, six ? 63 : 7> lo_dots(idot), hi_dots(hi_dot);
      QD_UNROLL
      for (int s = 0; s < 4; ++s) {
        VecB lo, hi;
        if constexpr (six) {
          section_step<true, true>(sub, s, lo, hi);
        } else {  // crumbs, then bit 2 from its masks (at +128)
          crumbs(sub, s, lo, hi);
          lo = high_bits(lo, sub + 128, s, 0x04);
          hi = high_bits(hi, sub + 128, s + 4, 0x04);
        }
        lo_dots.step(lo, r.xq, k0 + 32 * j + 4 * s);
        hi_dots.step(hi, r.xq, k0 + 32 * j + 16 + 4 * s);
      }
      lo_dots.end(idot);
      hi_dots.end(hi_dot);
      const VecI sc_lo = i8x16_to_i32(t + 32 + 16 * (2 * j));
      const VecI sc_hi = i8x16_to_i32(t + 32 + 16 * (2 * j + 1));
      QD_UNROLL
      for (int m = 0; m < MB; ++m) idot[m] = vi_add(vi_mullo(sc_lo, idot[m]), vi_mullo(sc_hi, hi_dot[m]));
      add_scaled<MB>(acc, d, idot, r.dx, bj);
    }
  } else {  // IQ4_XS: 4-bit indices into 16 levels, int8 scales per 32, d per 256
    const VecF d = half16(t);
    const VecB table = iq4_table<IQ4_XS>();
    for (int j = 0; j < 8; ++j) {
      const int64_t bj = b + j;
      init_offset<MB>(idot, r.bsum, bj, 128);
      iq4_block<MB>(t + 160 + 256 * j, table, r.xq, k0 + 32 * j, idot);
      const VecI sc = i8x16_to_i32(t + 32 + 16 * j);
      QD_UNROLL
      for (int m = 0; m < MB; ++m) idot[m] = vi_mullo(sc, idot[m]);
      add_scaled<MB>(acc, d, idot, r.dx, bj);
    }
  }
}

#endif  // QD_ISA_AVX2

// Rows m0..m0+MB-1 of x against weight group g (16 output rows), all of K.  A function of its
// own: inlined into its callers (every row count's in one function) GCC spills the AVX2 half
// tiles' sums, up to 1.5x slower at 2-6 rows, and the AVX-512 K-quants' at 4 rows.
template <int FMT, int MB>
__attribute__((noinline))
void group_rows(const uint8_t* group, int64_t ntiles, const QRows& x, int64_t m0, float* out, int64_t ldo,
                int64_t n0, int64_t nvalid) {
  Rows r;
  const bool quants = x.q != nullptr, floats = x.xf != nullptr;  // F16 / BF16 read only the floats
  for (int m = 0; m < MB; ++m) {
    r.xq[m] = quants ? x.q + (m0 + m) * x.K : nullptr;
    r.dx[m] = quants ? x.dx + (m0 + m) * (x.K / 32) : nullptr;
    r.bsum[m] = quants ? x.bsum + (m0 + m) * (x.K / 16) : nullptr;
    r.xf[m] = floats ? x.xf + (m0 + m) * x.K : nullptr;
    r.offset128[m] = x.offset128 ? x.offset128 + (m0 + m) * (x.K / 32) : nullptr;
  }
#if defined(QD_ISA_AVX2)
  if constexpr (FMT == Q8_0) {
    if (x.offset128) return half_group_rows<FMT, MB, true>(group, ntiles, r, out + m0 * ldo, ldo, n0, nvalid);
  }
  half_group_rows<FMT, MB, false>(group, ntiles, r, out + m0 * ldo, ldo, n0, nvalid);
#else
  VecF acc[MB];
  QD_UNROLL
  for (int m = 0; m < MB; ++m) acc[m] = vf_zero();
  for (int64_t i = 0; i < ntiles; ++i) {
    const uint8_t* t = group + i * kTileBytes[FMT];
    // Every line of the tile 4 KiB (F16 / BF16: 8 KiB) ahead: the hardware prefetchers stop at
    // page boundaries and the small layer matrices are streamed from DRAM in short runs.
    for (int64_t off = 0; off < kTileBytes[FMT]; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(t + tile_prefetch_bytes(FMT) + off), kPrefetchHint);
    tile<FMT, MB>(t, i * kTileK[FMT], r, acc);
  }
  for (int m = 0; m < MB; ++m) store_lanes(out + (m0 + m) * ldo + n0, acc[m], nvalid);
#endif
}

// The last M - m0 < MB rows, as one pass of that many.
template <int FMT, int MB>
void remaining_rows(const uint8_t* group, int64_t ntiles, const QRows& x, int64_t M, int64_t m0, float* out,
                    int64_t ldo, int64_t n0, int64_t nvalid) {
  if constexpr (MB > 0) {
    if (M - m0 == MB) return group_rows<FMT, MB>(group, ntiles, x, m0, out, ldo, n0, nvalid);
    remaining_rows<FMT, MB - 1>(group, ntiles, x, M, m0, out, ldo, n0, nvalid);
  }
}

// Rows m_begin..M-1 of x against weight group g.
template <int FMT>
void run_group(const uint8_t* group, int64_t ntiles, const QRows& x, int64_t M, float* out, int64_t ldo,
               int64_t n0, int64_t nvalid, int64_t m_begin = 0) {
  constexpr int kRows = float16_format(FMT) ? kRowsFloat16
                        : FMT == Q2_K          ? kRowsQ2K
                        : kTileK[FMT] == 256   ? kRowsSuper
                                               : kRowsBlock32;
  int64_t m0 = m_begin;
  for (; m0 + kRows <= M; m0 += kRows) group_rows<FMT, kRows>(group, ntiles, x, m0, out, ldo, n0, nvalid);
  remaining_rows<FMT, kRows - 1>(group, ntiles, x, M, m0, out, ldo, n0, nvalid);
}

template <int FMT>
void run_all(const uint8_t* packed, int64_t N, int64_t K, const QRows& x, int64_t M, float* out, int64_t ldo,
             int64_t col0) {
  const int64_t groups = (N + 15) / 16;
  const int64_t ntiles = K / kTileK[FMT];
  const int64_t group_bytes = ntiles * kTileBytes[FMT];
  // >= 32 KiB of weights per task so that small layers do not wake threads for nothing.
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / std::max<int64_t>(1, group_bytes));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      run_group<FMT>(packed + g * group_bytes, ntiles, x, M, out, ldo, col0 + 16 * g,
                     std::min<int64_t>(16, N - 16 * g));
  });
}


// ------------------------------------------------------------------------------------------
// AMX tiles for wide matmuls (Sapphire Rapids and later), with the very bits of the above
// ------------------------------------------------------------------------------------------
// Every kernel above computes each block's dot product of weight and activation quants as an
// exact int32, then runs a fixed fp32 epilogue per block, block after block in K order.  An
// exact integer is the same whichever instruction computes it, so here the tiles (TDPBSSD,
// TDPBSUD for Q8_0) take the block dots of 16 activation rows x 16 outputs x 32 k at a time
// (16 k for Q6_K's half blocks) and the epilogue is tile<>'s, operation for operation: which
// path a matmul takes (by its row count) changes no bit of any row, and batch invariance holds
// across the switch.
//
// Per group of 16 weight rows the weights are decoded once into B tiles (the vpdpbusd step
// layout, 16 outputs x 4 k bytes per 64-byte row, is the B-tile layout) as signed quants with
// their offsets subtracted (Q4_0's 8, Q5_0's 16, Q6_K's 32), so TDPBSSD's dots are the block
// dots themselves (sum x (w - offset) = sum x w - offset sum x, exactly), and their per-block
// epilogue vectors; Q8_0's packed quants are B tiles as stored (unsigned, TDPBSUD, the offset
// added in the epilogue as in tile<>), read in place.  Every block of 16 activation rows then
// runs against them (the VNNI kernel decodes the weights again for every 4-8 rows).  The tiles
// compute the next block pair while the vector units run the epilogue of this one; the epilogue
// (four to seven vector operations per row, block and 16 outputs, against the eight vpdpbusd it
// replaces) is what remains of the work.
#if !defined(QD_ISA_AVX2)

// Linux hands AMX state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM).
inline bool amx_usable() {
  static const bool usable = [] {
    if (!cpu_supported()) return false;
    unsigned eax, ebx, ecx, edx;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    const bool amx_tile = (edx >> 24) & 1, amx_int8 = (edx >> 25) & 1;
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return amx_tile && amx_int8 && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,avx2,f16c,amx-tile,amx-int8")

constexpr int kAmxRows = 16;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-3: C, two pairs (16 rows x 16 int32 outputs); tmm4-5: A (16 activation rows x `k`
// bytes); tmm6-7: B (k / 4 rows of 16 outputs x 4 bytes).  k = 32, or 16 for Q6_K's halves.
inline TileConfig tile_config(int k) {
  TileConfig config;
  for (int c = 0; c < 4; ++c) config.rows[c] = kAmxRows, config.colsb[c] = 64;
  for (int c = 4; c < 6; ++c) config.rows[c] = kAmxRows, config.colsb[c] = static_cast<uint16_t>(k);
  for (int c = 6; c < 8; ++c) config.rows[c] = static_cast<uint8_t>(k / 4), config.colsb[c] = 64;
  return config;
}

// One 32-k block of a group, decoded: the B tile and the epilogue's per-output vectors.
struct alignas(64) AmxBlock {
  uint8_t tile[512];  // [8 steps][16 outputs][4 k] signed quants, offsets removed (Q6_K: k 0-15, 16-31)
  const uint8_t* b;   // the B tile: `tile`, or Q8_0's packed quants in place
  VecF scale;         // the block's scale (Q4_0, Q5_0), d * sc (Q4_K, Q5_K), d (Q6_K); Q8_0: in place
  VecF min;           // Q4_K, Q5_K: dmin * m
  VecI sc_lo, sc_hi;  // Q6_K: the int8 scales of the block's 16-wide halves
};

// A nibble section's 32 k as the 8 rows of a B tile (step s's low nibbles are k 4s..4s+3, its
// high nibbles k 16 + 4s..), the format's offset subtracted.
template <bool FIVE_BITS, bool SIX_BITS>
QD_INLINE void decode_section(const uint8_t* section, char offset, uint8_t* tile) {
  const VecB off = _mm512_set1_epi8(offset);
  QD_UNROLL
  for (int s = 0; s < 4; ++s) {
    VecB lo, hi;
    section_step<FIVE_BITS, SIX_BITS>(section, s, lo, hi);
    _mm512_store_si512(tile + 64 * s, _mm512_sub_epi8(lo, off));
    _mm512_store_si512(tile + 64 * (4 + s), _mm512_sub_epi8(hi, off));
  }
}

// Weight group (ntiles tiles of FMT) -> its K / 32 blocks.
template <int FMT>
void decode_group(const uint8_t* group, int64_t ntiles, AmxBlock* blocks) {
  for (int64_t i = 0; i < ntiles; ++i) {
    const uint8_t* t = group + i * kTileBytes[FMT];
    if constexpr (FMT == Q8_0) {  // nothing to decode: the tiles and the epilogue read the weights in place
      blocks[i].b = t;
      continue;
    }
    for (int64_t off = 0; off < kTileBytes[FMT]; off += 64)  // as in group_rows
      _mm_prefetch(reinterpret_cast<const char*>(t + kPrefetchBytes + off), _MM_HINT_T0);
    if constexpr (FMT == Q4_0 || FMT == Q5_0) {
      decode_section<FMT == Q5_0, false>(t, FMT == Q4_0 ? 8 : 16, blocks[i].tile);
      blocks[i].b = blocks[i].tile;
      blocks[i].scale = half16(t + (FMT == Q4_0 ? 256 : 320));
    } else if constexpr (FMT == Q4_K || FMT == Q5_K) {
      const VecF d = half16(t), dmin = half16(t + 32);
      constexpr int sub_bytes = FMT == Q4_K ? 256 : 320;
      for (int j = 0; j < 8; ++j) {
        AmxBlock& block = blocks[8 * i + j];
        decode_section<FMT == Q5_K, false>(t + 320 + sub_bytes * j, 0, block.tile);
        block.b = block.tile;
        block.scale = vf_mul(d, u8x16_to_f32(t + 64 + 16 * j));
        block.min = vf_mul(dmin, u8x16_to_f32(t + 192 + 16 * j));
      }
    } else {  // Q6_K
      const VecF d = half16(t);
      for (int j = 0; j < 8; ++j) {
        AmxBlock& block = blocks[8 * i + j];
        decode_section<true, true>(t + 288 + 384 * j, 32, block.tile);
        block.b = block.tile;
        block.scale = d;
        block.sc_lo = i8x16_to_i32(t + 32 + 16 * (2 * j));
        block.sc_hi = i8x16_to_i32(t + 32 + 16 * (2 * j + 1));
      }
    }
  }
}

// Activation rows padded with zero rows to a multiple of 16 (the A tiles' height), with their
// 32-wide quant sums as Q8_0's offset and as floats (the K-quants' min term).
struct PaddedRows {
  std::vector<int8_t> q;          // [Mp, K]
  std::vector<float> dx;          // [Mp, K / 32]
  std::vector<int32_t> offset32;  // [Mp, K / 32]: -128 * (bsum16[2b] + bsum16[2b + 1])
  std::vector<float> bs32;        // [Mp, K / 32]: float(bsum16[2b] + bsum16[2b + 1])
  int64_t M, Mp, K;
};

inline PaddedRows pad_rows(const QRows& x, int64_t M) {
  const int64_t K = x.K, Mp = (M + kAmxRows - 1) / kAmxRows * kAmxRows, nb = K / 32;
  PaddedRows p{std::vector<int8_t>(Mp * K, 0), std::vector<float>(Mp * nb, 0.0f), std::vector<int32_t>(Mp * nb, 0),
               std::vector<float>(Mp * nb, 0.0f), M, Mp, K};
  std::memcpy(p.q.data(), x.q, M * K);
  std::memcpy(p.dx.data(), x.dx, sizeof(float) * M * nb);
  for (int64_t i = 0; i < M * nb; ++i) {
    p.offset32[i] = -kQ8Offset * (x.bsum[2 * i] + x.bsum[2 * i + 1]);
    p.bs32[i] = static_cast<float>(x.bsum[2 * i] + x.bsum[2 * i + 1]);
  }
  return p;
}

// acc[m] += block b's term for the first ROWS rows from their dots (Q6_K: of the low and the
// high half): tile<>'s epilogue for FMT, operation for operation.
template <int FMT, int ROWS>
QD_INLINE void amx_epilogue(const AmxBlock& block, const int32_t (*dots)[16], const int32_t (*dots_hi)[16],
                            const float* dx, const int32_t* offset32, const float* bs32, int64_t nb, int64_t b,
                            VecF* acc) {
  VecF scale_q8;
  if constexpr (FMT == Q8_0) scale_q8 = half16(block.b + 512);
  QD_UNROLL
  for (int m = 0; m < ROWS; ++m) {
    const VecF dxv = vf_set1(dx[m * nb + b]);
    const VecI dot = _mm512_load_si512(dots[m]);
    if constexpr (FMT == Q4_K || FMT == Q5_K) {
      const VecF bs = vf_set1(bs32[m * nb + b]);
      const VecF term = vf_sub(vf_mul(vf_mul(block.scale, dxv), vf_from_i(dot)), vf_mul(vf_mul(block.min, dxv), bs));
      acc[m] = vf_add(acc[m], term);
    } else if constexpr (FMT == Q6_K) {
      const VecI idot = vi_add(vi_mullo(block.sc_lo, dot), vi_mullo(block.sc_hi, _mm512_load_si512(dots_hi[m])));
      acc[m] = vf_add(acc[m], vf_mul(vf_mul(block.scale, dxv), vf_from_i(idot)));
    } else if constexpr (FMT == Q8_0) {
      const VecI idot = vi_add(vi_set1(offset32[m * nb + b]), dot);
      acc[m] = vf_add(acc[m], vf_mul(vf_mul(scale_q8, dxv), vf_from_i(idot)));
    } else {
      acc[m] = vf_add(acc[m], vf_mul(vf_mul(block.scale, dxv), vf_from_i(dot)));
    }
  }
}

// A step is two tile products into the C pair (C0, C1): blocks 2s and 2s + 1 (Q6_K: block s's
// low and high half).
template <int FMT>
constexpr int64_t amx_steps(int64_t nblocks) {
  return FMT == Q6_K ? nblocks : (nblocks + 1) / 2;
}

// The tile instructions take register numbers as literals: PAIR 0 is C (0, 1), PAIR 1 is (2, 3).
template <int PAIR>
QD_INLINE void zero_pair() {
  if constexpr (PAIR == 0) {
    _tile_zero(0);
    _tile_zero(1);
  } else {
    _tile_zero(2);
    _tile_zero(3);
  }
}

// C += A . B: signed bytes times signed (Q8_0: unsigned) bytes.
#define QD_TILE_DOT(FMT, c, a, b) \
  do {                            \
    if constexpr (FMT == Q8_0)    \
      _tile_dpbsud(c, a, b);      \
    else                          \
      _tile_dpbssd(c, a, b);      \
  } while (0)

// The first product of a step (A tmm4, B tmm6) into the pair's first C, the second (tmm5,
// tmm7) into its second.
template <int FMT, int PAIR, bool SECOND>
QD_INLINE void tile_dot() {
  if constexpr (!SECOND && PAIR == 0) QD_TILE_DOT(FMT, 0, 4, 6);
  else if constexpr (!SECOND) QD_TILE_DOT(FMT, 2, 4, 6);
  else if constexpr (PAIR == 0) QD_TILE_DOT(FMT, 1, 5, 7);
  else QD_TILE_DOT(FMT, 3, 5, 7);
}
#undef QD_TILE_DOT

template <int FMT, int PAIR>
QD_INLINE void amx_issue(const AmxBlock* blocks, int64_t nblocks, const int8_t* a, int64_t K, int64_t step) {
  zero_pair<PAIR>();
  if constexpr (FMT == Q6_K) {
    _tile_loadd(4, a + 32 * step, K);
    _tile_loadd(6, blocks[step].b, 64);
    _tile_loadd(5, a + 32 * step + 16, K);
    _tile_loadd(7, blocks[step].b + 256, 64);
    tile_dot<FMT, PAIR, false>();
    tile_dot<FMT, PAIR, true>();
  } else {
    const int64_t b = 2 * step;
    if constexpr (FMT == Q8_0)  // weights read in place: 4 KiB ahead, as in group_rows
      for (int64_t off = 0; off < 2 * kTileBytes[FMT]; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blocks[b].b + kPrefetchBytes + off), _MM_HINT_T0);
    _tile_loadd(4, a + 32 * b, K);
    _tile_loadd(6, blocks[b].b, 64);
    tile_dot<FMT, PAIR, false>();
    if (b + 1 < nblocks) {
      _tile_loadd(5, a + 32 * (b + 1), K);
      _tile_loadd(7, blocks[b + 1].b, 64);
      tile_dot<FMT, PAIR, true>();
    }
  }
}

template <int FMT, int ROWS>
QD_INLINE void amx_step_epilogue(const AmxBlock* blocks, int64_t nblocks, const int32_t (*dots)[kAmxRows][16],
                                 const float* dx, const int32_t* offset32, const float* bs32, int64_t step,
                                 VecF* acc) {
  if constexpr (FMT == Q6_K) {
    amx_epilogue<FMT, ROWS>(blocks[step], dots[0], dots[1], dx, offset32, bs32, nblocks, step, acc);
  } else {
    amx_epilogue<FMT, ROWS>(blocks[2 * step], dots[0], nullptr, dx, offset32, bs32, nblocks, 2 * step, acc);
    if (2 * step + 1 < nblocks)
      amx_epilogue<FMT, ROWS>(blocks[2 * step + 1], dots[1], nullptr, dx, offset32, bs32, nblocks, 2 * step + 1, acc);
  }
}

// Rows m0..m0+15 of x against one decoded group: all K, blocks in order, then the valid rows
// and outputs stored.  Steps alternate between the C pairs (0, 1) and (2, 3), so the tiles
// compute step s + 1 while the vector units run step s's epilogue.  The epilogue, the larger
// share of the work, runs for the first ROWS rows only (8 where no more are valid).
template <int FMT, int ROWS>
void amx_row_block(const AmxBlock* blocks, int64_t nblocks, const PaddedRows& x, int64_t m0, float* out, int64_t ldo,
                   int64_t n0, int64_t nvalid) {
  alignas(64) int32_t dots[2][2][kAmxRows][16];
  VecF acc[ROWS];
  QD_UNROLL
  for (int m = 0; m < ROWS; ++m) acc[m] = vf_zero();
  const int64_t K = x.K, nb = K / 32, steps = amx_steps<FMT>(nblocks);
  const int8_t* a = x.q.data() + m0 * K;
  const float* dx = x.dx.data() + m0 * nb;
  const int32_t* offset32 = x.offset32.data() + m0 * nb;
  const float* bs32 = x.bs32.data() + m0 * nb;
  amx_issue<FMT, 0>(blocks, nblocks, a, K, 0);
  for (int64_t s = 0; s < steps; s += 2) {
    _tile_stored(0, dots[0][0], 64);
    _tile_stored(1, dots[0][1], 64);
    if (s + 1 < steps) amx_issue<FMT, 1>(blocks, nblocks, a, K, s + 1);
    amx_step_epilogue<FMT, ROWS>(blocks, nblocks, dots[0], dx, offset32, bs32, s, acc);
    if (s + 1 >= steps) break;
    _tile_stored(2, dots[1][0], 64);
    _tile_stored(3, dots[1][1], 64);
    if (s + 2 < steps) amx_issue<FMT, 0>(blocks, nblocks, a, K, s + 2);
    amx_step_epilogue<FMT, ROWS>(blocks, nblocks, dots[1], dx, offset32, bs32, s + 1, acc);
  }
  const int64_t rows = std::min<int64_t>(ROWS, x.M - m0);
  for (int64_t m = 0; m < rows; ++m) store_lanes(out + (m0 + m) * ldo + n0, acc[m], nvalid);
}

// Rows 0..amx_rows-1 (whole 16-row blocks, the last one possibly partial) on the tiles; the rows
// after them, fewer than a block, by the VNNI kernel on each group while its weights are in cache.
template <int FMT>
void amx_run_all(const uint8_t* packed, int64_t N, int64_t K, const QRows& rows, int64_t M, int64_t amx_rows,
                 float* out, int64_t ldo, int64_t col0) {
  const PaddedRows x = pad_rows(rows, amx_rows);
  const int64_t groups = (N + 15) / 16, ntiles = K / kTileK[FMT], nblocks = K / 32;
  const int64_t group_bytes = ntiles * kTileBytes[FMT];
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / std::max<int64_t>(1, group_bytes));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    const TileConfig config = tile_config(FMT == Q6_K ? 16 : 32);
    _tile_loadconfig(&config);  // per thread state
    std::vector<AmxBlock> blocks(nblocks);
    for (int64_t g = g0; g < g1; ++g) {
      decode_group<FMT>(packed + g * group_bytes, ntiles, blocks.data());
      const int64_t n0 = col0 + 16 * g, nvalid = std::min<int64_t>(16, N - 16 * g);
      for (int64_t m0 = 0; m0 < x.Mp; m0 += kAmxRows) {
        if (x.M - m0 <= 8)
          amx_row_block<FMT, 8>(blocks.data(), nblocks, x, m0, out, ldo, n0, nvalid);
        else
          amx_row_block<FMT, kAmxRows>(blocks.data(), nblocks, x, m0, out, ldo, n0, nvalid);
      }
      if (amx_rows < M) run_group<FMT>(packed + g * group_bytes, ntiles, rows, M, out, ldo, n0, nvalid, amx_rows);
    }
    _tile_release();
  });
}

#pragma GCC pop_options
#endif  // !QD_ISA_AVX2

// run_all for a format known at run time.  Each block of 16 rows (the last one: the rows left)
// runs on AMX tiles when it has at least amx_min_rows rows (0: never), else on VNNI: 20 rows are
// a block on the tiles and 4 rows on VNNI, faster than either kernel for all 20.
inline void run_format(int64_t format, const uint8_t* packed, int64_t N, int64_t K, const QRows& x, int64_t M,
                       float* out, int64_t ldo, int64_t col0, int64_t amx_min_rows) {
  TORCH_CHECK(!float16_format(format) || x.xf != nullptr, "F16 / BF16 weights need the float rows of x");
#if !defined(QD_ISA_AVX2)
  const int64_t tail = M % kAmxRows, amx_rows = tail >= amx_min_rows ? M : M - tail;
  if (amx_format(format) && amx_min_rows > 0 && amx_min_rows <= kAmxRows && amx_rows > 0 && amx_usable()) {
    switch (format) {
      case Q8_0: return amx_run_all<Q8_0>(packed, N, K, x, M, amx_rows, out, ldo, col0);
      case Q4_0: return amx_run_all<Q4_0>(packed, N, K, x, M, amx_rows, out, ldo, col0);
      case Q5_0: return amx_run_all<Q5_0>(packed, N, K, x, M, amx_rows, out, ldo, col0);
      case Q4_K: return amx_run_all<Q4_K>(packed, N, K, x, M, amx_rows, out, ldo, col0);
      case Q5_K: return amx_run_all<Q5_K>(packed, N, K, x, M, amx_rows, out, ldo, col0);
      default: return amx_run_all<Q6_K>(packed, N, K, x, M, amx_rows, out, ldo, col0);  // Q6_K
    }
  }
#endif
  switch (format) {
    case Q8_0: run_all<Q8_0>(packed, N, K, x, M, out, ldo, col0); break;
    case Q4_0: run_all<Q4_0>(packed, N, K, x, M, out, ldo, col0); break;
    case Q5_0: run_all<Q5_0>(packed, N, K, x, M, out, ldo, col0); break;
    case Q4_K: run_all<Q4_K>(packed, N, K, x, M, out, ldo, col0); break;
    case Q5_K: run_all<Q5_K>(packed, N, K, x, M, out, ldo, col0); break;
    case Q6_K: run_all<Q6_K>(packed, N, K, x, M, out, ldo, col0); break;
    case IQ4_XS: run_all<IQ4_XS>(packed, N, K, x, M, out, ldo, col0); break;
    case IQ4_NL: run_all<IQ4_NL>(packed, N, K, x, M, out, ldo, col0); break;
    case MXFP4: run_all<MXFP4>(packed, N, K, x, M, out, ldo, col0); break;
    case Q3_K: run_all<Q3_K>(packed, N, K, x, M, out, ldo, col0); break;
    case Q4_1: run_all<Q4_1>(packed, N, K, x, M, out, ldo, col0); break;
    case Q5_1: run_all<Q5_1>(packed, N, K, x, M, out, ldo, col0); break;
    case Q2_K: run_all<Q2_K>(packed, N, K, x, M, out, ldo, col0); break;
    case F16: run_all<F16>(packed, N, K, x, M, out, ldo, col0); break;
    default: run_all<BF16>(packed, N, K, x, M, out, ldo, col0); break;
  }
}

#pragma GCC pop_options
#undef QD_UNROLL
#undef QD_INLINE

// ------------------------------------------------------------------------------------------
// Torch binding
// ------------------------------------------------------------------------------------------

// Quants within +-levels: 127, or 63 for the narrow quants that Q8_0's AVX2 step multiplies
// without a sign flip (QRows::offset128).
std::vector<at::Tensor> quantize_rows(const at::Tensor& x_in, int64_t levels) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "quantize_rows: x must be float32 [M, K]");
  TORCH_CHECK(levels == 127 || levels == 63, "quantize_rows: levels must be 127 or 63, got ", levels);
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "quantize_rows: K must be a multiple of 32, got ", K);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor dx = at::empty({M, K / 32}, x.options());
  at::Tensor bsum = at::empty({M, K / 16}, x.options().dtype(at::kInt));
  const float* xp = x.const_data_ptr<float>();
  auto* qp = q.mutable_data_ptr<int8_t>();
  auto* dp = dx.mutable_data_ptr<float>();
  auto* bp = bsum.mutable_data_ptr<int32_t>();
  quantize_rows_into(xp, M, K, qp, dp, bp, levels);
  return {q, dx, bsum};
}

// The checks quant_matmul and float16_matmul share: this CPU runs the build, `packed` holds W
// [N, K] in `format`, out is a contiguous float32 [M, >= col0 + N]; `name` starts each message.
void check_packed_matmul(const char* name, const at::Tensor& packed, int64_t format, int64_t N, int64_t K, int64_t M,
                         const at::Tensor& out, int64_t col0) {
  TORCH_CHECK(cpu_supported(), name, ": this CPU lacks the instructions of the ", kIsa, " build");
  TORCH_CHECK(packed.is_contiguous() && out.is_contiguous(), name, ": tensors must be contiguous");
  TORCH_CHECK(K % kTileK[format] == 0, name, ": K = ", K, " is not a multiple of ", kTileK[format]);
  const int64_t expected = (N + 15) / 16 * (K / kTileK[format]) * kTileBytes[format];
  TORCH_CHECK(packed.numel() == expected, name, ": packed weight has ", packed.numel(), " bytes, expected ", expected);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && col0 >= 0 && col0 + N <= out.size(1) &&
                  out.scalar_type() == at::kFloat, name, ": bad output tensor");
}

// out[:, col0 : col0 + N] = x @ W^T, W packed in `format`.  out is [M, ldo] float32, written in
// place (so a fused weight made of parts in different formats fills one output).
// x_levels: the levels quantize_rows made q with (63: narrow quants, see QRows::offset128).
void quant_matmul(const at::Tensor& q, const at::Tensor& dx, const at::Tensor& bsum, const at::Tensor& packed,
                  int64_t format, int64_t N, int64_t K, at::Tensor& out, int64_t col0, int64_t amx_min_rows,
                  int64_t x_levels) {
  TORCH_CHECK(format >= 0 && format <= kLastFormat, "quant_matmul: unknown format ", format);
  TORCH_CHECK(x_levels == 127 || x_levels == 63, "quant_matmul: x_levels must be 127 or 63, got ", x_levels);
  TORCH_CHECK(q.is_contiguous() && dx.is_contiguous() && bsum.is_contiguous(), "quant_matmul: tensors must be contiguous");
  TORCH_CHECK(q.dim() == 2 && q.size(1) == K, "quant_matmul: activations do not match K");
  const int64_t M = q.size(0);
  check_packed_matmul("quant_matmul", packed, format, N, K, M, out, col0);
  if (M == 0 || N == 0) return;
  // Narrow quants meet the stored unsigned Q8_0 quants as they are (AVX2): each block's dot
  // starts at -128 * its quant sum, read from memory (a broadcast load, no arithmetic per tile).
  std::vector<int32_t> offset128;
  const int32_t* bsum_p = bsum.const_data_ptr<int32_t>();
  if (x_levels == 63) {
    offset128.resize(M * (K / 32));
    for (int64_t i = 0; i < M * (K / 32); ++i) offset128[i] = -128 * (bsum_p[2 * i] + bsum_p[2 * i + 1]);
  }
  const QRows x{q.const_data_ptr<int8_t>(), dx.const_data_ptr<float>(), bsum_p, K, nullptr,
                offset128.empty() ? nullptr : offset128.data()};
  run_format(format, packed.const_data_ptr<uint8_t>(), N, K, x, M, out.mutable_data_ptr<float>(), out.size(1), col0,
             amx_min_rows);
}

// out[:, col0 : col0 + N] = x @ W^T for W packed in F16 or BF16 (x [M, K] float32, as it is).
void float16_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t N, int64_t K,
                    at::Tensor& out, int64_t col0) {
  TORCH_CHECK(float16_format(format), "float16_matmul: format ", format, " is not F16 or BF16");
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kFloat,
              "float16_matmul: x must be a contiguous float32 [M, K]");
  const int64_t M = x.size(0);
  check_packed_matmul("float16_matmul", packed, format, N, K, M, out, col0);
  if (M == 0 || N == 0) return;
  const QRows rows{nullptr, nullptr, nullptr, K, x.const_data_ptr<float>()};
  run_format(format, packed.const_data_ptr<uint8_t>(), N, K, rows, M, out.mutable_data_ptr<float>(), out.size(1), col0,
             0);
}

// IEEE half -> float, exact for every value (subnormals, infinities and NaNs included).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: shift the mantissa up to its leading one
    uint32_t m = mantissa, shift = 0;
    while ((m & 0x400u) == 0) m <<= 1, ++shift;
    bits = sign | ((113 - shift) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// One row of a Q8_0 (544-byte tiles: 8 steps x 16 rows x 4 quants stored + 128, then the 16 rows'
// fp16 scales: float(d) * (q - 128), the GGUF file's float32 values) or F16 / BF16 weight (1024-byte
// tiles: 32 k x 16 rows of 2 bytes, exactly the stored values) -> dst [K].
inline void dequantize_row(int64_t format, const uint8_t* group, int64_t lane, int64_t K, float* dst) {
  for (int64_t t = 0; t < K / 32; ++t, dst += 32) {
    const uint8_t* tile = group + t * kTileBytes[format];
    uint16_t bits;
    if (format == Q8_0) {
      std::memcpy(&bits, tile + 512 + 2 * lane, sizeof bits);
      const float d = half_to_float(bits);
      for (int k = 0; k < 32; ++k) dst[k] = d * (static_cast<float>(tile[64 * (k / 4) + 4 * lane + k % 4]) - 128.0f);
      continue;
    }
    for (int k = 0; k < 32; ++k) {
      std::memcpy(&bits, tile + 32 * k + 2 * lane, sizeof bits);
      const uint32_t wide = static_cast<uint32_t>(bits) << 16;  // BF16: the float's high half
      if (format == F16)
        dst[k] = half_to_float(bits);
      else
        std::memcpy(dst + k, &wide, sizeof wide);
    }
  }
}

// Rows `index` [n] of a Q8_0, F16 or BF16 weight [N, K] packed for the kernels -> [n, K] float32.
// An embedding lookup or a draft head's input: one row costs ~1 us here, ~30 us through numpy.
at::Tensor dequantize_rows(const at::Tensor& packed, int64_t format, int64_t N, int64_t K, const at::Tensor& index_in) {
  TORCH_CHECK(format == Q8_0 || float16_format(format), "dequantize_rows: format ", format, " is not Q8_0, F16 or BF16");
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kByte, "dequantize_rows: bad packed bytes");
  TORCH_CHECK(K % 32 == 0 && packed.numel() == (N + 15) / 16 * (K / 32) * kTileBytes[format],
              "dequantize_rows: packed weight does not match [", N, ", ", K, "]");
  const at::Tensor index = index_in.to(at::kLong).contiguous();
  const int64_t n = index.numel();
  at::Tensor out = at::empty({n, K}, at::kFloat);
  const auto* w = packed.const_data_ptr<uint8_t>();
  const int64_t* rows = index.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = rows[i];
    TORCH_CHECK_INDEX(r >= 0 && r < N, "row index ", r, " out of range for a weight of ", N, " rows");
    const uint8_t* group = w + (r / 16) * (K / 32) * kTileBytes[format];
    dequantize_row(format, group, r % 16, K, out.mutable_data_ptr<float>() + i * K);
  }
  return out;
}

// ------------------------------------------------------------------------------------------
// One decoder layer in one call (decoding and verification on quantized weights)
// ------------------------------------------------------------------------------------------
// The Python layer makes ~50 small torch calls per layer (norms, rope, splits, the KV write,
// attention, activations, four matmuls with their activation quantization); each costs
// microseconds of dispatch, which at batch 1 is a third of a decode step.  This is the same
// layer as quickdraft/models/decoder.py's DecoderLayer for quantized weights (LayerExtras below),
// every row computed on its own (batch-invariant like the kernels it calls).  Both builds have
// it: the norms, activations and attention rows are AVX-512 code (attention_row.h) in one, AVX2
// and FMA code (attention_row_avx2.h) in the other, each build with bits of its own.

using Part = std::tuple<int64_t, at::Tensor, int64_t, int64_t>;  // format, packed, rows, row_start

void matmul_parts(const std::vector<Part>& parts, const float* x, int64_t M, int64_t K, float* out, int64_t ldo,
                  std::vector<int8_t>& q, std::vector<float>& dx, std::vector<int32_t>& bsum, int64_t amx_min_rows) {
  // F16 / BF16 weights read x as it is: its int8 quants only where another format needs them
  const bool quantize = std::any_of(parts.begin(), parts.end(), [](const Part& p) { return !float16_format(std::get<0>(p)); });
  if (quantize) {
    q.resize(M * K);
    dx.resize(M * K / 32);
    bsum.resize(M * K / 16);
    quantize_rows_into(x, M, K, q.data(), dx.data(), bsum.data());
  }
  const QRows rows =
      quantize ? QRows{q.data(), dx.data(), bsum.data(), K, x} : QRows{nullptr, nullptr, nullptr, K, x};
  for (const auto& [format, packed, n, col0] : parts) {
    run_format(format, packed.const_data_ptr<uint8_t>(), n, K, rows, M, out, ldo, col0, amx_min_rows);
  }
}

#if defined(QD_ISA_AVX2)
#pragma GCC push_options
#pragma GCC target("avx2,fma")

// y = x / sqrt(mean(x^2) + eps) * w over one row of n values (n % 8 == 0; w null: no weight).
inline void rms_norm_row(const float* x, const float* w, int64_t n, float eps, float* y) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  const float sum = _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 0x55)));
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  for (int64_t i = 0; i < n; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), rv);
    if (w) v = _mm256_mul_ps(v, _mm256_loadu_ps(w + i));
    _mm256_storeu_ps(y + i, v);
  }
}

// sum_i a[i] * b[i] over n values (n % 8 == 0), lane by lane and then a fixed sum of the lanes:
// a mixture's router logits, the same bits for a row whatever rows share the call.
inline float dot_row(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 0x55)));
}

// act(gate) * up over n values (n % 8 == 0): GELU with the tanh approximation, or SiLU.
inline void gated_activation(const float* gate, const float* up, int64_t n, bool gelu, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f), two = _mm256_set1_ps(2.0f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    __m256 a;
    if (gelu) {
      const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
      const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                     _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), cube)));
      // tanh(u) = 1 - 2 / (exp(2u) + 1)
      const __m256 t = _mm256_sub_ps(
          one, _mm256_div_ps(two, _mm256_add_ps(qd_attention_avx2::exp8(_mm256_mul_ps(two, u)), one)));
      a = _mm256_mul_ps(_mm256_mul_ps(half, g), _mm256_add_ps(one, t));
    } else {
      a = _mm256_div_ps(g, _mm256_add_ps(one, qd_attention_avx2::exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    }
    _mm256_storeu_ps(out + i, _mm256_mul_ps(a, _mm256_loadu_ps(up + i)));
  }
}

#pragma GCC pop_options

inline int64_t attention_heads_per_call(int64_t group, int64_t rows_times_kv_heads, int64_t threads) {
  return qd_attention_avx2::heads_per_call(group, rows_times_kv_heads, threads);
}

using KvHalf = qd_attention_avx2::Float16;  // a float16 cache's element, as the attention rows read it

template <typename KV>
inline void attend_rows(int64_t G, const float* q, const KV* k, const KV* v, const int64_t* rows, int64_t S,
                        int64_t D, const bool* visible, AttentionScale scale, float* scores, float* out) {
  qd_attention_avx2::attend_heads_n(G, q, k, v, rows, S, D, visible, scale, scores, out);
}

namespace qd_attention_isa = qd_attention_avx2;  // this build's attention rows
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2")

// y = x / sqrt(mean(x^2) + eps) * w over one row of n values (n % 16 == 0; w null: no weight).
inline void rms_norm_row(const float* x, const float* w, int64_t n, float eps, float* y) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + eps);
  const __m512 rv = _mm512_set1_ps(r);
  for (int64_t i = 0; i < n; i += 16) {
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), rv);
    if (w) v = _mm512_mul_ps(v, _mm512_loadu_ps(w + i));
    _mm512_storeu_ps(y + i, v);
  }
}

// sum_i a[i] * b[i] over n values (n % 16 == 0), lane by lane and then a fixed sum of the lanes:
// a mixture's router logits, the same bits for a row whatever rows share the call.
inline float dot_row(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  return _mm512_reduce_add_ps(acc);
}

// act(gate) * up over n values (n % 16 == 0): GELU with the tanh approximation, or SiLU.
inline void gated_activation(const float* gate, const float* up, int64_t n, bool gelu, float* out) {
  const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f), two = _mm512_set1_ps(2.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    __m512 a;
    if (gelu) {
      const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
      const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                     _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(0.044715f), cube)));
      // tanh(u) = 1 - 2 / (exp(2u) + 1)
      const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(qd_attention::exp16(_mm512_mul_ps(two, u)), one)));
      a = _mm512_mul_ps(_mm512_mul_ps(half, g), _mm512_add_ps(one, t));
    } else {
      a = _mm512_div_ps(g, _mm512_add_ps(one, qd_attention::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    }
    _mm512_storeu_ps(out + i, _mm512_mul_ps(a, _mm512_loadu_ps(up + i)));
  }
}

#pragma GCC pop_options

inline int64_t attention_heads_per_call(int64_t group, int64_t rows_times_kv_heads, int64_t threads) {
  return qd_attention::heads_per_call(group, rows_times_kv_heads, threads);
}

using KvHalf = qd_attention::Float16;  // a float16 cache's element, as the attention rows read it

template <typename KV>
inline void attend_rows(int64_t G, const float* q, const KV* k, const KV* v, const int64_t* rows, int64_t S,
                        int64_t D, const bool* visible, AttentionScale scale, float* scores, float* out) {
  qd_attention::attend_heads_n(G, q, k, v, rows, S, D, visible, scale, scores, out);
}

namespace qd_attention_isa = qd_attention;  // this build's attention rows
#endif

inline int64_t shared_row_heads(int64_t group, int64_t D) { return qd_attention_isa::shared_heads(group, D); }

template <typename KV>
inline void attend_row_shared(int64_t G, const float* q, const KV* k, const KV* v, const int64_t* rows, int64_t S,
                              int64_t D, const bool* visible, AttentionScale scale, float* scores, float* out) {
  const auto parallel = [](int64_t b, int64_t e, int64_t grain, const auto& f) { at::parallel_for(b, e, grain, f); };
  qd_attention_isa::attend_heads_shared_n(G, q, k, v, rows, S, D, visible, scale, scores, out, parallel);
}

// f(n) for every row n < N.  Rows are independent and each is computed by the same operations
// whichever thread runs it; fewer than kRowsPerThread rows stay on one thread (a parallel
// region costs more than their work).
constexpr int64_t kRowsPerThread = 4;

template <typename F>
void for_rows(int64_t N, const F& f) {
  at::parallel_for(0, N, kRowsPerThread, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) f(n);
  });
}

// Rotary embedding of one head in place: v = v * cos + rotate_half(v) * sin (sin carries
// rotate_half's sign), as two halves so the compiler vectorizes it.
inline void rotate_head(float* v, const float* c, const float* s, int64_t hd, float* tmp) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < hd; ++i) tmp[i] = v[i];
  for (int64_t i = 0; i < half; ++i) v[i] = tmp[i] * c[i] + tmp[i + half] * s[i];
  for (int64_t i = half; i < hd; ++i) v[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
}

// A float buffer left uninitialized: zeroing a prefill's layer buffers (megabytes) took one
// thread longer than the rows' norms, and every element is written before it is read.
class Scratch {
 public:
  explicit Scratch(int64_t n) : values_(std::make_unique_for_overwrite<float[]>(n)) {}
  float* data() { return values_.get(); }
  float& operator[](int64_t i) { return values_[i]; }

 private:
  std::unique_ptr<float[]> values_;
};

// Query rows in the order 0, T-1, 1, T-2, ...: a parallel loop splits its range into one
// contiguous chunk per thread, and under a causal mask late rows attend to more keys.
inline int64_t zigzag(int64_t i, int64_t T) { return i % 2 == 0 ? i / 2 : T - 1 - i / 2; }

const float* opt_ptr(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->const_data_ptr<float>() : nullptr;
}

// A sequence's attention mask [rows, keys], or null where it has none (it sees every key).
const bool* mask_ptr(const c10::optional<at::Tensor>& mask) {
  return mask.has_value() && mask->defined() ? mask->const_data_ptr<bool>() : nullptr;
}

// A new key or value row into the cache: as it is, or rounded to half (to nearest, once).
inline void store_kv_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_kv_row(KvHalf* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i].bits = c10::Half(src[i]).x;
}

// One attention work item: query row t of a sequence, G heads from `head`.
struct AttentionItem {
  int64_t seq, t, head;
};

// Every query row of every sequence, each row's G heads at a time with its keys and columns
// shared between the threads (attend_row_shared): for a batch with fewer (row, key head) pairs
// than threads, a batch-1 decode above all.  The same bits as attend_sequences's items.
template <typename KV, typename Offset>
void attend_rows_shared(const float* qkv, const KV* kc, const KV* vc, const std::vector<int64_t>& seqs,
                        const std::vector<c10::optional<at::Tensor>>& masks, const Offset& offset, int64_t H,
                        int64_t Hkv, int64_t hd, int64_t QKV, AttentionScale scale, int64_t G, float* attended) {
  const int64_t group = H / Hkv;
  for (int64_t b = 0; b < static_cast<int64_t>(masks.size()); ++b) {
    const int64_t ts = seqs[5 * b], r0 = seqs[5 * b + 1], r1 = seqs[5 * b + 2];
    const int64_t kv_start = seqs[5 * b + 3], S = seqs[5 * b + 4] - kv_start;
    const bool* mask = mask_ptr(masks[b]);
    std::vector<int64_t> rows(S);
    std::vector<float> scores(G * S + 16);
    for (int64_t g = 0; g < Hkv; ++g) {
      for (int64_t s = 0; s < S; ++s) rows[s] = offset(ts, g, kv_start + s);
      for (int64_t t = 0; t < r1 - r0; ++t)
        for (int64_t head = g * group; head < (g + 1) * group; head += G)
          attend_row_shared(G, qkv + (r0 + t) * QKV + head * hd, kc, vc, rows.data(), S, hd,
                            mask ? mask + t * S : nullptr, scale.at_head(head), scores.data(), attended + (r0 + t) * H * hd + head * hd);
    }
  }
}

// Attention of every query row of every sequence, in one parallel region: a region per
// sequence cost more than a decode row's work (32 decodes over 150 keys: 3.1 -> 2.2 ms a layer
// with one region, fewer key reads included).  Each
// (row, G heads) is one attend_rows call whatever the chunking, so the split changes no bit.
// G follows the layer's rows (N), not a sequence's: a batch of decodes has enough items to keep
// every thread busy with its heads together, so the keys are read once per row, not per head.
// Items go to threads in contiguous runs of about equal keys read.
template <typename KV, typename Offset>
void attend_sequences(const float* qkv, const KV* kc, const KV* vc, const std::vector<int64_t>& seqs,
                      const std::vector<c10::optional<at::Tensor>>& masks,
                      const Offset& offset, int64_t N, int64_t H, int64_t Hkv, int64_t hd, int64_t QKV, AttentionScale scale,
                      float* attended) {
  const int64_t num_seqs = static_cast<int64_t>(masks.size()), group = H / Hkv;
  const int64_t threads = at::get_num_threads();
  const int64_t shared_G = shared_row_heads(group, hd);
  if (N * Hkv < threads && shared_G > 0) {  // fewer (row, key head) pairs than threads: share each
    attend_rows_shared(qkv, kc, vc, seqs, masks, offset, H, Hkv, hd, QKV, scale, shared_G, attended);
    return;
  }
  const int64_t G = attention_heads_per_call(group, N * Hkv, threads), calls = H / G;
  std::vector<int64_t> rows_at(num_seqs + 1, 0);  // where each sequence's key offsets start in `rows`
  int64_t max_keys = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t S = seqs[5 * b + 4] - seqs[5 * b + 3];
    rows_at[b + 1] = rows_at[b] + Hkv * S;
    max_keys = std::max(max_keys, S);
  }
  std::vector<int64_t> rows(rows_at[num_seqs]);  // per sequence and key head, where each key row lies
  std::vector<AttentionItem> items;
  std::vector<int64_t> work_before;  // keys read by the items before each one (and the total last)
  work_before.push_back(0);
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t ts = seqs[5 * b], r0 = seqs[5 * b + 1], r1 = seqs[5 * b + 2];
    const int64_t kv_start = seqs[5 * b + 3], S = seqs[5 * b + 4] - kv_start, T = r1 - r0;
    for (int64_t g = 0; g < Hkv; ++g)
      for (int64_t s = 0; s < S; ++s) rows[rows_at[b] + g * S + s] = offset(ts, g, kv_start + s);
    for (int64_t i = 0; i < T * calls; ++i) {
      items.push_back({b, zigzag(i / calls, T), (i % calls) * G});
      work_before.push_back(work_before.back() + S * G);
    }
  }
  const int64_t total = work_before.back();
  // At least ~64k floats of keys per thread: below that a region costs more than it saves.
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(threads, total * hd / (1 << 16)));
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> scores(G * max_keys + 16);
    for (int64_t c = c0; c < c1; ++c) {
      // items whose work starts in this chunk's share of the total (the search stops at the
      // items, so the last chunk ends after the last item)
      const auto starts_from = [&](int64_t share) {
        return std::lower_bound(work_before.begin(), work_before.end() - 1, share) - work_before.begin();
      };
      const int64_t first = starts_from(total * c / chunks), last = starts_from(total * (c + 1) / chunks);
      for (int64_t i = first; i < last; ++i) {
        const auto [b, t, head] = items[i];
        const int64_t r0 = seqs[5 * b + 1], S = seqs[5 * b + 4] - seqs[5 * b + 3], g = head / group;
        const bool* mask = mask_ptr(masks[b]);
        attend_rows(G, qkv + (r0 + t) * QKV + head * hd, kc, vc, rows.data() + rows_at[b] + g * S, S, hd,
                    mask ? mask + t * S : nullptr, scale.at_head(head), scores.data(), attended + (r0 + t) * H * hd + head * hd);
      }
    }
  });
}

// LoRA adapters (quickdraft/models/lora.py): per slot, per site (qkv, o_proj, gate_up, down), the
// parts out[:, col0 : col0 + n] += (x a_t) b_t of the modules it targets: a_t [K, r] and b_t [r, n]
// float32 (the scale folded in).  row_slots [N]: each row's slot, -1 for none.
struct LoraPart {
  at::Tensor a_t, b_t;
  int64_t col0;
};
constexpr int kLoraSites = 4;
using LoraSites = std::array<std::vector<LoraPart>, kLoraSites>;
struct LoraRows {
  const std::vector<LoraSites>* slots;  // by slot
  const int64_t* row_slots;             // [N]
};

// The deltas of one part for `count` rows of one adapter: per row u = x a_t (k after k), then
// delta = u b_t (r after r), added to its output.  The rows share each read of a_t's and b_t's
// rows (an adapter's weights are ~0.8 MB a layer: read once for a verified tree, not once per
// node), yet every row's sums run in the same order as alone: its bits do not depend on the rows
// beside it.  The loops vectorize across r and across outputs, never across a sum.
#pragma GCC push_options
#if defined(QD_ISA_AVX2)
#pragma GCC target("avx2")
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2")
#endif
void lora_rows(const float* __restrict a, const float* __restrict b, int64_t K, int64_t r, int64_t m,
               const float* x, int64_t ldx, const int64_t* rows, int64_t count, float* out, int64_t ldo,
               float* __restrict u, float* __restrict delta) {
  for (int64_t i = 0; i < count * r; ++i) u[i] = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    const float* __restrict ak = a + k * r;
    for (int64_t c = 0; c < count; ++c) {
      const float xk = x[rows[c] * ldx + k];
      float* __restrict uc = u + c * r;
      for (int64_t i = 0; i < r; ++i) uc[i] += ak[i] * xk;
    }
  }
  for (int64_t j = 0; j < count * m; ++j) delta[j] = 0.0f;
  for (int64_t i = 0; i < r; ++i) {
    const float* __restrict bi = b + i * m;
    for (int64_t c = 0; c < count; ++c) {
      const float ui = u[c * r + i];
      float* __restrict dc = delta + c * m;
      for (int64_t j = 0; j < m; ++j) dc[j] += bi[j] * ui;
    }
  }
  for (int64_t c = 0; c < count; ++c) {
    float* o = out + rows[c] * ldo;
    const float* dc = delta + c * m;
    for (int64_t j = 0; j < m; ++j) o[j] += dc[j];
  }
}
#pragma GCC pop_options

// lora_rows for r % 8 == 0 and m % 32 == 0 (every adapter part of the supported models but odd
// ranks), in fused multiply-adds with more independent sums: per row, u's vector v sums the k of
// each residue mod 4 apart, then adds the four ((0 + 1) + (2 + 3)); delta's outputs sum their r
// products in order, 64 (else 32) outputs at a time; both orders are fixed per row, so a row's
// bits still do not depend on the rows beside it, and the part always takes this path.  The rows
// of the group reuse each block of b_t from L1.
#pragma GCC push_options
#pragma GCC target("avx2,fma")
template <int NV>
void lora_down_fma(const float* __restrict a, int64_t K, const float* xc, float* __restrict uc) {
  __m256 acc[4][NV];
  for (int p = 0; p < 4; ++p)
    for (int v = 0; v < NV; ++v) acc[p][v] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 4 <= K; k += 4)
    for (int p = 0; p < 4; ++p) {
      const __m256 xk = _mm256_set1_ps(xc[k + p]);
      const float* ak = a + (k + p) * 8 * NV;
      for (int v = 0; v < NV; ++v) acc[p][v] = _mm256_fmadd_ps(_mm256_loadu_ps(ak + 8 * v), xk, acc[p][v]);
    }
  for (; k < K; ++k) {
    const __m256 xk = _mm256_set1_ps(xc[k]);
    for (int v = 0; v < NV; ++v) acc[0][v] = _mm256_fmadd_ps(_mm256_loadu_ps(a + k * 8 * NV + 8 * v), xk, acc[0][v]);
  }
  for (int v = 0; v < NV; ++v)
    _mm256_storeu_ps(uc + 8 * v, _mm256_add_ps(_mm256_add_ps(acc[0][v], acc[1][v]), _mm256_add_ps(acc[2][v], acc[3][v])));
}

template <int JB>
void lora_up_fma(const float* __restrict b, int64_t r, int64_t m, const float* __restrict u, const int64_t* rows,
                 int64_t count, float* out, int64_t ldo) {
  for (int64_t j0 = 0; j0 < m; j0 += 8 * JB)
    for (int64_t c = 0; c < count; ++c) {
      __m256 acc[JB];
      for (int v = 0; v < JB; ++v) acc[v] = _mm256_setzero_ps();
      for (int64_t i = 0; i < r; ++i) {
        const __m256 ui = _mm256_set1_ps(u[c * r + i]);
        const float* bi = b + i * m + j0;
        for (int v = 0; v < JB; ++v) acc[v] = _mm256_fmadd_ps(_mm256_loadu_ps(bi + 8 * v), ui, acc[v]);
      }
      float* o = out + rows[c] * ldo + j0;
      for (int v = 0; v < JB; ++v) _mm256_storeu_ps(o + 8 * v, _mm256_add_ps(_mm256_loadu_ps(o + 8 * v), acc[v]));
    }
}

template <int NV>
void lora_rows_fma(const float* a, const float* b, int64_t K, int64_t r, int64_t m, const float* x, int64_t ldx,
                   const int64_t* rows, int64_t count, float* out, int64_t ldo, float* u) {
  for (int64_t c = 0; c < count; ++c) lora_down_fma<NV>(a, K, x + rows[c] * ldx, u + c * r);
  if (m % 64 == 0)
    lora_up_fma<8>(b, r, m, u, rows, count, out, ldo);
  else
    lora_up_fma<4>(b, r, m, u, rows, count, out, ldo);
}
#pragma GCC pop_options

// The path a part takes: fixed by its shape alone.
bool lora_fma_path(int64_t r, int64_t m) { return r % 8 == 0 && r <= 64 && m % 32 == 0; }

void lora_rows_fast(const float* a, const float* b, int64_t K, int64_t r, int64_t m, const float* x, int64_t ldx,
                    const int64_t* rows, int64_t count, float* out, int64_t ldo, float* u) {
  switch (r / 8) {
    case 1: return lora_rows_fma<1>(a, b, K, r, m, x, ldx, rows, count, out, ldo, u);
    case 2: return lora_rows_fma<2>(a, b, K, r, m, x, ldx, rows, count, out, ldo, u);
    case 3: return lora_rows_fma<3>(a, b, K, r, m, x, ldx, rows, count, out, ldo, u);
    case 4: return lora_rows_fma<4>(a, b, K, r, m, x, ldx, rows, count, out, ldo, u);
    case 5: return lora_rows_fma<5>(a, b, K, r, m, x, ldx, rows, count, out, ldo, u);
    case 6: return lora_rows_fma<6>(a, b, K, r, m, x, ldx, rows, count, out, ldo, u);
    case 7: return lora_rows_fma<7>(a, b, K, r, m, x, ldx, rows, count, out, ldo, u);
    default: return lora_rows_fma<8>(a, b, K, r, m, x, ldx, rows, count, out, ldo, u);
  }
}

constexpr int64_t kLoraRowsAtOnce = 8;

// Adds site's deltas to the rows that run an adapter: the rows of each slot in groups of up to
// kLoraRowsAtOnce, the groups spread over the threads.
void add_lora(const LoraRows* lora, int site, const float* x, int64_t N, int64_t K, float* out, int64_t ldo) {
  if (lora == nullptr) return;
  std::vector<std::vector<int64_t>> by_slot(lora->slots->size());
  for (int64_t n = 0; n < N; ++n)
    if (lora->row_slots[n] >= 0) by_slot[lora->row_slots[n]].push_back(n);
  std::vector<std::pair<int64_t, int64_t>> groups;  // (slot, first index into by_slot[slot])
  for (size_t slot = 0; slot < by_slot.size(); ++slot)
    for (size_t first = 0; first < by_slot[slot].size(); first += kLoraRowsAtOnce)
      groups.emplace_back(static_cast<int64_t>(slot), static_cast<int64_t>(first));
  at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> scratch;
    for (int64_t g = g0; g < g1; ++g) {
      const auto [slot, first] = groups[g];
      const std::vector<int64_t>& rows = by_slot[slot];
      const int64_t count = std::min<int64_t>(kLoraRowsAtOnce, static_cast<int64_t>(rows.size()) - first);
      for (const LoraPart& part : (*lora->slots)[slot][site]) {
        const int64_t r = part.a_t.size(1), m = part.b_t.size(1);
        scratch.resize(count * (r + m));
        const float* a = part.a_t.const_data_ptr<float>();
        const float* b = part.b_t.const_data_ptr<float>();
        if (lora_fma_path(r, m))
          lora_rows_fast(a, b, K, r, m, x, K, rows.data() + first, count, out + part.col0, ldo, scratch.data());
        else
          lora_rows(a, b, K, r, m, x, K, rows.data() + first, count, out + part.col0, ldo, scratch.data(),
                    scratch.data() + count * r);
      }
    }
  });
}

// What some layers have beside their weights and norms, each a float32 vector or undefined: the
// biases of their matmuls (Qwen2's q/k/v; o_proj or the MLP in others; a gpt-oss expert's gate_up
// and down), each [its output width], and gpt-oss's attention sinks [H].  As torch's linear does,
// a bias is added to each row's product before the row's adapters: a row's value is its own
// whatever rows share the call.
struct LayerExtras {
  at::Tensor qkv, o_proj, gate_up, down, sinks;
};

LayerExtras make_layer_extras(const c10::optional<at::Tensor>& qkv, const c10::optional<at::Tensor>& o_proj,
                              const c10::optional<at::Tensor>& gate_up, const c10::optional<at::Tensor>& down,
                              const c10::optional<at::Tensor>& sinks) {
  auto checked = [](const c10::optional<at::Tensor>& b, const char* site) {
    if (!b.has_value() || !b->defined()) return at::Tensor();
    TORCH_CHECK(b->scalar_type() == at::kFloat && b->dim() == 1, "LayerExtras: ", site,
                " must be a 1-d float32 tensor");
    return b->contiguous();
  };
  return LayerExtras{checked(qkv, "the qkv bias"), checked(o_proj, "the o_proj bias"),
                     checked(gate_up, "the gate_up bias"), checked(down, "the down bias"), checked(sinks, "sinks")};
}

// gpt-oss's activation of an expert's gate and up halves: gate clamped to <= limit, up to
// [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate), value by value (std::exp).
struct SwigluOai {
  float limit, alpha;

  void operator()(const float* gate, const float* up, int64_t n, float* out) const {
    for (int64_t i = 0; i < n; ++i) {
      const float g = std::min(gate[i], limit), u = std::min(std::max(up[i], -limit), limit);
      out[i] = (u + 1.0f) * (g * (1.0f / (1.0f + std::exp(-(g * alpha)))));
    }
  }
};

// out [N, M] += bias [M] on every row; nothing for an undefined bias.
void add_bias(const at::Tensor& bias, float* out, int64_t N, int64_t M) {
  if (!bias.defined()) return;
  TORCH_CHECK(bias.numel() == M, "decoder_layer: a bias of ", bias.numel(), " values for a matmul of ", M);
  const float* b = bias.const_data_ptr<float>();
  for_rows(N, [&](int64_t n) {
    float* o = out + n * M;
    for (int64_t m = 0; m < M; ++m) o[m] = o[m] + b[m];
  });
}

// The gated MLP of rows x [N, D] -> out [N, D]: gate_up, the activation, down, each matmul
// followed by its bias and the rows' adapters where given (a dense layer's MLP; a mixture's
// experts have neither).  gate_up [N, 2I] and act [N, I] are scratch; act may be x (read before
// it is written).
void gated_mlp(const std::vector<Part>& gate_up_w, const std::vector<Part>& down_w, const float* x, int64_t N,
               int64_t D, int64_t I, bool gelu, float* gate_up, float* act, float* out, std::vector<int8_t>& q8,
               std::vector<float>& dx, std::vector<int32_t>& bsum, int64_t amx_min_rows, const LoraRows* lora,
               const LayerExtras* biases = nullptr, const SwigluOai* oai = nullptr) {
  matmul_parts(gate_up_w, x, N, D, gate_up, 2 * I, q8, dx, bsum, amx_min_rows);
  if (biases != nullptr) add_bias(biases->gate_up, gate_up, N, 2 * I);
  add_lora(lora, 2, x, N, D, gate_up, 2 * I);
  for_rows(N, [&](int64_t n) {
    if (oai != nullptr)
      (*oai)(gate_up + n * 2 * I, gate_up + n * 2 * I + I, I, act + n * I);
    else
      gated_activation(gate_up + n * 2 * I, gate_up + n * 2 * I + I, I, gelu, act + n * I);
  });
  matmul_parts(down_w, act, N, I, out, D, q8, dx, bsum, amx_min_rows);
  if (biases != nullptr) add_bias(biases->down, out, N, D);
  add_lora(lora, 3, act, N, I, out, D);
}

// A mixture-of-experts MLP (Qwen3-MoE, Mixtral) in the layer's call.  The Python layer spent
// ~1 ms a layer around its experts at one row (sorting entries, slicing, two quant_linear calls,
// an activation and a scatter per expert), as much as the experts' weight reads.  Per row: the
// router's float logits (dot_row), their softmax, the k most probable experts (ties to the lower
// index) and their probabilities, renormalised to sum to 1 where `renormalize`; each expert's two
// matmuls then run once for the rows that chose it, and a row's weighted outputs are added in
// rank order.  Every value of a row comes from that row's operations alone, in one order, so the
// mixture is batch-invariant like the kernels it calls.  Its bits are this build's (std::exp,
// dot_row, the layer's gated_activation), not the torch layer's: every forward of a model whose
// layers run here takes this path.  A shared expert (Qwen2-MoE), where given, takes every row; its
// output, times sigmoid(x . shared_gate) where a gate is given, is added after the ranks' sum.
struct Mixture {
  at::Tensor router;                             // [E, D] float32
  std::vector<std::vector<Part>> gate_up, down;  // per expert: [2 I, D] and [D, I]
  int64_t k;
  bool renormalize;
  std::vector<Part> shared_gate_up, shared_down;  // [2 S, D] and [D, S], or empty: no shared expert
  int64_t shared_width;                           // S (0: none)
  at::Tensor shared_gate;                         // [D] float32, or undefined: ungated
  // gpt-oss: the router's bias [E], each expert's gate_up and down biases, its activation
  at::Tensor router_bias;                  // or undefined
  std::vector<LayerExtras> expert_biases;  // per expert (gate_up, down), or empty
  std::optional<SwigluOai> swiglu_oai;     // or the layer's gated activation
};

Mixture make_mixture(const at::Tensor& router, std::vector<std::vector<Part>> gate_up,
                     std::vector<std::vector<Part>> down, int64_t k, bool renormalize,
                     std::vector<Part> shared_gate_up, std::vector<Part> shared_down, int64_t shared_width,
                     const c10::optional<at::Tensor>& shared_gate, const c10::optional<at::Tensor>& router_bias,
                     const std::vector<std::tuple<at::Tensor, at::Tensor>>& expert_biases, double swiglu_limit,
                     double swiglu_alpha) {
  TORCH_CHECK(router.dim() == 2 && router.scalar_type() == at::kFloat && router.is_contiguous(),
              "Mixture: the router must be a contiguous [experts, hidden] float32 matrix");
  const int64_t E = router.size(0), D = router.size(1);
  TORCH_CHECK(static_cast<int64_t>(gate_up.size()) == E && static_cast<int64_t>(down.size()) == E,
              "Mixture: one gate_up and one down weight per expert (", E, " experts)");
  TORCH_CHECK(1 <= k && k <= E, "Mixture: experts per token must be in [1, ", E, "], got ", k);
  TORCH_CHECK(shared_width >= 0 && shared_width % 32 == 0 && (shared_width == 0) == shared_gate_up.empty() &&
                  shared_gate_up.empty() == shared_down.empty(),
              "Mixture: a shared expert needs gate_up, down and a width that is a multiple of 32, got width ",
              shared_width);
  at::Tensor gate;
  if (shared_gate.has_value() && shared_gate->defined()) {
    TORCH_CHECK(shared_width > 0, "Mixture: a shared-expert gate without a shared expert");
    TORCH_CHECK(shared_gate->scalar_type() == at::kFloat && shared_gate->numel() == D,
                "Mixture: the shared-expert gate must be ", D, " float32 values");
    gate = shared_gate->contiguous().reshape({D});
  }
  at::Tensor bias;
  if (router_bias.has_value() && router_bias->defined()) {
    TORCH_CHECK(router_bias->scalar_type() == at::kFloat && router_bias->numel() == E,
                "Mixture: the router bias must be ", E, " float32 values");
    bias = router_bias->contiguous().reshape({E});
  }
  TORCH_CHECK(expert_biases.empty() || static_cast<int64_t>(expert_biases.size()) == E,
              "Mixture: expert biases for every expert or none");
  std::vector<LayerExtras> per_expert;
  for (const auto& [gate_up_bias, down_bias] : expert_biases)
    per_expert.push_back(make_layer_extras(c10::nullopt, c10::nullopt, gate_up_bias, down_bias, c10::nullopt));
  std::optional<SwigluOai> oai;  // a limit > 0: gpt-oss's activation
  if (swiglu_limit > 0.0) oai = SwigluOai{static_cast<float>(swiglu_limit), static_cast<float>(swiglu_alpha)};
  return Mixture{router, std::move(gate_up), std::move(down), k, renormalize,
                 std::move(shared_gate_up), std::move(shared_down), shared_width, gate,
                 bias, std::move(per_expert), oai};
}

// Up to this many rows a mixture splits its experts between the threads (where there are enough
// of them); more rows split each expert's matmuls (each expert then has work for every thread).
constexpr int64_t kExpertsAcrossThreadsRows = 4;

// x [N, D] (the normed MLP input) -> out [N, D]; I: the experts' width.
void mixture_mlp(const Mixture& mix, const float* x, int64_t N, int64_t D, int64_t I, bool gelu, float* out,
                 int64_t amx_min_rows) {
  const int64_t E = mix.router.size(0), k = mix.k;
  TORCH_CHECK(mix.router.size(1) == D, "Mixture: the router is [", E, ", ", mix.router.size(1), "], the layer's width ", D);
  const float* router = mix.router.const_data_ptr<float>();
  const float* router_bias = mix.router_bias.defined() ? mix.router_bias.const_data_ptr<float>() : nullptr;
  std::vector<int64_t> chosen(N * k);  // entry n * k + r: row n's rank-r expert
  std::vector<float> weights(N * k);
  for_rows(N, [&](int64_t n) {
    std::vector<float> probs(E);
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < E; ++e) {
      probs[e] = dot_row(x + n * D, router + e * D, D);
      if (router_bias != nullptr) probs[e] = probs[e] + router_bias[e];
      top = std::max(top, probs[e]);
    }
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) {
      probs[e] = std::exp(probs[e] - top);
      sum = sum + probs[e];
    }
    for (int64_t e = 0; e < E; ++e) probs[e] = probs[e] / sum;
    float picked = 0.0f;
    std::vector<char> taken(E, 0);
    for (int64_t r = 0; r < k; ++r) {
      int64_t best = -1;  // the first untaken expert, then any larger (a NaN row keeps the first)
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
      taken[best] = 1;
      chosen[n * k + r] = best;
      weights[n * k + r] = probs[best];
      picked = picked + probs[best];
    }
    if (mix.renormalize)
      for (int64_t r = 0; r < k; ++r) weights[n * k + r] = weights[n * k + r] / picked;
  });
  // The entries grouped by expert, rows ascending within each (a counting sort).
  std::vector<int64_t> first(E + 1, 0), order(N * k);
  for (int64_t i = 0; i < N * k; ++i) ++first[chosen[i] + 1];
  for (int64_t e = 0; e < E; ++e) first[e + 1] += first[e];
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  for (int64_t i = 0; i < N * k; ++i) order[next[chosen[i]]++] = i;
  Scratch by_rank(k * N * D);
  // One expert's rows through its two matmuls into by_rank (each (rank, row) written once).  A
  // row picks an expert at most once: an expert's rows fit N.
  struct ExpertScratch {
    Scratch rows_in, gate_up, act, rows_out;
    std::vector<int8_t> q8;
    std::vector<float> dx;
    std::vector<int32_t> bsum;
    ExpertScratch(int64_t N, int64_t D, int64_t I) : rows_in(N * D), gate_up(N * 2 * I), act(N * I), rows_out(N * D) {}
  };
  auto run_expert = [&](int64_t e, ExpertScratch& t) {
    const int64_t count = first[e + 1] - first[e];
    const int64_t* entries = order.data() + first[e];
    for (int64_t j = 0; j < count; ++j)
      std::memcpy(t.rows_in.data() + j * D, x + (entries[j] / k) * D, D * sizeof(float));
    gated_mlp(mix.gate_up[e], mix.down[e], t.rows_in.data(), count, D, I, gelu, t.gate_up.data(), t.act.data(),
              t.rows_out.data(), t.q8, t.dx, t.bsum, amx_min_rows, nullptr,
              mix.expert_biases.empty() ? nullptr : &mix.expert_biases[e],
              mix.swiglu_oai.has_value() ? &*mix.swiglu_oai : nullptr);
    for (int64_t j = 0; j < count; ++j) {
      const int64_t entry = entries[j], row = entry / k, rank = entry % k;
      const float w = weights[entry];
      const float* src = t.rows_out.data() + j * D;
      float* dst = by_rank.data() + (rank * N + row) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * w;
    }
  };
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (first[e + 1] > first[e]) active.push_back(e);
  if (N <= kExpertsAcrossThreadsRows && static_cast<int64_t>(active.size()) >= 2 * at::get_num_threads()) {
    // A few rows and enough experts to share out evenly (Qwen3-MoE's 8 a token, not Mixtral's
    // 2): each thread streams whole experts (their matmuls run inside this region, on its
    // thread), instead of a parallel region per matmul, 2k of them a layer at one row.  Which
    // thread computes an expert changes none of its bits.
    at::parallel_for(0, static_cast<int64_t>(active.size()), 1, [&](int64_t a0, int64_t a1) {
      ExpertScratch t(N, D, I);
      for (int64_t a = a0; a < a1; ++a) run_expert(active[a], t);
    });
  } else {
    ExpertScratch t(N, D, I);
    for (const int64_t e : active) run_expert(e, t);
  }
  const int64_t S = mix.shared_width;
  Scratch shared(S > 0 ? N * D : 0);
  std::vector<float> shared_scale(N, 1.0f);
  if (S > 0) {  // every row through the shared expert; its matmuls split between the threads
    Scratch gate_up(N * 2 * S), act(N * S);
    std::vector<int8_t> q8;
    std::vector<float> dx;
    std::vector<int32_t> bsum;
    gated_mlp(mix.shared_gate_up, mix.shared_down, x, N, D, S, gelu, gate_up.data(), act.data(), shared.data(), q8,
              dx, bsum, amx_min_rows, nullptr);
    if (mix.shared_gate.defined()) {
      const float* g = mix.shared_gate.const_data_ptr<float>();
      for_rows(N, [&](int64_t n) { shared_scale[n] = 1.0f / (1.0f + std::exp(-dot_row(x + n * D, g, D))); });
    }
  }
  for_rows(N, [&](int64_t n) {
    float* o = out + n * D;
    std::memcpy(o, by_rank.data() + n * D, D * sizeof(float));
    for (int64_t r = 1; r < k; ++r) {
      const float* add = by_rank.data() + (r * N + n) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = o[d] + add[d];
    }
    if (S > 0) {
      const float* add = shared.data() + n * D;
      const float scale = shared_scale[n];
      for (int64_t d = 0; d < D; ++d) o[d] = o[d] + add[d] * scale;
    }
  });
}

// hidden [N, D] -> the layer's output [N, D].  cache_k / cache_v [num_blocks, Hkv, block_size, hd]: a
// paged cache (a slot cache is one block per slot).  seqs: per sequence (table_start, row_start,
// row_end, kv_start, kv_end) of this layer's attention type, its block table at
// tables[table_start ...] (storage index p lives in block tables[table_start + p / block_size]);
// masks: its [T, kv_end - kv_start] or None.
at::Tensor decoder_layer_impl(const at::Tensor& hidden_in, const std::vector<Part>& qkv, const std::vector<Part>& o_proj,
                         const std::vector<Part>& gate_up, const std::vector<Part>& down,
                         const at::Tensor& input_norm, const at::Tensor& post_attention_norm,
                         const c10::optional<at::Tensor>& pre_ff_norm, const c10::optional<at::Tensor>& post_ff_norm,
                         const c10::optional<at::Tensor>& qk_norm, double eps_d, bool gelu,
                         const at::Tensor& cos_in, const at::Tensor& sin_in, at::Tensor& cache_k, at::Tensor& cache_v,
                         const std::vector<int64_t>& seqs, const std::vector<int64_t>& tables,
                         const std::vector<c10::optional<at::Tensor>>& masks,
                         int64_t H, int64_t Hkv, int64_t hd, int64_t I, double scale, double softcap,
                         int64_t amx_min_rows, const Mixture* mixture, const LayerExtras* extras,
                         const LoraRows* lora) {
  TORCH_CHECK(cpu_supported(), "decoder_layer: this CPU lacks the instructions of the ", kIsa, " build");
  const at::Tensor hidden = hidden_in.contiguous();
  const at::Tensor cosv = cos_in.contiguous(), sinv = sin_in.contiguous();
  const int64_t N = hidden.size(0), D = hidden.size(1), QKV = (H + 2 * Hkv) * hd;
  TORCH_CHECK(hd % 16 == 0 && D % 32 == 0 && (H * hd) % 32 == 0 && I % 32 == 0, "decoder_layer: unsupported sizes");
  TORCH_CHECK(cache_k.is_contiguous() && cache_v.is_contiguous() && cache_k.dim() == 4, "decoder_layer: bad cache");
  TORCH_CHECK(static_cast<int64_t>(seqs.size()) == 5 * static_cast<int64_t>(masks.size()), "decoder_layer: bad seqs");
  const float eps = static_cast<float>(eps_d);
  const bool sandwich = pre_ff_norm.has_value() && pre_ff_norm->defined();
  const float* sinks = nullptr;  // gpt-oss: a logit per query head in each softmax
  if (extras != nullptr && extras->sinks.defined()) {
    TORCH_CHECK(extras->sinks.numel() == H, "decoder_layer: ", extras->sinks.numel(), " sinks for ", H, " heads");
    sinks = extras->sinks.const_data_ptr<float>();
  }
  const float* h = hidden.const_data_ptr<float>();
  Scratch x(N * std::max(D, I)), qkv_out(N * QKV), attended(N * H * hd), proj(N * D), gu(N * 2 * I);
  std::vector<int8_t> q8;
  std::vector<float> dx;
  std::vector<int32_t> bsum;
  at::Tensor out = at::empty({N, D}, hidden.options());
  float* y = out.mutable_data_ptr<float>();

  // attention inputs
  const float* w_in = input_norm.const_data_ptr<float>();
  for_rows(N, [&](int64_t n) { rms_norm_row(h + n * D, w_in, D, eps, x.data() + n * D); });
  matmul_parts(qkv, x.data(), N, D, qkv_out.data(), QKV, q8, dx, bsum, amx_min_rows);
  if (extras != nullptr) add_bias(extras->qkv, qkv_out.data(), N, QKV);
  add_lora(lora, 0, x.data(), N, D, qkv_out.data(), QKV);
  const float* w_qk = opt_ptr(qk_norm);
  const float* cp = cosv.const_data_ptr<float>();
  const float* sp = sinv.const_data_ptr<float>();
  for_rows(N, [&](int64_t n) {
    std::vector<float> tmp(hd);
    for (int64_t head = 0; head < H + Hkv; ++head) {  // q and k heads: norm, then rotary
      float* v = qkv_out.data() + n * QKV + head * hd;
      if (w_qk) rms_norm_row(v, nullptr, hd, eps, v);
      if (w_qk) for (int64_t i = 0; i < hd; ++i) v[i] = v[i] * w_qk[head * hd + i];
      rotate_head(v, cp + n * hd, sp + n * hd, hd, tmp.data());
    }
  });
  // KV write, then attention of every sequence
  TORCH_CHECK(cache_k.scalar_type() == cache_v.scalar_type() &&
                  (cache_k.scalar_type() == at::kFloat || cache_k.scalar_type() == at::kHalf),
              "decoder_layer: the KV cache must be float32 or float16, got ", cache_k.scalar_type());
  const int64_t block_size = cache_k.size(2), block_stride = Hkv * block_size * hd, head_stride = block_size * hd;
  const int64_t num_seqs = static_cast<int64_t>(masks.size());
  const int64_t num_blocks = cache_k.size(0), num_table_entries = static_cast<int64_t>(tables.size());
  // Where storage index p of a sequence's key head g starts, in elements from the cache's start.
  auto offset = [&](int64_t table_start, int64_t g, int64_t p) {
    const int64_t entry = table_start + p / block_size;
    TORCH_CHECK(entry < num_table_entries, "decoder_layer: storage index past the block table");
    const int64_t block = tables[entry];
    TORCH_CHECK(block >= 0 && block < num_blocks, "decoder_layer: block ", block, " outside the cache");
    return block * block_stride + g * head_stride + (p % block_size) * hd;
  };
  auto write_and_attend = [&](auto* kc, auto* vc) {
    for (int64_t b = 0; b < num_seqs; ++b) {
      const int64_t ts = seqs[5 * b], r0 = seqs[5 * b + 1], r1 = seqs[5 * b + 2], kv_end = seqs[5 * b + 4];
      const int64_t cache_len = kv_end - (r1 - r0);
      for (int64_t n = r0; n < r1; ++n)
        for (int64_t g = 0; g < Hkv; ++g) {
          const int64_t at = offset(ts, g, cache_len + n - r0);
          store_kv_row(kc + at, qkv_out.data() + n * QKV + (H + g) * hd, hd);
          store_kv_row(vc + at, qkv_out.data() + n * QKV + (H + Hkv + g) * hd, hd);
        }
    }
    attend_sequences(qkv_out.data(), kc, vc, seqs, masks, offset, N, H, Hkv, hd, QKV,
                     AttentionScale{static_cast<float>(scale), static_cast<float>(softcap), sinks},
                     attended.data());
  };
  if (cache_k.scalar_type() == at::kHalf)
    write_and_attend(reinterpret_cast<KvHalf*>(cache_k.mutable_data_ptr<at::Half>()),
                     reinterpret_cast<KvHalf*>(cache_v.mutable_data_ptr<at::Half>()));
  else
    write_and_attend(cache_k.mutable_data_ptr<float>(), cache_v.mutable_data_ptr<float>());
  // block output
  matmul_parts(o_proj, attended.data(), N, H * hd, proj.data(), D, q8, dx, bsum, amx_min_rows);
  if (extras != nullptr) add_bias(extras->o_proj, proj.data(), N, D);
  add_lora(lora, 1, attended.data(), N, H * hd, proj.data(), D);
  const float* w_post = post_attention_norm.const_data_ptr<float>();
  for_rows(N, [&](int64_t n) {
    float* yn = y + n * D;
    if (sandwich) {
      rms_norm_row(proj.data() + n * D, w_post, D, eps, yn);
      for (int64_t i = 0; i < D; ++i) yn[i] = h[n * D + i] + yn[i];
      rms_norm_row(yn, pre_ff_norm->const_data_ptr<float>(), D, eps, x.data() + n * D);
    } else {
      for (int64_t i = 0; i < D; ++i) yn[i] = h[n * D + i] + proj[n * D + i];
      rms_norm_row(yn, w_post, D, eps, x.data() + n * D);
    }
  });
  if (mixture != nullptr) {  // experts instead of the dense MLP (no adapters on experts)
    mixture_mlp(*mixture, x.data(), N, D, I, gelu, proj.data(), amx_min_rows);
  } else {
    gated_mlp(gate_up, down, x.data(), N, D, I, gelu, gu.data(), x.data(), proj.data(), q8, dx, bsum, amx_min_rows,
              lora, extras);
  }
  const float* w_post_ff = opt_ptr(post_ff_norm);
  for_rows(N, [&](int64_t n) {
    std::vector<float> row(D);
    const float* add = proj.data() + n * D;
    if (sandwich) {
      rms_norm_row(add, w_post_ff, D, eps, row.data());
      add = row.data();
    }
    float* yn = y + n * D;
    for (int64_t i = 0; i < D; ++i) yn[i] = yn[i] + add[i];
  });
  return out;
}

// x [M, K] -> rms_norm(x) @ W^T [M, N], each row normalized per segment of `segment` values
// with its slice of `norm` [K] (a draft head's input concatenates two normalized halves).
at::Tensor norm_matmul(const at::Tensor& x_in, const at::Tensor& norm, int64_t segment, double eps,
                       const std::vector<Part>& parts, int64_t N, int64_t amx_min_rows) {
  TORCH_CHECK(cpu_supported(), "norm_matmul: this CPU lacks the instructions of the ", kIsa, " build");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(segment > 0 && segment % 16 == 0 && K % segment == 0 && K % 32 == 0 && norm.numel() == K,
              "norm_matmul: unsupported sizes");
  std::vector<float> normed(M * K);
  const float* xp = x.const_data_ptr<float>();
  const float* w = norm.const_data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t s = 0; s < K; s += segment)
      rms_norm_row(xp + m * K + s, w + s, segment, static_cast<float>(eps), normed.data() + m * K + s);
  at::Tensor out = at::empty({M, N}, x.options());
  std::vector<int8_t> q8;
  std::vector<float> dx;
  std::vector<int32_t> bsum;
  matmul_parts(parts, normed.data(), M, K, out.mutable_data_ptr<float>(), N, q8, dx, bsum, amx_min_rows);
  return out;
}

// decoder_layer_impl without adapters, for Python.
at::Tensor decoder_layer(const at::Tensor& hidden, const std::vector<Part>& qkv, const std::vector<Part>& o_proj,
                         const std::vector<Part>& gate_up, const std::vector<Part>& down,
                         const at::Tensor& input_norm, const at::Tensor& post_attention_norm,
                         const c10::optional<at::Tensor>& pre_ff_norm, const c10::optional<at::Tensor>& post_ff_norm,
                         const c10::optional<at::Tensor>& qk_norm, double eps, bool gelu, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor& cache_k, at::Tensor& cache_v,
                         const std::vector<int64_t>& seqs, const std::vector<int64_t>& tables,
                         const std::vector<c10::optional<at::Tensor>>& masks, int64_t H, int64_t Hkv, int64_t hd,
                         int64_t I, double scale, double softcap, int64_t amx_min_rows, const Mixture* mixture,
                         const LayerExtras* extras) {
  return decoder_layer_impl(hidden, qkv, o_proj, gate_up, down, input_norm, post_attention_norm, pre_ff_norm,
                            post_ff_norm, qk_norm, eps, gelu, cos, sin, cache_k, cache_v, seqs, tables, masks, H, Hkv,
                            hd, I, scale, softcap, amx_min_rows, mixture, extras, nullptr);
}

// The layers of a decoder, one forward in one call: decoder_layer for each layer in turn.  A
// Python loop around decoder_layer spends ~50 us a layer (the module call, the kernel's ~25
// arguments converted, the cached-argument checks): ~0.9 ms of a 13 ms batch-1 decode on the
// 2-core VM, with the other core waiting.  Built once per model from every layer's unchanging
// arguments (FusedLayerWeights in quant_linear.py); each layer reads the rotary rows and the
// sequences of its kind (sliding-window or full attention, and its cache group), given per call.
class DecoderStack {
 public:
  struct Layer {
    std::vector<Part> qkv, o_proj, gate_up, down;
    at::Tensor input_norm, post_attention_norm;
    c10::optional<at::Tensor> pre_ff_norm, post_ff_norm, qk_norm;
    double eps;
    bool gelu;
    int64_t H, Hkv, hd, I;
    double scale, softcap;
    std::shared_ptr<const Mixture> mixture;  // null: the dense MLP
    std::shared_ptr<const LayerExtras> extras;  // null: none
    std::vector<LoraSites> lora;  // by adapter slot
  };

  void add_layer(std::vector<Part> qkv, std::vector<Part> o_proj, std::vector<Part> gate_up, std::vector<Part> down,
                 at::Tensor input_norm, at::Tensor post_attention_norm, c10::optional<at::Tensor> pre_ff_norm,
                 c10::optional<at::Tensor> post_ff_norm, c10::optional<at::Tensor> qk_norm, double eps, bool gelu,
                 int64_t H, int64_t Hkv, int64_t hd, int64_t I, double scale, double softcap, const Mixture* mixture,
                 const LayerExtras* extras) {
    layers_.push_back({std::move(qkv), std::move(o_proj), std::move(gate_up), std::move(down), std::move(input_norm),
                       std::move(post_attention_norm), std::move(pre_ff_norm), std::move(post_ff_norm),
                       std::move(qk_norm), eps, gelu, H, Hkv, hd, I, scale, softcap,
                       mixture == nullptr ? nullptr : std::make_shared<const Mixture>(*mixture),
                       extras == nullptr ? nullptr : std::make_shared<const LayerExtras>(*extras)});
  }

  // Adapter slot `slot`'s parts at one site of one layer, (a_t [K, r], b_t [r, n], col0) each,
  // replacing what the slot held there.
  void set_lora(int64_t slot, int64_t layer, int64_t site, const std::vector<std::tuple<at::Tensor, at::Tensor, int64_t>>& parts) {
    TORCH_CHECK(0 <= layer && layer < size() && 0 <= site && site < kLoraSites && slot >= 0, "set_lora: bad index");
    Layer& l = layers_[layer];
    const int64_t D = l.input_norm.size(0), Q = l.H * l.hd;
    const int64_t widths_in[kLoraSites] = {D, Q, D, l.I};
    const int64_t widths_out[kLoraSites] = {(l.H + 2 * l.Hkv) * l.hd, D, 2 * l.I, D};
    std::vector<LoraPart> checked;
    for (const auto& [a_t, b_t, col0] : parts) {
      TORCH_CHECK(a_t.scalar_type() == at::kFloat && b_t.scalar_type() == at::kFloat && a_t.is_contiguous() &&
                      b_t.is_contiguous() && a_t.dim() == 2 && b_t.dim() == 2,
                  "set_lora: a_t and b_t must be contiguous 2-d float32");
      TORCH_CHECK(a_t.size(0) == widths_in[site] && b_t.size(0) == a_t.size(1) && col0 >= 0 &&
                      col0 + b_t.size(1) <= widths_out[site],
                  "set_lora: a part does not fit layer ", layer, " site ", site);
      checked.push_back({a_t, b_t, col0});
    }
    if (static_cast<int64_t>(l.lora.size()) <= slot) l.lora.resize(slot + 1);
    l.lora[slot][site] = std::move(checked);
  }

  // Forgets what adapter slot `slot` held, in every layer.
  void clear_lora(int64_t slot) {
    for (Layer& l : layers_)
      if (slot >= 0 && slot < static_cast<int64_t>(l.lora.size())) l.lora[slot] = LoraSites{};
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // hidden [N, D] through layers start..end-1 -> [the last layer's output, then the outputs of
  // the layers in `capture` (in its order)].  Per layer of the model: its rotary kind (an index
  // into cos / sin, each [N, hd]), its sequence kind (into seqs / tables / masks, as
  // decoder_layer reads them) and its cache keys and values.
  std::vector<at::Tensor> forward(const at::Tensor& hidden, int64_t start, int64_t end,
                                  const std::vector<int64_t>& rotary_kind, const std::vector<int64_t>& sequence_kind,
                                  const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                                  std::vector<at::Tensor> cache_keys, std::vector<at::Tensor> cache_values,
                                  const std::vector<std::vector<int64_t>>& seqs,
                                  const std::vector<std::vector<int64_t>>& tables,
                                  const std::vector<std::vector<c10::optional<at::Tensor>>>& masks,
                                  const std::vector<int64_t>& capture, int64_t amx_min_rows,
                                  const std::vector<int64_t>& row_slots) {
    TORCH_CHECK(0 <= start && start < end && end <= size(), "DecoderStack: bad layer range [", start, ", ", end, ")");
    TORCH_CHECK(static_cast<int64_t>(cache_keys.size()) == size() && cache_values.size() == cache_keys.size() &&
                    rotary_kind.size() == cache_keys.size() && sequence_kind.size() == cache_keys.size(),
                "DecoderStack: one cache tensor and kind per layer");
    TORCH_CHECK(cos.size() == sin.size() && seqs.size() == tables.size() && seqs.size() == masks.size(),
                "DecoderStack: inconsistent kinds");
    TORCH_CHECK(row_slots.empty() || static_cast<int64_t>(row_slots.size()) == hidden.size(0),
                "DecoderStack: row_slots must be empty or one per row");
    for (const int64_t slot : row_slots)
      for (int64_t i = start; i < end; ++i)
        TORCH_CHECK(slot < static_cast<int64_t>(layers_[i].lora.size()), "DecoderStack: a row reads LoRA slot ",
                    slot, ", which was never set");
    std::vector<at::Tensor> captured(capture.size());
    at::Tensor h = hidden;
    for (int64_t i = start; i < end; ++i) {
      const Layer& l = layers_[i];
      const int64_t r = rotary_kind[i], q = sequence_kind[i];
      TORCH_CHECK(0 <= r && r < static_cast<int64_t>(cos.size()) && 0 <= q && q < static_cast<int64_t>(seqs.size()),
                  "DecoderStack: layer ", i, " reads a kind this forward lacks");
      const LoraRows lora{&l.lora, row_slots.data()};
      h = decoder_layer_impl(h, l.qkv, l.o_proj, l.gate_up, l.down, l.input_norm, l.post_attention_norm, l.pre_ff_norm,
                        l.post_ff_norm, l.qk_norm, l.eps, l.gelu, cos[r], sin[r], cache_keys[i], cache_values[i],
                        seqs[q], tables[q], masks[q], l.H, l.Hkv, l.hd, l.I, l.scale, l.softcap, amx_min_rows,
                        l.mixture.get(), l.extras.get(), row_slots.empty() ? nullptr : &lora);
      for (size_t c = 0; c < capture.size(); ++c)
        if (capture[c] == i) captured[c] = h;
    }
    std::vector<at::Tensor> out{h};
    out.insert(out.end(), captured.begin(), captured.end());
    return out;
  }

 private:
  std::vector<Layer> layers_;
};

// A copy-path draft head's chain, every depth in this one call: ~10 Python-driven calls per depth
// (the input, the block, the draft logits, the mixture, their arguments) cost more than the
// head's arithmetic at one row.  The same computation as the drafter's depth-by-depth path for a
// top-1 chain (quickdraft/drafters/eagle.py), with the same functions: the token's embedding row
// times embed_scale (float32, as torch multiplies a float32 row by a Python float) beside the
// previous output, norm_matmul through in_proj, decoder_layer attending the head's true entries
// first_true..num_true-1 and the chain's own entries after them (no mask: a chain sees them all),
// norm_matmul through the draft LM rows, then the mixture's best candidate (mixture_top_k of
// draft_mixture.cpp, by address).  Depth d keeps its pick while the path's log-probability plus
// the pick's is at least floors[d - 1]; the path then adds min(0, log_prob), as DynamicTree does.
// root [1, D]: the head's output after the root pair; rotary tables [max_len, hd]; the chain's
// entry for depth d is num_true + d - 1 at position num_true + d (its first pick needs no
// entry).  Returns the picks (target ids [n], log-probabilities [n] float32), n <= floors.size().
std::vector<at::Tensor> draft_chain(
    const at::Tensor& root, const at::Tensor& embed_packed, int64_t embed_rows, double embed_scale,
    const at::Tensor& input_norm, const std::vector<Part>& in_proj, double input_eps, const std::vector<Part>& qkv,
    const std::vector<Part>& o_proj, const std::vector<Part>& gate_up, const std::vector<Part>& down,
    const at::Tensor& attn_norm, const at::Tensor& mlp_norm, double block_eps, bool gelu, const at::Tensor& cos_table,
    const at::Tensor& sin_table, at::Tensor& cache_k, at::Tensor& cache_v, const std::vector<int64_t>& table,
    int64_t first_true, int64_t num_true, int64_t H, int64_t Hkv, int64_t hd, int64_t I, double scale,
    const at::Tensor& final_norm, double final_eps, const std::vector<Part>& lm_rows, int64_t Vd,
    int64_t mixture_address, const std::vector<at::Tensor>& mixture_tensors, double mixture_eps,
    const std::vector<double>& floors, int64_t amx_min_rows) {
  TORCH_CHECK(cpu_supported(), "draft_chain: this CPU lacks the instructions of the ", kIsa, " build");
  TORCH_CHECK(mixture_address != 0 && mixture_tensors.size() == 10, "draft_chain: bad mixture arguments");
  TORCH_CHECK(root.dim() == 2 && root.size(0) == 1 && root.scalar_type() == at::kFloat, "draft_chain: bad root");
  const int64_t D = root.size(1);
  TORCH_CHECK(cos_table.is_contiguous() && sin_table.is_contiguous() && cos_table.size(1) == hd,
              "draft_chain: bad rotary tables");
  // query weight [C, D], gate weight [1, D], gate bias [1], keys [n, C], inverse [n], distinct [U],
  // distinct draft ids [U], distinct in vocab [U], copied draft id [Vd] bool, d2t [Vd]
  const auto& mt = mixture_tensors;
  for (int i : {0, 1, 2, 3, 7})
    TORCH_CHECK(mt[i].scalar_type() == at::kFloat && mt[i].is_contiguous(), "draft_chain: bad mixture tensor ", i);
  for (int i : {4, 5, 6, 9})
    TORCH_CHECK(mt[i].scalar_type() == at::kLong && mt[i].is_contiguous(), "draft_chain: bad mixture index ", i);
  TORCH_CHECK(mt[8].scalar_type() == at::kBool && mt[8].numel() == Vd && mt[9].numel() == Vd &&
                  mt[0].size(1) == D && mt[3].size(1) == mt[0].size(0) && mt[3].size(0) >= 1,
              "draft_chain: inconsistent mixture shapes");
  const auto mixture = reinterpret_cast<qd_mixture_abi::MixtureTopK>(mixture_address);
  qd_mixture_abi::MixtureInputs in{};
  in.m = 1;
  in.D = D;
  in.Vd = Vd;
  in.query_weight = mt[0].const_data_ptr<float>();
  in.C = mt[0].size(0);
  in.gate_weight = mt[1].const_data_ptr<float>();
  in.gate_bias = mt[2].const_data_ptr<float>()[0];
  in.keys = mt[3].const_data_ptr<float>();
  in.n = mt[3].size(0);
  in.inverse = mt[4].const_data_ptr<int64_t>();
  in.distinct = mt[5].const_data_ptr<int64_t>();
  in.U = mt[5].numel();
  in.distinct_draft_ids = mt[6].const_data_ptr<int64_t>();
  in.distinct_in_vocab = mt[7].const_data_ptr<float>();
  in.copied_draft_id = mt[8].const_data_ptr<bool>();
  in.d2t = mt[9].const_data_ptr<int64_t>();
  in.k = 1;
  in.eps = static_cast<float>(mixture_eps);

  const float embed_mul = static_cast<float>(embed_scale);
  std::vector<int64_t> picked_ids;
  std::vector<float> picked_log_probs;
  at::Tensor hidden = root.contiguous();
  at::Tensor joined = at::empty({1, 2 * D}, root.options());
  double path = 0.0;
  for (int64_t depth = 1; depth <= static_cast<int64_t>(floors.size()); ++depth) {
    if (depth > 1) {  // feed the last pick: its entry num_true + depth - 2, position num_true + depth - 1
      const int64_t entry = num_true + depth - 2, position = entry + 1;
      TORCH_CHECK(position < cos_table.size(0), "draft_chain: position past the rotary table");
      at::Tensor token = at::empty({1}, at::kLong);
      token.mutable_data_ptr<int64_t>()[0] = picked_ids.back();
      const at::Tensor embedded = dequantize_rows(embed_packed, Q8_0, embed_rows, D, token);
      float* j = joined.mutable_data_ptr<float>();
      const float* e = embedded.const_data_ptr<float>();
      for (int64_t i = 0; i < D; ++i) j[i] = embed_scale > 0.0 ? e[i] * embed_mul : e[i];
      std::memcpy(j + D, hidden.const_data_ptr<float>(), D * sizeof(float));
      const at::Tensor x = norm_matmul(joined, input_norm, D, input_eps, in_proj, D, amx_min_rows);
      hidden = decoder_layer(x, qkv, o_proj, gate_up, down, attn_norm, mlp_norm, c10::nullopt, c10::nullopt,
                             c10::nullopt, block_eps, gelu, cos_table.narrow(0, position, 1),
                             sin_table.narrow(0, position, 1), cache_k, cache_v, {0, 0, 1, first_true, entry + 1},
                             table, {c10::nullopt}, H, Hkv, hd, I, scale, 0.0, amx_min_rows, nullptr, nullptr);
    }
    const at::Tensor logits = norm_matmul(hidden, final_norm, D, final_eps, lm_rows, Vd, amx_min_rows);
    in.features = hidden.const_data_ptr<float>();
    in.logits = logits.const_data_ptr<float>();
    int64_t id = -1;
    float log_prob = -std::numeric_limits<float>::infinity();
    mixture(in, &id, &log_prob);
    if (id < 0 || !(path + static_cast<double>(log_prob) >= floors[depth - 1])) break;
    picked_ids.push_back(id);
    picked_log_probs.push_back(log_prob);
    path += std::min(0.0, static_cast<double>(log_prob));
  }
  const int64_t n = static_cast<int64_t>(picked_ids.size());
  at::Tensor ids = at::empty({n}, at::kLong), log_probs = at::empty({n}, at::kFloat);
  std::copy(picked_ids.begin(), picked_ids.end(), ids.mutable_data_ptr<int64_t>());
  std::copy(picked_log_probs.begin(), picked_log_probs.end(), log_probs.mutable_data_ptr<float>());
  return {ids, log_probs};
}
}  // namespace
}  // namespace qd_quant

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("quantize_rows", &qd_quant::quantize_rows, "x [M, K] float32 -> (q int8 [M, K], dx [M, K/32], bsum [M, K/16])",
        py::arg("x"), py::arg("levels") = 127, py::call_guard<py::gil_scoped_release>());
  m.def("quant_matmul", &qd_quant::quant_matmul, "out[:, col0:col0+N] = x @ W^T for a packed quantized W",
        py::arg("q"), py::arg("dx"), py::arg("bsum"), py::arg("packed"), py::arg("format"), py::arg("N"),
        py::arg("K"), py::arg("out"), py::arg("col0"), py::arg("amx_min_rows"), py::arg("x_levels") = 127,
        py::call_guard<py::gil_scoped_release>());
  m.def("float16_matmul", &qd_quant::float16_matmul, "out[:, col0:col0+N] = x @ W^T for W packed in F16 or BF16",
        py::arg("x"), py::arg("packed"), py::arg("format"), py::arg("N"), py::arg("K"), py::arg("out"),
        py::arg("col0"), py::call_guard<py::gil_scoped_release>());
  m.def("decoder_layer", &qd_quant::decoder_layer, "one decoder layer on quantized weights",
        py::call_guard<py::gil_scoped_release>());
  m.def("norm_matmul", &qd_quant::norm_matmul, "rms_norm(x) per segment, then x @ W^T on quantized weights",
        py::call_guard<py::gil_scoped_release>());
  py::class_<qd_quant::Mixture>(m, "Mixture")
      .def(py::init(&qd_quant::make_mixture), py::arg("router"), py::arg("gate_up"), py::arg("down"), py::arg("k"),
           py::arg("renormalize"), py::arg("shared_gate_up"), py::arg("shared_down"), py::arg("shared_width"),
           py::arg("shared_gate"), py::arg("router_bias"), py::arg("expert_biases"), py::arg("swiglu_limit"),
           py::arg("swiglu_alpha"));
  py::class_<qd_quant::LayerExtras>(m, "LayerExtras")
      .def(py::init(&qd_quant::make_layer_extras), py::arg("qkv"), py::arg("o_proj"), py::arg("gate_up"),
           py::arg("down"), py::arg("sinks"));
  py::class_<qd_quant::DecoderStack>(m, "DecoderStack")
      .def(py::init<>())
      .def("add_layer", &qd_quant::DecoderStack::add_layer)
      .def("size", &qd_quant::DecoderStack::size)
      .def("set_lora", &qd_quant::DecoderStack::set_lora)
      .def("clear_lora", &qd_quant::DecoderStack::clear_lora)
      .def("forward", &qd_quant::DecoderStack::forward, py::call_guard<py::gil_scoped_release>());
  m.def("draft_chain", &qd_quant::draft_chain, "a copy-path draft head's top-1 chain, every depth in one call",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_rows", &qd_quant::dequantize_rows, "rows of a packed Q8_0, F16 or BF16 weight as float32",
        py::arg("packed"), py::arg("format"), py::arg("N"), py::arg("K"), py::arg("index"));
  m.attr("isa") = qd_quant::kIsa;
  m.def("cpu_supported", &qd_quant::cpu_supported);
#if defined(QD_ISA_AVX2)
  m.def("amx_usable", [] { return false; });
#else
  m.def("amx_usable", &qd_quant::amx_usable);
#endif
}
