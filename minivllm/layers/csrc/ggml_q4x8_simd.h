// Q4_0 and Q4_1 weights repacked eight rows at a time ("x8"), and their matmul. Included by
// ggml_blocks.cpp in namespaces avx2 and vnni, after ggml_blocks_simd.h.
//
// Why a second layout: in ggml's own, a group's 32 products end as eight int32 lanes of ONE
// output column, so each group and activation row pays a float conversion, a scale and a
// multiply-add for 32 products. Interleaving eight weight rows puts eight output columns in
// the eight lanes: a 32-byte vector holds, for each of the 8 rows, the 4 stored bytes of the
// same 4 input pairs, and one broadcast of 4 activation bytes multiplies all 8 rows. The
// float work of a group is then paid once for 8 columns (256 products), and no lane is ever
// added across. The bytes are the file's bytes, moved (`repack_q4x8`): no value changes.
//
// One x8 group (32 inputs of 8 rows): 128 B of codes, vector u (u = 0..3) holding in lane c
// the stored bytes 4u..4u+3 of row c (low nibble: inputs 4u + b, high: 16 + 4u + b), then the
// 8 rows' fp16 d, then (Q4_1) their fp16 m. The codes are multiplied unsigned (0..15); Q4_0's
// offset of 8 is taken off the integer sum once a group, so both kinds compute the products of
// ggml's values with the activations' two codes: Q4_0 d * step / 254 * sum((q - 8) (254 xq +
// xf)), Q4_1 d * step / 254 * sum(q (254 xq + xf)) + m * sum(x).

// Bytes of one x8 group.
constexpr int q4x8_group_bytes(int qt) { return qt == kQ4_1 ? 160 : 144; }
// How far ahead of its reads a tile's kernel asks memory for weight bytes: a one-row step
// streams every weight once, faster than the hardware prefetcher alone keeps up with
// (docs/ggml-kernels.md, "Prefetch").
constexpr int kQ4x8Ahead = 2048;

// Output columns [n0, n0 + 8) for the `Rows` activation rows [row0, row0 + Rows): y[r * ldy + c].
// Each activation has two codes (QuantizedRows' fine ones: x = step * (q + f / 254)), so a
// group's integer is sum(w * (254 q + f)), from two int16 sums (q's, f's) joined by one
// multiply-add by (254, 1) pairs.
template <int QT, int Rows>
void dot_tile_q4x8(const uint8_t* tile, int64_t groups, const QuantizedRows& xq, int64_t row0,
                   int64_t k, float* y, int64_t ldy) {
  constexpr int kBytes = q4x8_group_bytes(QT);
  const int8_t* codes = xq.codes.data() + row0 * k;
  const int8_t* fine = xq.fine.data() + row0 * k;
  const float* steps = xq.steps.data() + row0 * groups;
  const float* sums = xq.sums.data() + row0 * groups;
  const int32_t* fine_sums = xq.fine_sums.data() + row0 * groups;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256 per_fine = _mm256_set1_ps(1.0f / 254.0f);
  __m256 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* b = tile + g * kBytes;
    _mm_prefetch(reinterpret_cast<const char*>(b + kQ4x8Ahead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + kQ4x8Ahead + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + kQ4x8Ahead + 128), _MM_HINT_T0);
    __m256i coarse[Rows], rest[Rows];
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      const __m256i w = load32(b + 32 * u);
      const __m256i lo = _mm256_and_si256(w, nibble);  // inputs 4u..4u+3 of the 8 rows
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);  // 16 + those
#pragma GCC unroll 4  // each row's sums registers of their own, not an array in memory
      for (int r = 0; r < Rows; ++r) {
        const int64_t at = r * k + g * kGroup + 4 * u;
        int32_t q_lo, q_hi, f_lo, f_hi;  // the same 4 activation bytes for all 8 rows
        std::memcpy(&q_lo, codes + at, 4);
        std::memcpy(&q_hi, codes + at + 16, 4);
        std::memcpy(&f_lo, fine + at, 4);
        std::memcpy(&f_hi, fine + at + 16, 4);
#ifdef MINIVLLM_GGML_VNNI
        if (u == 0) coarse[r] = rest[r] = _mm256_setzero_si256();
        coarse[r] = _mm256_dpbusd_epi32(coarse[r], lo, _mm256_set1_epi32(q_lo));
        coarse[r] = _mm256_dpbusd_epi32(coarse[r], hi, _mm256_set1_epi32(q_hi));
        rest[r] = _mm256_dpbusd_epi32(rest[r], lo, _mm256_set1_epi32(f_lo));
        rest[r] = _mm256_dpbusd_epi32(rest[r], hi, _mm256_set1_epi32(f_hi));
#else
        // int16 sums of at most 16 products of 15 * 128: exact, below 2^15
        const __m256i c = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(q_lo)),
                                           _mm256_maddubs_epi16(hi, _mm256_set1_epi32(q_hi)));
        const __m256i f = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(f_lo)),
                                           _mm256_maddubs_epi16(hi, _mm256_set1_epi32(f_hi)));
        coarse[r] = u == 0 ? c : _mm256_add_epi16(coarse[r], c);
        rest[r] = u == 0 ? f : _mm256_add_epi16(rest[r], f);
