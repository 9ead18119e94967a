// The cpu backend's float32 matmuls (the decoder's and the vocabulary projection): out = x @ w^T +
// bias, with w packed once into panels of 16 output columns.
//
// At a decode step's 8-64 rows and a small model's widths (K = 256-768) a call is short, so
// oneDNN's and MKL's per-call work (packing x, choosing a kernel, an OpenMP team) is a large
// share of it and keeps them far from the core's FMA peak. Here there is none of that: each
// panel of 16 columns (K x 16 floats, contiguous) stays in L1 while every tile of 6 rows of x
// streams past it, 12 accumulators in registers.
//
// The sum over k runs in order, one fused multiply-add per term, so results differ from MKL's
// and oneDNN's by float rounding only, and a row's result is the same bits whatever the other
// rows and the thread count. Threads: the library's pool (thread_pool.h), one block of rows
// against one panel at a time.

#include <cstdint>
#include <cstring>

#include "cpu_vector.h"
#include "thread_pool.h"

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel: two 8-lane vectors
constexpr int kTileRows = 6;    // 6 x 2 accumulators + 2 panel vectors + 1 broadcast: 15 of 16
constexpr int64_t kBlockRows = 32 * kTileRows;  // each block reads every panel once

struct Problem {
  const float* x;  // [m, k], rows x_stride apart
  int64_t m;
  int64_t k;
  int64_t x_stride;
  const float* packed;  // [panels, k, 16]: w's rows 16 at a time, transposed
  int64_t n;
  const float* bias;  // [n] or null
  float* out;         // [m, n], contiguous
};

// All 8 lanes = v: one broadcast load (`Vec8{} + v` costs an add first: 0 + -0 is +0).
inline Vec8 splat(float v) { return Vec8{v, v, v, v, v, v, v, v}; }

// Rows [row, row + R) of x against one panel: the R x 16 block of out at `columns` valid columns.
template <int R>
inline void tile(const Problem& p, int64_t row, int64_t panel, int64_t columns) {
  static_assert(R >= 1 && R <= kTileRows, "a tile has 1-6 rows");
  const float* b = p.packed + panel * p.k * kPanel;
  const float* a[kTileRows];
  for (int r = 0; r < kTileRows; ++r) a[r] = p.x + (row + (r < R ? r : 0)) * p.x_stride;
  // Named accumulators, not an array: GCC spilled an array of them to the stack every k.
  Vec8 c00{}, c01{}, c10{}, c11{}, c20{}, c21{}, c30{}, c31{}, c40{}, c41{}, c50{}, c51{};
  for (int64_t kk = 0; kk < p.k; ++kk) {
    const Vec8 b0 = load8(b + kk * kPanel);
    const Vec8 b1 = load8(b + kk * kPanel + 8);
    Vec8 av;
    av = splat(a[0][kk]), c00 += av * b0, c01 += av * b1;
    if constexpr (R > 1) av = splat(a[1][kk]), c10 += av * b0, c11 += av * b1;
    if constexpr (R > 2) av = splat(a[2][kk]), c20 += av * b0, c21 += av * b1;
    if constexpr (R > 3) av = splat(a[3][kk]), c30 += av * b0, c31 += av * b1;
    if constexpr (R > 4) av = splat(a[4][kk]), c40 += av * b0, c41 += av * b1;
    if constexpr (R > 5) av = splat(a[5][kk]), c50 += av * b0, c51 += av * b1;
  }
  const Vec8 sums[kTileRows][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                                   {c30, c31}, {c40, c41}, {c50, c51}};
  float bias[kPanel] = {};
  if (p.bias != nullptr) std::memcpy(bias, p.bias + panel * kPanel, columns * sizeof(float));
  const Vec8 bias0 = load8(bias), bias1 = load8(bias + 8);
  for (int r = 0; r < R; ++r) {
    float* o = p.out + (row + r) * p.n + panel * kPanel;
    float block[kPanel];
    store8(block, sums[r][0] + bias0);
    store8(block + 8, sums[r][1] + bias1);
    std::memcpy(o, block, columns * sizeof(float));
  }
}

// One work item: a block of up to kBlockRows rows against one panel. Consecutive items share the
// row block, which stays in L2 (192 rows x 768 floats: 576 KB) while the panels pass by.
void block_item(const void* context, int64_t item) {
  const Problem& p = *static_cast<const Problem*>(context);
  const int64_t panels = (p.n + kPanel - 1) / kPanel;
  const int64_t panel = item % panels;
  const int64_t first = item / panels * kBlockRows;
  const int64_t last = first + kBlockRows < p.m ? first + kBlockRows : p.m;
  const int64_t columns = p.n - panel * kPanel < kPanel ? p.n - panel * kPanel : kPanel;
  int64_t row = first;
  for (; row + kTileRows <= last; row += kTileRows) tile<kTileRows>(p, row, panel, columns);
  switch (last - row) {
    case 1: return tile<1>(p, row, panel, columns);
    case 2: return tile<2>(p, row, panel, columns);
    case 3: return tile<3>(p, row, panel, columns);
    case 4: return tile<4>(p, row, panel, columns);
    case 5: return tile<5>(p, row, panel, columns);
    default: return;
  }
}

}  // namespace

extern "C" {

// out [m, n] = x [m, k] @ w^T + bias; packed [panels, k, 16]: packed[panel, kk, j] = w[panel * 16
// + j, kk], zero past row n of w (engine/kernels/cpu/linear.py packs it, and checks arguments).
int engine_linear(const float* x, int64_t m, int64_t k, int64_t x_stride, const float* packed,
                  int64_t n, const float* bias, float* out, int num_threads) {
  const Problem problem{x, m, k, x_stride, packed, n, bias, out};
  engine_cpu::Task task;
  task.run = block_item;
  task.context = &problem;
  task.items = (m + kBlockRows - 1) / kBlockRows * ((n + kPanel - 1) / kPanel);
  engine_cpu::run_parallel(task, num_threads);
  return 0;
}

}  // extern "C"
