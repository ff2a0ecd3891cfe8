// Quantized weights times activations for few rows (decode steps) on x86 CPUs with AVX2.
//
// y[m, n] = sum_k x[m, k] * w[n, k] with w stored as llama.cpp stores it: groups of 32 inputs,
// one fp16 scale and one fp16 min per group and output, `w = q * scale + min`, q either
//   bits 4: 16 bytes a group, the low nibble of byte i is q[i], the high nibble q[16 + i]
//           (GGUF's Q4_0/Q4_1 layout), codes 0..15;
//   bits 8: 32 signed bytes a group (GGUF's Q8_0), codes -128..127.
// Outputs come in blocks of kCols = 4 whose groups are interleaved: block b holds, for each
// group g, the four columns' codes one after the other ([N / 4, groups, 4, group bytes]), and
// scales and mins likewise ([N / 4, groups, 4]), so that a one-row step reads the weights in
// one sequential stream. (The tensors keep the shapes [N, K * bits / 8] and [N, K / 32].)
//
// The fp32 activations are quantized per row and group of 32 to 16-bit integers, `x = step *
// xq` with step = max|x| / 32767 (one 8-bit code per group, llama.cpp's Q8 activations, lost
// too much perplexity: docs/performance.md), and the weight codes widened to 16 bits, so
// that a group's dot product is integer (`vpmaddwd`: 16 products a instruction, summed exactly
// in int32) and scaled once: `scale * step * sum(q * xq)`. The min term uses the exact fp32 sum
// of the group's activations: `min * sum(x)`. So a step reads 5 (or 8.5) bits per weight
// instead of 32, and the only rounding beyond fp32's is the activations' to 16 bits per group.
// Blocks of output columns are split over torch's own thread pool (at::parallel_for).
//
// On CPUs with AVX-512 VNNI (where torch runs its AVX-512 kernels: ATEN_CPU_CAPABILITY=avx2
// keeps this file's AVX2 code), 4-bit weights take `dot_block_vnni`: a block's four columns of
// a group in one 64-byte load, their 16-bit products summed by `vpdpwssd`, the same integers
// as the AVX2 path, about half the instructions a weight.
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <vector>

#include "cpu_features.h"

namespace {

constexpr int64_t kGroup = 32;
// How far ahead of its reads a one-row kernel asks memory for weight bytes (its stream is
// sequential, but the prefetcher alone leaves it waiting on memory).
constexpr int64_t kAhead = 2048;
constexpr int kCols = 4;  // output columns whose weights are stored interleaved, group by group

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Four fp16 values as fp32.
inline __m128 half4(const uint16_t* p) {
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i load_bytes(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Activations quantized per row and group of 32: codes [rows, k] int16, steps and exact sums
// [rows, groups], and the two again group-major ([groups, stride], stride = rows + 8, zeros
// past the last row) so that the 8 rows of a tile are one load.
struct QuantizedRows {
  std::vector<int16_t> codes;
  std::vector<float> steps;
  std::vector<float> sums;
  int64_t stride = 0;
  std::vector<float> steps_t;
  std::vector<float> sums_t;
};

// 16 floats, already integers in -32767..32767, as 16 int16 in order.
inline __m256i to_int16(__m256 a, __m256 b) {
  // packs works within 128-bit lanes: [a0-3 b0-3 | a4-7 b4-7]
  const __m256i mixed = _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));
  return _mm256_permute4x64_epi64(mixed, 0xD8);  // [a0-3 a4-7 | b0-3 b4-7]
}

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t k) {
  const int64_t groups = rows * (k / kGroup);
  QuantizedRows out{std::vector<int16_t>(rows * k), std::vector<float>(groups),
                    std::vector<float>(groups)};
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
    const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    __m256 q[4];
    for (int j = 0; j < 4; ++j) {  // nearest integer, ties to even: |q| <= 32767
      q[j] = _mm256_round_ps(_mm256_mul_ps(v[j], inverse),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    int16_t* codes = out.codes.data() + i * kGroup;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), to_int16(q[0], q[1]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 16), to_int16(q[2], q[3]));
    out.steps[i] = amax / 32767.0f;
    out.sums[i] = hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  }
  if (rows > 1) {
    const int64_t per_row = k / kGroup;
    out.stride = rows + 8;
    out.steps_t.assign(per_row * out.stride, 0.0f);
    out.sums_t.assign(per_row * out.stride, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < per_row; ++g) {
        out.steps_t[g * out.stride + r] = out.steps[r * per_row + g];
        out.sums_t[g * out.stride + r] = out.sums[r * per_row + g];
      }
    }
  }
  return out;
}

// One group's 32 weight codes widened to int16, in input order: [0..15], [16..31].
struct Widened {
  __m256i first, second;
};

