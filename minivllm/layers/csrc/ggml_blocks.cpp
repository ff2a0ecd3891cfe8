// llama.cpp's quantized blocks (GGUF tensors, as stored in the file) times activations, and
// their dequantization, without repacking: the weight `[N, K]` is `[N, row_bytes]` uint8, each
// row `K / block_elems` blocks laid out as ggml writes them:
//   Q4_0 (32, 18 B): fp16 d, 16 B nibbles               w = d * (q - 8)
//   Q4_1 (32, 20 B): fp16 d, fp16 m, 16 B nibbles       w = d * q + m
//   Q5_0 (32, 22 B): fp16 d, 32 high bits, 16 B nibbles w = d * (q - 16)
//   Q5_1 (32, 24 B): fp16 d, fp16 m, 32 high bits, ... w = d * q + m
//   Q8_0 (32, 34 B): fp16 d, 32 int8                    w = d * q
//   Q4_K (256, 144 B): fp16 d, fp16 dmin, 12 B of 6-bit scales and mins for 8 groups of 32,
//                      128 B nibbles                    w = d * sc * q - dmin * m
//   Q5_K (256, 176 B): as Q4_K plus 32 B of fifth bits (bit j of byte l: input l of group j)
//   Q6_K (256, 210 B): 128 B low nibbles, 64 B high 2 bits, 16 int8 scales (one per 16
//                      inputs), fp16 d                  w = d * sc * (q - 32)
// Every kind is read the same way: group j (32 inputs) of a block has 32 integer codes
// (`group_codes`, centred for the symmetric kinds so that |q| <= 32 or 127), one scale for
// each half of 16 inputs (equal except in Q6_K) and a min (`block_scales`).
//
// The matmul quantizes each activation row per group of 32 to int8 (`x = step * xq`, step =
// max|x| / 127); a group's 32 products are an integer dot product (`vpmaddubsw` + `vpmaddwd`,
// or one `vpdpbusd` with AVX-512 VNNI), scaled once per half by `scale * step`, and the min
// term is `min * step * sum(xq)`: the codes' sum, as llama.cpp's, not x's exact one. The
// codes are unsigned (q >= 0, the min subtracted after), so the exact sum would leave their
// rounding error weighed by a large positive weight; the codes' sum cancels its mean part (on
// a real Gemma-3-270M Q4_K_M with one code on the K kinds, +1.13% perplexity and 91.1% top-1
// against HF fp32 with the exact sums, -0.20% and 97.4% with the codes'). Unsigned codes
// times int8 is what those instructions multiply; signed weights use |w| and x with w's sign.
// The output columns (weight rows) are split over torch's thread pool; a weight row is read
// once for up to 4 activation rows. The scalar path computes the same integers in plain C++
// (the reference for the vector paths, and the fallback `isa` 1).
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_features.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13,
              kQ6_K = 14;  // GGML's type numbers, as in the GGUF file

struct Geometry {
  int elems;       // inputs a block
  int bytes;       // bytes a block
  int groups;      // groups of 32 a block
  bool is_signed;  // codes centred (no min)
  bool has_min;
};

bool known(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kQ4_K: case kQ5_K:
    case kQ6_K:
      return true;
    default:
      return false;
  }
}

constexpr Geometry geometry(int qtype) {
  switch (qtype) {
    case kQ4_0: return {32, 18, 1, true, false};
    case kQ4_1: return {32, 20, 1, false, true};
    case kQ5_0: return {32, 22, 1, true, false};
    case kQ5_1: return {32, 24, 1, false, true};
    case kQ8_0: return {32, 34, 1, true, false};
    case kQ4_K: return {256, 144, 8, false, true};
    case kQ5_K: return {256, 176, 8, false, true};
    default: return {256, 210, 8, true, false};  // kQ6_K
  }
}

