// Q8_0's and Q5_0's q8x8 tiles (ggml_q8x8_simd.h) on AMX's int8 tiles: included by
// ggml_blocks.cpp in namespace amx, after ggml_amx.h (its TileConfig and kAmxRows' reasoning).
//
// Why: a 16-sequence step of Gemma 3 spends more than half its matmul time in its 262k-row
// Q8_0 head, where the VNNI kernel pays two `vpdpbusd` (the activations' two codes) per 8
// columns, 4 inputs and activation row: at 16 rows that is 2.4x the one-row step, which only
// reads the weights.
//
// A q8x8 group's vector u (8 columns' inputs 4 u .. 4 u + 3, a signed byte each) is a row of
// an AMX B tile; two tiles' vectors side by side (copied, as the first rows go) make one B
// tile of 16 columns. Each group of 32 inputs has its own scale per column, so its sums leave
// the tiles once a group. The activation's two codes are one 16-bit integer, 254 q + f; as
// the bytes 256 high + low (`QuantizedRows::fill_bytes`) a group's integer is 256 (x_high . w)
// + (x_low . w): two `tdpbssd` (signed times signed, none of the VNNI kernel's +128 offset)
// and one shift, the VNNI kernel's integer, and its float work follows, so the results are
// equal bit for bit. On the Xeon (2 threads), Gemma-3-270M's head alone at 16 rows: VNNI
// 21.6 ms; four products a group on the tiles as they lie (8 columns each, no copy) 16.3; the
// two-byte integer 13.9; 16 columns and two sets of sums (one group's stored while the next
// one's multiply) 11.7; one row 8.3, the bytes' time. The step's matmuls at 16 rows
// (`benchmarks/gguf_step_rows.py FILE --rows 16 --isa avx512_vnni amx`): 38.2 -> 26.7 ms.

// Where AMX begins: at 4 activation rows the head (a tile per 262k columns) and the fused
// layers are as fast as on the VNNI kernel, which reads the weights once for all rows; from
// 8 rows faster.
constexpr int64_t kAmxQ8Rows = 4;

// Tiles 0 and 1: the activations' high and low bytes (rows x 32 bytes); 2: a group of both
// tiles' weights, interleaved (8 x 64); 3, 4 and 5, 6: two sets of high and low sums (rows x
// 16 int32), used by alternate groups, so that one group's products run while the previous
// group's sums are stored.
inline void configure_q8_tiles(int rows) {
  TileConfig cfg;
  for (int t : {0, 1}) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 32;
  cfg.rows[2] = 8, cfg.colsb[2] = 64;
  for (int t : {3, 4, 5, 6}) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// Group g of x8 tiles a and b as one B tile: row u is a's vector u, then b's (16 columns).
// Both tiles are read side by side, so the bytes kQ4x8Ahead past a's (b's) end are the next
// pair's a's (b's), 2 tiles on.
inline void interleave_q8_group(const uint8_t* a, const uint8_t* b, int64_t g, int64_t groups,
                                uint8_t* out) {
  const uint8_t* wa = a + g * kQ8x8GroupBytes;
  const uint8_t* wb = b + g * kQ8x8GroupBytes;
  // ahead as the VNNI kernel: one step streams every weight from memory once
  const int64_t tile_bytes = groups * kQ8x8GroupBytes;
  int64_t ahead = g * kQ8x8GroupBytes + kQ4x8Ahead;
  ahead += ahead >= tile_bytes ? tile_bytes : 0;
  for (int line = 0; line < 5; ++line) {
    _mm_prefetch(reinterpret_cast<const char*>(a + ahead + 64 * line), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + ahead + 64 * line), _MM_HINT_T0);
  }
  for (int u = 0; u < 8; ++u) {
    _mm512_store_si512(out + g * 512 + 64 * u, pair_load32(wa + 32 * u, wb + 32 * u));
  }
}

// One group's two products issued into sum set Set (tiles 3, 4 or 5, 6); x, f: the group's
// first high and low byte of row 0, k apart; w: its interleaved weights.
template <int Set>
inline void q8_group_products(const int8_t* x, const int8_t* f, int64_t k, const uint8_t* w) {
  _tile_loadd(0, x, k);
  _tile_loadd(1, f, k);
  _tile_loadd(2, w, 64);
  if constexpr (Set == 0) {  // a tile's number is part of its instruction: spelled out
    _tile_zero(3);
    _tile_zero(4);
    _tile_dpbssd(3, 0, 2);
    _tile_dpbssd(4, 1, 2);
  } else {
    _tile_zero(5);
    _tile_zero(6);
    _tile_dpbssd(5, 0, 2);
    _tile_dpbssd(6, 1, 2);
  }
}

