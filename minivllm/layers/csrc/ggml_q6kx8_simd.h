// Q6_K weights in tiles of 8 rows ("x8"), and their matmul: the tiles of ggml_q4kx8_simd.h for
// the 6-bit kind that K-quant files use for half of `attn_v` / `ffn_down` and for the output
// head. Included by ggml_blocks.cpp in namespaces avx2 and vnni; with VNNI one `vpdpbusd`
// sums 4 products into int32 where AVX2 needs `vpmaddubsw` and a share of the adds.
//
// A 6-bit code times an int8 activation no longer leaves room for 8 products in an int16 lane,
// so the roles are swapped: the weight codes are used centred (q - 32, -32..31) and the
// activations unsigned, x + 128 (1..255, QuantizedRows' `ucodes`). A lane then sums 4 products
// of at most 255 * 32 (two `vpmaddubsw`), below 2^15, and one `vpmaddwd` by the 8 columns'
// int8 scales of that group of 16 makes them int32. What the +128 adds, 128 * sum_g scale_g *
// sum(q - 32), depends on the weights alone: the repack computes it once per block and column,
// and the kernel subtracts it, so the integers are exactly those of the stored layout's K
// kernel (same activations, Q8_K's).
//
// The codes keep the file's 6 bits: a one-row step reads every byte once, and a byte a code
// read 1.32x the file's bytes (docs/ggml-kernels.md, "Q6_K in tiles of 8 rows"). Vector v
// (inputs 4 v .. 4 v + 3, lane c holding row c's 4 codes) is rebuilt in five instructions
// from two planes. One x8 block (256 inputs of 8 rows, kQ6KX8Bytes): 16 groups of 96 B, group
// g (vectors 4 g + u, u < 4) holding the low 4 bits of vectors 4 g and 4 g + 1 (32 B: the first
// in each byte's low nibble), of 4 g + 2 and 4 g + 3 (32 B), then the high 2 bits of all four
// (32 B: vector 4 g + u at bits 2 u, 2 u + 1); the 16 groups' int8 scales [g][c] (128 B); the
// 8 rows' fp16 d (16 B); the 8 rows' int32 offsets (32 B). 1712 B against the file's 1680.

constexpr int kQ6KX8Bytes = 1712;
constexpr int kQ6KX8Scales = 1536, kQ6KX8D = 1664, kQ6KX8Offsets = 1680;
// Blocks ahead of its reads that a tile's kernel asks memory for: 8 (13.7 KB), the distance in
// bytes of the byte-code tiles' 6 (13.3 KB; 4 read 3-8% slower on a 2-vCPU Zen 3:
// docs/ggml-kernels.md, "Prefetch").
constexpr int kQ6KX8Ahead = 8;

// Group g's 4 vectors of codes, centred (q - 32), from its two planes at b + 96 g.
inline void q6k_group(const uint8_t* b, int g, __m256i w[4]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(0x30);
  const __m256i centre = _mm256_set1_epi8(32);
  const __m256i lo01 = load32(b + 96 * g), lo23 = load32(b + 96 * g + 32);
  const __m256i hi = load32(b + 96 * g + 64);
  // each byte's bits 2 u, 2 u + 1 to bits 4, 5 (16-bit shifts: the mask drops what crossed)
  const __m256i h[4] = {_mm256_slli_epi16(hi, 4), _mm256_slli_epi16(hi, 2), hi,
                        _mm256_srli_epi16(hi, 2)};
  const __m256i lo[4] = {lo01, _mm256_srli_epi16(lo01, 4), lo23, _mm256_srli_epi16(lo23, 4)};
  for (int u = 0; u < 4; ++u) {
    const __m256i q =
        _mm256_or_si256(_mm256_and_si256(lo[u], nibble), _mm256_and_si256(h[u], high));
    w[u] = _mm256_sub_epi8(q, centre);
  }
}

