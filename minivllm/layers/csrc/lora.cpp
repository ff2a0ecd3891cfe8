// LoRA updates of a small step, each row through its own adapter only:
//   y[i] = out[i] + (x[i] @ A[s].T) @ B[s]    for the rows i of group g, s = slots[g]
// Rows come grouped by adapter (`order`: row ids, group g being order[starts[g]:starts[g+1]]);
// rows of the base model are in no group and keep `out`. a [S, R, in] and b [S, R, out] hold
// the resident adapters in float32, zero-padded to the layer's largest rank R, the scale folded
// into b. A masked matmul over all adapters does S times this work; at the row counts of decode
// steps this is what the update costs (minivllm/layers/lora.py picks it by rows, docs/lora.md).
// Four rows of a group share each load of A and B (AVX2 FMA, float32 accumulation).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kRows = 4;  // rows of one group per pass over its adapter's A and B

float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// xa[j][r] = x[rows[j]] . a[r] for j < m (m <= kRows)
void shrink(const float* x, int64_t in, const int64_t* rows, int64_t m, const float* a,
            int64_t rank, float* xa) {
  const float* xr[kRows];
  for (int64_t j = 0; j < kRows; ++j) xr[j] = x + rows[std::min(j, m - 1)] * in;
  for (int64_t r = 0; r < rank; ++r) {
    const float* ar = a + r * in;
    __m256 acc[kRows];
    for (int64_t j = 0; j < kRows; ++j) acc[j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= in; k += 8) {
      const __m256 av = _mm256_loadu_ps(ar + k);
      for (int64_t j = 0; j < kRows; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[j] + k), av, acc[j]);
    }
    for (int64_t j = 0; j < kRows; ++j) {
      float dot = hsum(acc[j]);
      for (int64_t t = k; t < in; ++t) dot += xr[j][t] * ar[t];
      xa[j * rank + r] = dot;
    }
  }
}

// y[rows[j]] += xa[j] @ b for j < m; rows past m write into `spare` (every loop runs kRows
// rows, so the accumulators stay in registers)
void expand(float* y, int64_t cols, const int64_t* rows, int64_t m, const float* xa,
            const float* b, int64_t rank, float* spare) {
  float* yr[kRows];
  for (int64_t j = 0; j < kRows; ++j) yr[j] = j < m ? y + rows[j] * cols : spare;
  int64_t o = 0;
  for (; o + 16 <= cols; o += 16) {  // two column vectors share each broadcast of xa
    __m256 lo[kRows], hi[kRows];
    for (int64_t j = 0; j < kRows; ++j) {
      lo[j] = _mm256_loadu_ps(yr[j] + o);
      hi[j] = _mm256_loadu_ps(yr[j] + o + 8);
    }
    for (int64_t r = 0; r < rank; ++r) {
      const __m256 bl = _mm256_loadu_ps(b + r * cols + o);
      const __m256 bh = _mm256_loadu_ps(b + r * cols + o + 8);
      for (int64_t j = 0; j < kRows; ++j) {
        const __m256 w = _mm256_set1_ps(xa[j * rank + r]);
        lo[j] = _mm256_fmadd_ps(w, bl, lo[j]);
        hi[j] = _mm256_fmadd_ps(w, bh, hi[j]);
      }
    }
    for (int64_t j = 0; j < kRows; ++j) {
      _mm256_storeu_ps(yr[j] + o, lo[j]);
      _mm256_storeu_ps(yr[j] + o + 8, hi[j]);
    }
  }
  for (; o + 8 <= cols; o += 8) {
    __m256 acc[kRows];
    for (int64_t j = 0; j < kRows; ++j) acc[j] = _mm256_loadu_ps(yr[j] + o);
    for (int64_t r = 0; r < rank; ++r) {
      const __m256 bv = _mm256_loadu_ps(b + r * cols + o);
      for (int64_t j = 0; j < kRows; ++j)
        acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(xa[j * rank + r]), bv, acc[j]);
    }
    for (int64_t j = 0; j < kRows; ++j) _mm256_storeu_ps(yr[j] + o, acc[j]);
  }
  for (; o < cols; ++o) {
    for (int64_t j = 0; j < m; ++j) {
      float sum = yr[j][o];
      for (int64_t r = 0; r < rank; ++r) sum += xa[j * rank + r] * b[r * cols + o];
      yr[j][o] = sum;
    }
  }
}

at::Tensor lora_rows(const at::Tensor& x, const at::Tensor& out, const at::Tensor& order,
                     const at::Tensor& starts, const at::Tensor& slots, const at::Tensor& a,
                     const at::Tensor& b) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0),
              "lora_rows: x [n, in] and out [n, out]");
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && a.dim() == 3 &&
                  b.dim() == 3 && a.size(0) == b.size(0) && a.size(1) == b.size(1) &&
                  a.size(2) == x.size(1) && b.size(2) == out.size(1),
              "lora_rows: a [S, R, in] and b [S, R, out] in float32");
  TORCH_CHECK(order.scalar_type() == at::kLong && starts.scalar_type() == at::kLong &&
                  slots.scalar_type() == at::kLong && starts.numel() == slots.numel() + 1,
              "lora_rows: int64 order, starts [G + 1] and slots [G]");
  const auto xf = x.to(at::kFloat).contiguous();
  auto acc = out.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true).contiguous();
  const auto ac = a.contiguous(), bc = b.contiguous();
  const auto oc = order.contiguous(), stc = starts.contiguous(), slc = slots.contiguous();
  const int64_t in = x.size(1), cols = out.size(1), rank = a.size(1), groups = slots.numel();
  const int64_t* op = oc.data_ptr<int64_t>();
  const int64_t* sp = stc.data_ptr<int64_t>();
  const int64_t* gp = slc.data_ptr<int64_t>();
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK(gp[g] >= 0 && gp[g] < a.size(0), "lora_rows: slot ", gp[g], " of ", a.size(0));
    TORCH_CHECK(sp[g] <= sp[g + 1] && sp[g + 1] <= order.numel(), "lora_rows: starts");
  }
  for (int64_t i = 0; i < order.numel(); ++i)
    TORCH_CHECK(op[i] >= 0 && op[i] < x.size(0), "lora_rows: row ", op[i]);
  const float* xp = xf.data_ptr<float>();
  const float* ap = ac.data_ptr<float>();
  const float* bp = bc.data_ptr<float>();
  float* yp = acc.data_ptr<float>();
  // Tasks: blocks of up to kRows rows of one group (each writes its own rows of y).
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (first index into order, group)
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t i = sp[g]; i < sp[g + 1]; i += kRows) tasks.emplace_back(i, g);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xa(kRows * rank), spare(cols);
    for (int64_t t = begin; t < end; ++t) {
      const auto [first, g] = tasks[t];
      const int64_t m = std::min(kRows, sp[g + 1] - first);
      const int64_t s = gp[g];
      shrink(xp, in, op + first, m, ap + s * rank * in, rank, xa.data());
      expand(yp, cols, op + first, m, xa.data(), bp + s * rank * cols, rank, spare.data());
    }
  });
  return acc.scalar_type() == out.scalar_type() ? acc : acc.to(out.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def(
      "lora_rows(Tensor x, Tensor out, Tensor order, Tensor starts, Tensor slots, Tensor a, "
      "Tensor b) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) { m.impl("lora_rows", &lora_rows); }