inline float fp16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);  // one instruction where the build allows it (it does: -mf16c)
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Q4_K / Q5_K: the 6-bit scale and min of group j from the 12 packed bytes q.
inline void k_scale_min(int j, const uint8_t* q, int& scale, int& min) {
  if (j < 4) {
    scale = q[j] & 63;
    min = q[j + 4] & 63;
  } else {
    scale = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The block's scales (scales[2j], scales[2j + 1]: group j's two halves) and mins (mins[j]),
// as gguf-py computes them in fp32.
inline void block_scales(int qtype, const uint8_t* b, float* scales, float* mins) {
  switch (qtype) {
    case kQ4_0: case kQ5_0: case kQ8_0:
      scales[0] = scales[1] = fp16(b);
      mins[0] = 0.0f;
      return;
    case kQ4_1: case kQ5_1:
      scales[0] = scales[1] = fp16(b);
      mins[0] = fp16(b + 2);
      return;
    case kQ4_K: case kQ5_K: {
      const float d = fp16(b), dmin = fp16(b + 2);
      for (int j = 0; j < 8; ++j) {
        int sc, m;
        k_scale_min(j, b + 4, sc, m);
        scales[2 * j] = scales[2 * j + 1] = d * static_cast<float>(sc);
        mins[j] = -(dmin * static_cast<float>(m));
      }
      return;
    }
    default: {  // kQ6_K
      const float d = fp16(b + 208);
      for (int i = 0; i < 16; ++i) scales[i] = d * static_cast<float>(static_cast<int8_t>(b[192 + i]));
      for (int j = 0; j < 8; ++j) mins[j] = 0.0f;
      return;
    }
  }
}

// Group j's 32 codes, one by one (the scalar twin of group_codes).
inline void group_codes_scalar(int qtype, const uint8_t* b, int j, int8_t* q) {
  for (int l = 0; l < 32; ++l) {
    const int nib = l < 16 ? 0 : 4, at = l % 16;  // the 32-input kinds' nibble of input l
    int v;
    switch (qtype) {
      case kQ4_0: v = ((b[2 + at] >> nib) & 15) - 8; break;
      case kQ4_1: v = (b[4 + at] >> nib) & 15; break;
      case kQ5_0: v = (((b[6 + at] >> nib) & 15) | (((b[2 + l / 8] >> (l % 8)) & 1) << 4)) - 16; break;
      case kQ5_1: v = ((b[8 + at] >> nib) & 15) | (((b[4 + l / 8] >> (l % 8)) & 1) << 4); break;
      case kQ8_0: v = static_cast<int8_t>(b[2 + l]); break;
      case kQ4_K: v = (b[16 + 32 * (j / 2) + l] >> (4 * (j & 1))) & 15; break;
      case kQ5_K:
        v = ((b[48 + 32 * (j / 2) + l] >> (4 * (j & 1))) & 15) | (((b[16 + l] >> j) & 1) << 4);
        break;
      default: {  // kQ6_K
        const int half = j / 4, jj = j % 4;
        const int low = (b[64 * half + 32 * (jj & 1) + l] >> (jj >= 2 ? 4 : 0)) & 15;
        const int high = (b[128 + 32 * half + l] >> (2 * jj)) & 3;
        v = (low | (high << 4)) - 32;
      }
    }
    q[l] = static_cast<int8_t>(v);
  }
}

// A std::vector whose data starts on a 64-byte line. The kernels load 64 bytes of a row at a
// time (AMX tiles, 512-bit vectors): from malloc's 16-byte alignment every such load and
// store would span two cache lines, which costs an AMX tile load about twice its time.
template <class T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <class U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
template <class T>
using LineVector = std::vector<T, LineAllocator<T>>;

// Activation rows quantized to int8 with one step per `block` inputs: 32 for the 32-input
// kinds (a group's products become floats one group at a time), 256 for the K kinds, as
// llama.cpp's Q8_K (a block's eight groups add up as integers, the group scales applied as
// 16-bit integers, before one float multiply a block). Codes [rows, k]; steps [rows,
// k / block]; the codes' values summed per group of 32 [rows, k / 32] (the min terms: step
// times the codes' sum, with fine codes step times the sum of q + f / 254); for block 256
// also the codes' integer sums per 16 inputs [rows, k / 16] (Q6_K's offset of 32).
//
// With `fine` (block 32, for the x8 kernel), each input also gets a second int8 code for what
// the first leaves: x = step * (q + f / 254), f = round((x - step * q) * 254 / step), so the
// activations keep about 15 bits (one rounding to 8 bits a group moves a small model's top-1
// token too often against fp32); `fine_sums` are the groups' sums of 254 q + f (Q4_0's offset).
// `ucodes` (block 256, for the Q6_K x8 kernel, filled by `fill_ucodes`) are the codes plus 128,
// as unsigned bytes. `high`, `low` (with fine codes, for the AMX q8x8 kernel, filled by
// `fill_bytes`): each 254 q + f as two signed bytes, 256 high + low.
struct QuantizedRows {
  int64_t block;
  LineVector<int8_t> codes;
  LineVector<float> steps;
  LineVector<float> sums;
  LineVector<int16_t> bsums;
  LineVector<int8_t> fine;
  LineVector<int32_t> fine_sums;
  LineVector<uint8_t> ucodes;
  LineVector<int8_t> high, low;

  QuantizedRows(int64_t rows, int64_t k, int64_t block_, bool with_fine = false)
      : block(block_), codes(rows * k), steps(rows * k / block_), sums(rows * k / kGroup),
        bsums(block_ == kGroup ? 0 : rows * k / 16), fine(with_fine ? rows * k : 0),
        fine_sums(with_fine ? rows * k / kGroup : 0) {}

  void fill_ucodes() {
    ucodes.resize(codes.size());
    for (size_t i = 0; i < codes.size(); ++i) ucodes[i] = static_cast<uint8_t>(codes[i] ^ 0x80);
  }

  void fill_bytes() {
    high.resize(fine.size());
    low.resize(fine.size());
    for (size_t i = 0; i < fine.size(); ++i) {
      const int v = 254 * codes[i] + fine[i];  // |v| < 2^15: high is v rounded to 256s
      low[i] = static_cast<int8_t>(v);
      high[i] = static_cast<int8_t>((v - low[i]) >> 8);
    }
  }
};

// Rows of a QuantizedRows from one row on, where a quantizer writes.
struct QuantizedView {
  int64_t block;
  int8_t* codes;
  float* steps;
  float* sums;
  int16_t* bsums;
  int8_t* fine;  // null: no fine codes
  int32_t* fine_sums;
};

QuantizedView rows_from(QuantizedRows& all, int64_t row, int64_t k) {
  return {all.block, all.codes.data() + row * k, all.steps.data() + row * k / all.block,
          all.sums.data() + row * k / kGroup,
          all.bsums.empty() ? nullptr : all.bsums.data() + row * k / 16,
          all.fine.empty() ? nullptr : all.fine.data() + row * k,
          all.fine.empty() ? nullptr : all.fine_sums.data() + row * k / kGroup};
}

bool is_k_kind(int qtype) { return qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K; }

void quantize_rows_scalar(const float* x, int64_t rows, int64_t k, QuantizedView out) {
  const int64_t block = out.block;
  for (int64_t i = 0; i < rows * (k / block); ++i) {
    const float* v = x + i * block;
    float amax = 0.0f;
    for (int64_t l = 0; l < block; ++l) amax = std::max(amax, std::fabs(v[l]));
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int64_t l = 0; l < block; ++l) {
      out.codes[i * block + l] = static_cast<int8_t>(std::nearbyint(v[l] * inverse));
    }
    out.steps[i] = amax / 127.0f;
    for (int64_t g = 0; g < block / kGroup; ++g) {
      int sum = 0;
      for (int l = 0; l < kGroup; ++l) sum += out.codes[i * block + g * kGroup + l];
      out.sums[i * (block / kGroup) + g] = out.steps[i] * static_cast<float>(sum);
    }
    if (out.fine != nullptr) {  // block 32
      const float step = out.steps[i], fine_inverse = step > 0.0f ? 254.0f / step : 0.0f;
      int sum = 0;
      for (int l = 0; l < kGroup; ++l) {
        const float left = std::fma(-static_cast<float>(out.codes[i * block + l]), step, v[l]);
        out.fine[i * block + l] = static_cast<int8_t>(std::nearbyint(left * fine_inverse));
        sum += 254 * out.codes[i * block + l] + out.fine[i * block + l];
      }
      out.fine_sums[i] = sum;
      out.sums[i] = step * (static_cast<float>(sum) / 254.0f);
    }
    for (int64_t h = 0; block != kGroup && h < block / 16; ++h) {
      int sum = 0;
      for (int l = 0; l < 16; ++l) sum += out.codes[i * block + h * 16 + l];
      out.bsums[i * (block / 16) + h] = static_cast<int16_t>(sum);
    }
  }
}

