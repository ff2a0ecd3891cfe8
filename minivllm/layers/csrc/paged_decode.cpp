// Decode attention straight from the paged KV cache on x86 CPUs with AVX2: a float32,
// bfloat16, int8 (a float32 scale per row: k_scale / v_scale [blocks, block_size, kv_heads])
// or float8 e4m3 cache, float32 maths.
//
// One query per sequence (a decode-only step): for sequence s and query head h, over the keys
// at positions [start, L) with L = seq_lens[s] (the new token's included) and start = L - window
// under a sliding window, else 0:
//   score_j = scale * <q[s, h], K[slot(j), h / G]>   (softcap: cap * tanh(score / cap))
//   out[s, h] = sum_j softmax(score)_j * V[slot(j), h / G]
// with slot(j) = block_tables[s, j / block_size] * block_size + j % block_size (the tutorial
// chapter's formula) and G = heads / kv_heads. Rows are read straight from the cache through
// the block table: no gathered copy, no padding, no mask. One task per (sequence, KV head),
// split over torch's own thread pool (at::parallel_for, OpenMP: the file is compiled with
// -fopenmp, without which the loop ran on one thread).
//
// An int8 row is read as its codes, never dequantized into a copy: a key's scale multiplies
// its dot product (<q, c * k> = k * <q, c>), a value's its softmax weight (p * (k * c) =
// (p * k) * c), so the inner loops only widen the codes. A float8 row is widened with integer
// shifts (see its load8).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

// 8 floats from the cache: float32 as they are, bfloat16 widened (its bits are a float's top
// half).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline __m256 load8(const int8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}
// 8 float8 e4m3 bytes widened: a normal byte's exponent and mantissa bits, moved to a float's
// places, need only the exponent bias changed (7 -> 127: + 120 << 23); a subnormal one (exponent
// 0) is its mantissa times 2^-9; then the sign. No table: a gather per 8 values cost ten times
// the bf16 loop on this project's AMD machine.
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
  const __m256 normal = _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_slli_epi32(magnitude, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 subnormal =
      _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(1.0f / 512.0f));
  const __m256 is_normal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(7)));
  const __m256 value = _mm256_blendv_ps(subnormal, normal, is_normal);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  return _mm256_or_ps(value, _mm256_castsi256_ps(sign));
}

// The 8 lanes' sums of 8 vectors: {sum(a[0]), ..., sum(a[7])}.
inline __m256 sum8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  // u0 = {a0..a3 low-half sums | a0..a3 high-half sums}, u1 the same for a4..a7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// s[h * Keys + u] = <q[h], rows[u]> for H query heads (q: H rows, d apart) and Keys rows at
// once, H * Keys <= 8: each row's values widened once for all the heads (the heads of a group
// share their key rows), H * Keys independent chains, one reduction.
template <int H, int Keys, typename T>
inline void dot_heads(const float* q, const T* const* rows, int64_t d, float* s) {
  static_assert(H * Keys <= 8);
  __m256 acc[8];
  for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    __m256 k[Keys];
    for (int u = 0; u < Keys; ++u) k[u] = load8(rows[u] + i);
    for (int h = 0; h < H; ++h) {
      const __m256 qi = _mm256_loadu_ps(q + h * d + i);
      for (int u = 0; u < Keys; ++u) {
        acc[h * Keys + u] = _mm256_fmadd_ps(qi, k[u], acc[h * Keys + u]);
      }
    }
  }
  alignas(32) float sums[8];
  _mm256_store_ps(sums, sum8x8(acc));
  for (int u = 0; u < H * Keys; ++u) s[u] = sums[u];
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

// out[h][c..c + 8 W) = sum_j p[h][j] * rows[j][c..c + 8 W) for H heads (p: H rows, n apart;
// out: H rows, d apart): each row's values widened once for all the heads, H W chains of FMAs.
template <int H, int W, typename T>
inline void weighted_sum_columns(const float* p, const T* const* rows, int64_t n, int64_t c,
                                 int64_t d, float* out) {
  __m256 acc[H][W];
  for (int h = 0; h < H; ++h) {
    for (int u = 0; u < W; ++u) acc[h][u] = _mm256_setzero_ps();
  }
  for (int64_t j = 0; j < n; ++j) {
    __m256 v[W];
    for (int u = 0; u < W; ++u) v[u] = load8(rows[j] + c + 8 * u);
    for (int h = 0; h < H; ++h) {
      const __m256 pj = _mm256_broadcast_ss(p + h * n + j);
      for (int u = 0; u < W; ++u) acc[h][u] = _mm256_fmadd_ps(pj, v[u], acc[h][u]);
    }
  }
  for (int h = 0; h < H; ++h) {
    for (int u = 0; u < W; ++u) _mm256_storeu_ps(out + h * d + c + 8 * u, acc[h][u]);
  }
}