template <int Bits>
inline Widened widen(const uint8_t* q) {
  if constexpr (Bits == 4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i mask = _mm_set1_epi8(0x0F);
    return {_mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask)),                      // q[0..15]
            _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask))};  // q[16..31]
  } else {
    return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))),
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))};
  }
}

// Eight int32 partial sums of a group's 32 products `q * xq` (exact: |sum| <= 32 * 128 * 32767),
// the activation codes at `x`.
inline __m256i group_dot(const Widened& w, const int16_t* x) {
  return _mm256_add_epi32(_mm256_madd_epi16(w.first, load_bytes(x)),
                          _mm256_madd_epi16(w.second, load_bytes(x + 16)));
}

// Output column `c` of the block of kCols columns at q / scale / min, for `Rows` (2..8)
// activation rows: y[r * ldy] for each row r. `Rows` is a compile-time constant so that the
// accumulators stay in registers; the rows' scales and sums of a group are one vector.
template <int Bits, int Rows>
inline void dot_rows(const QuantizedRows& xq, int64_t row0, int64_t k, const uint8_t* q,
                     const uint16_t* scale, const uint16_t* min, int64_t groups, int c, float* y,
                     int64_t ldy) {
  constexpr int64_t kBytes = Bits * kGroup / 8;
  const int16_t* codes = xq.codes.data() + row0 * k;
  const float* steps = xq.steps_t.data() + row0;  // + g * stride: the tile's rows
  const float* sums = xq.sums_t.data() + row0;
  __m256 acc[Rows];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
  __m256 min_term = _mm256_setzero_ps();  // [8 rows]
  alignas(32) float combined[8];
  for (int64_t g = 0; g < groups; ++g) {
    const Widened w = widen<Bits>(q + (g * kCols + c) * kBytes);
    // the weight's scale times each row's step: [8 rows]
    _mm256_store_ps(combined, _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(scale[g * kCols + c])),
                                            _mm256_loadu_ps(steps + g * xq.stride)));
#pragma GCC unroll 8  // unrolled, the accumulators live in registers, not on the stack
    for (int r = 0; r < Rows; ++r) {
      const __m256i dot = group_dot(w, codes + r * k + g * kGroup);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(combined + r),
                               acc[r]);
    }
    if (min != nullptr) {  // min * (the exact sum of the group's inputs), for the 8 rows
      min_term = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(min[g * kCols + c])),
                                 _mm256_loadu_ps(sums + g * xq.stride), min_term);
    }
  }
  alignas(32) float mins_of_rows[8];
  _mm256_store_ps(mins_of_rows, min_term);
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) y[r * ldy] = hsum(acc[r]) + mins_of_rows[r];
}

// The kCols (4) columns of one block for one activation row (a one-sequence decode step):
// the columns share the row's loads, their weights are read in one sequential stream, and
// their sums are reduced together and stored at once.
template <int Bits>
inline void dot_block(const QuantizedRows& xq, int64_t row0, int64_t k, const uint8_t* q,
                      const uint16_t* scale, const uint16_t* min, int64_t groups, float* y) {
  constexpr int64_t kBytes = Bits * kGroup / 8;
  const int16_t* codes = xq.codes.data() + row0 * k;
  const float* xd = xq.steps.data() + row0 * groups;
  const float* xs = xq.sums.data() + row0 * groups;
  __m256 acc[kCols];
#pragma GCC unroll 4
  for (int c = 0; c < kCols; ++c) acc[c] = _mm256_setzero_ps();
  __m128 min_term = _mm_setzero_ps();  // [4 columns]
  for (int64_t g = 0; g < groups; ++g) {
    const int16_t* x = codes + g * kGroup;
    const char* ahead = reinterpret_cast<const char*>(q + g * kCols * kBytes) + kAhead;
    for (int64_t line = 0; line < kCols * kBytes; line += 64) {
      _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    // the four columns' scales times the activations' scale: [4]
    alignas(16) float s[kCols];
    _mm_store_ps(s, _mm_mul_ps(half4(scale + g * kCols), _mm_set1_ps(xd[g])));
#pragma GCC unroll 4
    for (int c = 0; c < kCols; ++c) {
      const Widened w = widen<Bits>(q + (g * kCols + c) * kBytes);
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group_dot(w, x)), _mm256_set1_ps(s[c]),
                               acc[c]);
    }
    if (min != nullptr) {
      min_term = _mm_fmadd_ps(half4(min + g * kCols), _mm_set1_ps(xs[g]), min_term);
    }
  }
  // [a0..a7], [b0..b7], [c..], [d..] -> [sum a, sum b, sum c, sum d]
  const __m256 ab = _mm256_hadd_ps(acc[0], acc[1]), cd = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
  _mm_storeu_ps(y, _mm_add_ps(sums, min_term));
}

