// AVX2 tiles, one 8-row half of a 16-row weight group at a time (included by quant_linear.cpp
// inside its AVX2 section, after `Rows`; uses that section's helpers).
//
// Why halves: with both halves at once, a row of x keeps four ymm registers alive through a
// block (int16 pair sums and int32 dots of rows 0..7 and 8..15), so 8 rows of x need 32 and
// spill to L1 at every step.  With one half, a row keeps one int16 sum in a register through
// the steps of a block (its int32 dot and its float accumulator are touched once per flush or
// per block), so 8 rows of x fit in the 16 registers beside the weights and the step is one
// broadcast, one vpmaddubsw and one vpaddw per row: vpmaddubsw's port is what bounds it.  The
// halves read the same activation quants twice, from L1.
//
// Numerics: the very bits of tile<>: each block's dot is the same exact integer (the int16 sums
// are flushed before they can overflow: partial_steps), and the fp32 epilogue is the same
// operations on the same values in the same order, lane by lane.

// x's 4 quants at p in every int32 lane: vbroadcastss from memory, a load alone (set1 of a
// scalar read goes through a general register: two more vector operations per row and step)
QD_INLINE __m256i bcast4(const int8_t* p) {
  return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p)));
}

QD_INLINE __m256i widen16(__m256i sum) { return _mm256_madd_epi16(sum, _mm256_set1_epi16(1)); }

// w with `bit` added to the bytes of half h whose bit is set in step `step`'s mask: byte i of
// the result gets it where bit i of the half's 32 mask bits is set (vpshufb spreads mask byte
// i / 8 to byte i within each 128-bit lane).
QD_INLINE __m256i half_add_bits(__m256i w, const uint8_t* masks, int step, int h, char bit) {
  const __m256i spread = _mm256_shuffle_epi8(
      bcast4(reinterpret_cast<const int8_t*>(masks + 8 * step + 4 * h)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
  return _mm256_or_si256(w, _mm256_and_si256(set, _mm256_set1_epi8(bit)));
}

// Half h of steps s and s + 4 of a section of 2-bit crumbs (vectors 0 and 1, bits 2s).
QD_INLINE void half_crumbs(const uint8_t* section, int s, int h, __m256i& lo, __m256i& hi) {
  const __m256i m2 = _mm256_set1_epi8(0x03);
  lo = _mm256_and_si256(_mm256_srli_epi16(load32(section + 32 * h), 2 * s), m2);
  hi = _mm256_and_si256(_mm256_srli_epi16(load32(section + 64 + 32 * h), 2 * s), m2);
}

// Half h of step s of a nibble section, with bit 4 / bit 5 added from their masks.
template <bool FIVE_BITS, bool SIX_BITS>
QD_INLINE void half_section_step(const uint8_t* section, int s, int h, __m256i& lo, __m256i& hi) {
  const __m256i v = load32(section + 64 * s + 32 * h);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(v, m4);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  if constexpr (FIVE_BITS) {
    lo = half_add_bits(lo, section + 256, s, h, 0x10);
    hi = half_add_bits(hi, section + 256, s + 4, h, 0x10);
  }
  if constexpr (SIX_BITS) {
    lo = half_add_bits(lo, section + 320, s, h, 0x20);
    hi = half_add_bits(hi, section + 320, s + 4, h, 0x20);
  }
}

// sum[m] += w . x_m's 4 quants at k (int16 pair sums)
// (an empty asm per sum after each step keeps GCC from hoisting every step's products ahead
// of their adds, which spills them all to the stack)
template <int MB>
QD_INLINE void half_dots(__m256i* sum, __m256i w, const int8_t* const* xq, int64_t k) {
  QD_UNROLL
  for (int m = 0; m < MB; ++m) sum[m] = _mm256_add_epi16(sum[m], _mm256_maddubs_epi16(w, bcast4(xq[m] + k)));
  QD_UNROLL
  for (int m = 0; m < MB; ++m) __asm__("" : "+x"(sum[m]));
}

// idot[m] += the 32 k of a nibble section (4- or 5-bit quants) from k0: each int16 sum takes
// as many steps as stay below 2^15 (8 for 4 bits, 4 for 5).
template <int MB, bool FIVE_BITS>
QD_INLINE void half_nibble_block(const uint8_t* section, int h, const int8_t* const* xq, int64_t k0, __m256i* idot) {
  constexpr int kSectionsPerSum = partial_steps(FIVE_BITS ? 31 : 15) / 2;  // each s is two steps
  static_assert(kSectionsPerSum == (FIVE_BITS ? 2 : 4));
  QD_UNROLL
  for (int s0 = 0; s0 < 4; s0 += kSectionsPerSum) {
    __m256i sum[MB];
    QD_UNROLL
    for (int m = 0; m < MB; ++m) sum[m] = _mm256_setzero_si256();
    QD_UNROLL
    for (int s = s0; s < s0 + kSectionsPerSum; ++s) {
      __m256i lo, hi;
      half_section_step<FIVE_BITS, false>(section, s, h, lo, hi);
      half_dots<MB>(sum, lo, xq, k0 + 4 * s);
      half_dots<MB>(sum, hi, xq, k0 + 16 + 4 * s);
    }
    QD_UNROLL
    for (int m = 0; m < MB; ++m) idot[m] = _mm256_add_epi32(idot[m], widen16(sum[m]));
  }
}

// 8 fp16 / u8 / i8 values of half h as 8 lanes
QD_INLINE __m256 half_f16(const uint8_t* p, int h) { return _mm256_cvtph_ps(load16(p + 16 * h)); }
QD_INLINE __m256 half_u8_f32(const uint8_t* p, int h) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(load8(p + 8 * h)));
}
QD_INLINE __m256i half_i8_i32(const uint8_t* p, int h) { return _mm256_cvtepi8_epi32(load8(p + 8 * h)); }