void matmul_columns_scalar(int qtype, const uint8_t* weights, int64_t row_bytes,
                           const QuantizedRows& xq, int64_t rows, int64_t k, float* y,
                           int64_t n_out, int64_t begin, int64_t end) {
  const Geometry geo = geometry(qtype);
  const int64_t row_groups = k / kGroup;
  float scales[16], mins[8];
  int8_t q[32];
  for (int64_t n = begin; n < end; ++n) {
    for (int64_t r = 0; r < rows; ++r) {
      const int8_t* x = xq.codes.data() + r * k;
      float acc = 0.0f;
      for (int64_t blk = 0; blk < k / geo.elems; ++blk) {
        const uint8_t* b = weights + n * row_bytes + blk * geo.bytes;
        block_scales(qtype, b, scales, mins);
        for (int j = 0; j < geo.groups; ++j) {
          const int64_t g = blk * geo.groups + j;
          group_codes_scalar(qtype, b, j, q);
          int32_t dot[2] = {0, 0};
          for (int l = 0; l < 32; ++l) dot[l / 16] += q[l] * x[g * kGroup + l];
          const float step = xq.steps[(r * k + g * kGroup) / xq.block];
          acc += (scales[2 * j] * static_cast<float>(dot[0]) +
                  scales[2 * j + 1] * static_cast<float>(dot[1])) * step +
                 mins[j] * xq.sums[r * row_groups + g];
        }
      }
      y[r * n_out + n] = acc;
    }
  }
}

void dequantize_rows_scalar(int qtype, const uint8_t* weights, int64_t row_bytes, int64_t k,
                            int64_t begin, int64_t end, void* out, bool bf16) {
  const Geometry geo = geometry(qtype);
  float scales[16], mins[8];
  int8_t q[32];
  for (int64_t n = begin; n < end; ++n) {
    for (int64_t blk = 0; blk < k / geo.elems; ++blk) {
      const uint8_t* b = weights + n * row_bytes + blk * geo.bytes;
      block_scales(qtype, b, scales, mins);
      for (int j = 0; j < geo.groups; ++j) {
        group_codes_scalar(qtype, b, j, q);
        const int64_t at = (n - begin) * k + blk * geo.elems + j * kGroup;
        for (int l = 0; l < 32; ++l) {
          const float v = static_cast<float>(q[l]) * scales[2 * j + l / 16] + mins[j];
          if (bf16) {
            static_cast<c10::BFloat16*>(out)[at + l] = c10::BFloat16(v);
          } else {
            static_cast<float*>(out)[at + l] = v;
          }
        }
      }
    }
  }
}

