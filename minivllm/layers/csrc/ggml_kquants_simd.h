// The K kinds' matmul (Q4_K, Q5_K, Q6_K), included after ggml_blocks_simd.h in the same two
// namespaces. The activations are quantized per block of 256 (QuantizedRows with block 256,
// llama.cpp's Q8_K), so a block's eight groups need no float work of their own: each group's
// 32 products are `vpmaddubsw` (unsigned codes times int8 activations, pairs summed in int16),
// then `vpmaddwd` by the group's integer scale (6-bit for Q4_K / Q5_K, int8 per 16 inputs for
// Q6_K), added as int32; the block's sum becomes a float once, times `d * step`. Q6_K's codes
// are used unsigned (0..63) and the offset of 32 subtracted once a block from the activations'
// integer sums per 16 (`bsums`); Q4_K / Q5_K's mins multiply the codes' values summed per
// group (`sums`), as on the 32-input path. All sums are exact in int32: a pair is at most
// 2 * 63 * 127, a group lane at most twice that times 128, a block eight groups.
//
// Needs from the including files: kQ4_K, kQ5_K, kQ6_K, geometry, fp16, QuantizedRows, kGroup,
// load32, high_bits, hsum, for_each_tile.

// Activations quantized with one step per block of 256 inputs (the SIMD twin of
// quantize_rows_scalar with block 256: the same codes).
inline void quantize_rows_k(const float* x, int64_t rows, int64_t k, QuantizedView out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < rows * (k / 256); ++i) {  // block i: 256 contiguous inputs
    const float* v = x + i * 256;
    __m256 absmax = _mm256_setzero_ps();
    for (int j = 0; j < 32; ++j) absmax = _mm256_max_ps(absmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * j)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(absmax), _mm256_extractf128_ps(absmax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    out.steps[i] = amax / 127.0f;
    for (int g = 0; g < 8; ++g) {  // a group of 32: four vectors of 8
      __m256i q[4];
      for (int j = 0; j < 4; ++j) {
        const __m256 f = _mm256_loadu_ps(v + 32 * g + 8 * j);
        q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(f, inverse),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      }
      const __m256i words01 = _mm256_packs_epi32(q[0], q[1]), words23 = _mm256_packs_epi32(q[2], q[3]);
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words01, words23),
                                                        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.codes + i * 256 + 32 * g), bytes);
      int code_sum = 0;
      for (int h = 0; h < 2; ++h) {  // the integer sums of inputs 0..15 and 16..31
        const __m256i pair = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(pair), _mm256_extracti128_si256(pair, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        out.bsums[i * 16 + 2 * g + h] = static_cast<int16_t>(_mm_cvtsi128_si32(t));
        code_sum += _mm_cvtsi128_si32(t);
      }
      out.sums[i * 8 + g] = out.steps[i] * static_cast<float>(code_sum);
    }
  }
}

// Group j's 32 codes unsigned, in input order: Q4_K 0..15, Q5_K 0..31, Q6_K 0..63 (the
// stored value, before its offset of 32).
template <int QT>
inline __m256i group_codes_u(const uint8_t* b, int j) {
  if constexpr (QT == kQ6_K) {
    const int half = j / 4, jj = j % 4;
    const __m256i v = load32(b + 64 * half + 32 * (jj & 1));
    const __m256i low = _mm256_and_si256(jj >= 2 ? _mm256_srli_epi16(v, 4) : v,
                                         _mm256_set1_epi8(0x0F));
    return _mm256_or_si256(low, high_bits(load32(b + 128 + 32 * half), 2 * jj, 3));
  } else {
    return group_codes<QT>(b, j);
  }
}

// A K block's integer scales as 16-bit lanes for `vpmaddwd`, its fp32 `d` and (Q4_K / Q5_K)
// its eight mins as floats (`-dmin * m`). Q4_K / Q5_K: scale j at element j of both 128-bit
// lanes; Q6_K: its sixteen int8 scales in order (lane 0: inputs 0..127, lane 1: 128..255).
template <int QT>
inline __m256i k_int_scales(const uint8_t* b, float& d, __m256& min8) {
  if constexpr (QT == kQ6_K) {
    d = fp16(b + 208);
    min8 = _mm256_setzero_ps();
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
  } else {
    uint32_t lo, mid, hi;  // as simd_block_scales unpacks them
    std::memcpy(&lo, b + 4, 4);
    std::memcpy(&mid, b + 8, 4);
    std::memcpy(&hi, b + 12, 4);
    const uint32_t sc_high = (hi & 0x0F0F0F0Fu) | ((lo >> 2) & 0x30303030u);
    const uint32_t m_high = ((hi >> 4) & 0x0F0F0F0Fu) | ((mid >> 2) & 0x30303030u);
    const __m128i sc = _mm_setr_epi32(static_cast<int>(lo & 0x3F3F3F3Fu), static_cast<int>(sc_high), 0, 0);
    const __m128i m = _mm_setr_epi32(static_cast<int>(mid & 0x3F3F3F3Fu), static_cast<int>(m_high), 0, 0);
    d = fp16(b);
    min8 = _mm256_mul_ps(_mm256_set1_ps(-fp16(b + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m)));
    return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sc));
  }
}

