// Wide quantized matmuls on AMX tiles (Intel Sapphire Rapids and later), with the very bits of
// csrc/quant_linear.cpp.
//
// Why it can be exact: both kernels compute each 32-wide block's dot product of int8 activation
// quants and weight quants as an exact int32, then add (scale_w * dx) * float(idot) to one fp32
// accumulator per output, block after block in K order.  An exact integer is the same whichever
// instruction computes it, so this kernel may take the int32 block dots from TDPBSUD (16 rows x
// 16 outputs x 32 k per instruction) instead of 16 x 8 vpdpbusd, and run the identical fp32
// epilogue.  Which kernel a forward uses (by its row count) therefore changes nothing in a
// row's result: batch invariance holds across the switch.
//
// Why: verifying a 16-node tree makes the 262k-row LM head compute bound on VNNI (13 ms for
// 16 rows vs 6.7 ms to read it); the tiles do the integer work ~8x faster, leaving the epilogue.
//
// Formats: Q8_0 only for now (the LM head of the GGUFs we ship).  Its packed tile already is
// the B-tile layout (8 steps x 16 outputs x 4 k bytes), so B loads straight from the weights.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/extension.h>

namespace qd_amx {

constexpr int64_t kQ8TileBytes = 544;  // 8 x 64 quant bytes + 16 fp16 scales (quant_linear.cpp)
constexpr int kRowsPerTile = 16;
constexpr int64_t kPrefetchBytes = 4096;

// Linux hands AMX state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM).
bool request_tile_permission() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

bool cpu_supported() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("f16c")) {
    return false;
  }
  unsigned eax, ebx, ecx, edx;
  __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
  const bool amx_tile = (edx >> 24) & 1, amx_int8 = (edx >> 25) & 1;
  return amx_tile && amx_int8 && request_tile_permission();
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Two blocks in flight, so the tile unit works on one while the epilogue reads the other:
// tmm0/1: C of blocks b, b+1 (16 rows x 16 int32 outputs); tmm2/3: A (16 activation rows x 32
// k bytes); tmm4/5: B (8 k-quads x 16 outputs x 4 bytes).
TileConfig block_config() {
  TileConfig config;
  for (int c = 0; c < 2; ++c) {
    config.rows[c] = 16, config.colsb[c] = 64;
    config.rows[2 + c] = 16, config.colsb[2 + c] = 32;
    config.rows[4 + c] = 8, config.colsb[4 + c] = 64;
  }
  return config;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,f16c,amx-tile,amx-int8")

// 16 activation rows (zero rows past M) of quants, dx and 32-wide sums, for one row block.
struct RowBlock {
  std::vector<int8_t> q;       // [16, K]
  std::vector<float> dx;       // [16, K / 32]
  std::vector<int32_t> offset;  // [16, K / 32]: -128 * the sum of the block's 32 quants
  int rows;
};

RowBlock row_block(const int8_t* q, const float* dx, const int32_t* bsum16, int64_t m0, int rows, int64_t K) {
  RowBlock r{std::vector<int8_t>(kRowsPerTile * K, 0), std::vector<float>(kRowsPerTile * (K / 32), 0.0f),
             std::vector<int32_t>(kRowsPerTile * (K / 32), 0), rows};
  for (int m = 0; m < rows; ++m) {
    std::memcpy(r.q.data() + m * K, q + (m0 + m) * K, K);
    std::memcpy(r.dx.data() + m * (K / 32), dx + (m0 + m) * (K / 32), sizeof(float) * (K / 32));
    for (int64_t b = 0; b < K / 32; ++b)
      r.offset[m * (K / 32) + b] =
          -128 * (bsum16[(m0 + m) * (K / 16) + 2 * b] + bsum16[(m0 + m) * (K / 16) + 2 * b + 1]);
  }
  return r;
}

// acc[m] += (scale * dx) * float(dots - 128 * bsum) for block b: the weights are stored
// offset by 128 (unsigned), the integer correction keeps the block dot exact.  All 16 rows,
// unrolled, so the accumulators stay in registers (rows past M are zeros, their results unused).
__attribute__((always_inline)) inline void q8_epilogue(const uint8_t* t, const int32_t (*dots)[16],
                                                       const RowBlock& r, int64_t b, int64_t blocks,
                                                       __m512* acc) {
  const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 512)));
#pragma GCC unroll 16
  for (int m = 0; m < kRowsPerTile; ++m) {
    const __m512i idot = _mm512_add_epi32(_mm512_load_si512(dots[m]), _mm512_set1_epi32(r.offset[m * blocks + b]));
    acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_mul_ps(scale, _mm512_set1_ps(r.dx[m * blocks + b])),
                                                 _mm512_cvtepi32_ps(idot)));
  }
}

