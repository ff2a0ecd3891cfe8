// Q4_K's and Q6_K's x8 tiles multiplied on AMX's int8 tiles (Q6_K's way: near the end):
// included by ggml_blocks.cpp in namespace amx, after the vnni kernels (whose integers these
// are, and which take what AMX does not).
//
// Why: with many activation rows (16 decodes, each with two int8 codes: 32 rows; a
// speculative step's drafts) the VNNI kernel spends its time in `vpdpbusd`, 32 products an
// instruction. One AMX `tdpbsud` makes 16 x 16 x 64; on a Xeon with AMX one core sums 3.6 T
// int8 products a second there against 0.11 T with `vpdpbusd` on 256-bit vectors.
//
// What stands in the way is Q4_K's 6-bit scale per group of 32 inputs: a tile sums 64 inputs
// of every column at once, across two groups. So the scales go into the codes: sc = 8 sh + sl
// (digits sh, sl <= 7) and a block's integer, sum_j sc_j (x . q_j), is 8 (x . sh q) + (x . sl q)
// over all 256 inputs, where a code times a digit (<= 105) is still a byte. Each block of 16
// columns (two x8 tiles) is split so into 8 KB of B tiles just before it is used, and its two
// int32 sums leave the tiles once a block. The integers, the activations (QuantizedRows' codes)
// and the float work per column are the VNNI kernel's, so the results are equal bit for bit
// and a batch's size never changes an answer.
//
// Below kAmxRows rows the fixed work (the split: 2 bytes written per weight and step) costs
// more than the products save, and the VNNI kernel runs: `benchmarks/gguf_step_rows.py FILE
// --two-codes` on the Xeon, the coder's step, VNNI / AMX from 10 integer rows 100 / 103 ms,
// 12 rows 111 / 110, 14 rows 128 / 118, 16 rows 135 / 122, 24 rows 188 / 159; with Q6_K on
// AMX too (below), at 14 rows 121-123 -> 119-121 ms.
// The operating system lends the tile registers on request (Linux: arch_prctl), once per
// process; each call loads its tile configuration (oneDNN's AMX kernels, on the same threads,
// load theirs) and leaves it loaded: releasing the tiles costs a trap to the kernel at the
// next use, about 0.1 ms.

constexpr int64_t kAmxRows = 14;

// LDTILECFG's 64 bytes: palette 1, each tile's rows and bytes a row.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// pair_u8, pair_fp16, pair_load32: the VNNI kernels' (ggml_q4kx8_simd.h), shared through vnni.

// Q4_K's float work of one block for `rows` rows, in the VNNI kernel's order: the block's
// scale times its integer (c: the H sums of rows 0-15, their L sums, then rows 16-31's), and
// the min term, sum_j m_j * (group j's codes' value), times dmin. Row by row, with the block's
// values in registers and the accumulators in memory: 32 rows' accumulators, sums and mins
// at once would not fit the 32 vector registers.
inline void q4k_epilogue(const uint8_t* ba, const uint8_t* bb, int64_t blk, int64_t blocks,
                         const QuantizedRows& xq, int64_t r0, int rows, int64_t k,
                         const int32_t (*c)[256], float* acc) {
  const int64_t row_groups = k / kGroup;
  const __m512 d = pair_fp16(ba + 1152, bb + 1152);
  const __m512 dmin = pair_fp16(ba + 1168, bb + 1168);
  __m512 m[8];
  for (int j = 0; j < 8; ++j) {
    m[j] = _mm512_cvtepi32_ps(pair_u8(ba + 1088 + 8 * j, bb + 1088 + 8 * j));
  }
  for (int r = 0; r < rows; ++r) {
    const int32_t* h = c[2 * (r / 16)] + 16 * (r % 16);
    const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(h), 3),
                                          _mm512_load_si512(h + 256));
    const float* s = xq.sums.data() + (r0 + r) * row_groups + blk * 8;
    __m512 mins = _mm512_setzero_ps();
    for (int j = 0; j < 8; ++j) mins = _mm512_fmadd_ps(m[j], _mm512_set1_ps(s[j]), mins);
    const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xq.steps[(r0 + r) * blocks + blk]));
    __m512 a = _mm512_load_ps(acc + 16 * r);
    a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, a);
    _mm512_store_ps(acc + 16 * r, _mm512_fnmadd_ps(mins, dmin, a));
  }
}