// Signed int8 scales of 8 columns (8 bytes at p) as int16 pairs: lane c = (s_c, s_c).
inline __m256i column_scales_signed(const uint8_t* p) {
  const __m256i s = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(_mm256_and_si256(s, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(s, 16));
}

// Output columns [n0, n0 + 8) for the `Rows` activation rows [row0, row0 + Rows).
template <int Rows>
void dot_tile_q6kx8(const uint8_t* tile, int64_t blocks, const QuantizedRows& xq, int64_t row0,
                    int64_t k, float* y, int64_t ldy) {
  const uint8_t* codes = xq.ucodes.data() + row0 * k;
  const float* steps = xq.steps.data() + row0 * blocks;
  __m256 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = tile + blk * kQ6KX8Bytes;
    __m256i isum[Rows];
    for (int r = 0; r < Rows; ++r) isum[r] = _mm256_setzero_si256();
    for (int g = 0; g < 16; ++g) {  // a group of 16 inputs: vectors 4 g .. 4 g + 3
      const char* ahead = reinterpret_cast<const char*>(b + kQ6KX8Ahead * kQ6KX8Bytes + 110 * g);
      _mm_prefetch(ahead, _MM_HINT_T0);  // the block's 27 lines, 2 a group
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
      __m256i w[4];
      q6k_group(b, g, w);
#ifdef MINIVLLM_GGML_VNNI
      // int32 sums of the group's 16 products a lane, one instruction per 4, then times the
      // column's int8 scale: at most 16 * 255 * 32 * 128 a group, 16 groups below 2^31
      __m256i dot[Rows];
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
#pragma GCC unroll 8
        for (int r = 0; r < Rows; ++r) {
          int32_t x4;
          std::memcpy(&x4, codes + r * k + blk * 256 + 4 * (4 * g + u), 4);
          dot[r] = _mm256_dpbusd_epi32(u == 0 ? _mm256_setzero_si256() : dot[r],
                                       _mm256_set1_epi32(x4), w[u]);
          asm("" : "+v"(dot[r]));  // any of AVX-512's 32 registers: 8 rows' sums fit
        }
      }
      const __m256i scale = _mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + kQ6KX8Scales + 8 * g)));
      for (int r = 0; r < Rows; ++r) {
        isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(dot[r], scale));
      }
#else
      const __m256i scale = column_scales_signed(b + kQ6KX8Scales + 8 * g);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // two vectors' products a lane, then their scale
        __m256i dot[Rows];
#pragma GCC unroll 2
        for (int u = 0; u < 2; ++u) {
          const int v = 4 * g + 2 * h + u;
#pragma GCC unroll 4  // each row's sum a register of its own, not an array in memory
          for (int r = 0; r < Rows; ++r) {
            int32_t x4;
            std::memcpy(&x4, codes + r * k + blk * 256 + 4 * v, 4);
            const __m256i p = _mm256_maddubs_epi16(_mm256_set1_epi32(x4), w[2 * h + u]);
            dot[r] = u == 0 ? p : _mm256_add_epi16(dot[r], p);
            asm("" : "+x"(dot[r]));  // in a register, in order (GCC otherwise spills each product)
          }
        }
        for (int r = 0; r < Rows; ++r) {
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(dot[r], scale));
        }
      }
#endif
    }
    const __m256 d =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kQ6KX8D)));
    const __m256i offset = load32(b + kQ6KX8Offsets);
    for (int r = 0; r < Rows; ++r) {
      const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(steps[r * blocks + blk]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[r], offset)), scale, acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

#ifdef MINIVLLM_GGML_VNNI
// q6k_group for the blocks at a and b at once: lane c of tile a's vector in the low half,
// tile b's in the high.
inline void pair_q6k_group(const uint8_t* a, const uint8_t* b, int g, __m512i w[4]) {
  const auto both = [&](int at) { return pair_load32(a + at, b + at); };
  const __m512i nibble = _mm512_set1_epi8(0x0F), six = _mm512_set1_epi8(0x3F);
  const __m512i centre = _mm512_set1_epi8(32);
  const __m512i lo01 = both(96 * g), lo23 = both(96 * g + 32), hi = both(96 * g + 64);
  const __m512i h[4] = {_mm512_slli_epi16(hi, 4), _mm512_slli_epi16(hi, 2), hi,
                        _mm512_srli_epi16(hi, 2)};
  const __m512i lo[4] = {lo01, _mm512_srli_epi16(lo01, 4), lo23, _mm512_srli_epi16(lo23, 4)};
  for (int u = 0; u < 4; ++u) {
    // bits 0-3 from lo, 4-7 from h (one ternary-logic op: nibble ? lo : h), then 6 bits
    const __m512i q = _mm512_ternarylogic_epi32(lo[u], h[u], nibble, 0xE4);
    w[u] = _mm512_sub_epi8(_mm512_and_si512(q, six), centre);
  }
}

// Two tiles' 8 bytes (at a, at b) as 16 int32 lanes, sign-extended: their 8 columns' scales.
inline __m512i pair_scales(const uint8_t* a, const uint8_t* b) {
  return _mm512_cvtepi8_epi32(_mm_set_epi64x(*reinterpret_cast<const int64_t*>(b),
                                             *reinterpret_cast<const int64_t*>(a)));
}

