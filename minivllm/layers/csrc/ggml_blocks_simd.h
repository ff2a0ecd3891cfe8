// The vectorised half of ggml_blocks.cpp, included there twice: once as it is (AVX2, the
// flags every kernel is built with) in namespace `avx2`, once under
// `#pragma GCC target("avx512...vnni")` in namespace `vnni` with MINIVLLM_GGML_VNNI defined,
// where the integer dot product of a group is one `vpdpbusd` instead of `vpmaddubsw` +
// `vpmaddwd`. Both give the same integers; only that instruction differs.
//
// Needs from the including file: the block kinds' numbers (kQ4_0 ...), `geometry`, `fp16`,
// `block_scales`, QuantizedRows, kGroup.

// 32 bytes at p.
inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// 8 floats to out: fp32 as they are, or bf16 rounded to nearest even (+ 0x7FFF + bit 16, the
// high half kept).
inline void store8(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
inline void store8(uint16_t* out, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1)));
}

// 16 bytes of packed nibbles -> 32 codes 0..15 in input order: the low nibbles are inputs
// 0..15, the high ones 16..31 (Q4_0 / Q4_1 / Q5_0 / Q5_1).
inline __m256i nibbles16(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask),
                          _mm_and_si128(bytes, mask));
}

// The 32 bits of `bits` as 32 bytes, 0x10 where bit i is set (the fifth bit of input i).
inline __m256i bit4_of(uint32_t bits) {
  const __m256i select = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i which = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), select);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, which), which),
                          _mm256_set1_epi8(0x10));
}

// Bits [shift, shift + width) of every byte of v, moved to bits 4.. (width 1 or 2).
inline __m256i high_bits(__m256i v, int shift, int width_mask) {
  const __m256i bits = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)),
                                        _mm256_set1_epi8(static_cast<char>(width_mask)));
  return _mm256_slli_epi16(bits, 4);  // bytes <= 3: nothing crosses into the next byte
}

// Group j's 32 codes of the block at b, as int8 in input order. For the signed kinds
// (Q4_0, Q5_0, Q8_0, Q6_K) the codes are centred (q - 8, q - 16, q, q - 32); for the others
// they are the stored 0..15 / 0..31, the offset being the block's min.
template <int QT>
inline __m256i group_codes(const uint8_t* b, int j) {
  if constexpr (QT == kQ4_0) {
    return _mm256_sub_epi8(nibbles16(b + 2), _mm256_set1_epi8(8));
  } else if constexpr (QT == kQ4_1) {
    return nibbles16(b + 4);
  } else if constexpr (QT == kQ5_0) {
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    return _mm256_sub_epi8(_mm256_or_si256(nibbles16(b + 6), bit4_of(qh)), _mm256_set1_epi8(16));
  } else if constexpr (QT == kQ5_1) {
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    return _mm256_or_si256(nibbles16(b + 8), bit4_of(qh));
  } else if constexpr (QT == kQ8_0) {
    return load32(b + 2);
  } else if constexpr (QT == kQ4_K) {  // qs at 16: groups 2i, 2i + 1: low, high nibbles of qs[32i..]
    const __m256i v = load32(b + 16 + 32 * (j / 2));
    return _mm256_and_si256(j & 1 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
  } else if constexpr (QT == kQ5_K) {  // qh[32] at 16 (bit j of qh[l]: input l of group j), qs at 48
    const __m256i v = load32(b + 48 + 32 * (j / 2));
    const __m256i low = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(v, 4) : v,
                                         _mm256_set1_epi8(0x0F));
    return _mm256_or_si256(low, high_bits(load32(b + 16), j, 1));
  } else {  // kQ6_K: ql[128] at 0, qh[64] at 128; a half of 128 inputs is 4 groups
    const int half = j / 4, jj = j % 4;
    const __m256i v = load32(b + 64 * half + 32 * (jj & 1));
    const __m256i low = _mm256_and_si256(jj >= 2 ? _mm256_srli_epi16(v, 4) : v,
                                         _mm256_set1_epi8(0x0F));
    const __m256i high = high_bits(load32(b + 128 + 32 * half), 2 * jj, 3);
    return _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
  }
}

// Eight int32 partial sums of the 32 products `w * x` (w unsigned 0..63, x int8), exact:
// a pair of products is at most 2 * 63 * 127 in magnitude, inside int16.
inline __m256i dot_u8s8(__m256i w, __m256i x) {
#ifdef MINIVLLM_GGML_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

inline int hsum_epi32(__m256i v) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1)));
}