// acc = acc + (scale * dx) * float(idot)
template <int MB>
QD_INLINE void half_add_scaled(__m256* acc, __m256 scale, const __m256i* idot, const float* const* dx, int64_t b) {
  QD_UNROLL
  for (int m = 0; m < MB; ++m)
    acc[m] = _mm256_add_ps(acc[m],
                           _mm256_mul_ps(_mm256_mul_ps(scale, _mm256_set1_ps(dx[m][b])), _mm256_cvtepi32_ps(idot[m])));
}

// acc = acc + ((ds * dx) * float(idot) - (dm * dx) * float(bsum32)) (add_scaled_min for 8 lanes)
template <int MB>
QD_INLINE void half_add_scaled_min(__m256* acc, __m256 ds, __m256 dm, const __m256i* idot, const float* const* dx,
                                   const int32_t* const* bsum, int64_t b) {
  QD_UNROLL
  for (int m = 0; m < MB; ++m) {
    const __m256 dxv = _mm256_set1_ps(dx[m][b]);
    const __m256 bs = _mm256_set1_ps(static_cast<float>(bsum[m][2 * b] + bsum[m][2 * b + 1]));
    const __m256 term = _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(ds, dxv), _mm256_cvtepi32_ps(idot[m])),
                                      _mm256_mul_ps(_mm256_mul_ps(dm, dxv), bs));
    acc[m] = _mm256_add_ps(acc[m], term);
  }
}

template <int MB>
QD_INLINE void half_init_offset(__m256i* idot, const int32_t* const* bsum, int64_t b, int32_t offset) {
  QD_UNROLL
  for (int m = 0; m < MB; ++m) idot[m] = _mm256_set1_epi32(-offset * (bsum[m][2 * b] + bsum[m][2 * b + 1]));
}

// idot[m] += w . x_m's 4 quants at k, for signed weight bytes w (|w| <= 127 or w = -128, so no
// pair sum saturates): |w| times x with w's sign.
template <int MB>
QD_INLINE void signed_half_dots(__m256i* idot, __m256i w, const int8_t* const* xq, int64_t k) {
  const __m256i mag = _mm256_abs_epi8(w);
  QD_UNROLL
  for (int m = 0; m < MB; ++m) {
    const __m256i x = _mm256_sign_epi8(bcast4(xq[m] + k), w);
    idot[m] = _mm256_add_epi32(idot[m], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, x), _mm256_set1_epi16(1)));
  }
}

// idot[m] += step s of half h of a Q8_0 tile (its 4 k from k0 + 4s) . x_m: the signed quants
// (stored + 128).
template <int MB>
QD_INLINE void q8_0_half_step(const uint8_t* t, int s, int h, int64_t k0, const Rows& r, __m256i* idot) {
  const __m256i w = _mm256_xor_si256(load32(t + 64 * s + 32 * h), _mm256_set1_epi8(static_cast<char>(0x80)));
  signed_half_dots<MB>(idot, w, r.xq, k0 + 4 * s);
}