// Line `line` of the block 4 blocks past ba and past bb (blocks of `bytes`) into L1.
inline void prefetch_ahead(const uint8_t* ba, const uint8_t* bb, int line, int bytes) {
  _mm_prefetch(reinterpret_cast<const char*>(ba + 4 * bytes + 64 * line), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(bb + 4 * bytes + 64 * line), _MM_HINT_T0);
}

// Q4_K with its group scales inside the codes, so that a block's 8 groups sum in the tiles:
// sc = 8 sh + sl (sh, sl <= 7), and a block's integer sum_j sc_j dot_j is
// 8 (x . sh q) + (x . sl q), where each code times a digit, at most 15 * 7 = 105, is a byte.
// One `vpmullw` multiplies the two codes in a 16-bit lane (both of one column) by the
// column's digit without carry. Per block and 16 columns: 8 KB, the H codes (sh q) of its 4
// chunks of 64 inputs, then the L codes (sl q), each chunk a B tile (16 rows: group 2 i's
// inputs 4 u .., then group 2 i + 1's).
inline void split_q4k_block(const uint8_t* a, const uint8_t* b, int64_t blk, uint8_t* out) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), seven = _mm512_set1_epi16(7);
  const uint8_t* ba = a + blk * kQ4KX8Bytes;
  const uint8_t* bb = b + blk * kQ4KX8Bytes;
  // 4 blocks ahead (past a's last block: b's first, past b's: the next pair's), as the
  // VNNI kernel: one step streams every weight from memory once. A line an iteration below:
  // all 19 lines at once stalled the loop on full fill buffers (a fifth of its samples).
  __m512i sh[8], sl[8];
  for (int j = 0; j < 8; ++j) {  // column c's digits on 16-bit lanes 2 c and 2 c + 1
    __m512i sc = pair_u8(ba + 1024 + 8 * j, bb + 1024 + 8 * j);
    sc = _mm512_or_si512(sc, _mm512_slli_epi32(sc, 16));
    sh[j] = _mm512_srli_epi16(sc, 3);
    sl[j] = _mm512_and_si512(sc, seven);
  }
  for (int i = 0; i < 4; ++i) {
    uint8_t* o = out + blk * 8192 + 1024 * i;
    for (int u = 0; u < 8; ++u) {
      if (64 * (8 * i + u) < kQ4KX8Bytes) prefetch_ahead(ba, bb, 8 * i + u, kQ4KX8Bytes);
      const __m512i v = pair_load32(ba + 256 * i + 32 * u, bb + 256 * i + 32 * u);
      const __m512i lo = _mm512_and_si512(v, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      _mm512_storeu_si512(o + 64 * u, _mm512_mullo_epi16(lo, sh[2 * i]));
      _mm512_storeu_si512(o + 512 + 64 * u, _mm512_mullo_epi16(hi, sh[2 * i + 1]));
      _mm512_storeu_si512(o + 4096 + 64 * u, _mm512_mullo_epi16(lo, sl[2 * i]));
      _mm512_storeu_si512(o + 4096 + 512 + 64 * u, _mm512_mullo_epi16(hi, sl[2 * i + 1]));
    }
  }
}