// A group's fine codes (QuantizedRows in ggml_blocks.cpp): f = round((x - step q) * 254 /
// step), the difference by one fused multiply-add as the scalar path computes it; and the
// group's sum of 254 q + f.
inline void fine_codes(const __m256 v[4], const __m256i q[4], float step, int8_t* fine,
                       int32_t* fine_sum) {
  const __m256 neg_step = _mm256_set1_ps(-step), inverse = _mm256_set1_ps(step > 0.0f ? 254.0f / step : 0.0f);
  __m256i f[4], total = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    const __m256 left = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[j]), neg_step, v[j]);
    f[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(left, inverse),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    total = _mm256_add_epi32(total, _mm256_add_epi32(_mm256_mullo_epi32(q[j], _mm256_set1_epi32(254)), f[j]));
  }
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(f[0], f[1]), _mm256_packs_epi32(f[2], f[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(fine), bytes);
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  *fine_sum = _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1)));
}

// Activations quantized per row and group of 32 (the SIMD twin of quantize_rows_scalar, same
// rounding, so the same codes and sums): codes [rows, k] int8, steps and the codes' values
// summed [rows, k/32]; and the fine codes where asked for.
inline void quantize_rows(const float* x, int64_t rows, int64_t k, QuantizedView out) {
  const int64_t groups = rows * (k / kGroup);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < groups; ++i) {  // group i: row i / (k / 32), contiguous in x
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(x + i * kGroup + 8 * j);
    const __m256 absmax = _mm256_max_ps(
        _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
        _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(absmax), _mm256_extractf128_ps(absmax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i q[4];
    for (int j = 0; j < 4; ++j) {  // nearest integer, ties to even: |q| <= 127
      q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], inverse),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    // int32 -> int16 -> int8; packs works within 128-bit lanes, the permute puts them back
    const __m256i words01 = _mm256_packs_epi32(q[0], q[1]), words23 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words01, words23),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.codes + i * kGroup), bytes);
    out.steps[i] = amax / 127.0f;
    if (out.fine != nullptr) {
      fine_codes(v, q, out.steps[i], out.fine + i * kGroup, out.fine_sums + i);
      out.sums[i] = out.steps[i] * (static_cast<float>(out.fine_sums[i]) / 254.0f);
    } else {
      out.sums[i] = out.steps[i] * static_cast<float>(hsum_epi32(_mm256_add_epi32(
                                       _mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]))));
    }
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A block's scales and mins as block_scales writes them (scales[2j], scales[2j + 1]: group
// j's halves; mins[j]), the same fp32 values, with vector code for the K kinds' packed 6-bit
// scales and Q6_K's int8 ones. For Q4_K / Q5_K it also returns the 8 mins as one vector.
template <int QT>
inline __m256 simd_block_scales(const uint8_t* b, float* scales, float* mins) {
  if constexpr (QT == kQ4_K || QT == kQ5_K) {
    uint32_t lo, mid, hi;  // bytes 0-3: scales 0-3 (+ high bits of 4-7), 4-7: mins, 8-11: low
    std::memcpy(&lo, b + 4, 4);
    std::memcpy(&mid, b + 8, 4);
    std::memcpy(&hi, b + 12, 4);
    const uint32_t sc_high = (hi & 0x0F0F0F0Fu) | ((lo >> 2) & 0x30303030u);
    const uint32_t m_high = ((hi >> 4) & 0x0F0F0F0Fu) | ((mid >> 2) & 0x30303030u);
    const __m128i sc = _mm_setr_epi32(static_cast<int>(lo & 0x3F3F3F3Fu), static_cast<int>(sc_high), 0, 0);
    const __m128i m = _mm_setr_epi32(static_cast<int>(mid & 0x3F3F3F3Fu), static_cast<int>(m_high), 0, 0);
    const __m256 scale8 = _mm256_mul_ps(_mm256_set1_ps(fp16(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)));
    const __m256 min8 = _mm256_mul_ps(_mm256_set1_ps(-fp16(b + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m)));
    _mm256_storeu_ps(scales, _mm256_permutevar8x32_ps(scale8, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)));
    _mm256_storeu_ps(scales + 8, _mm256_permutevar8x32_ps(scale8, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)));
    _mm256_storeu_ps(mins, min8);
    return min8;
  } else if constexpr (QT == kQ6_K) {
    const __m256 d = _mm256_set1_ps(fp16(b + 208));
    for (int half = 0; half < 2; ++half) {
      const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 192 + 8 * half));
      _mm256_storeu_ps(scales + 8 * half, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight))));
    }
    _mm256_storeu_ps(mins, _mm256_setzero_ps());
    return _mm256_setzero_ps();
  } else {
    block_scales(QT, b, scales, mins);
    return _mm256_setzero_ps();
  }
}

