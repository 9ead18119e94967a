// The tiles of bf16_linear.cpp's three paths (the order they share is described there): each
// computes rows [row, row + R) of x against one panel of 16 output columns into float32 sums.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_vector.h"

#if defined(__x86_64__)
#define ENGINE_AVX2 __attribute__((target("avx2,fma")))
#define ENGINE_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#endif

namespace {

constexpr int64_t kPanel = 16;       // output columns per panel
constexpr int64_t kBlockRows = 192;  // rows of x per work item: a multiple of every tile's rows

enum Path : int { kBest = 0, kScalar = 1, kAvx2 = 2, kBf16 = 3 };
enum Status : int { kOk = 0, kBadArgument = 1, kUnavailable = 2 };

struct Problem {
  const uint16_t* x;     // [m, k] bfloat16, rows x_stride apart
  const float* x_wide;   // the AVX2 path's: x as float32 [m, k], each pair swapped; or null
  int64_t m, k, x_stride;
  const uint16_t* packed;  // [panels, k / 2, 16, 2]
  int64_t n;
  const float* bias;  // [n] float32, or null
  int out_dtype;      // Dtype
  void* out;          // [m, n]
};

inline float widen(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof out);
  return out;
}

// The tile's sums, plus bias, into out rows [row, row + rows), `columns` of the panel's 16.
inline void finish(const Problem& p, int64_t row, int rows, int64_t panel, int64_t columns,
                   const float* sums) {
  for (int r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < columns; ++j) {
      const int64_t column = panel * kPanel + j;
      const float value = sums[r * kPanel + j] + (p.bias ? p.bias[column] : 0.0f);
      const int64_t at = (row + r) * p.n + column;
      if (p.out_dtype == kFloat32) {
        static_cast<float*>(p.out)[at] = value;
      } else {
        store(static_cast<BFloat16*>(p.out) + at, value);
      }
    }
  }
}

// ---- The scalar path: the reference --------------------------------------------------------

inline float flushed(float v) {
  return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v;
}

inline float dot_step(float x, float w, float acc) {
  return flushed(std::fma(flushed(x), flushed(w), flushed(acc)));
}

void tile_scalar(const Problem& p, int64_t row, int rows, int64_t panel, float* sums) {
  const uint16_t* w = p.packed + panel * p.k * kPanel;
  for (int r = 0; r < rows; ++r) {
    const uint16_t* x = p.x + (row + r) * p.x_stride;
    for (int64_t j = 0; j < kPanel; ++j) {
      float acc = 0.0f;
      for (int64_t pair = 0; pair < p.k / 2; ++pair) {
        const uint16_t* wp = w + (pair * kPanel + j) * 2;
        acc = dot_step(widen(x[2 * pair + 1]), widen(wp[1]), acc);
        acc = dot_step(widen(x[2 * pair]), widen(wp[0]), acc);
      }
      sums[r * kPanel + j] = acc;
    }
  }
}

#if defined(__x86_64__)

// ---- The AVX2 path ---------------------------------------------------------------------------

// Sets MXCSR's flush-to-zero and denormals-are-zero for its lifetime.
struct FlushDenormals {
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
};

// R rows against one panel: each pair's 64 bytes are two vectors of 8 columns, whose dwords hold
// (w[2p], w[2p + 1]): shifted left 16, the even k as float32; masked, the odd.
template <int R>
ENGINE_AVX2 void tile_avx2(const Problem& p, int64_t row, int64_t panel, float* sums) {
  const uint16_t* w = p.packed + panel * p.k * kPanel;
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = p.x_wide + (row + r) * p.k;
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  {
    FlushDenormals flush;
    for (int64_t pair = 0; pair < p.k / 2; ++pair) {
      const __m256i* line = reinterpret_cast<const __m256i*>(w + pair * 2 * kPanel);
      __m256 even[2], odd[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i both = _mm256_loadu_si256(line + h);
        even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(both, 16));
        odd[h] = _mm256_castsi256_ps(_mm256_and_si256(both, high_half));
      }
      for (int r = 0; r < R; ++r) {
        const __m256 x_odd = _mm256_broadcast_ss(x[r] + 2 * pair);  // swapped: odd first
        const __m256 x_even = _mm256_broadcast_ss(x[r] + 2 * pair + 1);
        for (int h = 0; h < 2; ++h) {
          acc[r][h] = _mm256_fmadd_ps(x_odd, odd[h], acc[r][h]);
          acc[r][h] = _mm256_fmadd_ps(x_even, even[h], acc[r][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(sums + r * kPanel, acc[r][0]);
    _mm256_storeu_ps(sums + r * kPanel + 8, acc[r][1]);
  }
}

// The panel as float32 [k, 16], each pair's rows swapped (odd k first): the wide tile's weights.
ENGINE_AVX2 void widen_panel(const Problem& p, int64_t panel, float* wide) {
  const uint16_t* w = p.packed + panel * p.k * kPanel;
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t pair = 0; pair < p.k / 2; ++pair) {
    const __m256i* line = reinterpret_cast<const __m256i*>(w + pair * 2 * kPanel);
    for (int h = 0; h < 2; ++h) {
      const __m256i both = _mm256_loadu_si256(line + h);
      float* odd = wide + (2 * pair) * kPanel + 8 * h;
      _mm256_storeu_ps(odd, _mm256_castsi256_ps(_mm256_and_si256(both, high_half)));
      _mm256_storeu_ps(odd + kPanel, _mm256_castsi256_ps(_mm256_slli_epi32(both, 16)));
    }
  }
}

// R rows against a widened panel: linear.cpp's float32 tile, one FMA per k in (swapped) order.
template <int R>
ENGINE_AVX2 void tile_avx2_wide(const Problem& p, int64_t row, const float* wide, float* sums) {
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = p.x_wide + (row + r) * p.k;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  {
    FlushDenormals flush;
    for (int64_t kk = 0; kk < p.k; ++kk) {
      const __m256 w0 = _mm256_loadu_ps(wide + kk * kPanel);
      const __m256 w1 = _mm256_loadu_ps(wide + kk * kPanel + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x[r] + kk);
        acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(sums + r * kPanel, acc[r][0]);
    _mm256_storeu_ps(sums + r * kPanel + 8, acc[r][1]);
  }
}

// ---- The AVX512-BF16 path --------------------------------------------------------------------

// R rows against one panel: one vector of 16 columns' pairs, each row's pair broadcast into it.
template <int R>
ENGINE_BF16 void tile_bf16(const Problem& p, int64_t row, int64_t panel, float* sums) {
  const uint16_t* w = p.packed + panel * p.k * kPanel;
  const uint16_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = p.x + (row + r) * p.x_stride;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t pair = 0; pair < p.k / 2; ++pair) {
    const __m512bh pairs = (__m512bh)_mm512_loadu_si512(w + pair * 2 * kPanel);
    for (int r = 0; r < R; ++r) {
      uint32_t both;
      std::memcpy(&both, x[r] + 2 * pair, sizeof both);
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(both)),
                                pairs);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(sums + r * kPanel, acc[r]);
}

#endif  // __x86_64__

}  // namespace