namespace avx2 {
#include "ggml_blocks_simd.h"
#include "ggml_kquants_simd.h"
#include "ggml_q4x8_simd.h"
#include "ggml_q4kx8_simd.h"
#include "ggml_q6kx8_simd.h"
#include "ggml_q8x8_simd.h"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace vnni {
#define MINIVLLM_GGML_VNNI
#include "ggml_blocks_simd.h"
#include "ggml_kquants_simd.h"
#include "ggml_q4x8_simd.h"
#include "ggml_q4kx8_simd.h"
#include "ggml_q6kx8_simd.h"
#include "ggml_q8x8_simd.h"
#undef MINIVLLM_GGML_VNNI
}  // namespace vnni
#pragma GCC pop_options

enum Isa : int64_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kVnni = 3, kAmx = 4 };

bool vnni_available() { return minivllm::vnni_runs(); }

Isa resolve(int64_t isa) {
  TORCH_CHECK(isa >= kAuto && isa <= kAmx, "ggml: isa must be 0 (auto), 1 (scalar), 2 (avx2), "
              "3 (avx512 vnni) or 4 (amx), got ", isa);
  if (isa == kAuto) return minivllm::amx_runs() ? kAmx : vnni_available() ? kVnni : kAvx2;
  TORCH_CHECK(isa != kVnni || vnni_available(),
              "ggml: the AVX-512 VNNI path does not run on this CPU (or torch runs its AVX2 "
              "kernels)");
  TORCH_CHECK(isa != kAmx || minivllm::amx_runs(),
              "ggml: the AMX path does not run on this CPU (or torch runs its AVX2 kernels)");
  return static_cast<Isa>(isa);
}

// Checks the blocks against `k` inputs a row; returns the geometry.
Geometry check_blocks(const at::Tensor& blocks, int64_t qtype, int64_t k, const char* op) {
  TORCH_CHECK(known(qtype), op, ": unsupported GGML type ", qtype);
  const Geometry geo = geometry(static_cast<int>(qtype));
  TORCH_CHECK(k > 0 && k % geo.elems == 0, op, ": the row size (", k,
              ") must be a multiple of the type's block of ", geo.elems);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              op, ": blocks must be [N, row_bytes] uint8, contiguous");
  TORCH_CHECK(blocks.size(1) == k / geo.elems * geo.bytes, op, ": rows of ", blocks.size(1),
              " bytes, expected ", k / geo.elems * geo.bytes, " for ", k, " inputs");
  return geo;
}

#include "ggml_x8.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")
namespace amx {
using namespace vnni;  // the VNNI kernels' tiles, loads and layouts (and what AMX leaves them)
#include "ggml_amx.h"
#include "ggml_amx_q8.h"
}  // namespace amx
#pragma GCC pop_options

// The activation rows quantized into each of x32 / x256 given (rows split over the thread
// pool: a prefill's rows are many).
void quantize_activations(const float* x, int64_t rows, int64_t k, Isa isa, QuantizedRows* x32,
                          QuantizedRows* x256) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / k), [&](int64_t begin, int64_t end) {
    for (QuantizedRows* all : {x32, x256}) {
      if (all == nullptr) continue;
      const QuantizedView out = rows_from(*all, begin, k);
      const float* from = x + begin * k;
      if (isa == kScalar) {
        quantize_rows_scalar(from, end - begin, k, out);
      } else if (all->block == kGroup) {
        avx2::quantize_rows(from, end - begin, k, out);
      } else {
        avx2::quantize_rows_k(from, end - begin, k, out);
      }
    }
  });
}

// One weight of a fused layer's segments, as the matmul reads it.
struct Segment {
  const uint8_t* weights;
  int64_t row_bytes, rows, column;  // its first output column in y; x8: bytes a tile, rows
  int qtype;                        // the block kind (without kX8)
  bool x8;
};

// One kernel over output columns [begin, end) of a segment: every entry of the traits table
// below has this signature (qtype, weights, bytes a row or tile, xq, rows, k, y, ldy, begin, end).
using ColumnsFn = void (*)(int, const uint8_t*, int64_t, const QuantizedRows&, int64_t, int64_t,
                           float*, int64_t, int64_t, int64_t);
using OneKindFn = void (*)(const uint8_t*, int64_t, const QuantizedRows&, int64_t, int64_t, float*,
                           int64_t, int64_t, int64_t);

// A kernel written for one kind (no qtype argument) in the table's signature.
template <OneKindFn F>
void one_kind(int, const uint8_t* w, int64_t bytes, const QuantizedRows& xq, int64_t rows,
              int64_t k, float* y, int64_t ldy, int64_t begin, int64_t end) {
  F(w, bytes, xq, rows, k, y, ldy, begin, end);
}

// The K kinds' tiles on no vector unit: each row moved back, then the stored layout's scalar loop.
void matmul_columns_kx8_scalar(int qtype, const uint8_t* tiles, int64_t tile_bytes,
                               const QuantizedRows& xq, int64_t rows, int64_t k, float* y,
                               int64_t ldy, int64_t begin, int64_t end) {
  std::vector<uint8_t> row(k / 256 * geometry(qtype).bytes);
  for (int64_t n = begin; n < end; ++n) {
    x8_row(qtype, tiles + (n / 8) * tile_bytes, static_cast<int>(n % 8), k / 256, row.data());
    matmul_columns_scalar(qtype, row.data(), 0, xq, rows, k, y + n, ldy, 0, 1);
  }
}