// Output column n (its weight row `w`, `blocks` blocks) for the `Rows` activation rows
// [row0, row0 + Rows): y[r * ldy]. A group's codes are unpacked once for all the rows; each
// row has two accumulators (even and odd groups) so that consecutive groups do not wait on
// one another's multiply-add.
template <int QT, int Rows>
void dot_row(const uint8_t* w, int64_t blocks, const QuantizedRows& xq, int64_t row0, int64_t k,
             float* y, int64_t ldy) {
  constexpr Geometry geo = geometry(QT);
  constexpr bool is_signed = geo.is_signed;
  constexpr int groups = geo.groups;
  constexpr bool k_mins = QT == kQ4_K || QT == kQ5_K;  // a vector of 8 mins a block
  const int64_t row_groups = k / kGroup;
  const int8_t* codes = xq.codes.data() + row0 * k;
  const float* steps = xq.steps.data() + row0 * row_groups;
  const float* sums = xq.sums.data() + row0 * row_groups;
  __m256 acc[Rows][2], min_acc[Rows];
  float min_term[Rows];
  for (int r = 0; r < Rows; ++r) {
    acc[r][0] = acc[r][1] = min_acc[r] = _mm256_setzero_ps();
    min_term[r] = 0.0f;
  }
  alignas(32) float scales[16], mins[8];
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = w + blk * geo.bytes;
    const __m256 min8 = simd_block_scales<QT>(b, scales, mins);
    if constexpr (k_mins) {  // the block's 8 groups: min * (their codes' values)
      for (int r = 0; r < Rows; ++r) {
        min_acc[r] = _mm256_fmadd_ps(min8, _mm256_loadu_ps(sums + r * row_groups + blk * 8), min_acc[r]);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < groups; ++j) {
      const int64_t g = blk * groups + j;  // the group's index along the row
      const __m256i q = group_codes<QT>(b, j);
      const __m256i magnitude = is_signed ? _mm256_abs_epi8(q) : q;
      // Q6_K's per-lane scale: lanes 0-3 sum inputs 0..15, lanes 4-7 inputs 16..31
      __m256 halves = _mm256_setzero_ps();
      if constexpr (QT == kQ6_K) {
        halves = _mm256_setr_m128(_mm_set1_ps(scales[2 * j]), _mm_set1_ps(scales[2 * j + 1]));
      }
#pragma GCC unroll 4
      for (int r = 0; r < Rows; ++r) {
        __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + r * k + g * kGroup));
        if constexpr (is_signed) x = _mm256_sign_epi8(x, q);  // |w| * (x * sign w) == w * x
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(magnitude, x));
        const float step = steps[r * row_groups + g];
        const __m256 scale = QT == kQ6_K ? _mm256_mul_ps(halves, _mm256_set1_ps(step))
                                         : _mm256_set1_ps(scales[2 * j] * step);
        acc[r][j & 1] = _mm256_fmadd_ps(dot, scale, acc[r][j & 1]);
        if constexpr (geo.has_min && !k_mins) min_term[r] += mins[0] * sums[r * row_groups + g];
      }
    }
  }
  for (int r = 0; r < Rows; ++r) {
    y[r * ldy] = hsum(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), min_acc[r])) + min_term[r];
  }
}

// Calls tile(n, r0, Rows) for every weight row n in [begin, end) and activation rows [r0, r0 +
// Rows) of `rows`, Rows a std::integral_constant of 1..4, blocked for the caches: activation
// rows 64 at a time (their codes stay in L2 while the weight rows stream past), weight rows 8
// at a time (they stay in L1 while each 4 activation rows meet them; a weight row's codes are
// unpacked once for 4 rows). Both kernels' (32-input and K kinds) loop.
template <typename Tile>
inline void for_each_tile(int64_t rows, int64_t begin, int64_t end, Tile tile) {
  for (int64_t c0 = 0; c0 < rows; c0 += 64) {
    const int64_t c1 = std::min(rows, c0 + 64);
    for (int64_t n0 = begin; n0 < end; n0 += 8) {
      const int64_t n1 = std::min(end, n0 + 8);
      for (int64_t r0 = c0; r0 < c1; r0 += 4) {
        for (int64_t n = n0; n < n1; ++n) {
          switch (std::min<int64_t>(4, c1 - r0)) {
            case 4: tile(n, r0, std::integral_constant<int, 4>{}); break;
            case 3: tile(n, r0, std::integral_constant<int, 3>{}); break;
            case 2: tile(n, r0, std::integral_constant<int, 2>{}); break;
            default: tile(n, r0, std::integral_constant<int, 1>{}); break;
          }
        }
      }
    }
  }
}