// q8_0_half_step for narrow quants of x (|x| <= 63, Rows::offset128): the stored unsigned quants
// (w + 128) times x as they are, so idot starts at -128 * bsum instead.  No pair sum saturates
// (2 * 255 * 63 < 2^15), and without vpsignb the step is one multiply-pipe instruction shorter:
// the LM head at 8-16 rows ~20% faster on Zen 3 (docs/performance-log.md, session 59).
template <int MB>
QD_INLINE void q8_0_half_step_narrow(const uint8_t* t, int s, int h, int64_t k0, const Rows& r, __m256i* idot) {
  const __m256i w = load32(t + 64 * s + 32 * h);
  QD_UNROLL
  for (int m = 0; m < MB; ++m)
    idot[m] = _mm256_add_epi32(idot[m], widen16(_mm256_maddubs_epi16(w, bcast4(r.xq[m] + k0 + 4 * s))));
}

// idot's start for block b: 0 (signed quants), or -128 * x's quant sum (narrow: Rows::offset128)
template <int MB, bool NARROW>
QD_INLINE void q8_0_init(__m256i* idot, const Rows& r, int64_t b) {
  QD_UNROLL
  for (int m = 0; m < MB; ++m) idot[m] = NARROW ? _mm256_set1_epi32(r.offset128[m][b]) : _mm256_setzero_si256();
}

// Step s of half h of a Q8_0 tile, signed or narrow.
template <int MB, bool NARROW>
QD_INLINE void q8_0_step(const uint8_t* t, int s, int h, int64_t k0, const Rows& r, __m256i* idot) {
  if constexpr (NARROW)
    q8_0_half_step_narrow<MB>(t, s, h, k0, r, idot);
  else
    q8_0_half_step<MB>(t, s, h, k0, r, idot);
}

// The 8 steps of half h of a Q8_0 tile into idot (offset included), signed or narrow.
template <int MB, bool NARROW>
QD_INLINE void q8_0_half_block(const uint8_t* t, int h, int64_t k0, const Rows& r, __m256i* idot) {
  q8_0_init<MB, NARROW>(idot, r, k0 / 32);
  QD_UNROLL
  for (int s = 0; s < 8; ++s) {
    q8_0_step<MB, NARROW>(t, s, h, k0, r, idot);
    QD_UNROLL
    for (int m = 0; m < MB; ++m) __asm__("" : "+x"(idot[m]));  // as in half_dots
  }
}

// idot[m] += half h of a section of IQ4 indices (32 k from k0) . x_m: the signed levels, as Q8_0's
// quants (|w| <= 127).
template <int MB, int FMT>
QD_INLINE void iq4_half_block(const uint8_t* section, int h, const int8_t* const* xq, int64_t k0, __m256i* idot) {
  const __m256i table =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(level_table<FMT>())));
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  QD_UNROLL
  for (int s = 0; s < 4; ++s) {
    const __m256i v = load32(section + 64 * s + 32 * h);
    const __m256i w[2] = {_mm256_shuffle_epi8(table, _mm256_and_si256(v, m4)),
                          _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4))};
    QD_UNROLL
    for (int part = 0; part < 2; ++part) {
      signed_half_dots<MB>(idot, w[part], xq, k0 + 16 * part + 4 * s);
      QD_UNROLL
      for (int m = 0; m < MB; ++m) __asm__("" : "+x"(idot[m]));  // as in half_dots
    }
  }
}

// Half h of the 16 rows' values at one k of an F16 / BF16 tile, as floats (exactly).
template <int FMT>
QD_INLINE __m256 half_float16_lanes(const uint8_t* p, int h) {
  if constexpr (FMT == F16) return half_f16(p, h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load16(p + 16 * h)), 16));
}

// float16_tile for half h: the same chains, products and sums, lane by lane.
template <int FMT, int MB>
QD_INLINE void half_float16_tile(const uint8_t* t, int h, int64_t k0, const float* const* xf, __m256* acc) {
  __m256 chain[MB][4];
  QD_UNROLL
  for (int j = 0; j < 4; ++j) {
    const __m256 w = half_float16_lanes<FMT>(t + 32 * j, h);
    QD_UNROLL
    for (int m = 0; m < MB; ++m) chain[m][j] = _mm256_mul_ps(_mm256_broadcast_ss(xf[m] + k0 + j), w);
  }
  QD_UNROLL
  for (int k = 4; k < 32; k += 4) {
    QD_UNROLL
    for (int j = 0; j < 4; ++j) {
      const __m256 w = half_float16_lanes<FMT>(t + 32 * (k + j), h);
      QD_UNROLL
      for (int m = 0; m < MB; ++m)
        chain[m][j] = _mm256_add_ps(chain[m][j], _mm256_mul_ps(_mm256_broadcast_ss(xf[m] + k0 + k + j), w));
    }
  }
  QD_UNROLL
  for (int m = 0; m < MB; ++m)
    acc[m] = _mm256_add_ps(acc[m], _mm256_add_ps(_mm256_add_ps(chain[m][0], chain[m][1]),
                                                 _mm256_add_ps(chain[m][2], chain[m][3])));
}