// dot_tile_q6kx8 for tiles a and b at once (output columns n0 .. n0 + 16): each 512-bit
// `vpdpbusd` takes both tiles' 32 bytes, so a broadcast activation meets 16 columns, not 8.
// Lane for lane the same integers and float work as two calls of dot_tile_q6kx8: the same
// results. Where the products, not the weights' bytes, bound the step (a batch of decodes,
// two codes each), this halves their broadcasts, scale multiplies and float work.
template <int Rows>
void dot_pair_q6kx8(const uint8_t* a, const uint8_t* b, int64_t blocks, const QuantizedRows& xq,
                    int64_t row0, int64_t k, float* y, int64_t ldy) {
  const uint8_t* codes = xq.ucodes.data() + row0 * k;
  const float* steps = xq.steps.data() + row0 * blocks;
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* ba = a + blk * kQ6KX8Bytes;
    const uint8_t* bb = b + blk * kQ6KX8Bytes;
    __m512i isum[Rows];
    for (int r = 0; r < Rows; ++r) isum[r] = _mm512_setzero_si512();
    for (int g = 0; g < 16; ++g) {
      for (const uint8_t* t : {ba, bb}) {
        const char* ahead = reinterpret_cast<const char*>(t + kQ6KX8Ahead * kQ6KX8Bytes + 110 * g);
        _mm_prefetch(ahead, _MM_HINT_T0);
        _mm_prefetch(ahead + 64, _MM_HINT_T0);
      }
      __m512i w[4];
      pair_q6k_group(ba, bb, g, w);
      __m512i dot[Rows];
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
#pragma GCC unroll 8
        for (int r = 0; r < Rows; ++r) {
          int32_t x4;
          std::memcpy(&x4, codes + r * k + blk * 256 + 4 * (4 * g + u), 4);
          dot[r] = _mm512_dpbusd_epi32(u == 0 ? _mm512_setzero_si512() : dot[r],
                                       _mm512_set1_epi32(x4), w[u]);
          asm("" : "+v"(dot[r]));
        }
      }
      const __m512i scale = pair_scales(ba + kQ6KX8Scales + 8 * g, bb + kQ6KX8Scales + 8 * g);
      for (int r = 0; r < Rows; ++r) {
        isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot[r], scale));
      }
    }
    const __m512 d = pair_fp16(ba + kQ6KX8D, bb + kQ6KX8D);
    const __m512i offset = pair_load32(ba + kQ6KX8Offsets, bb + kQ6KX8Offsets);
    for (int r = 0; r < Rows; ++r) {
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(steps[r * blocks + blk]));
      const __m512i centred = _mm512_sub_epi32(isum[r], offset);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), scale, acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}
#endif

// Output columns [begin, end) (multiples of 8) of every row of xq: with VNNI, tiles two at a
// time where `x8_pairs` says (an odd last tile alone). One thread, 2048 -> 8192
// (`benchmarks/ggml_kernels.py --threads 1`), single tiles / pairs at 32 rows 4979-5189 /
// 4377-4454 us, 8 rows 1752-1819 / 2242-2308 (a Xeon, codes a byte each). With the two planes
// the pairs' unpacking is 512 bits wide too, and on a Zen 4 (whose 512-bit instructions take
// two 256-bit passes) single tiles won at 1-4 rows: 1 row 558 / 1124 us, 4 rows 927 / 1367; the
// 1B's whole one-row step 18.3 / 20.9 ms (docs/ggml-kernels.md, "Q6_K in tiles of 8 rows").
// 8192 -> 2048 at 8 / 16 rows: pairs 0.85x / 0.79x the single tiles' time (Zen 4).
inline void matmul_columns_q6kx8(const uint8_t* tiles, int64_t tile_bytes,
                                 const QuantizedRows& xq, int64_t rows, int64_t k, float* y,
                                 int64_t ldy, int64_t begin, int64_t end) {
  const auto single = [&](int64_t t, int64_t r0, auto tile_rows) {
    dot_tile_q6kx8<decltype(tile_rows)::value>(tiles + t * tile_bytes, k / 256, xq, r0, k,
                                               y + r0 * ldy + 8 * t, ldy);
  };
#ifdef MINIVLLM_GGML_VNNI
  const auto pair = [&](int64_t t, int64_t r0, auto tile_rows) {
    const uint8_t* a = tiles + t * tile_bytes;
    dot_pair_q6kx8<decltype(tile_rows)::value>(a, a + tile_bytes, k / 256, xq, r0, k,
                                               y + r0 * ldy + 8 * t, ldy);
  };
  x8_columns_paired(x8_pairs(rows, k), rows, begin, end, pair, single);
#else
  for_each_x8_tile<kKTileRows>(rows, begin, end, single);
#endif
}
