// Matmuls on quantized weights: out = x @ w^T + bias, where w [n, k] is held in the packed formats
// of quant_formats.h (engine/quantization/layout.py, the contract): each GGUF block type at its own
// width, streamed as it is stored. A weight may be several parts of different formats stacked by
// rows (a fused q|k|v whose v is Q6_K and q, k Q4_K): one call runs them all, each part's panels
// in its own format.
//
// Each row of x is quantized per block of 32 values to int8 (quant_activations.h). A block holds
// unsigned codes u, an integer offset o and float scales; its contribution to out[j] is
//
//   sum_t w[j, t] x[t] ~ dx * (s[j] * sum_t (u[j, t] - o) q[t]) (+ mn[j] * dx * sum_t q[t])
//
// whose integer sums are exact in int32, and whose float part is done in one fixed order, the
// same in every path (isum over the block, or over each half of it for Q6_K's two scales):
//
//   symmetric:    acc = fma(float(isum) * dx, s, acc)
//   with minimum: acc = fma(float(isum) * dx, s, acc);  acc = fma(mn, xsum, acc)
//   halves:       acc = fma(float(isum_0) * dx, s_0, acc);  acc = fma(float(isum_1) * dx, s_1, acc)
//
// with xsum = float(sum_t q[t]) * dx. So a row's result is the same bits whatever the other rows,
// the tile it falls in, the thread count and the path; the error against a float matmul is the
// activations' rounding (each value moved by at most dx / 2).
//
// Paths, chosen at run time (the library is built with -march=native, but a home shared by
// machines, or a CPU whose AVX512 the hypervisor hides, must still run): AVX512-VNNI
// (quant_tile_avx512.h, compiled in quant_vnni.cpp), AVX2 (quant_tile_avx2.h, in
// quant_avx2.cpp), and a plain C++ scalar path below, the reference the others must equal.
// Threads: the library's pool (thread_pool.h), one block of rows against a run of one part's
// panels per work item, so that a decode step's single row spreads over the panels.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_activations.h"
#include "quant_formats.h"
#include "quant_tiles.h"
#include "thread_pool.h"

