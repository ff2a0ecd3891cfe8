// Q8_0 and Q5_0 weights in tiles of eight rows of 8-bit codes ("q8x8"), and their matmul.
// Included by ggml_blocks.cpp in namespaces avx2 and vnni, after ggml_q4x8_simd.h (its
// x8 loop) and ggml_q4kx8_simd.h (kKTileRows: 8 rows at once with VNNI, each weight vector's
// load shared by twice the rows).
//
// Why: in the stored layout each group of 32 products ends in eight int32 lanes of one output
// column, so every group, column and activation row pays a horizontal sum, a float conversion
// and a multiply-add (the Q4_0/Q4_1 x8 comment in ggml_q4x8_simd.h). With eight rows side by
// side the lanes are eight columns and that float work is paid once for 256 products. A
// 262k-row Q8_0 LM head (Gemma 3's tied embedding) at 16 activation rows, two codes each, took
// 84 ms a step that way.
//
// One q8x8 group (32 inputs of 8 rows): 256 B of signed codes, vector u (u = 0..7) holding in
// lane c the codes of inputs 4u..4u+3 of row c, then the 8 rows' fp16 d. Q8_0's codes are its
// stored bytes, moved; Q5_0's are its 5-bit codes centred (q - 16) and widened to a byte each
// (22 -> 34 bytes a block): d * code is then its value as ggml computes it, and one kernel
// serves both. The activations carry two codes (x = step * (q + f / 254), QuantizedRows' fine
// ones), so a group's integer is sum(w * (254 q + f)) and its value d * step / 254 times that.

// Bytes of one q8x8 group.
constexpr int kQ8x8GroupBytes = 272;

// Output columns [n0, n0 + 8) for the `Rows` activation rows [row0, row0 + Rows): y[r * ldy + c].
template <int Rows>
void dot_tile_q8x8(const uint8_t* tile, int64_t groups, const QuantizedRows& xq, int64_t row0,
                   int64_t k, float* y, int64_t ldy) {
  const int8_t* codes = xq.codes.data() + row0 * k;
  const int8_t* fine = xq.fine.data() + row0 * k;
  const float* steps = xq.steps.data() + row0 * groups;
  const int32_t* fine_sums = xq.fine_sums.data() + row0 * groups;
  const __m256 per_fine = _mm256_set1_ps(1.0f / 254.0f);
  __m256 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* b = tile + g * kQ8x8GroupBytes;
    _mm_prefetch(reinterpret_cast<const char*>(b + kQ4x8Ahead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + kQ4x8Ahead + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + kQ4x8Ahead + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + kQ4x8Ahead + 192), _MM_HINT_T0);
    __m256i coarse[Rows], rest[Rows];  // sum(w q), sum(w f) (VNNI: w plus 128)
    for (int r = 0; r < Rows; ++r) coarse[r] = rest[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      const __m256i w = load32(b + 32 * u);  // inputs 4u..4u+3 of the 8 rows
#ifdef MINIVLLM_GGML_VNNI
      // vpdpbusd multiplies unsigned by signed bytes: the codes plus 128, taken off once a
      // group below (128 times the activations' sum)
      const __m256i wu = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
#else
      // vpmaddubsw likewise, and its int16 pairs would overflow at (q + 128) * x: |w| times x
      // with w's sign, whose pairs stay within 2 * 128 * 127
      const __m256i wa = _mm256_sign_epi8(w, w);
      const __m256i ones = _mm256_set1_epi16(1);
#endif
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) {
        const int64_t at = r * k + g * kGroup + 4 * u;
        int32_t q4, f4;  // the same 4 activation bytes for all 8 rows
        std::memcpy(&q4, codes + at, 4);
        std::memcpy(&f4, fine + at, 4);
#ifdef MINIVLLM_GGML_VNNI
        coarse[r] = _mm256_dpbusd_epi32(coarse[r], wu, _mm256_set1_epi32(q4));
        rest[r] = _mm256_dpbusd_epi32(rest[r], wu, _mm256_set1_epi32(f4));
#else
        const __m256i c = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(_mm256_set1_epi32(q4), w));
        const __m256i f = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(_mm256_set1_epi32(f4), w));
        coarse[r] = _mm256_add_epi32(coarse[r], _mm256_madd_epi16(c, ones));
        rest[r] = _mm256_add_epi32(rest[r], _mm256_madd_epi16(f, ones));
#endif
        // each sum in a register (ggml_q4x8_simd.h); "v": any of AVX-512's 32
#ifdef MINIVLLM_GGML_VNNI
        asm("" : "+v"(coarse[r]), "+v"(rest[r]));
#else
        asm("" : "+x"(coarse[r]), "+x"(rest[r]));
