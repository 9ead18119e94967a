// Matmuls on bfloat16 weights: out = x @ w^T + bias, w [n, k] held in 16 bits (half float32's
// bytes), packed once into panels of 16 output columns whose values go in pairs along k:
//
//   packed[panel, p, j, t] = w[16 * panel + j, 2 p + t]     ([panels, k / 2, 16, 2] bfloat16)
//
// so that one 64-byte line holds a pair of k for 16 columns: what AVX512-BF16's vdpbf16ps reads.
// The activations are bfloat16 too (a float32 x is rounded to it first, ties to even).
//
// Every path computes each output in one order, the one vdpbf16ps has: for each pair p in turn,
//
//   acc = fma(x[2p + 1], w[2p + 1], acc);  acc = fma(x[2p], w[2p], acc)
//
// in float32, with denormal inputs read as zero and denormal results flushed to zero (DAZ, FTZ:
// vdpbf16ps' own rules); a bfloat16 product is exact in float32, so each step is one rounding.
// Then out = acc + bias, rounded to the output's dtype. So a row's result is the same bits
// whatever the other rows, the tile it falls in, the thread count and the path:
//
// - AVX512-BF16: vdpbf16ps, 16 columns x 2 k per instruction, x broadcast from memory;
// - AVX2 (+FMA): the pairs widened to float32 and two FMAs per pair, MXCSR's DAZ and FTZ set for
//   the tile's sums. A few rows (a decode step) widen the weights in registers (a shift, a mask)
//   as they stream by; a block of more rows widens its panel once into a float32 copy that stays
//   in cache while tiles of 6 rows pass over it (as linear.cpp's float32 tiles). The activations
//   are widened once per call, each pair's two values swapped, so that both tiles read a pair's
//   odd value first;
// - scalar: plain C++ with std::fma and explicit flushing, the reference the others must equal.
//
// Chosen at run time, as quantized_linear.cpp's paths. Threads: the library's pool, one block of
// rows against one panel per work item, as in linear.cpp.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_vector.h"
#include "thread_pool.h"

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

bool path_available(int path) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  switch (path) {
    case kScalar: return true;
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kBf16:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
    default: return false;
  }
#else
  return path == kScalar;
#endif
}

template <int R>
struct Scalar {
  static void run(const Problem& p, int64_t row, int64_t panel, float* sums) {
    tile_scalar(p, row, R, panel, sums);
  }
};

#if defined(__x86_64__)
template <int R>
struct Avx2 {
  static void run(const Problem& p, int64_t row, int64_t panel, float* sums) {
    tile_avx2<R>(p, row, panel, sums);
  }
};

template <int R>
struct Avx2Wide {  // `panel` is the widened panel's address here
  static void run(const Problem& p, int64_t row, const float* wide, float* sums) {
    tile_avx2_wide<R>(p, row, wide, sums);
  }
};

template <int R>
struct Bf16 {
  static void run(const Problem& p, int64_t row, int64_t panel, float* sums) {
    tile_bf16<R>(p, row, panel, sums);
  }
};
#endif

// A tile of `rows` rows (at most R) of Tile.
template <template <int> class Tile, int R, typename Panel>
void tile_of(int rows, const Problem& p, int64_t row, Panel panel, float* sums) {
  if constexpr (R > 1) {
    if (rows < R) return tile_of<Tile, R - 1, Panel>(rows, p, row, panel, sums);
  }
  Tile<R>::run(p, row, panel, sums);
}

using Item = void (*)(const void*, int64_t);

// One work item: a block of up to kBlockRows rows against one panel, in tiles of up to Rows.
template <int Rows, template <int> class Tile>
void block_item(const void* context, int64_t item) {
  const Problem& p = *static_cast<const Problem*>(context);
  const int64_t panels = (p.n + kPanel - 1) / kPanel;
  const int64_t panel = item % panels;
  const int64_t columns = std::min(kPanel, p.n - panel * kPanel);
  const int64_t first = item / panels * kBlockRows;
  const int64_t last = std::min(first + kBlockRows, p.m);
  float sums[Rows * kPanel];
  for (int64_t row = first; row < last; row += Rows) {
    const int rows = static_cast<int>(std::min<int64_t>(Rows, last - row));
    tile_of<Tile, Rows, int64_t>(rows, p, row, panel, sums);
    finish(p, row, rows, panel, columns, sums);
  }
}

#if defined(__x86_64__)
// The AVX2 path's work item: a block of kWideRows rows or more widens its panel once.
constexpr int64_t kWideRows = 6;