namespace {

constexpr int64_t kBlockRows = 192;    // rows of x per work item: a multiple of every tile's rows
constexpr int64_t kRunsPerThread = 4;  // work items per thread and row block

enum Path : int { kBest = 0, kScalar = 1, kAvx2 = 2, kVnni = 3 };
enum Status : int { kOk = 0, kBadArgument = 1, kUnavailable = 2, kBadId = 3 };

// One part of a weight, as engine/kernels/cpu/quantized.py passes it (ctypes).
struct Part {
  const uint8_t* data;  // panel by panel, 64-byte aligned
  int64_t rows;         // of w: the output columns it fills
  int64_t column;       // its first output column
  int64_t format;       // quant_formats.h's Format
};

using engine_quant::kMaxRows;
using engine_quant::Tiles;

// ---- The scalar path: the reference --------------------------------------------------------

// One row: the reference compiled once for every format (its speed does not matter).
void tile_scalar(int format, const uint8_t* panel, int64_t k, const int8_t* const* q,
                 const BlockStats* const* stats, float* sums) {
  const Traits t = traits(format);
  const int64_t blocks = k / kBlock;
  for (int64_t i = 0; i < kPanel; ++i) {
    float acc = 0.0f;
    const uint8_t* chunk = panel;
    for (int64_t first = 0; first < blocks; first += kChunkBlocks) {
      const int64_t count = std::min(kChunkBlocks, blocks - first);
      for (int64_t b = 0; b < count; ++b) {
        const BlockView view = block_view(t, chunk, count, b);
        const int8_t* x = q[0] + (first + b) * kBlock;
        const BlockStats& st = stats[0][first + b];
        int32_t half[2] = {-t.offset * st.half[0], -t.offset * st.half[1]};
        for (int64_t v = 0; v < kBlock; ++v) half[v / 16] += code_at(view, i, v) * x[v];
        const RowScales s = row_scales(format, view, i);
        if (t.epilogue == kHalves) {
          acc = std::fma(static_cast<float>(half[0]) * st.dx, s.s, acc);
          acc = std::fma(static_cast<float>(half[1]) * st.dx, s.second, acc);
        } else {
          acc = std::fma(static_cast<float>(half[0] + half[1]) * st.dx, s.s, acc);
          if (t.epilogue == kWithMinimum) acc = std::fma(s.second, st.xsum, acc);
        }
      }
      chunk += chunk_layout(t, count).bytes;
    }
    sums[i] = acc;
  }
}

// ---- Choosing a tile -------------------------------------------------------------------------

Tiles scalar_tiles() {
  Tiles tiles{1, {}};
  for (int format = kFirstFormat; format <= kLastFormat; ++format) {
    tiles.kinds[format][0] = tile_scalar;
  }
  return tiles;
}

bool path_available(int path) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  switch (path) {
    case kScalar: return true;
    case kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case kVnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
#else
  return path == kScalar;
#endif
}

// The tiles of `path` (kBest: the fastest this CPU runs), or null where it cannot run. A library
// built without AVX-512 (ENGINE_KERNEL_FLAGS=-mno-avx512f, build.py) takes AVX2 for its best, as
// an AVX2 machine does; the VNNI tiles stay there for a caller that names them.
const Tiles* tiles_for(int path) {
  if (path == kBest) {
#if defined(__AVX512F__)
    const bool vnni = path_available(kVnni);
#else
    const bool vnni = false;
#endif
    path = vnni ? kVnni : path_available(kAvx2) ? kAvx2 : kScalar;
  }
  if (!path_available(path)) return nullptr;
  // A scalar tile of one row: the reference has no registers to share between rows.
  static const Tiles scalar = scalar_tiles();
#if defined(__x86_64__)
  if (path == kVnni) return &engine_quant::vnni_tiles();
  if (path == kAvx2) return &engine_quant::avx2_tiles();
#endif
  return &scalar;
}

// ---- Work items ------------------------------------------------------------------------------

// A run of consecutive panels of one part: one work item with each block of rows.
struct Run {
  int64_t part, first_panel, last_panel;
};

struct Problem {
  const int8_t* q;          // [m, k] quantized activations
  const BlockStats* stats;  // [m, k / 32]
  int64_t m;
  int64_t k;
  const Part* parts;
  const Run* runs;
  int64_t run_count;
  const Tiles* tiles;
  const float* bias;  // [n] or null
  float* out;         // [m, n], contiguous
  int64_t n;
};

// Sums [rows][16] of one tile into out, plus the bias, at the panel's valid columns.
void store_tile(const Problem& p, const Part& part, int64_t row, int rows, int64_t panel,
                const float* sums) {
  const int64_t column = part.column + panel * kPanel;
  const int64_t columns = std::min(part.rows - panel * kPanel, kPanel);
  const float* bias = p.bias == nullptr ? nullptr : p.bias + column;
  for (int r = 0; r < rows; ++r) {
    float* o = p.out + (row + r) * p.n + column;
    const float* s = sums + r * kPanel;
    for (int64_t j = 0; j < columns; ++j) o[j] = bias == nullptr ? s[j] : s[j] + bias[j];
  }
}

// One block of up to kBlockRows rows against one panel, tile by tile: the largest tile that
// the rows left fill.
void panel_rows(const Problem& p, const Part& part, int64_t first, int64_t panel) {
  const int64_t last = std::min(first + kBlockRows, p.m);
  const int64_t blocks = p.k / kBlock;
  const uint8_t* data = part.data + panel * panel_bytes(traits(part.format), p.k);
  const int format = static_cast<int>(part.format);
  float sums[kMaxRows * kPanel];
  const int8_t* q[kMaxRows];
  const BlockStats* stats[kMaxRows];
  for (int64_t row = first; row < last;) {
    int size = p.tiles->sizes - 1;
    while ((int64_t{1} << size) > last - row) --size;
    const int rows = 1 << size;
    for (int r = 0; r < rows; ++r) {
      q[r] = p.q + (row + r) * p.k;
      stats[r] = p.stats + (row + r) * blocks;
    }
    p.tiles->kinds[format][size](format, data, p.k, q, stats, sums);
    store_tile(p, part, row, rows, panel, sums);
    row += rows;
  }
}

// One work item: a block of up to kBlockRows rows against a run of consecutive panels. A run, not
// one panel: the weight is read from memory as a contiguous stream per thread, which the
// hardware prefetchers follow (panels dealt out one by one leave each thread a stream with gaps,
// and it reads at a fraction of the bandwidth). The row block's activations stay in cache while
// its panels pass by.
void block_item(const void* context, int64_t item) {
  const Problem& p = *static_cast<const Problem*>(context);
  const Run& run = p.runs[item % p.run_count];
  for (int64_t panel = run.first_panel; panel < run.last_panel; ++panel) {
    panel_rows(p, p.parts[run.part], item / p.run_count * kBlockRows, panel);
  }
}

int64_t panels_of(int64_t rows) { return (rows + kPanel - 1) / kPanel; }

// Each part's panels cut into runs: a few per thread, contiguous enough to stream, enough to
// even out a late helper.
const std::vector<Run>& runs_of(const Part* parts, int64_t count, int threads) {
  thread_local std::vector<Run> runs;
  runs.clear();
  int64_t panels = 0;
  for (int64_t i = 0; i < count; ++i) panels += panels_of(parts[i].rows);
  const int64_t run = std::max<int64_t>(1, panels / (kRunsPerThread * std::max(threads, 1)));
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t first = 0; first < panels_of(parts[i].rows); first += run) {
      runs.push_back({i, first, std::min(first + run, panels_of(parts[i].rows))});
    }
  }
  return runs;
}