#endif
        // keeps each sum in a register, added in order: left free, GCC computes every product
        // first and spills them all to the stack
        asm("" : "+x"(coarse[r]), "+x"(rest[r]));
      }
    }
    const __m256 d = _mm256_mul_ps(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 128))), per_fine);
    for (int r = 0; r < Rows; ++r) {
#ifdef MINIVLLM_GGML_VNNI
      __m256i sum32 = _mm256_add_epi32(
          _mm256_sub_epi32(_mm256_slli_epi32(coarse[r], 8), _mm256_slli_epi32(coarse[r], 1)), rest[r]);
#else
      // (254 q + f) summed: 32-bit pair sums of the two int16 sums, weighted 254 and 1
      __m256i sum32 = _mm256_add_epi32(_mm256_madd_epi16(coarse[r], _mm256_set1_epi16(254)),
                                       _mm256_madd_epi16(rest[r], _mm256_set1_epi16(1)));
#endif
      if constexpr (QT == kQ4_0) {  // centred as ggml's Q4_0 (q - 8): the same integers
        sum32 = _mm256_sub_epi32(sum32, _mm256_set1_epi32(8 * fine_sums[r * groups + g]));
      }
      const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(steps[r * groups + g]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum32), scale, acc[r]);
      if constexpr (QT == kQ4_1) {
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 144)));
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sums[r * groups + g]), acc[r]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

// Calls tile(t, r0, Rows) for every x8 tile t with columns in [begin, end) (multiples of 8)
// and activation rows [r0, r0 + Rows) of `rows`, Rows a std::integral_constant of 1..4 (or 8,
// where `MaxRows` is 8): activation rows 64 at a time (their codes stay in L2), tiles 4 at a
// time (32 weight rows stay in L1 while each 4 or 8 activation rows meet them). The x8
// kernels' loop. Kept out of line: inlined into the traits table's thin wrappers in
// ggml_blocks.cpp, GCC compiled the AVX2 tile loops slower at several activation rows
// (`benchmarks/ggml_kernels.py --rows 16`); out of line, as when an if-chain called them,
// they run as before.
// With Span 2, tile(t, ...) takes tiles t and t + 1 (16 columns), and [begin, end) must hold
// an even number of tiles.
template <int MaxRows = 4, int Span = 1, typename Tile>
[[gnu::noinline]] void for_each_x8_tile(int64_t rows, int64_t begin, int64_t end, Tile tile) {
  for (int64_t c0 = 0; c0 < rows; c0 += 64) {
    const int64_t c1 = std::min(rows, c0 + 64);
    for (int64_t t0 = begin / 8; t0 < end / 8; t0 += 4) {
      const int64_t t1 = std::min(end / 8, t0 + 4);
      for (int64_t r0 = c0; r0 < c1;) {
        const int64_t step = MaxRows == 8 && c1 - r0 >= 8 ? 8 : std::min<int64_t>(4, c1 - r0);
        for (int64_t t = t0; t < t1; t += Span) {
          switch (step) {
            case 8:
              if constexpr (MaxRows == 8) tile(t, r0, std::integral_constant<int, 8>{});
              break;
            case 4: tile(t, r0, std::integral_constant<int, 4>{}); break;
            case 3: tile(t, r0, std::integral_constant<int, 3>{}); break;
            case 2: tile(t, r0, std::integral_constant<int, 2>{}); break;
            default: tile(t, r0, std::integral_constant<int, 1>{}); break;
          }
        }
        r0 += step;
      }
    }
  }
}

// Output columns [begin, end) (multiples of 8) of every row of xq, from x8 tiles of
// `tile_bytes` each.
template <int QT>
void matmul_columns_q4x8_of(const uint8_t* tiles, int64_t tile_bytes, const QuantizedRows& xq,
                            int64_t rows, int64_t k, float* y, int64_t ldy, int64_t begin,
                            int64_t end) {
  for_each_x8_tile(rows, begin, end, [&](int64_t t, int64_t r0, auto tile_rows) {
    dot_tile_q4x8<QT, decltype(tile_rows)::value>(tiles + t * tile_bytes, k / kGroup, xq, r0, k,
                                                   y + r0 * ldy + 8 * t, ldy);
  });
}

inline void matmul_columns_q4x8(int qtype, const uint8_t* tiles, int64_t tile_bytes,
                                const QuantizedRows& xq, int64_t rows, int64_t k, float* y,
                                int64_t ldy, int64_t begin, int64_t end) {
  if (qtype == kQ4_1) {
    matmul_columns_q4x8_of<kQ4_1>(tiles, tile_bytes, xq, rows, k, y, ldy, begin, end);
  } else {
    matmul_columns_q4x8_of<kQ4_0>(tiles, tile_bytes, xq, rows, k, y, ldy, begin, end);
  }
}
