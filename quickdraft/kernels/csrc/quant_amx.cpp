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
// Formats: Q8_0 (the LM head of the GGUFs we ship), whose packed tile already is the B-tile
// layout (8 steps x 16 outputs x 4 k bytes), so B loads straight from the weights; and Q5_0
// (two thirds of the embedded model's layer MACs), whose tiles are unpacked once per group of 16
// weight rows into that layout (quants 0..31, offset 16) and reused by every row block.
//
// The layer's prefill and wide verification reach these tiles through a function pointer
// (wide_matmul_address) that quant_linear.cpp's decoder layer calls for M >= a threshold.

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

// quant_linear.cpp's format ids and packed tiles (16 weight rows x 32 k each)
enum Format : int64_t { Q8_0 = 0, Q5_0 = 2 };
constexpr int64_t kQ8TileBytes = 544;  // 8 x 64 quant bytes + 16 fp16 scales
constexpr int64_t kQ5TileBytes = 352;  // 4 x 64 nibble bytes + 8 x 8 bit-4 mask bytes + 16 fp16 scales
constexpr int64_t kBTileBytes = 512;
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
  std::vector<int32_t> bsum;   // [16, K / 32]: the sum of the block's 32 quants
  int rows;
};

RowBlock row_block(const int8_t* q, const float* dx, const int32_t* bsum16, int64_t m0, int rows, int64_t K) {
  RowBlock r{std::vector<int8_t>(kRowsPerTile * K, 0), std::vector<float>(kRowsPerTile * (K / 32), 0.0f),
             std::vector<int32_t>(kRowsPerTile * (K / 32), 0), rows};
  for (int m = 0; m < rows; ++m) {
    std::memcpy(r.q.data() + m * K, q + (m0 + m) * K, K);
    std::memcpy(r.dx.data() + m * (K / 32), dx + (m0 + m) * (K / 32), sizeof(float) * (K / 32));
    for (int64_t b = 0; b < K / 32; ++b)
      r.bsum[m * (K / 32) + b] = bsum16[(m0 + m) * (K / 16) + 2 * b] + bsum16[(m0 + m) * (K / 16) + 2 * b + 1];
  }
  return r;
}

template <int64_t FMT>
struct Layout {
  static constexpr int64_t kTileBytes = FMT == Q8_0 ? kQ8TileBytes : kQ5TileBytes;
  static constexpr int64_t kScaleAt = FMT == Q8_0 ? 512 : 320;  // the 16 fp16 scales in a tile
  static constexpr int32_t kOffset = FMT == Q8_0 ? 128 : 16;   // stored quants = signed quants + offset
};

// acc[m] += (scale * dx) * float(dots - offset * bsum) for block b: the weights are stored
// offset (unsigned), the integer correction keeps the block dot exact (quant_linear.cpp folds
// the same correction in first: the same integer).  The first R rows, unrolled, so the
// accumulators stay in registers.  R is the row block's rows rounded up to 4: the epilogue, not
// the tiles, bounds this kernel, so a 5-row verification should not pay for 16 (rows past M are
// zeros, their results unused).
template <int R, int32_t OFFSET>
__attribute__((always_inline)) inline void epilogue(const uint8_t* scales, const int32_t (*dots)[16],
                                                    const RowBlock& r, int64_t b, int64_t blocks, __m512* acc) {
  const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
#pragma GCC unroll 16
  for (int m = 0; m < R; ++m) {
    const __m512i idot = _mm512_add_epi32(_mm512_load_si512(dots[m]), _mm512_set1_epi32(-OFFSET * r.bsum[m * blocks + b]));
    acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_mul_ps(scale, _mm512_set1_ps(r.dx[m * blocks + b])),
                                                 _mm512_cvtepi32_ps(idot)));
  }
}

inline void prefetch_tile(const uint8_t* t, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(t + kPrefetchBytes + off), _MM_HINT_T0);
}