// The traits table, llama.cpp's `type_traits_cpu[]` for our kernels: one row per (kind family,
// layout), one kernel per instruction set (kScalar, kAvx2, kVnni). The K kinds on plain rows
// run the same integer kernel on both vector sets.
// Q4_0..Q8_0 | Q4_K, Q5_K | Q6_K | Q8_0, Q5_0 (their tiles: a byte a code)
enum Family { kFamily32 = 0, kFamilyK = 1, kFamilyQ6K = 2, kFamilyQ8 = 3 };
enum Layout { kRowLayout = 0, kTileLayout = 1 };                 // [N, row_bytes] | x8 tiles
struct ColumnTraits {
  ColumnsFn by_isa[4];  // indexed by Isa - kScalar
};
constexpr ColumnTraits kColumnTraits[4][2] = {
    {{{matmul_columns_scalar, avx2::matmul_columns, vnni::matmul_columns, vnni::matmul_columns}},
     {{matmul_columns_q4x8_scalar, avx2::matmul_columns_q4x8, vnni::matmul_columns_q4x8,
       vnni::matmul_columns_q4x8}}},
    {{{matmul_columns_scalar, avx2::matmul_columns_k, avx2::matmul_columns_k,
       avx2::matmul_columns_k}},
     {{matmul_columns_kx8_scalar, one_kind<avx2::matmul_columns_q4kx8>,
       one_kind<vnni::matmul_columns_q4kx8>, one_kind<amx::matmul_columns_pairs<amx::Q4KPairs>>}}},
    {{{matmul_columns_scalar, avx2::matmul_columns_k, avx2::matmul_columns_k,
       avx2::matmul_columns_k}},
     {{matmul_columns_kx8_scalar, one_kind<avx2::matmul_columns_q6kx8>,
       one_kind<vnni::matmul_columns_q6kx8>, one_kind<amx::matmul_columns_pairs<amx::Q6KPairs>>}}},
    {{{matmul_columns_scalar, avx2::matmul_columns, vnni::matmul_columns, vnni::matmul_columns}},
     {{matmul_columns_q8x8_scalar, avx2::matmul_columns_q8x8, vnni::matmul_columns_q8x8,
       amx::matmul_columns_q8x8}}},
};

Family family(int qtype) {
  return qtype == kQ6_K       ? kFamilyQ6K
         : is_k_kind(qtype)   ? kFamilyK
         : q8x8_kind(qtype)   ? kFamilyQ8
                              : kFamily32;
}

// Columns [begin, end) of one segment, on the chosen instruction set: one look-up, one call.
void segment_columns(const Segment& seg, Isa isa, const QuantizedRows& x32,
                     const QuantizedRows& x256, int64_t rows, int64_t k, float* y, int64_t ldy,
                     int64_t begin, int64_t end) {
  const QuantizedRows& xq = is_k_kind(seg.qtype) ? x256 : x32;
  const ColumnsFn kernel =
      kColumnTraits[family(seg.qtype)][seg.x8 ? kTileLayout : kRowLayout].by_isa[isa - kScalar];
  if (seg.x8) {  // the tiles whose first column is in [begin, end): each computed once
    begin = (begin + 7) / 8 * 8;
    end = std::min(seg.rows, (end + 7) / 8 * 8);
    if (begin >= end) return;
  }
  kernel(seg.qtype, seg.weights, seg.row_bytes, xq, rows, k, y + seg.column, ldy, begin, end);
}

// x @ [W_0; W_1; ...].T: the segments' outputs side by side in one [M, sum N_i] tensor. The
// activations are quantized once for all the segments (once per block size their kinds use)
// and the output columns of every segment split over the thread pool in one loop.
at::Tensor ggml_matmul_segments(const at::Tensor& x, at::TensorList blocks,
                                at::IntArrayRef qtypes, int64_t isa_arg) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "ggml_matmul: x must be [M, K] float32 or bfloat16");
  TORCH_CHECK(!blocks.empty() && blocks.size() == qtypes.size(),
              "ggml_matmul: one qtype per blocks tensor, at least one");
  const int64_t rows = x.size(0), k = x.size(1);
  std::vector<Segment> segments;
  int64_t n_out = 0, widest = 1;
  bool any32 = false, any256 = false, any_x8 = false, any_q6x8 = false, any_q8x8 = false;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const bool x8 = qtypes[i] >= kX8;
    const int qt = static_cast<int>(x8 ? qtypes[i] - kX8 : qtypes[i]);
    if (x8) {
      check_x8(blocks[i], qt, k, "ggml_matmul");
    } else {
      check_blocks(blocks[i], qt, k, "ggml_matmul");
    }
    const int64_t n = blocks[i].size(0) * (x8 ? 8 : 1);
    segments.push_back({blocks[i].data_ptr<uint8_t>(), blocks[i].size(1), n, n_out, qt, x8});
    n_out += n;
    widest = std::max(widest, blocks[i].size(1) / (x8 ? 8 : 1));  // bytes an output column
    (is_k_kind(qt) ? any256 : any32) = true;
    any_x8 = any_x8 || (x8 && !is_k_kind(qt));  // the 32-input kinds' x8 kernels read fine codes
    any_q6x8 = any_q6x8 || (x8 && qt == kQ6_K);  // the Q6_K one unsigned codes
    any_q8x8 = any_q8x8 || (x8 && q8x8_kind(qt));  // on AMX, each 254 q + f as two bytes
  }
  const Isa isa = resolve(isa_arg);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({rows, n_out}, xf.options());
  if (rows == 0 || n_out == 0) return y;
  QuantizedRows x32(any32 ? rows : 0, k, kGroup, any_x8), x256(any256 ? rows : 0, k, 256);
  quantize_activations(xf.data_ptr<float>(), rows, k, isa, any32 ? &x32 : nullptr,
                       any256 ? &x256 : nullptr);
  if (any_q6x8 && isa != kScalar) x256.fill_ucodes();
  if (any_q8x8 && isa == kAmx && rows >= amx::kAmxQ8Rows) x32.fill_bytes();
  float* yp = y.data_ptr<float>();
  // enough weight rows a task that it streams tens of kilobytes
  // (a multiple of 8, so that an x8 tile is rarely split between two tasks' ranges)
  const int64_t grain = (std::max<int64_t>(1, 32768 / widest) + 7) / 8 * 8;
  at::parallel_for(0, n_out, grain, [&](int64_t begin, int64_t end) {
    for (const Segment& seg : segments) {
      const int64_t b = std::max(begin, seg.column), e = std::min(end, seg.column + seg.rows);
      if (b < e) {
        segment_columns(seg, isa, x32, x256, rows, k, yp, n_out, b - seg.column, e - seg.column);
      }
    }
  });
  return y;
}