// Group j's scale in every 16-bit lane that holds its products: Q4_K / Q5_K one scale for the
// group; Q6_K the scale of inputs 0..15 in lane 0, of 16..31 in lane 1 (from `both`, the
// block's scales 0..7 or 8..15 copied into both lanes).
template <int QT>
inline __m256i group_scale(__m256i scales, __m256i both_low, __m256i both_high, int j) {
  if constexpr (QT == kQ6_K) {
    const int jj = j % 4;
    const __m256i pick = _mm256_setr_m128i(_mm_set1_epi16(static_cast<short>(((4 * jj + 1) << 8) | (4 * jj))),
                                           _mm_set1_epi16(static_cast<short>(((4 * jj + 3) << 8) | (4 * jj + 2))));
    return _mm256_shuffle_epi8(j < 4 ? both_low : both_high, pick);
  } else {
    return _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<short>(((2 * j + 1) << 8) | (2 * j))));
  }
}

// Output column n (its weight row `w` of `blocks` K blocks) for the `Rows` activation rows
// [row0, row0 + Rows): y[r * ldy].
template <int QT, int Rows>
void dot_row_k(const uint8_t* w, int64_t blocks, const QuantizedRows& xq, int64_t row0, int64_t k,
               float* y, int64_t ldy) {
  constexpr Geometry geo = geometry(QT);
  const int64_t row_groups = k / kGroup;
  const int8_t* codes = xq.codes.data() + row0 * k;
  const float* steps = xq.steps.data() + row0 * blocks;
  const float* sums = xq.sums.data() + row0 * row_groups;
  const int16_t* bsums = xq.bsums.data() + row0 * (k / 16);
  __m256 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = w + blk * geo.bytes;
    float d;
    __m256 min8;
    const __m256i scales = k_int_scales<QT>(b, d, min8);
    const __m256i both_low = _mm256_permute4x64_epi64(scales, 0x44);
    const __m256i both_high = _mm256_permute4x64_epi64(scales, 0xEE);
    __m256i isum[Rows];
    for (int r = 0; r < Rows; ++r) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i q = group_codes_u<QT>(b, j);
      const __m256i scale = group_scale<QT>(scales, both_low, both_high, j);
#pragma GCC unroll 4
      for (int r = 0; r < Rows; ++r) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + r * k + blk * 256 + 32 * j));
        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), scale));
        // Keeps each row's sum in a register, added in order: left free, GCC regroups the
        // integer adds into a tree and spills every product to the stack (benchmarks/int8_peak.py).
        asm("" : "+x"(isum[r]));
      }
    }
    for (int r = 0; r < Rows; ++r) {
      if constexpr (QT == kQ6_K) {  // the codes' offset: 32 * sum over 16s of scale * inputs
        const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums + r * (k / 16) + blk * 16));
        isum[r] = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(_mm256_madd_epi16(scales, xs), 5));
      }
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * steps[r * blocks + blk]), acc[r]);
      if constexpr (QT != kQ6_K) {
        acc[r] = _mm256_fmadd_ps(min8, _mm256_loadu_ps(sums + r * row_groups + blk * 8), acc[r]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r) y[r * ldy] = hsum(acc[r]);
}

// Output columns [begin, end) of a K-kind weight for every row of xq (block 256): y[r * ldy +
// n], tile by tile (for_each_tile).
template <int QT>
void matmul_columns_k_of(const uint8_t* weights, int64_t row_bytes, const QuantizedRows& xq,
                         int64_t rows, int64_t k, float* y, int64_t ldy, int64_t begin,
                         int64_t end) {
  const int64_t blocks = k / 256;
  for_each_tile(rows, begin, end, [&](int64_t n, int64_t r0, auto tile_rows) {
    dot_row_k<QT, decltype(tile_rows)::value>(weights + n * row_bytes, blocks, xq, r0, k,
                                              y + r0 * ldy + n, ldy);
  });
}

inline void matmul_columns_k(int qtype, const uint8_t* weights, int64_t row_bytes,
                             const QuantizedRows& xq, int64_t rows, int64_t k, float* y,
                             int64_t ldy, int64_t begin, int64_t end) {
  switch (qtype) {
    case kQ4_K: return matmul_columns_k_of<kQ4_K>(weights, row_bytes, xq, rows, k, y, ldy, begin, end);
    case kQ5_K: return matmul_columns_k_of<kQ5_K>(weights, row_bytes, xq, rows, k, y, ldy, begin, end);
    case kQ6_K: return matmul_columns_k_of<kQ6_K>(weights, row_bytes, xq, rows, k, y, ldy, begin, end);
    default: return;
  }
}
