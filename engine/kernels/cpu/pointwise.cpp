// The decoder's small pointwise steps on the CPU: RMSNorm (of hidden rows, or of each head
// vector), rotary embedding and SwiGLU, each one call over the whole step.
//
// For a decode step's few tokens, torch runs each of them as several small ops (RMSNorm alone is
// six), and their dispatch costs more than their arithmetic: for a small model, a noticeable
// share of the whole decode step. The arithmetic is that of engine/kernels/torch_ops.py (the
// Hugging Face reference's order), in float32; for bfloat16 and float16 the result is rounded to
// the dtype at the same points as there.
//
// One thread: these run on tensors small enough for dispatch to dominate (the Python side sends
// larger ones to torch's parallel ops; engine/kernels/cpu/pointwise.py).

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_vector.h"

namespace {

template <typename T>
inline float round_to(float x) {  // x as the dtype T would hold it
  T held;
  store(&held, x);
  return to_float(held);
}

// out[t, h, :] = weight[h, :] * normalised x[t, h, :], over `heads` vectors of `dim` per token.
// float32: weight * (x * rsqrt(mean(x^2) + eps)); other dtypes: the normalised value is rounded to
// the dtype before the product, as torch_ops does.
template <typename T>
void rms_norm(const T* x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t dim,
              const T* weight, int64_t weight_head_stride, float eps, T* out) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const T* row = x + t * token_stride + h * dim;
      const T* w = weight + h * weight_head_stride;
      T* o = out + (t * heads + h) * dim;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < dim; ++d) {
        const float v = to_float(row[d]);
        squares += v * v;
      }
      const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
      for (int64_t d = 0; d < dim; ++d) {
        const float normed = to_float(row[d]) * inverse;
        if constexpr (sizeof(T) == sizeof(float)) {
          store(o + d, to_float(w[d]) * normed);
        } else {
          store(o + d, round_to<T>(normed) * to_float(w[d]));
        }
      }
    }
  }
}

// "Rotate half" rotary embedding (GPT-NeoX / Hugging Face): with x = [x1 | x2] per head,
// out = [x1 cos - x2 sin | x2 cos + x1 sin]; cos and sin are [tokens, dim / 2].
template <typename T>
void rotary(const T* x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t dim,
            const T* cos, const T* sin, T* out) {
  const int64_t half = dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + t * half;
    const T* s = sin + t * half;
    for (int64_t h = 0; h < heads; ++h) {
      const T* x1 = x + t * token_stride + h * dim;
      const T* x2 = x1 + half;
      T* o = out + (t * heads + h) * dim;
      for (int64_t d = 0; d < half; ++d) {
        const float a = to_float(x1[d]), b = to_float(x2[d]);
        const float cd = to_float(c[d]), sd = to_float(s[d]);
        // Each product rounded to T before the sum, as torch's separate ops round them.
        store(o + d, round_to<T>(a * cd) - round_to<T>(b * sd));
        store(o + half + d, round_to<T>(b * cd) + round_to<T>(a * sd));
      }
    }
  }
}

inline Vec8 silu8(Vec8 x) { return x / (1.0f + exp8(-x)); }  // x * sigmoid(x), as torch

// out[t, :] = silu(gate) * up, with gate_up[t] = [gate | up] of `width` each.
template <typename T>
void silu_and_mul(const T* gate_up, int64_t tokens, int64_t width, T* out) {
  float lanes[8];
  for (int64_t t = 0; t < tokens; ++t) {
    const T* gate = gate_up + t * 2 * width;
    const T* up = gate + width;
    T* o = out + t * width;
    int64_t start = 0;
    if constexpr (sizeof(T) == sizeof(float)) {  // whole vectors straight from and to memory
      for (; start + 8 <= width; start += 8) {
        store8(o + start, silu8(load8(gate + start)) * load8(up + start));
      }
    }
    for (; start < width; start += 8) {  // other dtypes, and a float32 row's last lanes
      const int64_t count = width - start < 8 ? width - start : 8;
      Vec8 g = {};
      for (int64_t i = 0; i < count; ++i) g[i] = to_float(gate[start + i]);
      store8(lanes, silu8(g));
      for (int64_t i = 0; i < count; ++i) {
        store(o + start + i, round_to<T>(lanes[i]) * to_float(up[start + i]));
      }
    }
  }
}

inline bool any_lane(Int8 mask) {
  uint64_t words[4];
  std::memcpy(words, &mask, sizeof words);
  return (words[0] | words[1] | words[2] | words[3]) != 0;
}

// The first column of row[0, cols) where row[c] == value (or is a NaN, when value is one).
int64_t first_equal(const float* row, int64_t cols, float value) {
  const bool nan = value != value;
  const Vec8 target = Vec8{} + value;
  int64_t c = 0;
  for (; c + 8 <= cols; c += 8) {  // 8 at a time to the block that holds it
    const Vec8 v = load8(row + c);
    if (any_lane(nan ? v != v : v == target)) break;
  }
  for (; c < cols; ++c) {
    if (nan ? row[c] != row[c] : row[c] == value) return c;
  }
  return 0;  // not reached for a value taken from the row
}