// Half h of one tile (8 weight rows x kTileK values from k0) into the accumulators: tile<>
// for 8 lanes (NARROW: x's quants are narrow, Rows::offset128; Q8_0 only).
template <int FMT, int MB, bool NARROW>
QD_INLINE void half_tile(const uint8_t* t, int h, int64_t k0, const Rows& r, __m256* acc) {
  __m256i idot[MB];
  const int64_t b = k0 / 32;
  if constexpr (float16_format(FMT)) {
    half_float16_tile<FMT, MB>(t, h, k0, r.xf, acc);
  } else if constexpr (FMT == Q8_0) {
    q8_0_half_block<MB, NARROW>(t, h, k0, r, idot);
    half_add_scaled<MB>(acc, half_f16(t + 512, h), idot, r.dx, b);
  } else if constexpr (FMT == Q4_0 || FMT == Q5_0) {
    half_init_offset<MB>(idot, r.bsum, b, FMT == Q4_0 ? 8 : 16);
    half_nibble_block<MB, FMT == Q5_0>(t, h, r.xq, k0, idot);
    half_add_scaled<MB>(acc, half_f16(t + (FMT == Q4_0 ? 256 : 320), h), idot, r.dx, b);
  } else if constexpr (FMT == IQ4_NL || FMT == MXFP4) {
    QD_UNROLL
    for (int m = 0; m < MB; ++m) idot[m] = _mm256_setzero_si256();
    iq4_half_block<MB, FMT>(t, h, r.xq, k0, idot);
    half_add_scaled<MB>(acc, half_f16(t + 256, h), idot, r.dx, b);
  } else if constexpr (FMT == Q4_K || FMT == Q5_K) {
    const __m256 d = half_f16(t, h), dmin = half_f16(t + 32, h);
    constexpr int sub_bytes = FMT == Q4_K ? 256 : 320;
    for (int j = 0; j < 8; ++j) {
      const uint8_t* sub = t + 320 + sub_bytes * j;
      QD_UNROLL
      for (int m = 0; m < MB; ++m) idot[m] = _mm256_setzero_si256();
      half_nibble_block<MB, FMT == Q5_K>(sub, h, r.xq, k0 + 32 * j, idot);
      const __m256 ds = _mm256_mul_ps(d, half_u8_f32(t + 64 + 16 * j, h));
      const __m256 dm = _mm256_mul_ps(dmin, half_u8_f32(t + 192 + 16 * j, h));
      half_add_scaled_min<MB>(acc, ds, dm, idot, r.dx, r.bsum, b + j);
    }
  } else if constexpr (FMT == Q2_K) {  // tile<>'s Q2_K for 8 lanes: quants 0..3 as 2-bit crumbs
    static_assert(partial_steps(3) >= 4);
    const __m256 d = half_f16(t, h), dmin = half_f16(t + 32, h);
    const __m256i low4 = _mm256_set1_epi32(0x0F);
    for (int j = 0; j < 8; ++j) {
      const uint8_t* sub = t + 320 + 128 * j;
      const int64_t bj = b + j;
      const int64_t k = k0 + 32 * j;
      __m256i lo_sum[MB], hi_sum[MB];
      QD_UNROLL
      for (int m = 0; m < MB; ++m) lo_sum[m] = hi_sum[m] = _mm256_setzero_si256();
      QD_UNROLL
      for (int s = 0; s < 4; ++s) {  // 4 steps per int16 sum: at most 4 * 2 * 3 * 127 < 2^15
        __m256i lo, hi;
        half_crumbs(sub, s, h, lo, hi);
        half_dots<MB>(lo_sum, lo, r.xq, k + 4 * s);
        half_dots<MB>(hi_sum, hi, r.xq, k + 16 + 4 * s);
      }
      const __m256i sm_lo = _mm256_cvtepu8_epi32(load8(t + 64 + 32 * j + 8 * h));
      const __m256i sm_hi = _mm256_cvtepu8_epi32(load8(t + 80 + 32 * j + 8 * h));
      const __m256i sc_lo = _mm256_and_si256(sm_lo, low4), sc_hi = _mm256_and_si256(sm_hi, low4);
      const __m256i m_lo = _mm256_srli_epi32(sm_lo, 4), m_hi = _mm256_srli_epi32(sm_hi, 4);
      QD_UNROLL
      for (int m = 0; m < MB; ++m) {
        const __m256i dots = _mm256_add_epi32(_mm256_mullo_epi32(sc_lo, widen16(lo_sum[m])),
                                              _mm256_mullo_epi32(sc_hi, widen16(hi_sum[m])));
        const __m256i mins = _mm256_add_epi32(_mm256_mullo_epi32(m_lo, _mm256_set1_epi32(r.bsum[m][2 * bj])),
                                              _mm256_mullo_epi32(m_hi, _mm256_set1_epi32(r.bsum[m][2 * bj + 1])));
        const __m256 dxv = _mm256_set1_ps(r.dx[m][bj]);
        const __m256 term = _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(d, dxv), _mm256_cvtepi32_ps(dots)),
                                          _mm256_mul_ps(_mm256_mul_ps(dmin, dxv), _mm256_cvtepi32_ps(mins)));
        acc[m] = _mm256_add_ps(acc[m], term);
      }
    }
  } else if constexpr (FMT == Q4_1 || FMT == Q5_1) {
    QD_UNROLL
    for (int m = 0; m < MB; ++m) idot[m] = _mm256_setzero_si256();
    half_nibble_block<MB, FMT == Q5_1>(t, h, r.xq, k0, idot);
    constexpr int quant_bytes = FMT == Q4_1 ? 256 : 320;
    half_add_scaled_min<MB>(acc, half_f16(t + quant_bytes, h), half_f16(t + quant_bytes + 32, h), idot, r.dx, r.bsum,
                            b);
  } else if constexpr (FMT == Q6_K || FMT == Q3_K) {
    // 16-wide sub-blocks with int8 scales; quants 0..63 offset by 32 (Q6_K), 0..7 offset by 4 (Q3_K)
    static_assert(partial_steps(63) == 2);
    constexpr bool six = FMT == Q6_K;
    constexpr int32_t offset = six ? 32 : 4;
    const __m256 d = half_f16(t, h);
    for (int j = 0; j < 8; ++j) {
      const uint8_t* sub = t + 288 + (six ? 384 : 192) * j;
      const int64_t bj = b + j;
      const int64_t k = k0 + 32 * j;
      __m256i hi_dot[MB];
      QD_UNROLL
      for (int m = 0; m < MB; ++m) {
        idot[m] = _mm256_set1_epi32(-offset * r.bsum[m][2 * bj]);
        hi_dot[m] = _mm256_set1_epi32(-offset * r.bsum[m][2 * bj + 1]);
      }
      QD_UNROLL
      for (int s0 = 0; s0 < 4; s0 += 2) {  // two steps per int16 sum (Q6_K's bound; Q3_K's is higher)
        __m256i lo[2], hi[2];
        for (int i = 0; i < 2; ++i) {
          if constexpr (six) {
            half_section_step<true, true>(sub, s0 + i, h, lo[i], hi[i]);
          } else {  // crumbs, then bit 2 from its masks (at +128)
            half_crumbs(sub, s0 + i, h, lo[i], hi[i]);
            lo[i] = half_add_bits(lo[i], sub + 128, s0 + i, h, 0x04);
            hi[i] = half_add_bits(hi[i], sub + 128, s0 + i + 4, h, 0x04);
          }
        }
        __m256i sum[MB];
        QD_UNROLL
        for (int m = 0; m < MB; ++m) sum[m] = _mm256_setzero_si256();
        half_dots<MB>(sum, lo[0], r.xq, k + 4 * s0);
        half_dots<MB>(sum, lo[1], r.xq, k + 4 * s0 + 4);
        QD_UNROLL
        for (int m = 0; m < MB; ++m) {
          idot[m] = _mm256_add_epi32(idot[m], widen16(sum[m]));
          sum[m] = _mm256_setzero_si256();
        }
        half_dots<MB>(sum, hi[0], r.xq, k + 16 + 4 * s0);
        half_dots<MB>(sum, hi[1], r.xq, k + 16 + 4 * s0 + 4);
        QD_UNROLL
        for (int m = 0; m < MB; ++m) hi_dot[m] = _mm256_add_epi32(hi_dot[m], widen16(sum[m]));
      }
      const __m256i sc_lo = half_i8_i32(t + 32 + 16 * (2 * j), h);
      const __m256i sc_hi = half_i8_i32(t + 32 + 16 * (2 * j + 1), h);
      QD_UNROLL
      for (int m = 0; m < MB; ++m)
        idot[m] = _mm256_add_epi32(_mm256_mullo_epi32(sc_lo, idot[m]), _mm256_mullo_epi32(sc_hi, hi_dot[m]));
      half_add_scaled<MB>(acc, d, idot, r.dx, bj);
    }
  } else {  // IQ4_XS: 4-bit indices into 16 levels, int8 scales per 32, d per 256
    const __m256 d = half_f16(t, h);
    for (int j = 0; j < 8; ++j) {
      const int64_t bj = b + j;
      QD_UNROLL
      for (int m = 0; m < MB; ++m) idot[m] = _mm256_setzero_si256();
      iq4_half_block<MB, IQ4_XS>(t + 160 + 256 * j, h, r.xq, k0 + 32 * j, idot);
      const __m256i sc = half_i8_i32(t + 32 + 16 * j, h);
      QD_UNROLL
      for (int m = 0; m < MB; ++m) idot[m] = _mm256_mullo_epi32(sc, idot[m]);
      half_add_scaled<MB>(acc, d, idot, r.dx, bj);
    }
  }
}