// A Q5_0 tile's B tile: quants 0..31 (low nibble + bit 4), k-quad s < 4 from the low nibbles of
// step s, k-quad 4 + s from its high nibbles, as quant_linear.cpp's nibble_block reads them.
inline void unpack_q5_0(const uint8_t* t, uint8_t* out) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  for (int s = 0; s < 4; ++s) {
    const __m512i v = _mm512_loadu_si512(t + 64 * s);
    uint64_t lo_bits, hi_bits;
    std::memcpy(&lo_bits, t + 256 + 8 * s, 8);
    std::memcpy(&hi_bits, t + 256 + 8 * (s + 4), 8);
    __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(lo_bits), lo, bit4);
    hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(hi_bits), hi, bit4);
    _mm512_store_si512(out + 64 * s, lo);
    _mm512_store_si512(out + 64 * (s + 4), hi);
  }
}

// One group of 16 weight rows against the row block: acc[m] over every block of K, in order.
// b_tiles: the group's B tiles (kBTileBytes apart after unpacking, else the packed tiles).
template <int64_t FMT, int R>
void group_block(const uint8_t* group, const uint8_t* b_tiles, int64_t b_stride, int64_t K, const RowBlock& r,
                 float* out, int64_t ldo, int64_t n0, int nvalid) {
  using L = Layout<FMT>;
  alignas(64) int32_t dots[2][kRowsPerTile][16];
  __m512 acc[R];
#pragma GCC unroll 16
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t blocks = K / 32;
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    const uint8_t* t0 = group + b * L::kTileBytes;
    const uint8_t* t1 = t0 + L::kTileBytes;
    if (FMT == Q8_0) {
      prefetch_tile(t0, L::kTileBytes);
      prefetch_tile(t1, L::kTileBytes);
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, r.q.data() + 32 * b, K);
    _tile_loadd(4, b_tiles + b * b_stride, 64);
    _tile_loadd(3, r.q.data() + 32 * (b + 1), K);
    _tile_loadd(5, b_tiles + (b + 1) * b_stride, 64);
    _tile_dpbsud(0, 2, 4);
    _tile_dpbsud(1, 3, 5);
    _tile_stored(0, dots[0], 64);
    _tile_stored(1, dots[1], 64);
    epilogue<R, L::kOffset>(t0 + L::kScaleAt, dots[0], r, b, blocks, acc);
    epilogue<R, L::kOffset>(t1 + L::kScaleAt, dots[1], r, b + 1, blocks, acc);
  }
  if (b < blocks) {
    const uint8_t* t0 = group + b * L::kTileBytes;
    _tile_zero(0);
    _tile_loadd(2, r.q.data() + 32 * b, K);
    _tile_loadd(4, b_tiles + b * b_stride, 64);
    _tile_dpbsud(0, 2, 4);
    _tile_stored(0, dots[0], 64);
    epilogue<R, L::kOffset>(t0 + L::kScaleAt, dots[0], r, b, blocks, acc);
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << nvalid) - 1u);
  for (int m = 0; m < r.rows; ++m) _mm512_mask_storeu_ps(out + m * ldo + n0, mask, acc[m]);
}

// Groups g0..g1-1 on this thread (tile configuration is per thread state), every row block
// per group while its weights are in cache: the weights stream from memory once, and a Q5_0
// group is unpacked once.
template <int64_t FMT>
void groups_on_thread(const uint8_t* weights, int64_t g0, int64_t g1, int64_t rows, int64_t K,
                      const std::vector<RowBlock>& blocks, float* out, int64_t ldo, int64_t row_start) {
  using L = Layout<FMT>;
  const TileConfig config = block_config();
  _tile_loadconfig(&config);
  std::vector<uint8_t, std::allocator<uint8_t>> unpacked;
  uint8_t* aligned = nullptr;
  if (FMT != Q8_0) {
    unpacked.resize((K / 32) * kBTileBytes + 64);
    aligned = unpacked.data() + (64 - reinterpret_cast<uintptr_t>(unpacked.data()) % 64) % 64;
  }
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* group = weights + g * (K / 32) * L::kTileBytes;
    const uint8_t* b_tiles = group;
    int64_t b_stride = L::kTileBytes;
    if (FMT != Q8_0) {
      for (int64_t b = 0; b < K / 32; ++b) unpack_q5_0(group + b * L::kTileBytes, aligned + b * kBTileBytes);
      b_tiles = aligned, b_stride = kBTileBytes;
    }
    const int nvalid = static_cast<int>(std::min<int64_t>(16, rows - 16 * g));
    for (size_t i = 0; i < blocks.size(); ++i) {
      float* block_out = out + i * kRowsPerTile * ldo;
      const int64_t n0 = row_start + 16 * g;
      switch ((blocks[i].rows + 3) / 4) {
        case 1: group_block<FMT, 4>(group, b_tiles, b_stride, K, blocks[i], block_out, ldo, n0, nvalid); break;
        case 2: group_block<FMT, 8>(group, b_tiles, b_stride, K, blocks[i], block_out, ldo, n0, nvalid); break;
        case 3: group_block<FMT, 12>(group, b_tiles, b_stride, K, blocks[i], block_out, ldo, n0, nvalid); break;
        default: group_block<FMT, 16>(group, b_tiles, b_stride, K, blocks[i], block_out, ldo, n0, nvalid); break;
      }
    }
  }
  _tile_release();
}

