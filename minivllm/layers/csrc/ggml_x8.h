// The x8 layouts' host side, included by ggml_blocks.cpp (after its block kinds,
// QuantizedRows and check_blocks): Q4_0 / Q4_1 / Q4_K / Q6_K / Q8_0 / Q5_0 weights moved into
// tiles of 8 rows (ggml_q4x8_simd.h, ggml_q4kx8_simd.h, ggml_q6kx8_simd.h and
// ggml_q8x8_simd.h have the layouts and why),
// their checks, the moves there and back, and the scalar reference of the Q4_0 / Q4_1 kernel
// (the K kinds' is the stored layout's, on rows moved back).

// A segment whose qtype is the kind plus kX8 holds x8 tiles: [N / 8, blocks * x8_group_bytes].
constexpr int kX8 = 256;

// Bytes of one x8 block (8 rows of one ggml block: 32 inputs, or 256 for the K kinds).
constexpr int64_t x8_group_bytes(int qtype) {
  return qtype == kQ6_K   ? avx2::kQ6KX8Bytes
         : qtype == kQ4_K ? 1184
         : qtype == kQ8_0 || qtype == kQ5_0 ? 272
         : qtype == kQ4_1 ? 160
                          : 144;
}

// Q8_0 and Q5_0 share one tile layout: a byte a code (ggml_q8x8_simd.h).
bool q8x8_kind(int64_t qtype) { return qtype == kQ8_0 || qtype == kQ5_0; }

bool x8_kind(int64_t qtype) {
  return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ4_K || qtype == kQ6_K || q8x8_kind(qtype);
}

// The scalar twin of the q8x8 matmul: the same integers, from the tiles' signed codes.
void matmul_columns_q8x8_scalar(int, const uint8_t* tiles, int64_t tile_bytes,
                                const QuantizedRows& xq, int64_t rows, int64_t k, float* y,
                                int64_t ldy, int64_t begin, int64_t end) {
  const int64_t groups = k / kGroup;
  for (int64_t n = begin; n < end; ++n) {
    const int c = static_cast<int>(n % 8);
    for (int64_t r = 0; r < rows; ++r) {
      const int8_t* x = xq.codes.data() + r * k;
      const int8_t* f = xq.fine.data() + r * k;
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* b = tiles + (n / 8) * tile_bytes + g * x8_group_bytes(kQ8_0);
        int32_t dot = 0;  // sum(q * (254 x + f))
        for (int u = 0; u < 8; ++u) {
          for (int i = 0; i < 4; ++i) {
            const int64_t at = g * kGroup + 4 * u + i;
            dot += static_cast<int8_t>(b[32 * u + 4 * c + i]) * (254 * x[at] + f[at]);
          }
        }
        const float d = fp16(b + 256 + 2 * c) * (1.0f / 254.0f);  // as the vector paths round it
        acc += static_cast<float>(dot) * (d * xq.steps[r * groups + g]);
      }
      y[r * ldy + n] = acc;
    }
  }
}

// The scalar twin of the x8 matmul (the reference for the vector paths): the same integers,
// from the x8 layout, with the activations' two codes (QuantizedRows' fine ones).
void matmul_columns_q4x8_scalar(int qtype, const uint8_t* tiles, int64_t tile_bytes,
                                const QuantizedRows& xq, int64_t rows, int64_t k, float* y,
                                int64_t ldy, int64_t begin, int64_t end) {
  const int64_t groups = k / kGroup, gbytes = x8_group_bytes(qtype);
  for (int64_t n = begin; n < end; ++n) {
    const int c = static_cast<int>(n % 8);
    for (int64_t r = 0; r < rows; ++r) {
      const int8_t* x = xq.codes.data() + r * k;
      float acc = 0.0f;
      const int8_t* f = xq.fine.data() + r * k;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* b = tiles + (n / 8) * tile_bytes + g * gbytes;
        int32_t dot = 0;  // sum(q * (254 x + f))
        for (int u = 0; u < 4; ++u) {
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = b[32 * u + 4 * c + i];
            const int64_t lo = g * kGroup + 4 * u + i, hi = lo + 16;
            dot += (byte & 15) * (254 * x[lo] + f[lo]) + (byte >> 4) * (254 * x[hi] + f[hi]);
          }
        }
        const float d = fp16(b + 128 + 2 * c) * (1.0f / 254.0f);  // as the vector paths round it
        const float step = xq.steps[r * groups + g];
        if (qtype == kQ4_1) {
          acc += static_cast<float>(dot) * (d * step) + fp16(b + 144 + 2 * c) * xq.sums[r * groups + g];
        } else {  // the codes centred, as ggml's Q4_0: exact integers
          dot -= 8 * xq.fine_sums[r * groups + g];
          acc += static_cast<float>(dot) * (d * step);
        }
      }
      y[r * ldy + n] = acc;
    }
  }
}