inline void prefetch_tile(const uint8_t* t) {
  for (int64_t off = 0; off < kQ8TileBytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(t + kPrefetchBytes + off), _MM_HINT_T0);
}

// One group of 16 weight rows against the row block: acc[m] over every block of K, in order.
void q8_group(const uint8_t* group, int64_t K, const RowBlock& r, float* out, int64_t ldo, int64_t n0,
              int nvalid) {
  alignas(64) int32_t dots[2][kRowsPerTile][16];
  __m512 acc[kRowsPerTile];
#pragma GCC unroll 16
  for (int m = 0; m < kRowsPerTile; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t blocks = K / 32;
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    const uint8_t* t0 = group + b * kQ8TileBytes;
    const uint8_t* t1 = t0 + kQ8TileBytes;
    prefetch_tile(t0);
    prefetch_tile(t1);
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, r.q.data() + 32 * b, K);
    _tile_loadd(4, t0, 64);
    _tile_loadd(3, r.q.data() + 32 * (b + 1), K);
    _tile_loadd(5, t1, 64);
    _tile_dpbsud(0, 2, 4);
    _tile_dpbsud(1, 3, 5);
    _tile_stored(0, dots[0], 64);
    _tile_stored(1, dots[1], 64);
    q8_epilogue(t0, dots[0], r, b, blocks, acc);
    q8_epilogue(t1, dots[1], r, b + 1, blocks, acc);
  }
  if (b < blocks) {
    const uint8_t* t0 = group + b * kQ8TileBytes;
    _tile_zero(0);
    _tile_loadd(2, r.q.data() + 32 * b, K);
    _tile_loadd(4, t0, 64);
    _tile_dpbsud(0, 2, 4);
    _tile_stored(0, dots[0], 64);
    q8_epilogue(t0, dots[0], r, b, blocks, acc);
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << nvalid) - 1u);
  for (int m = 0; m < r.rows; ++m) _mm512_mask_storeu_ps(out + m * ldo + n0, mask, acc[m]);
}

// Groups g0..g1-1 on this thread (tile configuration is per thread state), every row block
// per group while its 11 KB of weights are in cache: the weights stream from memory once.
void q8_groups(const uint8_t* weights, int64_t g0, int64_t g1, int64_t rows, int64_t K,
               const std::vector<RowBlock>& blocks, float* out, int64_t ldo, int64_t row_start) {
  const TileConfig config = block_config();
  _tile_loadconfig(&config);
  for (int64_t g = g0; g < g1; ++g) {
    for (size_t i = 0; i < blocks.size(); ++i)
      q8_group(weights + g * (K / 32) * kQ8TileBytes, K, blocks[i], out + i * kRowsPerTile * ldo, ldo,
               row_start + 16 * g, static_cast<int>(std::min<int64_t>(16, rows - 16 * g)));
  }
  _tile_release();
}

#pragma GCC pop_options

// out[:, row_start : row_start + rows] = x @ W^T for a Q8_0 packed weight W [rows, K].
void q8_0_matmul(const torch::Tensor& q, const torch::Tensor& dx, const torch::Tensor& bsum,
                 const torch::Tensor& packed, int64_t rows, int64_t K, torch::Tensor& out, int64_t row_start) {
  // q [M, K] int8, dx [M, K/32] float32, bsum [M, K/16] int32, out [M, ldo] float32
  TORCH_CHECK(q.is_contiguous() && dx.is_contiguous() && bsum.is_contiguous() && out.is_contiguous() &&
                  packed.is_contiguous(), "q8_0_matmul: contiguous tensors expected");
  TORCH_CHECK(K % 32 == 0 && q.size(1) == K, "q8_0_matmul: K mismatch");
  const int64_t M = q.size(0), ldo = out.size(1), groups = (rows + 15) / 16;
  TORCH_CHECK(packed.numel() == groups * (K / 32) * kQ8TileBytes, "q8_0_matmul: packed size mismatch");
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  float* out_ptr = out.data_ptr<float>();
  std::vector<RowBlock> blocks;
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerTile)
    blocks.push_back(row_block(q.data_ptr<int8_t>(), dx.data_ptr<float>(), bsum.data_ptr<int32_t>(), m0,
                               static_cast<int>(std::min<int64_t>(kRowsPerTile, M - m0)), K));
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    q8_groups(weights, g0, g1, rows, K, blocks, out_ptr, ldo, row_start);
  });
}

}  // namespace qd_amx

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpu_supported", &qd_amx::cpu_supported);
  m.def("q8_0_matmul", &qd_amx::q8_0_matmul);
}
