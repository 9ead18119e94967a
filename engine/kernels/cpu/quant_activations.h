// The quantized matmul's activations: each row of x quantized per block of 32 values to int8,
// symmetric: dx = amax / 127, codes q = round(x * (127 / amax)) in [-127, 127] (the product
// rounded to float, then to the nearest integer, ties to even). Per (row, block) the step dx,
// xsum = float(sum of q) * dx (what a block's minimums multiply) and the sums of q over each half
// of the block (what a code offset multiplies).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vector.h"
#include "quant_formats.h"

namespace engine_quant {  // named: the tiles of every path's source take it

struct BlockStats {
  float dx;         // the step: x ~ dx * q
  float xsum;       // float(sum of q) * dx
  int32_t half[2];  // sum of q over values 0-15 and 16-31
};

}  // namespace engine_quant

namespace {

using engine_quant::BlockStats;

inline Vec8 splat(float v) { return Vec8{v, v, v, v, v, v, v, v}; }

typedef int8_t Bytes32 __attribute__((vector_size(32)));

// The 8 lanes combined by `op` in a tree of 3 steps (a loop over the lanes is a chain of 7).
template <typename V, typename Op>
inline auto fold(V v, Op op) {
  v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  return op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6))[0];
}
inline float max_lanes(Vec8 v) {
  return fold(v, [](Vec8 a, Vec8 b) { return a > b ? a : b; });
}
inline float sum_lanes(Vec8 v) {
  return fold(v, [](Vec8 a, Vec8 b) { return a + b; });
}
inline int32_t sum_lanes(Int8 v) {
  return fold(v, [](Int8 a, Int8 b) { return a + b; });
}

// The largest magnitude of a block of 32 values; NaN if one of them is NaN or infinite.
inline float block_top(const float* x) {
  Vec8 amax{}, poison{};  // poison: 0 unless a value is NaN or infinite (then 0 * value is NaN)
  for (int i = 0; i < kBlock / 8; ++i) {
    const Vec8 v = load8(x + 8 * i);
    const Vec8 magnitude = v < 0.0f ? -v : v;
    amax = magnitude > amax ? magnitude : amax;
    poison += v * 0.0f;
  }
  return sum_lanes(poison) == 0.0f ? max_lanes(amax) : NAN;
}

// Quantizes one block of 32 values whose largest magnitude is `top`, 8 lanes at a time. A block
// with a NaN or an infinity gets dx = xsum = NaN (and codes 0), so its row's outputs are NaN, as
// a float matmul's would be (or infinite).
inline void quantize_block(const float* x, float top, int8_t* q, BlockStats* stats) {
  if (std::isnan(top)) {
    std::memset(q, 0, kBlock);
    *stats = {NAN, NAN, {0, 0}};
    return;
  }
  const float dx = top / 127.0f;
  const Vec8 inverse = splat(top > 0.0f ? 127.0f / top : 0.0f);
  const Vec8 high = splat(127.0f), low = splat(-127.0f);
  const Vec8 rounder = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to integer, ties even
  Int8 sums[2] = {};
  for (int i = 0; i < kBlock / 8; ++i) {
    // The product is rounded to float, then to the nearest integer: the clamp between them
    // keeps the compiler from fusing the product into the rounding add.
    Vec8 scaled = load8(x + 8 * i) * inverse;
    scaled = scaled > high ? high : scaled;
    scaled = scaled < low ? low : scaled;
    const Int8 codes = __builtin_convertvector((scaled + rounder) - rounder, Int8);
    sums[i / 2] += codes;
    // Each lane's low byte is its int8 code (a shuffle: GCC narrows a conversion lane by lane).
    const Bytes32 lanes = reinterpret_cast<const Bytes32&>(codes);
    const auto bytes = __builtin_shufflevector(lanes, lanes, 0, 4, 8, 12, 16, 20, 24, 28);
    std::memcpy(q + 8 * i, &bytes, sizeof bytes);
  }
  const int32_t first = sum_lanes(sums[0]), second = sum_lanes(sums[1]);
  *stats = {dx, static_cast<float>(first + second) * dx, {first, second}};
}

// The quantized activations live in per-thread buffers that only grow: a call allocates nothing
// once its thread has seen a batch as large. The pool's helpers read the caller's buffers during
// the call only.
struct Activations {
  std::vector<int8_t> q;
  std::vector<BlockStats> stats;
};

inline const Activations& quantize_rows(const float* x, int64_t m, int64_t k, int64_t x_stride) {
  thread_local Activations scratch;
  const int64_t blocks = k / kBlock;
  if (static_cast<int64_t>(scratch.q.size()) < m * k) scratch.q.resize(m * k);
  if (static_cast<int64_t>(scratch.stats.size()) < m * blocks) scratch.stats.resize(m * blocks);
  for (int64_t row = 0; row < m; ++row) {
    // Two passes over the row: each block's chain (its maximum, a division, the codes, their
    // sum) is long, and a pass of independent maxima first lets the blocks' chains overlap.
    const float* xr = x + row * x_stride;
    BlockStats* stats = scratch.stats.data() + row * blocks;
    for (int64_t b = 0; b < blocks; ++b) stats[b].dx = block_top(xr + b * kBlock);
    for (int64_t b = 0; b < blocks; ++b) {
      quantize_block(xr + b * kBlock, stats[b].dx, scratch.q.data() + row * k + b * kBlock,
                     stats + b);
    }
  }
  return scratch;
}

}  // namespace