#define MINIVLLM_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

// Whether dot_block_vnni runs here (cpu_features.h).
bool vnni_path() { return minivllm::vnni_runs(); }

// 8 int16 at p in every 128-bit lane.
MINIVLLM_VNNI inline __m512i lane(const int16_t* p) {
  return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A block of four columns of 4-bit weights for `Rows` activation rows (1..8) with AVX-512
// VNNI: y[r * ldy + c]. Per group, the four columns' 16 bytes each are one 64-byte load, a
// 128-bit lane a column; unpacking its low and high nibbles against zero gives, lane by lane,
// words q[0..7], q[8..15], q[16..23], q[24..31] of that column, multiplied by a row's same 8
// activation codes broadcast to every lane and summed in int32 (`vpdpwssd`). So lane c of a
// row's accumulator holds column c's four partial sums, scaled by its scale times the row's
// step; the weights are unpacked once for all the rows.
template <int Rows>
MINIVLLM_VNNI void dot_block_vnni(const QuantizedRows& xq, int64_t row0, int64_t k,
                                  const uint8_t* q, const uint16_t* scale, const uint16_t* min,
                                  int64_t groups, float* y, int64_t ldy) {
  const int16_t* codes = xq.codes.data() + row0 * k;
  const float* xd = xq.steps.data() + row0 * groups;  // row r's: xd[r * groups + g]
  const float* xs = xq.sums.data() + row0 * groups;
  const __m512i low4 = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  // each column's scale to its 128-bit lane: [s0 x4, s1 x4, s2 x4, s3 x4]
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[Rows];
  __m128 min_term[Rows];  // [4 columns] a row
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) {
    acc[r] = _mm512_setzero_ps();
    min_term[r] = _mm_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    // the stream's next lines, asked of memory ahead (blocks follow one another in memory)
    _mm_prefetch(reinterpret_cast<const char*>(q + g * kCols * 16) + kAhead, _MM_HINT_T0);
    const __m512i bytes = _mm512_loadu_si512(q + g * kCols * 16);
    const __m512i lo = _mm512_and_si512(bytes, low4);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
    const __m512i w0 = _mm512_unpacklo_epi8(lo, zero), w1 = _mm512_unpackhi_epi8(lo, zero);
    const __m512i w2 = _mm512_unpacklo_epi8(hi, zero), w3 = _mm512_unpackhi_epi8(hi, zero);
    const __m128 s4 = half4(scale + g * kCols);  // [4 columns]
    const __m128 m4 = min != nullptr ? half4(min + g * kCols) : _mm_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      const int16_t* x = codes + r * k + g * kGroup;
      __m512i dot = _mm512_dpwssd_epi32(zero, w0, lane(x));
      dot = _mm512_dpwssd_epi32(dot, w1, lane(x + 8));
      dot = _mm512_dpwssd_epi32(dot, w2, lane(x + 16));
      dot = _mm512_dpwssd_epi32(dot, w3, lane(x + 24));
      const __m128 sr = _mm_mul_ps(s4, _mm_set1_ps(xd[r * groups + g]));  // [4]
      const __m512 s16 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(sr));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s16, acc[r]);
      min_term[r] = _mm_fmadd_ps(m4, _mm_set1_ps(xs[r * groups + g]), min_term[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) {
    // lane c's four sums -> column c: transpose the four lanes and add them up
    const __m128 c0 = _mm512_extractf32x4_ps(acc[r], 0), c1 = _mm512_extractf32x4_ps(acc[r], 1);
    const __m128 c2 = _mm512_extractf32x4_ps(acc[r], 2), c3 = _mm512_extractf32x4_ps(acc[r], 3);
    const __m128 sums = _mm_hadd_ps(_mm_hadd_ps(c0, c1), _mm_hadd_ps(c2, c3));
    _mm_storeu_ps(y + r * ldy, _mm_add_ps(sums, min_term[r]));
  }
}

// The blocks [begin, end) for the rows [row0, row0 + Rows).
template <int Bits, int Rows>
void tile(const QuantizedRows& xq, int64_t row0, int64_t k, const uint8_t* q,
          const uint16_t* scale, const uint16_t* min, int64_t groups, float* y, int64_t n_out,
          int64_t begin, int64_t end) {
  const int64_t block_bytes = kCols * k * Bits / 8, block_groups = kCols * groups;
  for (int64_t b = begin; b < end; ++b) {
    const uint8_t* qb = q + b * block_bytes;
    const uint16_t* sb = scale + b * block_groups;
    const uint16_t* mb = min ? min + b * block_groups : nullptr;
    float* yb = y + row0 * n_out + b * kCols;
    if (Bits == 4 && vnni_path()) {
      dot_block_vnni<Rows>(xq, row0, k, qb, sb, mb, groups, yb, n_out);
    } else if constexpr (Rows == 1) {
      dot_block<Bits>(xq, row0, k, qb, sb, mb, groups, yb);
    } else {
      for (int c = 0; c < kCols; ++c) {
        dot_rows<Bits, Rows>(xq, row0, k, qb, sb, mb, groups, c, yb + c, n_out);
      }
    }
  }
}