bool parts_valid(const Part* parts, int64_t count, int64_t k, int64_t n) {
  int64_t column = 0;
  for (int64_t i = 0; i < count; ++i) {
    const Part& part = parts[i];
    if (part.format < kFirstFormat || part.format > kLastFormat) return false;
    if (traits(part.format).whole_chunks && k % (kBlock * kChunkBlocks) != 0) return false;
    if (part.column != column || part.rows < 0) return false;
    column += part.rows;
  }
  return column == n;
}

}  // namespace

extern "C" {

// Bit p set where path p (1 scalar, 2 AVX2, 3 AVX512-VNNI) runs on this CPU.
int engine_quantized_paths() {
  int mask = 0;
  for (int path = kScalar; path <= kVnni; ++path) mask |= path_available(path) ? 1 << path : 0;
  return mask;
}

// Bytes of one part of `rows` rows of k values in `format`; -1 where the format or k is wrong.
int64_t engine_quantized_bytes(int64_t format, int64_t rows, int64_t k) {
  if (format < kFirstFormat || format > kLastFormat || k % kBlock != 0 || rows < 0) return -1;
  if (traits(format).whole_chunks && k % (kBlock * kChunkBlocks) != 0) return -1;
  return panels_of(rows) * panel_bytes(traits(format), k);
}

// out [m, n] = x [m, k] @ w^T + bias for w [n, k] held as `count` parts stacked by rows (each
// part's column is the sum of the rows before it); x's rows x_stride floats apart. Returns 0; 1
// for k not a multiple of 32 (256 for a K-quant part) or parts that do not fill n; 2 for a path
// this CPU cannot run. engine/kernels/cpu/quantized.py checks the rest.
int engine_quantized_linear(const float* x, int64_t m, int64_t k, int64_t x_stride,
                            const Part* parts, int64_t count, int64_t n, const float* bias,
                            float* out, int threads, int path) {
  if (k % kBlock != 0 || m < 0 || n < 0 || !parts_valid(parts, count, k, n)) return kBadArgument;
  const Tiles* tiles = tiles_for(path);
  if (tiles == nullptr) return kUnavailable;
  if (m == 0 || n == 0) return kOk;
  // Once, on the calling thread, before the others start: quantizing a row is one pass over its
  // k values, small against the matmul's pass over every column for it.
  const Activations& activations = quantize_rows(x, m, k, x_stride);
  const std::vector<Run>& runs = runs_of(parts, count, threads);
  const int64_t run_count = static_cast<int64_t>(runs.size());
  const Problem problem{activations.q.data(), activations.stats.data(), m, k, parts, runs.data(),
                        run_count, tiles, bias, out, n};
  engine_cpu::Task task;
  task.run = block_item;
  task.context = &problem;
  task.items = (m + kBlockRows - 1) / kBlockRows * run_count;
  engine_cpu::run_parallel(task, threads);
  return kOk;
}

// out [count, k] = rows `ids` of w (one part), decoded as gguf.quants.dequantize computes them
// (quant_formats.h's value_at): a quantized embedding table's lookup. Returns 0; 1 for a bad
// format or k; 3 for an id outside [0, n).
int engine_quantized_rows(const Part* part, int64_t k, const int64_t* ids, int64_t count,
                          float* out) {
  if (part->format < kFirstFormat || part->format > kLastFormat || k % kBlock != 0) {
    return kBadArgument;
  }
  const Traits& t = traits(part->format);
  if (t.whole_chunks && k % (kBlock * kChunkBlocks) != 0) return kBadArgument;
  for (int64_t c = 0; c < count; ++c) {
    if (ids[c] < 0 || ids[c] >= part->rows) return kBadId;
  }
  const int64_t blocks = k / kBlock;
  for (int64_t c = 0; c < count; ++c) {
    const int64_t i = ids[c] % kPanel;
    const uint8_t* chunk = part->data + ids[c] / kPanel * panel_bytes(t, k);
    for (int64_t first = 0; first < blocks; first += kChunkBlocks) {
      const int64_t blocks_here = std::min(kChunkBlocks, blocks - first);
      for (int64_t b = 0; b < blocks_here; ++b) {
        const BlockView view = block_view(t, chunk, blocks_here, b);
        float* o = out + c * k + (first + b) * kBlock;
        for (int64_t v = 0; v < kBlock; ++v) o[v] = value_at(part->format, view, i, v);
      }
      chunk += chunk_layout(t, blocks_here).bytes;
    }
  }
  return kOk;
}

}  // extern "C"
