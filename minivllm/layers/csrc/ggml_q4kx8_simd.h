// Q4_K weights in tiles of 8 rows ("x8"), and their matmul: ggml_q4x8_simd.h's idea for the K
// kind. Included by ggml_blocks.cpp in namespaces avx2 and vnni (the same tiles; VNNI sums a
// group in int32 with `vpdpbusd` and meets 8 activation rows at once, AVX2 4).
//
// The per-lane columns make the K kind's integer scales cheap: a group's 32 products of 8
// columns end as int16 pairs in 8 lanes, and one `vpmaddwd` by the 8 columns' 6-bit scales (each
// lane's scale twice) weights and joins them, exactly, into the block's int32 sums. A block's
// float work (one conversion, one multiply-add, the min term) is then shared by 8 columns and
// 256 inputs. The activations are those of the stored layout's K kernel (int8, one step per 256
// inputs), so the integers are the same.
//
// One x8 block (256 inputs of 8 rows, kQ4KX8Bytes): 1024 B of codes, then the 8 groups'
// scales [j][c] and mins [j][c] (64 B each, the 6-bit values unpacked to bytes), then the 8
// rows' fp16 d and fp16 dmin. Codes: chunk i (inputs 64 i .. 64 i + 63) is 8 vectors u, lane c
// holding row c's stored bytes qs[32 i + 4 u .. + 3] (low nibbles: group 2 i's inputs 4 u ..
// 4 u + 3, high nibbles: group 2 i + 1's).

constexpr int kQ4KX8Bytes = 1184;
// Blocks ahead of its reads that a tile's kernel asks memory for (~9.5 KB): with 4 a one-row
// step read its weights from memory at 22-25 GB/s, with 8 at 27-32 (2-vCPU Zen 3, two
// threads; 16 ran slower again, the lines evicted from L1 before their turn):
// docs/ggml-kernels.md, "Prefetch".
constexpr int kQ4KX8Ahead = 8;

// Activation rows a tile's unpacked codes meet at once: 8 where VNNI's 32 vector registers hold
// 8 rows' sums (the unpacking and the scales' loads shared by twice the rows), else 4. The
// Q6_K and q8x8 tiles take the same.
#ifdef MINIVLLM_GGML_VNNI
constexpr int kKTileRows = 8;
#else
constexpr int kKTileRows = 4;
#endif

#ifdef MINIVLLM_GGML_VNNI
// Whether a step of `rows` activation rows over K tiles of `k` inputs takes them two at a time
// on 512-bit vectors (a broadcast activation meeting 16 columns, not 8, and the scales' float
// work shared likewise): from 32 rows, and from 8 where the rows' codes (rows * k bytes) reach
// 64 KB, twice a 32 KB L1 data cache (8 rows of 8192 inputs, 16 of 4096). One thread, Zen 4,
// Q4_K pairs' time over single tiles' (docs/ggml-kernels.md, "Two tiles at a time"): 8192 ->
// 2048 at 8 / 16 / 64 rows 0.85-0.88 / 0.78-0.80 / 0.74; 4096 -> 4096 at 8 / 16 / 64 rows 1.04
// / 0.88 / 0.78; 2048 -> 8192 at 16 / 32 / 64 rows 0.99-1.06 / 0.90-0.98 / 0.87; at 1-4 rows
// pairs lose (1.0-2.0), their 512-bit instructions taking two passes on a Zen 4.
inline bool x8_pairs(int64_t rows, int64_t k) {
  return rows >= 32 || (rows >= 8 && rows * k >= 64 * 1024);
}
#endif

// Row scales of 8 columns (8 bytes at p) as int16 pairs: lane c = (s_c, s_c).
inline __m256i column_scales(const uint8_t* p) {
  const __m256i s = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(s, _mm256_slli_epi32(s, 16));
}