template <int Bits>
void qgemv_impl(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                const at::Tensor& mins, at::Tensor& y) {
  const int64_t m_rows = x.size(0), k = x.size(1), n_out = codes.size(0);
  const int64_t groups = k / kGroup;
  const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), m_rows, k);
  const uint8_t* qp = static_cast<const uint8_t*>(codes.data_ptr());
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* mp =
      mins.numel() ? reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()) : nullptr;
  float* yp = y.data_ptr<float>();
  // Enough blocks per task that a task streams tens of kilobytes of weights.
  const int64_t block_bytes = kCols * k * Bits / 8;
  const int64_t grain = std::max<int64_t>(4, 32768 / block_bytes);
  if (Bits == 4 && m_rows >= 1 && m_rows <= 8 && vnni_path()) {  // all rows in one pass
    at::parallel_for(0, n_out / kCols, grain, [&](int64_t begin, int64_t end) {
      switch (m_rows) {
        case 1: tile<Bits, 1>(xq, 0, k, qp, sp, mp, groups, yp, n_out, begin, end); break;
        case 2: tile<Bits, 2>(xq, 0, k, qp, sp, mp, groups, yp, n_out, begin, end); break;
        case 3: tile<Bits, 3>(xq, 0, k, qp, sp, mp, groups, yp, n_out, begin, end); break;
        case 4: tile<Bits, 4>(xq, 0, k, qp, sp, mp, groups, yp, n_out, begin, end); break;
        case 5: tile<Bits, 5>(xq, 0, k, qp, sp, mp, groups, yp, n_out, begin, end); break;
        case 6: tile<Bits, 6>(xq, 0, k, qp, sp, mp, groups, yp, n_out, begin, end); break;
        case 7: tile<Bits, 7>(xq, 0, k, qp, sp, mp, groups, yp, n_out, begin, end); break;
        default: tile<Bits, 8>(xq, 0, k, qp, sp, mp, groups, yp, n_out, begin, end); break;
      }
    });
    return;
  }
  at::parallel_for(0, n_out / kCols, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m_rows;) {
      const int64_t left = m_rows - r0;
      if (left >= 8) {
        tile<Bits, 8>(xq, r0, k, qp, sp, mp, groups, yp, n_out, begin, end);
        r0 += 8;
      } else if (left >= 4) {
        tile<Bits, 4>(xq, r0, k, qp, sp, mp, groups, yp, n_out, begin, end);
        r0 += 4;
      } else if (left >= 2) {
        tile<Bits, 2>(xq, r0, k, qp, sp, mp, groups, yp, n_out, begin, end);
        r0 += 2;
      } else {
        tile<Bits, 1>(xq, r0, k, qp, sp, mp, groups, yp, n_out, begin, end);
        r0 += 1;
      }
    }
  });
}

at::Tensor qgemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                 const at::Tensor& mins, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "qgemv: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "qgemv: x must be [M, K] float32");
  const int64_t k = x.size(1), n_out = codes.size(0);
  TORCH_CHECK(k % kGroup == 0, "qgemv: K (", k, ") must be a multiple of ", kGroup);
  TORCH_CHECK(n_out % kCols == 0, "qgemv: N (", n_out, ") must be a multiple of ", kCols);
  TORCH_CHECK(codes.dim() == 2 && codes.size(1) == k * bits / 8 && codes.is_contiguous() &&
                  codes.element_size() == 1,
              "qgemv: codes must be [N, K * bits / 8] bytes, contiguous");
  TORCH_CHECK(scales.sizes() == at::IntArrayRef({n_out, k / kGroup}) &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "qgemv: scales must be [N, K / 32] float16, contiguous");
  TORCH_CHECK(mins.numel() == 0 || (mins.sizes() == scales.sizes() &&
                                    mins.scalar_type() == at::kHalf && mins.is_contiguous()),
              "qgemv: mins must be empty or shaped as scales");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), n_out}, x.options());
  if (bits == 4) {
    qgemv_impl<4>(xc, codes, scales, mins, y);
  } else {
    qgemv_impl<8>(xc, codes, scales, mins, y);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("qgemv(Tensor x, Tensor codes, Tensor scales, Tensor mins, int bits) -> Tensor");
  m.def("qgemv_vnni() -> bool", [] { return vnni_path(); });
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) { m.impl("qgemv", &qgemv); }