// Sum set Set to c: high sums at c[0], low at c[1], rows of 16 columns.
template <int Set>
inline void q8_group_store(int32_t (*c)[256]) {
  if constexpr (Set == 0) {
    _tile_stored(3, c[0], 64);
    _tile_stored(4, c[1], 64);
  } else {
    _tile_stored(5, c[0], 64);
    _tile_stored(6, c[1], 64);
  }
}

// Output columns of q8x8 tiles a and b (16) for rows [r0, r0 + rows), rows <= 16, their
// groups interleaved into w as the first rows go (r0 == 0), two groups ahead (a tile load of
// bytes still in the store buffer waits for them). Group g's products are issued before
// group g - 1's sums are stored and group g - 2's float work runs: the tiles compute while
// the vector units work (three buffers of sums).
inline void dot_q8_pair(const uint8_t* a, const uint8_t* b, uint8_t* w, int64_t groups,
                        const QuantizedRows& xq, int64_t r0, int rows, int64_t k, float* y,
                        int64_t ldy) {
  alignas(64) int32_t c[3][2][256];
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* x = xq.high.data() + r0 * k;
  const int8_t* f = xq.low.data() + r0 * k;
  const float* steps = xq.steps.data() + r0 * groups;
  const __m512 per_fine = _mm512_set1_ps(1.0f / 254.0f);
  const auto float_work = [&](int64_t g) {
    const int32_t(*s)[256] = c[g % 3];
    const __m512 d = _mm512_mul_ps(
        pair_fp16(a + g * kQ8x8GroupBytes + 256, b + g * kQ8x8GroupBytes + 256), per_fine);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      if (r < rows) {  // 254 q + f = 256 high + low: the VNNI kernel's integer
        const __m512i high = _mm512_slli_epi32(_mm512_load_si512(s[0] + 16 * r), 8);
        const __m512i exact = _mm512_add_epi32(high, _mm512_load_si512(s[1] + 16 * r));
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(steps[r * groups + g]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, acc[r]);
      }
    }
  };
  constexpr int64_t kAhead = 2;
  for (int64_t g = 0; r0 == 0 && g < std::min(kAhead, groups); ++g) {
    interleave_q8_group(a, b, g, groups, w);
  }
  for (int64_t g = 0; g < groups; ++g) {
    if (g & 1) {
      q8_group_products<1>(x + g * kGroup, f + g * kGroup, k, w + g * 512);
      q8_group_store<0>(c[(g - 1) % 3]);
    } else {
      q8_group_products<0>(x + g * kGroup, f + g * kGroup, k, w + g * 512);
      if (g > 0) q8_group_store<1>(c[(g - 1) % 3]);
    }
    if (r0 == 0 && g + kAhead < groups) interleave_q8_group(a, b, g + kAhead, groups, w);
    if (g > 1) float_work(g - 2);
  }
  if (groups & 1) {
    q8_group_store<0>(c[(groups - 1) % 3]);
  } else {
    q8_group_store<1>(c[(groups - 1) % 3]);
  }
  if (groups > 1) float_work(groups - 2);
  float_work(groups - 1);
  for (int r = 0; r < rows; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// Output columns [begin, end) (multiples of 8) of every row of xq for q8x8 tiles: pairs of
// tiles on AMX, 16 rows at a time; a range's last odd tile, and steps of fewer than
// kAmxQ8Rows rows, on the VNNI kernel.
inline void matmul_columns_q8x8(int qtype, const uint8_t* tiles, int64_t tile_bytes,
                                const QuantizedRows& xq, int64_t rows, int64_t k, float* y,
                                int64_t ldy, int64_t begin, int64_t end) {
  for_each_tile_pair(
      tiles, tile_bytes, rows, k, begin, end, kAmxQ8Rows, 16, configure_q8_tiles,
      [&](const uint8_t* a, const uint8_t* b, uint8_t* weights, int64_t r0, int m, int64_t t) {
        dot_q8_pair(a, b, weights, k / kGroup, xq, r0, m, k, y + r0 * ldy + 8 * t, ldy);
      },
      [&](int64_t first) {
        vnni::matmul_columns_q8x8(qtype, tiles, tile_bytes, xq, rows, k, y, ldy, first, end);
      });
}