// out[h][0..d) for H <= 4 heads: 16 columns at a time (with the two rows and the weights,
// within AVX2's 16 registers), then 8 where d is no multiple of 16.
template <int H, typename T>
inline void weighted_sum_heads(const float* p, const T* const* rows, int64_t n, float* out,
                               int64_t d) {
  int64_t c = 0;
  for (; c + 16 <= d; c += 16) weighted_sum_columns<H, 2>(p, rows, n, c, d, out);
  for (; c < d; c += 8) weighted_sum_columns<H, 1>(p, rows, n, c, d, out);
}

// Heads [h0, h0 + H) of a group: their scores (scores: [group, n]) over the keys, Keys at a
// time, the key and value rows kAhead positions on asked of memory meanwhile (`prefetch`:
// the first block of heads only; the others find the rows in the caches).
template <int H, typename T>
void score_heads(const float* qs, const T* const* keys, const T* const* values, int64_t n,
                 int64_t d, int64_t h0, bool prefetch, float* scores) {
  constexpr int Keys = 8 / H;
  // a block's rows of one KV head are strided and blocks are scattered: the hardware's
  // prefetchers alone left this loop waiting on memory. Into L2, not L1 (T1): 16 sequences of
  // 200 tokens at Llama-3.2-1B's heads (benchmarks/paged_decode.py), two threads, 569 against
  // 729 us a layer, one thread 814 against 1147, 4 of 1000 tokens 594 against 1134 (2-vCPU
  // Zen 4, medians of three to five runs taking turns).
  constexpr int64_t kAhead = 16;
  const int64_t lines = (d * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  for (int64_t j = 0; j < n; j += Keys) {
    for (int64_t a = j + kAhead; prefetch && a < std::min(j + kAhead + Keys, n); ++a) {
      for (int64_t l = 0; l < lines; ++l) {
        _mm_prefetch(reinterpret_cast<const char*>(keys[a]) + 64 * l, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(values[a]) + 64 * l, _MM_HINT_T1);
      }
    }
    const T* chunk[Keys];  // the last few positions padded with the last one
    for (int u = 0; u < Keys; ++u) chunk[u] = keys[std::min<int64_t>(j + u, n - 1)];
    float s[8];
    dot_heads<H, Keys>(qs + h0 * d, chunk, d, s);
    for (int h = 0; h < H; ++h) {
      for (int u = 0; u < Keys && j + u < n; ++u) scores[(h0 + h) * n + j + u] = s[h * Keys + u];
    }
  }
}

// One sequence and one KV head: its `group` query heads (qs, os: [group, d]) over positions
// [start, len) of the sequence's block table (`table`).
// Each position's row scales (int8: ks / vs non-null), else 1.
struct RowScales {
  const float* ks = nullptr;
  const float* vs = nullptr;
  std::vector<float> k, v;
};

template <typename T>
void attend_one_kv_head(const float* qs, const T* kp, const T* vp, const int64_t* table,
                        int64_t start, int64_t len, int64_t block, int64_t kv_heads,
                        int64_t g, int64_t group, int64_t d, float scale, float cap, float* os,
                        std::vector<float>& scores, std::vector<const T*>& keys,
                        std::vector<const T*>& values, RowScales& rs) {
  const int64_t n = len - start;
  keys.resize(n);
  values.resize(n);
  if (rs.ks != nullptr) {
    rs.k.resize(n);
    rs.v.resize(n);
  }
  // Where each position's rows are: one block-table read per block, no division per row.
  for (int64_t pos = start, j = 0; pos < len;) {
    const int64_t b = pos / block, in_block = pos - b * block;
    const int64_t rows = std::min(block - in_block, len - pos);
    const int64_t first = ((table[b] * block + in_block) * kv_heads + g) * d;
    const int64_t first_scale = (table[b] * block + in_block) * kv_heads + g;
    for (int64_t r = 0; r < rows; ++r, ++j) {
      keys[j] = kp + first + r * kv_heads * d;
      values[j] = vp + first + r * kv_heads * d;
      if (rs.ks != nullptr) {
        rs.k[j] = rs.ks[first_scale + r * kv_heads];
        rs.v[j] = rs.vs[first_scale + r * kv_heads];
      }
    }
    pos += rows;
  }
  scores.resize(group * n);  // [group, n]
  // Scores of up to 4 heads at a time (each key row widened once for them; their rows stay
  // in L1 / L2 for the next block of heads)
  const T* const* k = keys.data();
  const T* const* v = values.data();
  float* s = scores.data();
  for (int64_t h0 = 0; h0 < group; h0 += 4) {
    switch (std::min<int64_t>(4, group - h0)) {
      case 4: score_heads<4>(qs, k, v, n, d, h0, h0 == 0, s); break;
      case 3: score_heads<3>(qs, k, v, n, d, h0, h0 == 0, s); break;
      case 2: score_heads<2>(qs, k, v, n, d, h0, h0 == 0, s); break;
      default: score_heads<1>(qs, k, v, n, d, h0, h0 == 0, s);
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    float* row = scores.data() + h * n;
    for (int64_t j = 0; j < n; ++j) {
      float score = scale * row[j] * (rs.ks != nullptr ? rs.k[j] : 1.0f);
      if (cap > 0.0f) score = cap * std::tanh(score / cap);
      row[j] = score;
    }
    softmax(row, n);
    if (rs.vs != nullptr) {
      for (int64_t j = 0; j < n; ++j) row[j] *= rs.v[j];
    }
  }
  for (int64_t h0 = 0; h0 < group; h0 += 4) {
    const float* p = scores.data() + h0 * n;
    switch (std::min<int64_t>(4, group - h0)) {
      case 4: weighted_sum_heads<4>(p, v, n, os + h0 * d, d); break;
      case 3: weighted_sum_heads<3>(p, v, n, os + h0 * d, d); break;
      case 2: weighted_sum_heads<2>(p, v, n, os + h0 * d, d); break;
      default: weighted_sum_heads<1>(p, v, n, os + h0 * d, d);
    }
  }
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const int64_t* tp, const int64_t* lp, int64_t max_blocks, int64_t window,
            float scale, float cap, const float* ks, const float* vs, at::Tensor& out) {
  const int64_t seqs = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t block = k_cache.size(1), kv_heads = k_cache.size(2), group = heads / kv_heads;
  const float* qp = q.data_ptr<float>();
  const T* kp = static_cast<const T*>(k_cache.data_ptr());
  const T* vp = static_cast<const T*>(v_cache.data_ptr());
  float* op = out.data_ptr<float>();
  // One task a (sequence, KV head): the group's query heads share its key and value rows,
  // read from memory once (the group's later heads find them in the core's caches).
  at::parallel_for(0, seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const T*> keys, values;
    RowScales rs;
    rs.ks = ks;
    rs.vs = vs;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / kv_heads, g = task % kv_heads, len = lp[s];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t first_head = (s * heads + g * group) * d;
      attend_one_kv_head(qp + first_head, kp, vp, tp + s * max_blocks, start, len, block,
                         kv_heads, g, group, d, scale, cap, op + first_head, scores, keys,
                         values, rs);
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, double scale, const at::Tensor& window_t,
                        double softcap, const std::optional<at::Tensor>& k_scale,
                        const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "paged_decode: q must be [seqs, heads, head_dim] float32, contiguous");
  const auto kind = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 4 &&
                  (kind == at::kFloat || kind == at::kBFloat16 || kind == at::kChar ||
                   kind == at::kFloat8_e4m3fn) &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == kind && v_cache.is_contiguous(),
              "paged_decode: the caches must be [blocks, block_size, kv_heads, head_dim] "
              "float32, bfloat16, int8 or float8_e4m3fn, both the same, contiguous");
  const bool scaled = k_scale.has_value() && v_scale.has_value();
  TORCH_CHECK(scaled == (kind == at::kChar) && k_scale.has_value() == v_scale.has_value(),
              "paged_decode: an int8 cache needs k_scale and v_scale, other caches none");
  if (scaled) {
    for (const at::Tensor* t : {&*k_scale, &*v_scale}) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                      t->sizes() == k_cache.sizes().slice(0, 3),
                  "paged_decode: the scales must be [blocks, block_size, kv_heads] float32, "
                  "contiguous");
    }
  }
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
  // The window is data, not a constant of the op's call: a compiled layer graph then serves
  // sliding and full attention layers alike (their windows differ, the graph does not).
  TORCH_CHECK(window_t.numel() == 1 && window_t.scalar_type() == at::kLong && window_t.is_cpu(),
              "paged_decode: window must be one int64 on the CPU (0: no window)");
  const int64_t window = window_t.contiguous().data_ptr<int64_t>()[0];
  const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const int64_t max_blocks = tables.size(1);
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
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const float* ks = scaled ? k_scale->data_ptr<float>() : nullptr;
  const float* vs = scaled ? v_scale->data_ptr<float>() : nullptr;
  if (kind == at::kFloat) {
    attend<float>(q, k_cache, v_cache, tp, lp, max_blocks, window, sc, cap, ks, vs, out);
  } else if (kind == at::kBFloat16) {
    attend<at::BFloat16>(q, k_cache, v_cache, tp, lp, max_blocks, window, sc, cap, ks, vs, out);
  } else if (kind == at::kChar) {
    attend<int8_t>(q, k_cache, v_cache, tp, lp, max_blocks, window, sc, cap, ks, vs, out);
  } else {
    attend<c10::Float8_e4m3fn>(q, k_cache, v_cache, tp, lp, max_blocks, window, sc, cap, ks,
                               vs, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, Tensor window, float softcap, Tensor? k_scale=None, "
      "Tensor? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) { m.impl("paged_decode", &paged_decode); }