// Checks x8 tiles (ggml_q4x8_repack's output) against `k` inputs a row.
void check_x8(const at::Tensor& tiles, int qtype, int64_t k, const char* op) {
  TORCH_CHECK(x8_kind(qtype), op, ": only Q4_0, Q4_1, Q4_K, Q6_K, Q8_0 and Q5_0 repack 8 rows "
              "at a time, got GGML type ", qtype);
  const int64_t elems = geometry(qtype).elems;
  TORCH_CHECK(k > 0 && k % elems == 0, op, ": the row size (", k, ") must be a multiple of ",
              elems);
  TORCH_CHECK(tiles.dim() == 2 && tiles.scalar_type() == at::kByte && tiles.is_contiguous(), op,
              ": x8 tiles must be [N / 8, tile_bytes] uint8, contiguous");
  TORCH_CHECK(tiles.size(1) == k / elems * x8_group_bytes(qtype), op, ": tiles of ",
              tiles.size(1), " bytes, expected ", k / elems * x8_group_bytes(qtype), " for ", k,
              " inputs");
}

// Q4_K: 8 rows' blocks (in[c] each) as one x8 block (ggml_q4kx8_simd.h), and back.
void q4k_to_x8(const uint8_t* const in[8], uint8_t* dst) {
  for (int c = 0; c < 8; ++c) {
    for (int i = 0; i < 4; ++i) {
      for (int u = 0; u < 8; ++u) std::memcpy(dst + 256 * i + 32 * u + 4 * c, in[c] + 16 + 32 * i + 4 * u, 4);
    }
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      k_scale_min(j, in[c] + 4, sc, m);
      dst[1024 + 8 * j + c] = static_cast<uint8_t>(sc);
      dst[1088 + 8 * j + c] = static_cast<uint8_t>(m);
    }
    std::memcpy(dst + 1152 + 2 * c, in[c], 2);      // d
    std::memcpy(dst + 1168 + 2 * c, in[c] + 2, 2);  // dmin
  }
}

void q4k_from_x8(const uint8_t* src, int c, uint8_t* blk) {
  std::memcpy(blk, src + 1152 + 2 * c, 2);
  std::memcpy(blk + 2, src + 1168 + 2 * c, 2);
  uint8_t sc[8], m[8];
  for (int j = 0; j < 8; ++j) sc[j] = src[1024 + 8 * j + c], m[j] = src[1088 + 8 * j + c];
  uint8_t* q = blk + 4;  // the inverse of k_scale_min's packing
  for (int j = 0; j < 4; ++j) {
    q[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    q[j + 4] = static_cast<uint8_t>(m[j] | ((m[j + 4] >> 4) << 6));
    q[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4));
  }
  for (int i = 0; i < 4; ++i) {
    for (int u = 0; u < 8; ++u) std::memcpy(blk + 16 + 32 * i + 4 * u, src + 256 * i + 32 * u + 4 * c, 4);
  }
}

// Q6_K: 8 rows' blocks (in[c] each) as one x8 block (ggml_q6kx8_simd.h), and back. Input i
// of row c is vector v = i / 4 (group v / 4, u = v % 4) at byte 4 c + i % 4 of each plane.
inline int64_t q6k_x8_low(int i, int c) {
  return 96 * (i / 16) + 32 * (i / 8 % 2) + 4 * c + i % 4;
}
inline int64_t q6k_x8_high(int i, int c) { return 96 * (i / 16) + 64 + 4 * c + i % 4; }