void avx2_item(const void* context, int64_t item) {
  const Problem& p = *static_cast<const Problem*>(context);
  const int64_t panels = (p.n + kPanel - 1) / kPanel;
  const int64_t first = item / panels * kBlockRows;
  const int64_t last = std::min(first + kBlockRows, p.m);
  if (last - first < kWideRows) return block_item<4, Avx2>(context, item);
  const int64_t panel = item % panels;
  const int64_t columns = std::min(kPanel, p.n - panel * kPanel);
  thread_local std::vector<float> wide;
  wide.resize(p.k * kPanel);
  widen_panel(p, panel, wide.data());
  float sums[kWideRows * kPanel];
  for (int64_t row = first; row < last; row += kWideRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kWideRows, last - row));
    tile_of<Avx2Wide, kWideRows, const float*>(rows, p, row, wide.data(), sums);
    finish(p, row, rows, panel, columns, sums);
  }
}
#endif

// What kBest means: the fastest path this CPU has, unless engine_bf16_linear_choose named one.
std::atomic<int> chosen{kBest};

// The path that runs for `path` (kBest: the chosen one); kBest where it cannot run here. A library
// built without AVX-512 (ENGINE_KERNEL_FLAGS=-mno-avx512f, build.py) takes AVX2 for its best, as
// an AVX2 machine does; the AVX512-BF16 tiles stay there for a caller that names them.
int resolve(int path) {
  if (path == kBest) path = chosen.load();
  if (path == kBest) {
#if defined(__AVX512F__)
    const bool bf16 = path_available(kBf16);
#else
    const bool bf16 = false;
#endif
    path = bf16 ? kBf16 : path_available(kAvx2) ? kAvx2 : kScalar;
  }
  return path_available(path) ? path : kBest;
}

Item item_for(int path) {
#if defined(__x86_64__)
  if (path == kBf16) return block_item<12, Bf16>;
  if (path == kAvx2) return avx2_item;
#endif
  return block_item<4, Scalar>;
}

}  // namespace

extern "C" {

// Bit p set where path p (1 scalar, 2 AVX2, 3 AVX512-BF16) runs on this CPU.
int engine_bf16_linear_paths() {
  int mask = 0;
  for (int path = kScalar; path <= kBf16; ++path) mask |= path_available(path) ? 1 << path : 0;
  return mask;
}

// The path a call asking for the best (0) takes: the chosen one, else the fastest of this build.
int engine_bf16_linear_best() { return resolve(kBest); }

// Makes `path` the one calls asking for the best (0) take, in every thread: a machine without
// AVX512-BF16 imitated on one that has it (engine/kernels/cpu/bf16_linear.py). Returns 0; 2 where
// this CPU cannot run it (nothing changes).
int engine_bf16_linear_choose(int path) {
  if (path != kBest && !path_available(path)) return kUnavailable;
  chosen.store(path);
  return kOk;
}

// out [m, n] (out_dtype: float32 or bfloat16) = x [m, k] @ w^T + bias for w packed as above; x
// of x_dtype (float32: rounded to bfloat16 first), rows x_stride elements apart; bias float32 or
// null. Returns 0; 1 for an odd k or an unknown dtype; 2 for a path this CPU cannot run.
int engine_bf16_linear(int x_dtype, const void* x, int64_t m, int64_t k, int64_t x_stride,
                       const uint16_t* packed, int64_t n, const float* bias, int out_dtype,
                       void* out, int threads, int path) {
  path = resolve(path);
  if (path == kBest) return kUnavailable;
  if (k % 2 != 0 || (x_dtype != kFloat32 && x_dtype != kBFloat16) ||
      (out_dtype != kFloat32 && out_dtype != kBFloat16)) {
    return kBadArgument;
  }
  // Scratch of the calling thread, read by the pool's helpers during this call only.
  thread_local std::vector<uint16_t> rounded;
  thread_local std::vector<float> wide;
  const uint16_t* x16 = static_cast<const uint16_t*>(x);
  if (x_dtype == kFloat32) {  // rows of x_stride floats -> contiguous bfloat16
    rounded.resize(m * k);
    BFloat16* to = reinterpret_cast<BFloat16*>(rounded.data());
    for (int64_t r = 0; r < m; ++r) {
      const float* from = static_cast<const float*>(x) + r * x_stride;
      for (int64_t i = 0; i < k; ++i) store(to + r * k + i, from[i]);
    }
    x16 = rounded.data();
    x_stride = k;
  }
  const float* x_wide = nullptr;
  if (path == kAvx2) {  // widened once here, not once per panel; each pair swapped
    wide.resize(m * k);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t i = 0; i < k; ++i) wide[r * k + (i ^ 1)] = widen(x16[r * x_stride + i]);
    }
    x_wide = wide.data();
  }
  const Problem problem{x16, x_wide, m, k, x_stride, packed, n, bias, out_dtype, out};
  engine_cpu::Task task;
  task.run = item_for(path);
  task.context = &problem;
  task.items = (m + kBlockRows - 1) / kBlockRows * ((n + kPanel - 1) / kPanel);
  engine_cpu::run_parallel(task, threads);
  return kOk;
}

}  // extern "C"
