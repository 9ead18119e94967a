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

#include "bf16_tiles.h"

namespace {

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