// The index of each row's largest value, as torch.argmax(dim=-1): the first one of equal maxima,
// and the first NaN where a row has one. torch's CPU reduction keeps an index beside every value
// it compares, so it runs far below memory bandwidth; greedy sampling calls it every step, over
// every sequence's row of a vocabulary that is 152k wide for Qwen. Here: one pass of 8-lane max
// (and NaN check) over the row, then a scan for the first element equal to it, both at the
// speed of streaming the row.
void argmax_rows(const float* x, int64_t rows, int64_t cols, int64_t row_stride, int64_t* out) {
  constexpr int kChains = 4;  // independent max chains, so compares overlap
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * row_stride;
    Vec8 most[kChains];
    Int8 nan_lanes[kChains];
    for (int i = 0; i < kChains; ++i) {
      most[i] = Vec8{} - INFINITY;
      nan_lanes[i] = Int8{};
    }
    int64_t c = 0;
    for (; c + 8 * kChains <= cols; c += 8 * kChains) {
      for (int i = 0; i < kChains; ++i) {
        const Vec8 v = load8(row + c + 8 * i);
        most[i] = v > most[i] ? v : most[i];
        nan_lanes[i] |= v != v;
      }
    }
    float best = -INFINITY;
    bool has_nan = false;
    for (int i = 0; i < kChains; ++i) {
      has_nan = has_nan || any_lane(nan_lanes[i]);
      for (int lane = 0; lane < 8; ++lane) best = most[i][lane] > best ? most[i][lane] : best;
    }
    for (; c < cols; ++c) {
      best = row[c] > best ? row[c] : best;
      has_nan = has_nan || row[c] != row[c];
    }
    out[r] = first_equal(row, cols, has_nan ? NAN : best);
  }
}

}  // namespace

extern "C" {

// Each returns 0, or -1 for an unknown dtype. Arguments are checked by the Python caller.

int engine_rms_norm(int dtype, const void* x, int64_t token_stride, int64_t tokens,
                    int64_t heads, int64_t dim, const void* weight, int64_t weight_head_stride,
                    float eps, void* out) {
  switch (dtype) {
    case kFloat32:
      rms_norm(static_cast<const float*>(x), token_stride, tokens, heads, dim,
               static_cast<const float*>(weight), weight_head_stride, eps,
               static_cast<float*>(out));
      return 0;
    case kBFloat16:
      rms_norm(static_cast<const BFloat16*>(x), token_stride, tokens, heads, dim,
               static_cast<const BFloat16*>(weight), weight_head_stride, eps,
               static_cast<BFloat16*>(out));
      return 0;
    case kFloat16:
      rms_norm(static_cast<const Float16*>(x), token_stride, tokens, heads, dim,
               static_cast<const Float16*>(weight), weight_head_stride, eps,
               static_cast<Float16*>(out));
      return 0;
    default:
      return -1;
  }
}

int engine_rotary(int dtype, const void* x, int64_t token_stride, int64_t tokens, int64_t heads,
                  int64_t dim, const void* cos, const void* sin, void* out) {
  switch (dtype) {
    case kFloat32:
      rotary(static_cast<const float*>(x), token_stride, tokens, heads, dim,
             static_cast<const float*>(cos), static_cast<const float*>(sin),
             static_cast<float*>(out));
      return 0;
    case kBFloat16:
      rotary(static_cast<const BFloat16*>(x), token_stride, tokens, heads, dim,
             static_cast<const BFloat16*>(cos), static_cast<const BFloat16*>(sin),
             static_cast<BFloat16*>(out));
      return 0;
    case kFloat16:
      rotary(static_cast<const Float16*>(x), token_stride, tokens, heads, dim,
             static_cast<const Float16*>(cos), static_cast<const Float16*>(sin),
             static_cast<Float16*>(out));
      return 0;
    default:
      return -1;
  }
}

int engine_silu_and_mul(int dtype, const void* gate_up, int64_t tokens, int64_t width,
                        void* out) {
  switch (dtype) {
    case kFloat32:
      silu_and_mul(static_cast<const float*>(gate_up), tokens, width, static_cast<float*>(out));
      return 0;
    case kBFloat16:
      silu_and_mul(static_cast<const BFloat16*>(gate_up), tokens, width,
                   static_cast<BFloat16*>(out));
      return 0;
    case kFloat16:
      silu_and_mul(static_cast<const Float16*>(gate_up), tokens, width,
                   static_cast<Float16*>(out));
      return 0;
    default:
      return -1;
  }
}

int engine_argmax_rows(const float* x, int64_t rows, int64_t cols, int64_t row_stride,
                       int64_t* out) {
  argmax_rows(x, rows, cols, row_stride, out);
  return 0;
}

}  // extern "C"