#pragma GCC pop_options

bool supports(int64_t format) { return format == Q8_0 || format == Q5_0; }

// out[:, row_start : row_start + rows] = x @ W^T for a packed W [rows, K] of `format` (Q8_0 or
// Q5_0); x as quant_linear.cpp's quantize_rows gives it: q [M, K], dx [M, K/32], bsum [M, K/16].
void matmul_raw(int64_t format, const int8_t* q, const float* dx, const int32_t* bsum, const uint8_t* weights,
                int64_t rows, int64_t K, int64_t M, float* out, int64_t ldo, int64_t row_start) {
  const int64_t groups = (rows + 15) / 16;
  std::vector<RowBlock> blocks;
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerTile)
    blocks.push_back(row_block(q, dx, bsum, m0, static_cast<int>(std::min<int64_t>(kRowsPerTile, M - m0)), K));
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    if (format == Q8_0) groups_on_thread<Q8_0>(weights, g0, g1, rows, K, blocks, out, ldo, row_start);
    else groups_on_thread<Q5_0>(weights, g0, g1, rows, K, blocks, out, ldo, row_start);
  });
}

void matmul(const torch::Tensor& q, const torch::Tensor& dx, const torch::Tensor& bsum, const torch::Tensor& packed,
            int64_t format, int64_t rows, int64_t K, torch::Tensor& out, int64_t row_start) {
  // q [M, K] int8, dx [M, K/32] float32, bsum [M, K/16] int32, out [M, ldo] float32
  TORCH_CHECK(supports(format), "amx matmul: format ", format, " has no tile kernel");
  TORCH_CHECK(q.is_contiguous() && dx.is_contiguous() && bsum.is_contiguous() && out.is_contiguous() &&
                  packed.is_contiguous(), "amx matmul: contiguous tensors expected");
  TORCH_CHECK(K % 32 == 0 && q.size(1) == K, "amx matmul: K mismatch");
  const int64_t tile_bytes = format == Q8_0 ? kQ8TileBytes : kQ5TileBytes;
  TORCH_CHECK(packed.numel() == (rows + 15) / 16 * (K / 32) * tile_bytes, "amx matmul: packed size mismatch");
  TORCH_CHECK(out.size(0) == q.size(0) && row_start >= 0 && row_start + rows <= out.size(1),
              "amx matmul: bad output tensor");
  matmul_raw(format, q.data_ptr<int8_t>(), dx.data_ptr<float>(), bsum.data_ptr<int32_t>(), packed.data_ptr<uint8_t>(),
             rows, K, q.size(0), out.data_ptr<float>(), out.size(1), row_start);
}

}  // namespace qd_amx

// For quant_linear.cpp's decoder layer: a plain C function it calls through this address.
extern "C" void qd_amx_matmul(int64_t format, const int8_t* q, const float* dx, const int32_t* bsum,
                              const uint8_t* weights, int64_t rows, int64_t K, int64_t M, float* out, int64_t ldo,
                              int64_t row_start) {
  qd_amx::matmul_raw(format, q, dx, bsum, weights, rows, K, M, out, ldo, row_start);
}


PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("cpu_supported", &qd_amx::cpu_supported);
  m.def("matmul", &qd_amx::matmul, "out[:, row_start:row_start+rows] = x @ W^T for a Q8_0 or Q5_0 packed W",
        py::call_guard<py::gil_scoped_release>());
  m.def("supports", &qd_amx::supports);
  m.def("matmul_address", []() { return reinterpret_cast<int64_t>(&qd_amx_matmul); });
}
