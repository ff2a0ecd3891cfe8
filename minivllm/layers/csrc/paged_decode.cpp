// Decode attention straight from the paged KV cache on x86 CPUs with AVX2, fp32.
//
// One query per sequence (a decode-only step): for sequence s and query head h, over the keys
// at positions [start, L) with L = seq_lens[s] (the new token's included) and start = L - window
// under a sliding window, else 0:
//   score_j = scale * <q[s, h], K[slot(j), h / G]>   (softcap: cap * tanh(score / cap))
//   out[s, h] = sum_j softmax(score)_j * V[slot(j), h / G]
// with slot(j) = block_tables[s, j / block_size] * block_size + j % block_size (the tutorial
// chapter's formula) and G = heads / kv_heads. Each slot's keys (and values) of all KV heads
// are one row, read once, straight from the cache: no gathered copy, no padding, no mask.
// Sequences are split over torch's own thread pool (at::parallel_for).
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  }
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for 8 floats (x <= 0 here: scores minus their row's maximum): x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its degree-6 Taylor-like polynomial (Cephes' coefficients), 2^n
// through the exponent bits. Relative error ~1e-7; below -87 it flushes to ~1e-38, not 0.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// row[0..n) = softmax(row), in place.
inline void softmax(float* row, int64_t n) {
  __m256 top8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(row + j));
  float top = -std::numeric_limits<float>::infinity();
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  for (float lane : lanes) top = std::max(top, lane);
  for (; j < n; ++j) top = std::max(top, row[j]);
  const __m256 shift = _mm256_set1_ps(top);
  __m256 total8 = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), shift));
    _mm256_storeu_ps(row + j, e);
    total8 = _mm256_add_ps(total8, e);
  }
  _mm256_store_ps(lanes, total8);
  float total = 0.0f;
  for (float lane : lanes) total += lane;
  for (; j < n; ++j) total += (row[j] = std::exp(row[j] - top));
  const float inverse = 1.0f / total;
  const __m256 inverse8 = _mm256_set1_ps(inverse);
  for (j = 0; j + 8 <= n; j += 8) {
    _mm256_storeu_ps(row + j, _mm256_mul_ps(_mm256_loadu_ps(row + j), inverse8));
  }
  for (; j < n; ++j) row[j] *= inverse;
}

// out[0..d) = sum_j p[j] * rows[j][0..d), the sums held in registers 64 floats at a time.
inline void weighted_sum(const float* p, const float* const* rows, int64_t n, float* out,
                         int64_t d) {
  for (int64_t c = 0; c < d; c += 64) {
    const int64_t width = std::min<int64_t>(64, d - c) / 8;
    __m256 acc[8];
    for (int64_t u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      const float* row = rows[j] + c;
      for (int64_t u = 0; u < width; ++u) {
        acc[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(row + 8 * u), acc[u]);
      }
    }
    for (int64_t u = 0; u < width; ++u) _mm256_storeu_ps(out + c + 8 * u, acc[u]);
  }
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, double scale, int64_t window,
                        double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "paged_decode: q must be [seqs, heads, head_dim] float32, contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
              "paged_decode: the caches must be [blocks, block_size, kv_heads, head_dim] "
              "float32, contiguous");
  const int64_t seqs = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && d % 8 == 0,
              "paged_decode: head_dim must match the cache's and be a multiple of 8, got ", d);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0,
              "paged_decode: heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == seqs &&
                  block_tables.scalar_type() == at::kLong && seq_lens.dim() == 1 &&
                  seq_lens.size(0) == seqs && seq_lens.scalar_type() == at::kLong,
              "paged_decode: block_tables [seqs, max_blocks] and seq_lens [seqs], int64");
  const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const int64_t max_blocks = tables.size(1), group = heads / kv_heads;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < seqs; ++s) {
    TORCH_CHECK(lp[s] >= 1 && lp[s] <= max_blocks * block,
                "paged_decode: seq_lens[", s, "] = ", lp[s], " is outside its block table");
    for (int64_t b = 0; b < (lp[s] + block - 1) / block; ++b) {
      TORCH_CHECK(tp[s * max_blocks + b] >= 0 && tp[s * max_blocks + b] < num_blocks,
                  "paged_decode: block_tables[", s, ", ", b, "] is not a block of the cache");
    }
  }
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float cap = static_cast<float>(softcap), sc = static_cast<float>(scale);
  // One task a sequence. Scores: its keys read position by position, each slot's row of all
  // KV heads at once, so a block's rows stream in order. Values: head by head, each head's
  // weighted sum held in registers over all positions (its KV head's rows, already read for
  // the group's first head, come again from the cache hierarchy).
  at::parallel_for(0, seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const float*> value_rows;
    for (int64_t s = begin; s < end; ++s) {
      const int64_t len = lp[s];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - start;
      const float* qs = qp + s * heads * d;
      float* os = op + s * heads * d;
      scores.assign(heads * n, 0.0f);  // [H, n]
      value_rows.resize(kv_heads * n);  // [KVH, n]: where each position's values are
      for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = start + j;
        const int64_t slot = tp[s * max_blocks + pos / block] * block + pos % block;
        const float* keys = kp + slot * kv_heads * d;  // [KVH, D]
        for (int64_t g = 0; g < kv_heads; ++g) {
          value_rows[g * n + j] = vp + (slot * kv_heads + g) * d;
        }
        for (int64_t h = 0; h < heads; ++h) {
          float score = sc * dot(qs + h * d, keys + (h / group) * d, d);
          if (cap > 0.0f) score = cap * std::tanh(score / cap);
          scores[h * n + j] = score;
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* row = scores.data() + h * n;
        softmax(row, n);
        weighted_sum(row, value_rows.data() + (h / group) * n, n, os + h * d, d);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) { m.impl("paged_decode", &paged_decode); }