at::Tensor ggml_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                       int64_t isa_arg) {
  return ggml_matmul_segments(x, {blocks}, {qtype}, isa_arg);
}

// x [M, K] as [2M, K] fp32 rows for two 8-bit activation codes: first what x's first code
// stands for, then what it leaves, `left = x - step * code` (step = max|x| / 127 over each
// `block` inputs, the code rounded to nearest even, as the kernel rounds x), which the kernel
// rounds again with a step of its own. The first rows are x - left, the first code's value,
// which rounds to the same code. Computed here rather than as tensor maths in the caller: a
// compiled decode step traced those ops in every linear layer, a sixth of a warm start's
// compile (docs/real-models.md).
at::Tensor two_code_rows(const at::Tensor& xf, int64_t block) {
  const int64_t rows = xf.size(0), k = xf.size(1);
  TORCH_CHECK(block > 0 && k % block == 0, "ggml_matmul: a second code's block of ", block,
              " inputs does not divide rows of ", k);
  at::Tensor out = at::empty({2 * rows, k}, xf.options());
  const float* x = xf.data_ptr<float>();
  float* first = out.data_ptr<float>();
  float* left = first + rows * k;
  at::parallel_for(0, rows * (k / block), 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* v = x + i * block;
      float amax = 0.0f;
      for (int64_t l = 0; l < block; ++l) amax = std::max(amax, std::fabs(v[l]));
      const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f, step = amax / 127.0f;
      for (int64_t l = 0; l < block; ++l) {
        const float rest = v[l] - std::nearbyint(v[l] * inverse) * step;  // no fma: see flags
        left[i * block + l] = rest;
        first[i * block + l] = v[l] - rest;
      }
    }
  });
  return out;
}

// ggml_matmul_segments with the kinds as a tensor: a compiled decode step then takes them as
// a graph input, so layers whose kinds differ (a Q4_K_M file's Q6_K down projections beside
// its Q4_K ones) share one graph instead of each tracing its own. `columns` is the output
// width, which the fake kernel cannot read from the kinds' values. `residual_block` > 0: each
// activation takes two 8-bit codes (`two_code_rows`), each weight row still read once.
at::Tensor ggml_matmul_kinds(const at::Tensor& x, at::TensorList blocks, const at::Tensor& qtypes,
                             int64_t columns, int64_t isa_arg, int64_t residual_block) {
  TORCH_CHECK(qtypes.dim() == 1 && qtypes.scalar_type() == at::kLong && qtypes.is_cpu(),
              "ggml_matmul: qtypes must be a 1-D int64 CPU tensor");
  TORCH_CHECK(x.dim() == 2, "ggml_matmul: x must be [M, K]");
  const at::Tensor kinds = qtypes.contiguous();
  const int64_t* kind = kinds.data_ptr<int64_t>();
  const std::vector<int64_t> values(kind, kind + kinds.numel());
  const int64_t rows = x.size(0);
  const at::Tensor input =
      residual_block > 0 ? two_code_rows(x.to(at::kFloat).contiguous(), residual_block) : x;
  at::Tensor y = ggml_matmul_segments(input, blocks, values, isa_arg);
  TORCH_CHECK(y.size(1) == columns, "ggml_matmul: the blocks give ", y.size(1),
              " output columns, not ", columns);
  if (residual_block <= 0) return y;
  at::Tensor sum = at::empty({rows, columns}, y.options());  // each row's two codes' outputs
  const float* codes = y.data_ptr<float>();
  float* out = sum.data_ptr<float>();
  const int64_t half = rows * columns;
  at::parallel_for(0, half, 16384, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = codes[i] + codes[half + i];
  });
  return sum;
}