#endif
      }
    }
    const __m256 d = _mm256_mul_ps(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 256))), per_fine);
    for (int r = 0; r < Rows; ++r) {
      // 254 sum(w q) + sum(w f), within int32: |w q| <= 255 * 127 over 32 inputs
      __m256i exact = _mm256_add_epi32(
          _mm256_sub_epi32(_mm256_slli_epi32(coarse[r], 8), _mm256_slli_epi32(coarse[r], 1)), rest[r]);
#ifdef MINIVLLM_GGML_VNNI
      exact = _mm256_sub_epi32(exact, _mm256_set1_epi32(128 * fine_sums[r * groups + g]));
#endif
      const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(steps[r * groups + g]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), scale, acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

#ifdef MINIVLLM_GGML_VNNI
// dot_tile_q8x8 for tiles a and b at once (output columns n0 .. n0 + 16), as
// dot_pair_q4kx8 (ggml_q4kx8_simd.h): each 512-bit `vpdpbusd` takes both tiles' 32 bytes, so
// a broadcast activation meets 16 columns and a group's float work (once a group of 32 inputs
// here, the most of any kind) serves 16; lane for lane the same operations as two single tiles.
template <int Rows>
void dot_pair_q8x8(const uint8_t* a, const uint8_t* b, int64_t groups, const QuantizedRows& xq,
                   int64_t row0, int64_t k, float* y, int64_t ldy) {
  const int8_t* codes = xq.codes.data() + row0 * k;
  const int8_t* fine = xq.fine.data() + row0 * k;
  const float* steps = xq.steps.data() + row0 * groups;
  const int32_t* fine_sums = xq.fine_sums.data() + row0 * groups;
  const __m512 per_fine = _mm512_set1_ps(1.0f / 254.0f);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* ga = a + g * kQ8x8GroupBytes;
    const uint8_t* gb = b + g * kQ8x8GroupBytes;
    for (const uint8_t* t : {ga, gb}) {
      for (int line = 0; line < 4; ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(t + kQ4x8Ahead + 64 * line), _MM_HINT_T0);
      }
    }
    __m512i coarse[Rows], rest[Rows];  // sum(w q), sum(w f), w plus 128
    for (int r = 0; r < Rows; ++r) coarse[r] = rest[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      const __m512i wu = _mm512_xor_si512(pair_load32(ga + 32 * u, gb + 32 * u), flip);
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) {
        const int64_t at = r * k + g * kGroup + 4 * u;
        int32_t q4, f4;
        std::memcpy(&q4, codes + at, 4);
        std::memcpy(&f4, fine + at, 4);
        coarse[r] = _mm512_dpbusd_epi32(coarse[r], wu, _mm512_set1_epi32(q4));
        rest[r] = _mm512_dpbusd_epi32(rest[r], wu, _mm512_set1_epi32(f4));
        asm("" : "+v"(coarse[r]), "+v"(rest[r]));
      }
    }
    const __m512 d = _mm512_mul_ps(pair_fp16(ga + 256, gb + 256), per_fine);
    for (int r = 0; r < Rows; ++r) {
      __m512i exact = _mm512_add_epi32(
          _mm512_sub_epi32(_mm512_slli_epi32(coarse[r], 8), _mm512_slli_epi32(coarse[r], 1)),
          rest[r]);
      exact = _mm512_sub_epi32(exact, _mm512_set1_epi32(128 * fine_sums[r * groups + g]));
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(steps[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}
#endif

// Output columns [begin, end) (multiples of 8) of every row of xq, from q8x8 tiles of
// `tile_bytes` each (the qtype, Q8_0 or Q5_0, no longer matters); with VNNI two at a time from
// 8-16 rows (an odd last tile alone).
inline void matmul_columns_q8x8(int, const uint8_t* tiles, int64_t tile_bytes,
                                const QuantizedRows& xq, int64_t rows, int64_t k, float* y,
                                int64_t ldy, int64_t begin, int64_t end) {
  const auto single = [&](int64_t t, int64_t r0, auto tile_rows) {
    dot_tile_q8x8<decltype(tile_rows)::value>(tiles + t * tile_bytes, k / kGroup, xq, r0, k,
                                              y + r0 * ldy + 8 * t, ldy);
  };
#ifdef MINIVLLM_GGML_VNNI
  // Pairs from 16 rows, and from 8 where the rows' codes reach 16 KB: a group's float work
  // (once 32 inputs) pays sooner than the K kinds' (`x8_pairs`). One thread, Zen 4, pairs' time
  // over single tiles' (docs/ggml-kernels.md, "Two tiles at a time"): Q8_0 2048 -> 8192 at 4 /
  // 8 / 16 / 32 rows 0.93 / 0.87 / 0.85 / 0.83, 640 -> 4096 1.49 / 1.09 / 0.95 / 0.88.
  const bool pairs = rows >= 16 || (rows >= 8 && rows * k >= 16 * 1024);
  const auto pair = [&](int64_t t, int64_t r0, auto tile_rows) {
    const uint8_t* a = tiles + t * tile_bytes;
    dot_pair_q8x8<decltype(tile_rows)::value>(a, a + tile_bytes, k / kGroup, xq, r0, k,
                                              y + r0 * ldy + 8 * t, ldy);
  };
  x8_columns_paired(pairs, rows, begin, end, pair, single);
#else
  for_each_x8_tile<kKTileRows>(rows, begin, end, single);
#endif
}