// Output columns [begin, end) for every row of xq.
template <int QT>
void matmul_columns_of(const uint8_t* weights, int64_t row_bytes, const QuantizedRows& xq,
                       int64_t rows, int64_t k, float* y, int64_t n_out, int64_t begin,
                       int64_t end) {
  const int64_t blocks = k / geometry(QT).elems;
  for_each_tile(rows, begin, end, [&](int64_t n, int64_t r0, auto tile_rows) {
    dot_row<QT, decltype(tile_rows)::value>(weights + n * row_bytes, blocks, xq, r0, k,
                                            y + r0 * n_out + n, n_out);
  });
}

inline void matmul_columns(int qtype, const uint8_t* weights, int64_t row_bytes,
                           const QuantizedRows& xq, int64_t rows, int64_t k, float* y,
                           int64_t n_out, int64_t begin, int64_t end) {
  switch (qtype) {
#define MINIVLLM_GGML_CASE(QT) \
    case QT: return matmul_columns_of<QT>(weights, row_bytes, xq, rows, k, y, n_out, begin, end);
    MINIVLLM_GGML_CASE(kQ4_0) MINIVLLM_GGML_CASE(kQ4_1) MINIVLLM_GGML_CASE(kQ5_0)
    MINIVLLM_GGML_CASE(kQ5_1) MINIVLLM_GGML_CASE(kQ8_0) MINIVLLM_GGML_CASE(kQ4_K)
    MINIVLLM_GGML_CASE(kQ5_K) MINIVLLM_GGML_CASE(kQ6_K)
#undef MINIVLLM_GGML_CASE
    default: return;
  }
}

// Weight rows [begin, end) as floats: out[(n - begin) * k + i], fp32 or (bf16 == true) the
// fp32 values rounded to bf16, nearest-even. Each value is `scale * q + min` computed as
// gguf-py computes it (a product, then a sum: no fused multiply-add), so fp32 is bit-exact.
template <int QT>
void dequantize_rows_of(const uint8_t* weights, int64_t row_bytes, int64_t k, int64_t begin,
                        int64_t end, void* out, bool bf16) {
  constexpr Geometry geo = geometry(QT);
  const int64_t blocks = k / geo.elems;
  alignas(32) float scales[16], mins[8];
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* w = weights + n * row_bytes;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const uint8_t* b = w + blk * geo.bytes;
      simd_block_scales<QT>(b, scales, mins);
      for (int j = 0; j < geo.groups; ++j) {
        const __m256i q = group_codes<QT>(b, j);
        const __m256 min = _mm256_set1_ps(mins[j]);
        const int64_t at = (n - begin) * k + blk * geo.elems + j * kGroup;
        const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
        for (int part = 0; part < 4; ++part) {  // 8 inputs a part; parts 0-1 scale 2j
          const __m128i eight = part & 1 ? _mm_srli_si128(halves[part / 2], 8) : halves[part / 2];
          const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight));
          const __m256 v = _mm256_add_ps(_mm256_mul_ps(f, _mm256_set1_ps(scales[2 * j + part / 2])), min);
          if (bf16) {
            store8(static_cast<uint16_t*>(out) + at + 8 * part, v);
          } else {
            store8(static_cast<float*>(out) + at + 8 * part, v);
          }
        }
      }
    }
  }
}

inline void dequantize_rows(int qtype, const uint8_t* weights, int64_t row_bytes, int64_t k,
                            int64_t begin, int64_t end, void* out, bool bf16) {
  switch (qtype) {
#define MINIVLLM_GGML_CASE(QT) \
    case QT: return dequantize_rows_of<QT>(weights, row_bytes, k, begin, end, out, bf16);
    MINIVLLM_GGML_CASE(kQ4_0) MINIVLLM_GGML_CASE(kQ4_1) MINIVLLM_GGML_CASE(kQ5_0)
    MINIVLLM_GGML_CASE(kQ5_1) MINIVLLM_GGML_CASE(kQ8_0) MINIVLLM_GGML_CASE(kQ4_K)
    MINIVLLM_GGML_CASE(kQ5_K) MINIVLLM_GGML_CASE(kQ6_K)
#undef MINIVLLM_GGML_CASE
    default: return;
  }
}