// Rows [begin, end) of `blocks` into `out` (fp32 or bf16), split over the thread pool; with
// `ids`, rows ids[begin] .. ids[end - 1]. With `qtype` plus kX8 the blocks are x8 tiles: each
// row is moved back to ggml's layout first.
void dequantize_into(const at::Tensor& blocks, int qtype, int64_t k, int64_t begin, int64_t end,
                     void* out, bool bf16, Isa isa, const int64_t* ids = nullptr) {
  const bool x8 = qtype >= kX8;
  // Q5_0's tiles move back as Q8_0 blocks (x8_row): the same values
  const int kind = x8 && q8x8_kind(qtype % kX8) ? kQ8_0 : qtype % kX8;
  const Geometry geo = geometry(kind);
  const int64_t row_bytes = k / geo.elems * geo.bytes;  // a row in ggml's layout
  const int64_t grain = std::max<int64_t>(1, 16384 / k);
  const auto rows_into = [&](const uint8_t* w, int64_t b, int64_t e, void* at_row) {
    if (isa == kScalar) {
      dequantize_rows_scalar(kind, w, row_bytes, k, b, e, at_row, bf16);
    } else {
      avx2::dequantize_rows(kind, w, row_bytes, k, b, e, at_row, bf16);
    }
  };
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    char* at_b = static_cast<char*>(out) + (b - begin) * k * (bf16 ? 2 : 4);
    if (!x8 && ids == nullptr) return rows_into(blocks.data_ptr<uint8_t>(), b, e, at_b);
    std::vector<uint8_t> row(x8 ? row_bytes : 0);
    for (int64_t i = b; i < e;) {  // output row i: the weight's row n
      const int64_t n = ids != nullptr ? ids[i] : i;
      char* at_row = at_b + (i - b) * k * (bf16 ? 2 : 4);
      if (!x8) {  // an asked-for row of the stored blocks
        rows_into(blocks.data_ptr<uint8_t>(), n, n + 1, at_row);
        ++i;
        continue;
      }
      const uint8_t* tile = blocks.data_ptr<uint8_t>() + (n / 8) * blocks.size(1);  // row n % 8
      if (ids == nullptr && kind == kQ6_K && isa != kScalar && n % 8 == 0 && n + 8 <= e) {
        for (int64_t blk = 0; blk < k / 256; ++blk) {  // the tile at once
          const uint8_t* src = tile + blk * x8_group_bytes(kind);
          if (bf16) {
            q6k_x8_block_values(src, reinterpret_cast<uint16_t*>(at_row) + 256 * blk, k);
          } else {
            q6k_x8_block_values(src, reinterpret_cast<float*>(at_row) + 256 * blk, k);
          }
        }
        i += 8;
        continue;
      }
      x8_row(kind, tile, static_cast<int>(n % 8), k / geo.elems, row.data());  // moved back
      rows_into(row.data(), 0, 1, at_row);
      ++i;
    }
  });
}

// The weight's rows dequantized, all of them or (`ids`) those rows in that order: a head's
// few exact rows read from its tiles without dequantizing the other 7 rows of each tile.
at::Tensor ggml_dequantize(const at::Tensor& blocks, int64_t qtype, int64_t cols,
                           at::ScalarType dtype, int64_t isa_arg,
                           const std::optional<at::Tensor>& ids) {
  const int64_t rows = check_any(blocks, qtype, cols, "ggml_dequantize");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "ggml_dequantize: dtype must be float32 or bfloat16");
  const Isa isa = resolve(isa_arg);
  at::Tensor picked;
  if (ids.has_value()) {
    TORCH_CHECK(ids->dim() == 1 && ids->scalar_type() == at::kLong && ids->is_cpu(),
                "ggml_dequantize: ids must be one-dimensional int64 on the CPU");
    picked = ids->contiguous();
    const int64_t* ip = picked.data_ptr<int64_t>();
    for (int64_t i = 0; i < picked.numel(); ++i) {
      TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "ggml_dequantize: ids[", i, "] = ", ip[i],
                  " is not a row of the weight's ", rows);
    }
  }
  const int64_t count = ids.has_value() ? picked.numel() : rows;
  at::Tensor out = at::empty({count, cols}, blocks.options().dtype(dtype));
  dequantize_into(blocks, static_cast<int>(qtype), cols, 0, count, out.data_ptr(),
                  dtype == at::kBFloat16, isa,
                  ids.has_value() ? picked.data_ptr<int64_t>() : nullptr);
  return out;
}

// The calling thread's scratch buffer for ggml_dequant_matmul's tiles.
at::Tensor& dequant_scratch() {
  thread_local at::Tensor scratch;
  return scratch;
}