void q6k_to_x8(const uint8_t* const in[8], uint8_t* dst) {
  std::memset(dst, 0, avx2::kQ6KX8Scales);  // the code planes, or-ed into below
  int8_t q[256];
  for (int c = 0; c < 8; ++c) {
    for (int j = 0; j < 8; ++j) group_codes_scalar(kQ6_K, in[c], j, q + 32 * j);  // q - 32
    int32_t offset = 0;
    for (int g = 0; g < 16; ++g) {
      const int8_t scale = static_cast<int8_t>(in[c][192 + g]);
      int sum = 0;
      for (int i = 16 * g; i < 16 * g + 16; ++i) {
        const int code = q[i] + 32, u = i / 4 % 4;
        dst[q6k_x8_low(i, c)] |= static_cast<uint8_t>((code & 15) << (4 * (u % 2)));
        dst[q6k_x8_high(i, c)] |= static_cast<uint8_t>((code >> 4) << (2 * u));
        sum += q[i];
      }
      dst[avx2::kQ6KX8Scales + 8 * g + c] = static_cast<uint8_t>(scale);
      offset += 128 * scale * sum;
    }
    std::memcpy(dst + avx2::kQ6KX8D + 2 * c, in[c] + 208, 2);  // d
    std::memcpy(dst + avx2::kQ6KX8Offsets + 4 * c, &offset, 4);
  }
}

void q6k_from_x8(const uint8_t* src, int c, uint8_t* blk) {
  std::memset(blk, 0, 192);
  for (int i = 0; i < 256; ++i) {  // the inverse of group_codes_scalar's Q6_K unpacking
    const int u = i / 4 % 4;
    const int q = ((src[q6k_x8_low(i, c)] >> (4 * (u % 2))) & 15) |
                  (((src[q6k_x8_high(i, c)] >> (2 * u)) & 3) << 4);
    const int j = i / 32, l = i % 32, half = j / 4, jj = j % 4;
    blk[64 * half + 32 * (jj & 1) + l] |= static_cast<uint8_t>((q & 15) << (jj >= 2 ? 4 : 0));
    blk[128 + 32 * half + l] |= static_cast<uint8_t>((q >> 4) << (2 * jj));
  }
  for (int g = 0; g < 16; ++g) blk[192 + g] = src[avx2::kQ6KX8Scales + 8 * g + c];
  std::memcpy(blk + 208, src + avx2::kQ6KX8D + 2 * c, 2);
}

// A tile's 8 rows of one Q6_K x8 block (256 inputs) as values, row c at out + c * ldo:
// (d * scale) * (q - 32) in gguf-py's order, so fp32 is bit-exact. The tile is read as stored,
// 8 rows at once: each vector holds 4 codes of every row, widened two rows at a time and
// multiplied by those rows' scales. Moving each row back to the stored layout first (x8_row)
// repacks every code into its 4+2-bit halves, the slow part of a prefill; Q4_K's rows, moved
// back, dequantize as fast as its tiles would (docs/ggml-kernels.md).
template <typename T>
void q6k_x8_block_values(const uint8_t* src, T* out, int64_t ldo) {
  alignas(32) float d[8];
  for (int c = 0; c < 8; ++c) d[c] = fp16(src + avx2::kQ6KX8D + 2 * c);
  const __m256 dv = _mm256_load_ps(d);
  const __m256i lanes[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
                            _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                            _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5),
                            _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
  for (int g = 0; g < 16; ++g) {  // 16 inputs: vectors 4 g .. 4 g + 3
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + avx2::kQ6KX8Scales + 8 * g))));
    const __m256 s = _mm256_mul_ps(dv, sc);  // [8 rows]
    __m256i group[4];
    avx2::q6k_group(src, g, group);
    for (int v = 4 * g; v < 4 * g + 4; ++v) {
      const __m256i codes = group[v % 4];  // lane c: row c's inputs 4 v .. 4 v + 3
      const __m128i half[2] = {_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1)};
      for (int p = 0; p < 4; ++p) {  // rows 2 p and 2 p + 1
        const __m128i eight = p & 1 ? _mm_srli_si128(half[p / 2], 8) : half[p / 2];
        const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight));
        alignas(32) T both[8];
        avx2::store8(both, _mm256_mul_ps(_mm256_permutevar8x32_ps(s, lanes[p]), f));
        std::memcpy(out + 2 * p * ldo + 4 * v, both, 4 * sizeof(T));
        std::memcpy(out + (2 * p + 1) * ldo + 4 * v, both + 4, 4 * sizeof(T));
      }
    }
  }
}