// A Q8_0 tile for a row or two of x, both halves step by step: with so few rows the tile is
// read from memory at the pace of the steps (the LM head at one row: 7.1 ms against 7.5 ms
// for half after half), and the registers hold both halves' dots.
template <int MB, bool NARROW>
QD_INLINE void q8_0_tile_both_halves(const uint8_t* t, int64_t k0, const Rows& r, __m256* acc0, __m256* acc1) {
  __m256i idot[2][MB];
  const int64_t b = k0 / 32;
  q8_0_init<MB, NARROW>(idot[0], r, b);
  q8_0_init<MB, NARROW>(idot[1], r, b);
  QD_UNROLL
  for (int s = 0; s < 8; ++s) {
    q8_0_step<MB, NARROW>(t, s, 0, k0, r, idot[0]);
    q8_0_step<MB, NARROW>(t, s, 1, k0, r, idot[1]);
  }
  half_add_scaled<MB>(acc0, half_f16(t + 512, 0), idot[0], r.dx, b);
  half_add_scaled<MB>(acc1, half_f16(t + 512, 1), idot[1], r.dx, b);
}

// Rows m0..m0+MB-1 of x against weight group g (16 output rows), all of K: per tile, half 0 for
// every row, then half 1 (the group streams from memory once per pass).  NARROW: as half_tile's
// (a template argument: a test per tile made GCC's 8-row Q8_0 loop no faster than the signed one).
template <int FMT, int MB, bool NARROW>
QD_INLINE void half_group_rows(const uint8_t* group, int64_t ntiles, const Rows& r, float* out, int64_t ldo,
                               int64_t n0, int64_t nvalid) {
  __m256 acc[2][MB];
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MB; ++m) acc[h][m] = _mm256_setzero_ps();
  for (int64_t i = 0; i < ntiles; ++i) {
    const uint8_t* t = group + i * kTileBytes[FMT];
    // Every line of the tile 4 KiB (F16 / BF16: 8 KiB) ahead: the hardware prefetchers stop at
    // page boundaries and the small layer matrices are streamed from DRAM in short runs.
    for (int64_t off = 0; off < kTileBytes[FMT]; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(t + tile_prefetch_bytes(FMT) + off), kPrefetchHint);
    if constexpr (FMT == Q8_0 && MB <= 2) {
      q8_0_tile_both_halves<MB, NARROW>(t, i * kTileK[FMT], r, acc[0], acc[1]);
    } else {
      half_tile<FMT, MB, NARROW>(t, 0, i * kTileK[FMT], r, acc[0]);
      half_tile<FMT, MB, NARROW>(t, 1, i * kTileK[FMT], r, acc[1]);
    }
  }
  for (int m = 0; m < MB; ++m) store_lanes(out + m * ldo + n0, VecF{acc[0][m], acc[1][m]}, nvalid);
}