// Output columns [n0, n0 + 8) for the `Rows` activation rows [row0, row0 + Rows).
template <int Rows>
void dot_tile_q4kx8(const uint8_t* tile, int64_t blocks, const QuantizedRows& xq, int64_t row0,
                    int64_t k, float* y, int64_t ldy) {
  const int64_t row_groups = k / kGroup;
  const int8_t* codes = xq.codes.data() + row0 * k;
  const float* steps = xq.steps.data() + row0 * blocks;
  const float* sums = xq.sums.data() + row0 * row_groups;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = tile + blk * kQ4KX8Bytes;
    __m256i isum[Rows];
    for (int r = 0; r < Rows; ++r) isum[r] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {  // chunk i: group 2 i in its low nibbles, 2 i + 1 in its high
      const uint8_t* chunk = b + 256 * i;
      const int8_t* xi = codes + blk * 256 + 64 * i;
      for (int line = 0; line < 5; ++line) {  // the chunk's 296 B, kQ4KX8Ahead blocks on
        const uint8_t* ahead = b + kQ4KX8Ahead * kQ4KX8Bytes + 296 * i + 64 * line;
        _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
      }
      // both groups from one load a vector: a shift for the high nibbles, none for the low
      // (one load and three operations per 64 codes, where a group at a time took two loads
      // and four with a shift by a register)
      __m256i lo[Rows], hi[Rows];
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        const __m256i v = load32(chunk + 32 * u);
        const __m256i ql = _mm256_and_si256(v, nibble);
        const __m256i qh = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
#pragma GCC unroll 8  // each row's sums registers of their own, not arrays in memory
        for (int r = 0; r < Rows; ++r) {
          int32_t xl, xh;
          std::memcpy(&xl, xi + r * k + 4 * u, 4);
          std::memcpy(&xh, xi + r * k + 32 + 4 * u, 4);
#ifdef MINIVLLM_GGML_VNNI
          // int32 sums straight away: one instruction where AVX2 needs two
          const __m256i zero = _mm256_setzero_si256();
          lo[r] = _mm256_dpbusd_epi32(u == 0 ? zero : lo[r], ql, _mm256_set1_epi32(xl));
          hi[r] = _mm256_dpbusd_epi32(u == 0 ? zero : hi[r], qh, _mm256_set1_epi32(xh));
          // in registers, in order (GCC otherwise spills each product); "v": any of the 32
          // registers AVX-512 has, where "x" is the first 16
          asm("" : "+v"(lo[r]), "+v"(hi[r]));
#else
          // int16 sums of at most 16 products of 15 * 127: exact, below 2^15
          const __m256i pl = _mm256_maddubs_epi16(ql, _mm256_set1_epi32(xl));
          const __m256i ph = _mm256_maddubs_epi16(qh, _mm256_set1_epi32(xh));
          lo[r] = u == 0 ? pl : _mm256_add_epi16(lo[r], pl);
          hi[r] = u == 0 ? ph : _mm256_add_epi16(hi[r], ph);
          asm("" : "+x"(lo[r]), "+x"(hi[r]));
#endif
        }
      }
#ifdef MINIVLLM_GGML_VNNI
      // each column's 32 products times its 6-bit scale: below 2^31 exactly (32 * 15 * 127 * 63)
      const auto scale = [&](int j) {
        const auto* at = reinterpret_cast<const __m128i*>(b + 1024 + 8 * j);
        return _mm256_cvtepu8_epi32(_mm_loadl_epi64(at));
      };
      const __m256i sl = scale(2 * i), sh = scale(2 * i + 1);
      for (int r = 0; r < Rows; ++r) {
        isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_mullo_epi32(lo[r], sl),
                                                             _mm256_mullo_epi32(hi[r], sh)));
      }
#else
      const __m256i sl = column_scales(b + 1024 + 16 * i), sh = column_scales(b + 1032 + 16 * i);
      for (int r = 0; r < Rows; ++r) {
        isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(lo[r], sl),
                                                             _mm256_madd_epi16(hi[r], sh)));
      }
#endif
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 1152)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 1168)));
    __m256 mins[Rows];
    for (int r = 0; r < Rows; ++r) mins[r] = _mm256_setzero_ps();
    for (int j = 0; j < 8; ++j) {  // sum_j m_j * (group j's codes' value)
      const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 1088 + 8 * j))));
      for (int r = 0; r < Rows; ++r) {
        mins[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sums[r * row_groups + blk * 8 + j]), mins[r]);
      }
    }
    for (int r = 0; r < Rows; ++r) {
      const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(steps[r * blocks + blk]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), scale, acc[r]);
      acc[r] = _mm256_fnmadd_ps(mins[r], dmin, acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

#ifdef MINIVLLM_GGML_VNNI
// Two x8 tiles side by side in one 512-bit vector, for the kernels that take them two at a
// time (and AMX's, which share them): tile a's lanes in the low half, tile b's in the high.

// 32 bytes of each tile (at a, at b).
inline __m512i pair_load32(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(load32(a)), load32(b), 1);
}

// 8 per-column bytes of each tile as 16 int32 lanes, zero-extended (Q4_K's scales or mins).
inline __m512i pair_u8(const uint8_t* a, const uint8_t* b) {
  return _mm512_cvtepu8_epi32(_mm_set_epi64x(*reinterpret_cast<const int64_t*>(b),
                                             *reinterpret_cast<const int64_t*>(a)));
}

// 8 fp16 values of each tile as 16 floats.
inline __m512 pair_fp16(const uint8_t* a, const uint8_t* b) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

// Output columns [begin, end): with `pairs`, tiles two at a time through `pair(t, r0, rows)`
// (tiles t and t + 1), an odd last tile alone; the rest, or all, through `single`.
template <typename Pair, typename Single>
void x8_columns_paired(bool pairs, int64_t rows, int64_t begin, int64_t end, Pair pair,
                       Single single) {
  const int64_t pairs_end = pairs ? begin + (end - begin) / 16 * 16 : begin;
  for_each_x8_tile<kKTileRows, 2>(rows, begin, pairs_end, pair);
  if (pairs_end < end) for_each_x8_tile<kKTileRows>(rows, pairs_end, end, single);
}