// Row c of an x8 tile (`groups` groups) back in ggml's layout: one block a group; Q5_0's as
// Q8_0 blocks (its codes centred, a byte each: the same values).
void x8_row(int qtype, const uint8_t* tile, int c, int64_t groups, uint8_t* row) {
  if (q8x8_kind(qtype)) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* src = tile + g * x8_group_bytes(kQ8_0);
      uint8_t* blk = row + g * geometry(kQ8_0).bytes;
      std::memcpy(blk, src + 256 + 2 * c, 2);
      for (int u = 0; u < 8; ++u) std::memcpy(blk + 2 + 4 * u, src + 32 * u + 4 * c, 4);
    }
    return;
  }
  const Geometry geo = geometry(qtype);
  const int qs = geo.has_min ? 4 : 2, gbytes = static_cast<int>(x8_group_bytes(qtype));
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* src = tile + g * gbytes;
    uint8_t* blk = row + g * geo.bytes;
    if (qtype == kQ4_K || qtype == kQ6_K) {
      (qtype == kQ4_K ? q4k_from_x8 : q6k_from_x8)(src, c, blk);
      continue;
    }
    for (int u = 0; u < 4; ++u) std::memcpy(blk + qs + 4 * u, src + 32 * u + 4 * c, 4);
    std::memcpy(blk, src + 128 + 2 * c, 2);
    if (geo.has_min) std::memcpy(blk + 2, src + 144 + 2 * c, 2);
  }
}

// Checks blocks, or x8 tiles for `qtype` plus kX8; returns the weight's rows.
int64_t check_any(const at::Tensor& blocks, int64_t qtype, int64_t k, const char* op) {
  if (qtype >= kX8) {
    check_x8(blocks, static_cast<int>(qtype - kX8), k, op);
    return blocks.size(0) * 8;
  }
  check_blocks(blocks, qtype, k, op);
  return blocks.size(0);
}

// Q4_0 / Q4_1 / Q4_K / Q6_K blocks [N, row_bytes] (N a multiple of 8) as x8 tiles [N / 8,
// tile_bytes]: the same values, moved (ggml_q4x8_simd.h, ggml_q4kx8_simd.h, ggml_q6kx8_simd.h;
// Q4_K's packed 6-bit scales and mins unpacked to bytes, Q6_K's codes to a byte each).
// Tiles split over the thread pool.
at::Tensor ggml_q4x8_repack(const at::Tensor& blocks, int64_t qtype) {
  TORCH_CHECK(x8_kind(qtype), "ggml_q4x8_repack: only Q4_0, Q4_1, Q4_K, Q6_K, Q8_0 and Q5_0, "
              "got GGML type ", qtype);
  const Geometry geo = geometry(static_cast<int>(qtype));
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) % geo.bytes == 0,
              "ggml_q4x8_repack: blocks must be [N, row_bytes], whole blocks a row");
  TORCH_CHECK(blocks.size(0) % 8 == 0, "ggml_q4x8_repack: the rows (", blocks.size(0),
              ") must be a multiple of 8");
  check_blocks(blocks, qtype, blocks.size(1) / geo.bytes * geo.elems, "ggml_q4x8_repack");
  const int64_t groups = blocks.size(1) / geo.bytes, gbytes = x8_group_bytes(static_cast<int>(qtype));
  const int qs = geo.has_min ? 4 : 2;  // where the nibbles start in a block
  at::Tensor out = at::empty({blocks.size(0) / 8, groups * gbytes}, blocks.options());
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  const int64_t in_row = blocks.size(1), out_row = out.size(1);
  at::parallel_for(0, out.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* dst = o + t * out_row + g * gbytes;
        if (qtype == kQ4_K || qtype == kQ6_K) {
          const uint8_t* rows8[8];
          for (int c = 0; c < 8; ++c) rows8[c] = in + (8 * t + c) * in_row + g * geo.bytes;
          (qtype == kQ4_K ? q4k_to_x8 : q6k_to_x8)(rows8, dst);
          continue;
        }
        if (q8x8_kind(qtype)) {
          for (int c = 0; c < 8; ++c) {
            const uint8_t* blk = in + (8 * t + c) * in_row + g * geo.bytes;
            int8_t q[32];
            group_codes_scalar(static_cast<int>(qtype), blk, 0, q);  // Q5_0's centred
            for (int u = 0; u < 8; ++u) std::memcpy(dst + 32 * u + 4 * c, q + 4 * u, 4);
            std::memcpy(dst + 256 + 2 * c, blk, 2);  // d
          }
          continue;
        }
        for (int c = 0; c < 8; ++c) {
          const uint8_t* blk = in + (8 * t + c) * in_row + g * geo.bytes;
          for (int u = 0; u < 4; ++u) std::memcpy(dst + 32 * u + 4 * c, blk + qs + 4 * u, 4);
          std::memcpy(dst + 128 + 2 * c, blk, 2);                     // d
          if (geo.has_min) std::memcpy(dst + 144 + 2 * c, blk + 2, 2);  // m
        }
      }
    }
  });
  return out;
}
