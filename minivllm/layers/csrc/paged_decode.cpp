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

// out += p * v over d floats
inline void axpy(float p, const float* v, float* out, int64_t d) {
  const __m256 pv = _mm256_set1_ps(p);
  for (int64_t i = 0; i < d; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i),
                                              _mm256_loadu_ps(out + i)));
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
  // One task a sequence: its keys (then values) are read position by position, each slot's
  // row of all KV heads at once, so a block's rows stream in order.
  at::parallel_for(0, seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t s = begin; s < end; ++s) {
      const int64_t len = lp[s];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - start;
      const float* qs = qp + s * heads * d;
      float* os = op + s * heads * d;
      scores.assign(heads * n, 0.0f);  // [H, n]
      for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = start + j;
        const int64_t slot = tp[s * max_blocks + pos / block] * block + pos % block;
        const float* keys = kp + slot * kv_heads * d;  // [KVH, D]
        for (int64_t h = 0; h < heads; ++h) {
          float score = sc * dot(qs + h * d, keys + (h / group) * d, d);
          if (cap > 0.0f) score = cap * std::tanh(score / cap);
          scores[h * n + j] = score;
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* row = scores.data() + h * n;
        const float top = *std::max_element(row, row + n);
        float total = 0.0f;
        for (int64_t j = 0; j < n; ++j) total += (row[j] = std::exp(row[j] - top));
        const float inverse = 1.0f / total;
        for (int64_t j = 0; j < n; ++j) row[j] *= inverse;
      }
      std::fill(os, os + heads * d, 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = start + j;
        const int64_t slot = tp[s * max_blocks + pos / block] * block + pos % block;
        const float* values = vp + slot * kv_heads * d;  // [KVH, D]
        for (int64_t h = 0; h < heads; ++h) {
          axpy(scores[h * n + j], values + (h / group) * d, os + h * d, d);
        }
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