// A pair's tiles (both kinds): rows 0-15 of a pass on C tiles 0 (H) and 1 (L) with A tile 2; rows 16-31 on
// C tiles 5 and 6 with A tile 7; the chunk's H and L codes in B tiles 3 and 4, read by both.
inline void configure_pair_tiles(int rows0, int rows1) {
  TileConfig cfg;
  for (int t : {0, 1, 2}) cfg.rows[t] = static_cast<uint8_t>(rows0), cfg.colsb[t] = 64;
  for (int t : {5, 6, 7}) cfg.rows[t] = static_cast<uint8_t>(rows1), cfg.colsb[t] = rows1 ? 64 : 0;
  for (int t : {3, 4}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// One block's H and L products of up to 32 rows issued to the tiles (x: the block's first
// activation row, k apart; w: its split codes): rows 0-15 into C tiles 0 (H) and 1 (L), rows
// 16-31 into 5 and 6. The sums stay in the tiles until store_pair_sums. Q4_K's H codes are
// unsigned (`tdpbsud`); Q6_K's (SignedHigh) signed (`tdpbssd`); the L codes unsigned in both.
template <bool SignedHigh>
inline void pair_products(const int8_t* x, int64_t k, const uint8_t* w, bool second) {
  _tile_zero(0);
  _tile_zero(1);
  if (second) {
    _tile_zero(5);
    _tile_zero(6);
  }
  for (int i = 0; i < 4; ++i) {
    _tile_loadd(3, w + 1024 * i, 64);
    _tile_loadd(4, w + 4096 + 1024 * i, 64);
    _tile_loadd(2, x + 64 * i, k);
    if constexpr (SignedHigh) {
      _tile_dpbssd(0, 2, 3);
    } else {
      _tile_dpbsud(0, 2, 3);
    }
    _tile_dpbsud(1, 2, 4);
    if (second) {
      _tile_loadd(7, x + 16 * k + 64 * i, k);
      if constexpr (SignedHigh) {
        _tile_dpbssd(5, 7, 3);
      } else {
        _tile_dpbsud(5, 7, 3);
      }
      _tile_dpbsud(6, 7, 4);
    }
  }
}

// The sums of pair_products to c[0..1] (rows 0-15) and c[2..3] (rows 16-31).
inline void store_pair_sums(bool second, int32_t (*c)[256]) {
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  if (second) {
    _tile_stored(5, c[2], 64);
    _tile_stored(6, c[3], 64);
  }
}

// The calling thread's buffer for a pair of tiles' split codes (32 bytes an input).
inline uint8_t* split_codes_buffer(int64_t k) {
  thread_local LineVector<uint8_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < 32 * k) buffer.resize(32 * k);
  return buffer.data();
}

// Q6_K on the same tiles. Its x8 tiles hold centred codes (q - 32, a signed byte) and a signed
// 8-bit scale per group of 16 inputs and column; a weight's integer w = sc (q - 32) needs 14
// bits, so it is split into bytes: w = 256 hi + lo, lo unsigned (w & 255), hi signed (w >> 8,
// -16..16). A block's integer is then 256 (x . hi) + (x . lo) over its 256 inputs: the VNNI
// kernel's integer (which takes x + 128 and subtracts the offset that adds), so the results
// are its own bit for bit. A B tile row is an x8 vector of each tile (8 columns' 4 inputs),
// side by side: 16 columns.
inline void split_q6k_block(const uint8_t* a, const uint8_t* b, int64_t blk, uint8_t* out) {
  const uint8_t* ba = a + blk * kQ6KX8Bytes;
  const uint8_t* bb = b + blk * kQ6KX8Bytes;
  // A vector of both tiles' codes (a's 32 bytes, then b's) is multiplied as its even and its
  // odd bytes, each sign-extended in place to 16 bits: no byte shuffles, which share one port.
  // 16-bit lane l holds bytes 2 l, 2 l + 1, of column l / 2 (a's 8, then b's): its scale.
  const __m512i pairs = _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8,
                                         8, 7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i low = _mm512_set1_epi16(0x00FF), high = _mm512_set1_epi16(-256);
  for (int g = 0; g < 16; ++g) {
    // the block's lines (27) 4 blocks ahead, 2 a group
    for (int line = 2 * g; line < std::min(2 * g + 2, (kQ6KX8Bytes + 63) / 64); ++line) {
      prefetch_ahead(ba, bb, line, kQ6KX8Bytes);
    }
    const __m128i s8 =
        _mm_set_epi64x(*reinterpret_cast<const int64_t*>(bb + kQ6KX8Scales + 8 * g),
                       *reinterpret_cast<const int64_t*>(ba + kQ6KX8Scales + 8 * g));
    const __m512i sc =
        _mm512_permutexvar_epi16(pairs, _mm512_castsi256_si512(_mm256_cvtepi8_epi16(s8)));
    __m512i codes[4];
    pair_q6k_group(ba, bb, g, codes);
    for (int u = 0; u < 4; ++u) {
      const int v = 4 * g + u;  // inputs 4 v .. 4 v + 3: row v % 16 of chunk v / 16's B tiles
      const __m512i c = codes[u];
      const __m512i even = _mm512_mullo_epi16(_mm512_srai_epi16(_mm512_slli_epi16(c, 8), 8), sc);
      const __m512i odd = _mm512_mullo_epi16(_mm512_srai_epi16(c, 8), sc);
      uint8_t* o = out + blk * 8192 + 1024 * (v / 16) + 64 * (v % 16);
      _mm512_storeu_si512(o, _mm512_or_si512(_mm512_srli_epi16(even, 8),
                                             _mm512_and_si512(odd, high)));  // high bytes
      _mm512_storeu_si512(o + 4096, _mm512_or_si512(_mm512_and_si512(even, low),
                                                    _mm512_slli_epi16(odd, 8)));  // low bytes
    }
  }
}

// Q6_K's float work of one block: the VNNI kernel's, scale d times the row's step.
inline void q6k_epilogue(const uint8_t* ba, const uint8_t* bb, int64_t blk, int64_t blocks,
                         const QuantizedRows& xq, int64_t r0, int rows, int64_t /*k*/,
                         const int32_t (*c)[256], float* acc) {
  const __m512 d = pair_fp16(ba + kQ6KX8D, bb + kQ6KX8D);
  for (int r = 0; r < rows; ++r) {
    const int32_t* h = c[2 * (r / 16)] + 16 * (r % 16);
    const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(h), 8),
                                          _mm512_load_si512(h + 256));
    const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xq.steps[(r0 + r) * blocks + blk]));
    __m512 a = _mm512_load_ps(acc + 16 * r);
    _mm512_store_ps(acc + 16 * r, _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, a));
  }
}