// dot_tile_q4kx8 for tiles a and b at once (output columns n0 .. n0 + 16): each 512-bit
// `vpdpbusd` takes both tiles' 32 bytes, so a broadcast activation meets 16 columns, not 8,
// and the scales' and mins' float work is shared likewise. Lane for lane the same integers and
// float operations, in the same order, as two calls of dot_tile_q4kx8: the same results. A
// chunk's two groups run one after the other (the low nibbles, then the high), so 8 rows'
// sums, their block sums and their accumulators fit the 32 registers.
template <int Rows>
void dot_pair_q4kx8(const uint8_t* a, const uint8_t* b, int64_t blocks, const QuantizedRows& xq,
                    int64_t row0, int64_t k, float* y, int64_t ldy) {
  const int64_t row_groups = k / kGroup;
  const int8_t* codes = xq.codes.data() + row0 * k;
  const float* steps = xq.steps.data() + row0 * blocks;
  const float* sums = xq.sums.data() + row0 * row_groups;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* ba = a + blk * kQ4KX8Bytes;
    const uint8_t* bb = b + blk * kQ4KX8Bytes;
    __m512i isum[Rows];
    for (int r = 0; r < Rows; ++r) isum[r] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) {  // group g: chunk g / 2's low nibbles (even g) or high
      const int i = g / 2;
      if (g % 2 == 0) {
        for (const uint8_t* t : {ba, bb}) {
          for (int line = 0; line < 5; ++line) {  // as dot_tile_q4kx8's, for both tiles
            const uint8_t* ahead = t + kQ4KX8Ahead * kQ4KX8Bytes + 296 * i + 64 * line;
            _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
          }
        }
      }
      const int8_t* xi = codes + blk * 256 + 64 * i + 32 * (g % 2);
      __m512i dot[Rows];
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        const __m512i v = pair_load32(ba + 256 * i + 32 * u, bb + 256 * i + 32 * u);
        const __m512i q = _mm512_and_si512(g % 2 ? _mm512_srli_epi16(v, 4) : v, nibble);
#pragma GCC unroll 8
        for (int r = 0; r < Rows; ++r) {
          int32_t x4;
          std::memcpy(&x4, xi + r * k + 4 * u, 4);
          dot[r] = _mm512_dpbusd_epi32(u == 0 ? _mm512_setzero_si512() : dot[r], q,
                                       _mm512_set1_epi32(x4));
          asm("" : "+v"(dot[r]));
        }
      }
      const __m512i scale = pair_u8(ba + 1024 + 8 * g, bb + 1024 + 8 * g);
      for (int r = 0; r < Rows; ++r) {
        isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot[r], scale));
      }
    }
    const __m512 d = pair_fp16(ba + 1152, bb + 1152);
    const __m512 dmin = pair_fp16(ba + 1168, bb + 1168);
    for (int r = 0; r < Rows; ++r) {
      __m512 mins = _mm512_setzero_ps();
      for (int j = 0; j < 8; ++j) {  // sum_j m_j * (group j's codes' value)
        const __m512 m = _mm512_cvtepi32_ps(pair_u8(ba + 1088 + 8 * j, bb + 1088 + 8 * j));
        mins = _mm512_fmadd_ps(m, _mm512_set1_ps(sums[r * row_groups + blk * 8 + j]), mins);
      }
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(steps[r * blocks + blk]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), scale, acc[r]);
      acc[r] = _mm512_fnmadd_ps(mins, dmin, acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}
#endif

// Output columns [begin, end) (multiples of 8) of every row of xq: with VNNI, tiles two at a
// time where `x8_pairs` says (an odd last tile alone).
inline void matmul_columns_q4kx8(const uint8_t* tiles, int64_t tile_bytes,
                                 const QuantizedRows& xq, int64_t rows, int64_t k, float* y,
                                 int64_t ldy, int64_t begin, int64_t end) {
  const auto single = [&](int64_t t, int64_t r0, auto tile_rows) {
    dot_tile_q4kx8<decltype(tile_rows)::value>(tiles + t * tile_bytes, k / 256, xq, r0, k,
                                               y + r0 * ldy + 8 * t, ldy);
  };
#ifdef MINIVLLM_GGML_VNNI
  const auto pair = [&](int64_t t, int64_t r0, auto tile_rows) {
    const uint8_t* a = tiles + t * tile_bytes;
    dot_pair_q4kx8<decltype(tile_rows)::value>(a, a + tile_bytes, k / 256, xq, r0, k,
                                               y + r0 * ldy + 8 * t, ldy);
  };
  x8_columns_paired(x8_pairs(rows, k), rows, begin, end, pair, single);
#else
  for_each_x8_tile<kKTileRows>(rows, begin, end, single);
#endif
}
