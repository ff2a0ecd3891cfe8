// Quantized weights times fp32 activations for few rows (decode steps) on x86 CPUs with AVX2.
//
// y[m, n] = sum_k x[m, k] * w[n, k] with w stored as llama.cpp stores it: groups of 32 inputs,
// one fp32 scale and one fp32 min per group and output, `w = q * scale + min`, q either
//   bits 4: 16 bytes a group, the low nibble of byte i is q[i], the high nibble q[16 + i]
//           (GGUF's Q4_0/Q4_1 layout), codes 0..15;
//   bits 8: 32 signed bytes a group (GGUF's Q8_0), codes -128..127.
// The weights are unpacked to fp32 in registers and never written out, so a step reads 4.5
// (or 8.5) bits per weight instead of 32; the products and sums are fp32, the activations are
// not rounded. Output rows are split over torch's own thread pool (at::parallel_for).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <vector>

namespace {

constexpr int64_t kGroup = 32;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 32 codes of one group as four vectors of 8 floats, in input order.
template <int Bits>
inline void unpack(const uint8_t* q, __m256* w) {
  if constexpr (Bits == 4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);                     // q[0..15]
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);  // q[16..31]
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  } else {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));       // q[0..15]
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));  // q[16..31]
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  }
}

// Output n for `Rows` activation rows starting at x: y[r * ldy] for each row r. `Rows` is a
// compile-time constant so that the accumulators stay in registers.
template <int Bits, int Rows>
inline void dot_rows(const float* x, int64_t k, const uint8_t* q, const float* scale,
                     const float* min, const float* xsum, int64_t groups, float* y,
                     int64_t ldy) {
  constexpr int64_t kBytes = Bits * kGroup / 8;
  __m256 acc[Rows];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
  __m256 w[4];
  for (int64_t g = 0; g < groups; ++g) {
    unpack<Bits>(q + g * kBytes, w);
    const __m256 s = _mm256_broadcast_ss(scale + g);
#pragma GCC unroll 8  // unrolled, the accumulators live in registers, not on the stack
    for (int r = 0; r < Rows; ++r) {
      const float* xg = x + r * k + g * kGroup;
      __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(xg));
      t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), t);
      t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), t);
      t = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), t);
      acc[r] = _mm256_fmadd_ps(t, s, acc[r]);
    }
  }
  if (min != nullptr) {  // + sum_g min[g] * (the sum of group g's activations), 8 groups a go
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
      const __m256 m = _mm256_loadu_ps(min + g);
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) {
        acc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(xsum + r * groups + g), acc[r]);
      }
    }
    for (; g < groups; ++g) {
      const __m256 m = _mm256_set_ps(0, 0, 0, 0, 0, 0, 0, min[g]);
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) {
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[r * groups + g]), acc[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) y[r * ldy] = hsum(acc[r]);
}

// Outputs [begin, end) for rows [r0, r0 + Rows).
template <int Bits, int Rows>
void tile(const float* x, int64_t k, const uint8_t* q, int64_t bytes_per_row, const float* scale,
          const float* min, const float* xsum, int64_t groups, float* y, int64_t n_out,
          int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    dot_rows<Bits, Rows>(x, k, q + n * bytes_per_row, scale + n * groups,
                         min ? min + n * groups : nullptr, xsum, groups, y + n, n_out);
  }
}

template <int Bits>
void qgemv_impl(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                const at::Tensor& mins, at::Tensor& y) {
  const int64_t m_rows = x.size(0), k = x.size(1), n_out = codes.size(0);
  const int64_t groups = k / kGroup, bytes_per_row = codes.size(1);
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = static_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.numel() ? mins.data_ptr<float>() : nullptr;
  // Each group's sum of activations, for the min term: [m_rows, groups].
  std::vector<float> xsum(mp ? m_rows * groups : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(xsum.size()); ++i) {
    const float* xg = xp + i * kGroup;  // row i / groups, group i % groups: contiguous
    float total = 0.0f;
    for (int64_t j = 0; j < kGroup; ++j) total += xg[j];
    xsum[i] = total;
  }
  float* yp = y.data_ptr<float>();
  // Enough outputs per task that a task streams tens of kilobytes of weights.
  const int64_t grain = std::max<int64_t>(16, 32768 / std::max<int64_t>(bytes_per_row, 1));
  at::parallel_for(0, n_out, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m_rows;) {
      const float* xr = xp + r0 * k;
      const float* xs = mp ? xsum.data() + r0 * groups : nullptr;
      float* yr = yp + r0 * n_out;
      const int64_t left = m_rows - r0;
      if (left >= 8) {
        tile<Bits, 8>(xr, k, qp, bytes_per_row, sp, mp, xs, groups, yr, n_out, begin, end);
        r0 += 8;
      } else if (left >= 4) {
        tile<Bits, 4>(xr, k, qp, bytes_per_row, sp, mp, xs, groups, yr, n_out, begin, end);
        r0 += 4;
      } else if (left >= 2) {
        tile<Bits, 2>(xr, k, qp, bytes_per_row, sp, mp, xs, groups, yr, n_out, begin, end);
        r0 += 2;
      } else {
        tile<Bits, 1>(xr, k, qp, bytes_per_row, sp, mp, xs, groups, yr, n_out, begin, end);
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
  TORCH_CHECK(codes.dim() == 2 && codes.size(1) == k * bits / 8 && codes.is_contiguous() &&
                  codes.element_size() == 1,
              "qgemv: codes must be [N, K * bits / 8] bytes, contiguous");
  TORCH_CHECK(scales.sizes() == at::IntArrayRef({n_out, k / kGroup}) &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "qgemv: scales must be [N, K / 32] float32, contiguous");
  TORCH_CHECK(mins.numel() == 0 || (mins.sizes() == scales.sizes() &&
                                    mins.scalar_type() == at::kFloat && mins.is_contiguous()),
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

TORCH_LIBRARY(minivllm, m) {
  m.def("qgemv(Tensor x, Tensor codes, Tensor scales, Tensor mins, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) { m.impl("qgemv", &qgemv); }