// Each kind's pieces, for dot_pair and matmul_columns_pairs: its x8 block's bytes, whether its
// high plane is signed, its split, its float work and its VNNI kernel (the rows AMX leaves).
struct Q4KPairs {
  static constexpr int64_t kBytes = kQ4KX8Bytes;
  static constexpr bool kSignedHigh = false;
  static constexpr auto split = split_q4k_block;
  static constexpr auto epilogue = q4k_epilogue;
  static constexpr auto on_vnni = vnni::matmul_columns_q4kx8;
};
struct Q6KPairs {
  static constexpr int64_t kBytes = kQ6KX8Bytes;
  static constexpr bool kSignedHigh = true;
  static constexpr auto split = split_q6k_block;
  static constexpr auto epilogue = q6k_epilogue;
  static constexpr auto on_vnni = vnni::matmul_columns_q6kx8;
};

// Output columns of x8 tiles a and b (16) for rows [r0, r0 + rows), rows <= 32, their codes
// split into w as the first rows go (r0 == 0), block by block. A block's float work waits
// for its products; so each block's products are issued before the previous block's float
// work, which runs while the tiles compute (two buffers of sums, one block apart).
template <class Kind>
inline void dot_pair(const uint8_t* a, const uint8_t* b, uint8_t* w, int64_t blocks,
                     const QuantizedRows& xq, int64_t r0, int rows, int64_t k, float* y,
                     int64_t ldy) {
  alignas(64) int32_t c[2][4][256];
  alignas(64) float acc[32 * 16];
  const bool second = rows > 16;
  for (int r = 0; r < rows; ++r) _mm512_store_ps(acc + 16 * r, _mm512_setzero_ps());
  const int8_t* x = xq.codes.data() + r0 * k;
  // The first rows split the codes as they go, two blocks ahead: a tile load of bytes still
  // in the store buffer waits for them to reach the cache
  constexpr int64_t kAhead = 2;
  for (int64_t blk = 0; r0 == 0 && blk < std::min(kAhead, blocks); ++blk) {
    Kind::split(a, b, blk, w);
  }
  const auto float_work = [&](int64_t blk) {
    Kind::epilogue(a + blk * Kind::kBytes, b + blk * Kind::kBytes, blk, blocks, xq, r0, rows, k,
                   c[blk & 1], acc);
  };
  for (int64_t blk = 0; blk < blocks; ++blk) {
    pair_products<Kind::kSignedHigh>(x + blk * 256, k, w + blk * 8192, second);
    if (blk > 0) float_work(blk - 1);
    if (r0 == 0 && blk + kAhead < blocks) Kind::split(a, b, blk + kAhead, w);
    store_pair_sums(second, c[blk & 1]);
  }
  float_work(blocks - 1);
  for (int r = 0; r < rows; ++r) _mm512_storeu_ps(y + r * ldy, _mm512_load_ps(acc + 16 * r));
}