// x @ W.T for prefill-sized steps, into `y` ([M, n_out], a column slice of the layer's
// output): W dequantized `tile_rows` rows at a time into one scratch buffer (per thread,
// reused by every layer and call, grown when needed), each tile multiplied by torch's matmul
// straight into its columns of y: no temporary product, no copy.
void dequant_matmul_into(const at::Tensor& xc, const at::Tensor& blocks, int64_t qtype,
                         int64_t tile_rows, at::Tensor y) {
  const int64_t k = xc.size(1), n_out = y.size(1);
  const bool bf16 = xc.scalar_type() == at::kBFloat16;
  const int64_t tile = std::min(tile_rows, std::max<int64_t>(n_out, 1));
  at::Tensor& scratch = dequant_scratch();
  if (!scratch.defined() || scratch.scalar_type() != xc.scalar_type() ||
      scratch.numel() < tile * k) {
    scratch = at::empty({tile * k}, xc.options());
  }
  for (int64_t n0 = 0; n0 < n_out; n0 += tile) {
    const int64_t n = std::min(tile, n_out - n0);
    dequantize_into(blocks, static_cast<int>(qtype), k, n0, n0 + n, scratch.data_ptr(), bf16,
                    kAvx2);
    const at::Tensor w = scratch.narrow(0, 0, n * k).view({n, k});  // [n, K]
    at::Tensor part = y.narrow(1, n0, n);                              // [M, n]
    at::mm_out(part, xc, w.t());
  }
}

void check_dequant_x(const at::Tensor& x, int64_t tile_rows) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "ggml_dequant_matmul: x must be [M, K] float32 or bfloat16");
  TORCH_CHECK(tile_rows > 0, "ggml_dequant_matmul: tile_rows must be positive");
}

at::Tensor ggml_dequant_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                               int64_t tile_rows) {
  check_dequant_x(x, tile_rows);
  const int64_t n_out = check_any(blocks, qtype, x.size(1), "ggml_dequant_matmul");
  at::Tensor y = at::empty({x.size(0), n_out}, x.options());
  dequant_matmul_into(x.contiguous(), blocks, qtype, tile_rows, y);
  return y;
}

// ggml_dequant_matmul over a fused layer's segments, outputs side by side: one call for a
// layer's segments of different kinds, the kinds as a tensor as ggml_matmul_kinds takes them
// (were a compiled graph to hold it, each layer sharing the graph would pass its own; ints
// would be the first traced layer's constants).
at::Tensor ggml_dequant_matmul_kinds(const at::Tensor& x, at::TensorList blocks,
                                     const at::Tensor& qtypes, int64_t columns,
                                     int64_t tile_rows) {
  check_dequant_x(x, tile_rows);
  TORCH_CHECK(qtypes.dim() == 1 && qtypes.scalar_type() == at::kLong && qtypes.is_cpu() &&
                  qtypes.numel() == static_cast<int64_t>(blocks.size()) && !blocks.empty(),
              "ggml_dequant_matmul: qtypes must be a 1-D int64 CPU tensor, one per blocks tensor");
  const at::Tensor kinds = qtypes.contiguous();
  const int64_t* kind = kinds.data_ptr<int64_t>();
  std::vector<int64_t> widths;
  int64_t total = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    widths.push_back(check_any(blocks[i], kind[i], x.size(-1), "ggml_dequant_matmul"));
    total += widths.back();
  }
  TORCH_CHECK(total == columns, "ggml_dequant_matmul: the blocks give ", total,
              " output columns, not ", columns);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), columns}, x.options());
  int64_t at_column = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    dequant_matmul_into(xc, blocks[i], kind[i], tile_rows, y.narrow(1, at_column, widths[i]));
    at_column += widths[i];
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("ggml_matmul(Tensor x, Tensor blocks, int qtype, int isa) -> Tensor");
  m.def("ggml_matmul_segments(Tensor x, Tensor[] blocks, int[] qtypes, int isa) -> Tensor");
  m.def(
      "ggml_matmul_kinds(Tensor x, Tensor[] blocks, Tensor qtypes, int columns, int isa, "
      "int residual_block=0) -> Tensor");
  m.def(
      "ggml_dequantize(Tensor blocks, int qtype, int cols, ScalarType dtype, int isa, "
      "Tensor? ids=None) -> Tensor");
  m.def("ggml_dequant_matmul(Tensor x, Tensor blocks, int qtype, int tile_rows) -> Tensor");
  m.def("ggml_dequant_matmul_kinds(Tensor x, Tensor[] blocks, Tensor qtypes, int columns, "
        "int tile_rows) -> Tensor");
  m.def("ggml_q4x8_repack(Tensor blocks, int qtype) -> Tensor");
  m.def("ggml_vnni() -> bool", [] { return vnni_available(); });
  m.def("ggml_amx() -> bool", [] { return minivllm::amx_runs(); });
  m.def("ggml_scratch_bytes() -> int", [] {
    const at::Tensor& scratch = dequant_scratch();
    return static_cast<int64_t>(scratch.defined() ? scratch.nbytes() : 0);
  });
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) {
  m.impl("ggml_matmul", &ggml_matmul);
  m.impl("ggml_matmul_segments", &ggml_matmul_segments);
  m.impl("ggml_matmul_kinds", &ggml_matmul_kinds);
  m.impl("ggml_dequantize", &ggml_dequantize);
  m.impl("ggml_q4x8_repack", &ggml_q4x8_repack);
  m.impl("ggml_dequant_matmul", &ggml_dequant_matmul);
  m.impl("ggml_dequant_matmul_kinds", &ggml_dequant_matmul_kinds);
}