// The pairs of x8 tiles with columns in [begin, end) (multiples of 8) on AMX, `pass` rows at a
// time: configure(m) loads the tiles' shapes for a pass of m rows (once per change of m),
// pair(a, b, buffer, r0, m, t) computes tiles a = t and b = t + 1 for rows [r0, r0 + m), its
// buffer the calling thread's (split_codes_buffer). A range's last odd tile, and steps of
// fewer than min_rows rows, are left to rest(first column): the kind's VNNI kernel.
template <class Configure, class Pair, class Rest>
inline void for_each_tile_pair(const uint8_t* tiles, int64_t tile_bytes, int64_t rows, int64_t k,
                               int64_t begin, int64_t end, int64_t min_rows, int pass,
                               Configure configure, Pair pair, Rest rest) {
  const int64_t t0 = begin / 8, t1 = end / 8;
  const int64_t pairs_end = rows < min_rows ? t0 : t0 + (t1 - t0) / 2 * 2;
  uint8_t* buffer = pairs_end > t0 ? split_codes_buffer(k) : nullptr;
  int configured = 0;
  for (int64_t t = t0; t < pairs_end; t += 2) {
    const uint8_t* a = tiles + t * tile_bytes;
    for (int64_t r0 = 0; r0 < rows; r0 += pass) {
      const int m = static_cast<int>(std::min<int64_t>(pass, rows - r0));
      if (m != configured) configure(m);
      configured = m;
      pair(a, a + tile_bytes, buffer, r0, m, t);
    }
  }
  if (pairs_end < t1) rest(8 * pairs_end);
}

// Output columns [begin, end) (multiples of 8) of every row of xq for a kind's x8 tiles: pairs
// of tiles on AMX, 32 rows at a time; a range's last odd tile, and steps of fewer than
// kAmxRows rows, on the kind's VNNI kernel.
template <class Kind>
inline void matmul_columns_pairs(const uint8_t* tiles, int64_t tile_bytes,
                                 const QuantizedRows& xq, int64_t rows, int64_t k, float* y,
                                 int64_t ldy, int64_t begin, int64_t end) {
  for_each_tile_pair(
      tiles, tile_bytes, rows, k, begin, end, kAmxRows, 32,
      [](int m) { configure_pair_tiles(std::min(m, 16), m - std::min(m, 16)); },
      [&](const uint8_t* a, const uint8_t* b, uint8_t* codes, int64_t r0, int m, int64_t t) {
        dot_pair<Kind>(a, b, codes, k / 256, xq, r0, m, k, y + r0 * ldy + 8 * t, ldy);
      },
      [&](int64_t first) { Kind::on_vnni(tiles, tile_bytes, xq, rows, k, y, ldy, first, end); });
}
