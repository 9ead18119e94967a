// Matmuls on quantized weights: out = x @ w^T + bias, where w [n, k] is held as 4- or 8-bit codes
// u with a float32 scale s and minimum mn per block of 32 values of a row (w = s * u + mn), packed
// in panels of 16 rows (engine/quantization/layout.py, the contract: one record per panel and
// block, codes in groups of 4 values per row, then 16 scales and 16 minimums).
//
// Each row of x is quantized per block of 32 values to int8, symmetric: dx = amax / 127, codes
// q = round(x * (127 / amax)) in [-127, 127] (the product rounded to float, then to the nearest
// integer, ties to even). A block's contribution to out[j] is then
//
//   sum_t w[j, t] x[t] ~ s[j] dx sum_t u[j, t] q[t] + mn[j] dx sum_t q[t]
//
// whose integer sum is exact in int32 (at most 32 * 255 * 127), and its float part is done in one
// fixed order, the same in every path:
//
//   p = float(isum) * dx;  acc = fma(p, s[j], acc);  acc = fma(mn[j], xsum, acc)
//
// with xsum = float(sum_t q[t]) * dx kept per (row, block). So a row's result is the same bits
// whatever the other rows, the tile it falls in, the thread count and the path; the error against
// a float matmul is the activations' rounding (each value moved by at most dx / 2).
//
// Paths, chosen at run time (the library is built with -march=native, but a home shared by
// machines, or a CPU whose AVX512 the hypervisor hides, must still run): AVX512-VNNI, where
// vpdpbusd sums 4 products of unsigned codes by signed activations into each of 16 int32 lanes,
// one panel row each; AVX2, where vpmaddubsw does the same in two steps; and a plain C++ scalar
// path, the reference the others must equal. Threads: the library's pool (thread_pool.h), one
// block of rows against one panel per work item, as in linear.cpp, so that a decode step's single
// row spreads over the panels.

#include <algorithm>
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
#define ENGINE_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline
#define ENGINE_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#endif

namespace {

constexpr int64_t kBlock = 32;  // values per block (layout.BLOCK)
constexpr int64_t kPanel = 16;  // rows of w per panel (layout.PANEL)
constexpr int64_t kGroup = 4;   // consecutive values per row in a group (layout.GROUP)
constexpr int64_t kGroups = kBlock / kGroup;
constexpr int64_t kBlockRows = 192;  // rows of x per work item: a multiple of every tile's rows
constexpr int64_t kRunsPerThread = 4;  // work items per thread and row block (block_item)
// How far ahead of the record in use a tile asks for the weight: the hardware prefetchers stop
// at each 4 KB page, and a tile of several rows computes long enough per record to hide a
// fetch from memory if it starts a page ahead. (A prefetch past the weight's end is harmless:
// it never faults.)
constexpr int64_t kPrefetchBytes = 4096;

enum Path : int { kBest = 0, kScalar = 1, kAvx2 = 2, kVnni = 3 };
enum Status : int { kOk = 0, kBadArgument = 1, kUnavailable = 2, kBadId = 3 };

constexpr int64_t code_bytes(int bits) { return kBlock * kPanel * bits / 8; }
constexpr int64_t record_bytes(int bits) { return code_bytes(bits) + 2 * kPanel * 4; }

// One (row of x, block) of the quantized activations.
struct BlockStats {
  float dx;      // the step: x ~ dx * q
  float xsum;    // float(sum of q) * dx: what a block's minimums multiply
  int32_t qsum;  // sum of q (the AVX2 8-bit path's offset)
};

struct Problem {
  const int8_t* q;          // [m, k] quantized activations
  const BlockStats* stats;  // [m, k / 32]
  int64_t m;
  int64_t k;
  const uint8_t* packed;  // the layout's records, panel by panel
  int64_t n;
  const float* bias;  // [n] or null
  float* out;         // [m, n], contiguous
  int64_t panels_per_item;
};

// ---- Activations ----------------------------------------------------------------------------

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
float block_top(const float* x) {
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
void quantize_block(const float* x, float top, int8_t* q, BlockStats* stats) {
  if (std::isnan(top)) {
    std::memset(q, 0, kBlock);
    *stats = {NAN, NAN, 0};
    return;
  }
  const float dx = top / 127.0f;
  const Vec8 inverse = splat(top > 0.0f ? 127.0f / top : 0.0f);
  const Vec8 high = splat(127.0f), low = splat(-127.0f);
  const Vec8 rounder = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to integer, ties even
  Int8 sums{};
  for (int i = 0; i < kBlock / 8; ++i) {
    // The product is rounded to float, then to the nearest integer: the clamp between them
    // keeps the compiler from fusing the product into the rounding add.
    Vec8 scaled = load8(x + 8 * i) * inverse;
    scaled = scaled > high ? high : scaled;
    scaled = scaled < low ? low : scaled;
    const Int8 codes = __builtin_convertvector((scaled + rounder) - rounder, Int8);
    sums += codes;
    // Each lane's low byte is its int8 code (a shuffle: GCC narrows a conversion lane by lane).
    const Bytes32 lanes = reinterpret_cast<const Bytes32&>(codes);
    const auto bytes = __builtin_shufflevector(lanes, lanes, 0, 4, 8, 12, 16, 20, 24, 28);
    std::memcpy(q + 8 * i, &bytes, sizeof bytes);
  }
  const int32_t qsum = sum_lanes(sums);
  *stats = {dx, static_cast<float>(qsum) * dx, qsum};
}

// The quantized activations live in per-thread buffers that only grow: a call allocates nothing
// once its thread has seen a batch as large. The pool's helpers read the caller's buffers during
// the call only.
struct Activations {
  std::vector<int8_t> q;
  std::vector<BlockStats> stats;
};

const Activations& quantize_rows(const float* x, int64_t m, int64_t k, int64_t x_stride) {
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

// ---- The scalar path: the reference --------------------------------------------------------

// Row i's code for value t of a block (its record's code area), as layout.py places it.
inline int code_at(const uint8_t* codes, int bits, int64_t i, int64_t t) {
  const int64_t group = t / kGroup, within = t % kGroup;
  if (bits == 8) return codes[(group * kPanel + i) * kGroup + within];
  const uint8_t both = codes[((group % 4) * kPanel + i) * kGroup + within];
  return group < 4 ? both & 0x0F : both >> 4;
}

// The float part of one block, for one output: the order every path keeps.
inline float add_block(float acc, int32_t isum, float scale, float minimum,
                       const BlockStats& stats) {
  const float p = static_cast<float>(isum) * stats.dx;
  acc = std::fma(p, scale, acc);
  return std::fma(minimum, stats.xsum, acc);
}

struct Scalar {
  static constexpr int kRows = 1;

  // Rows [row, row + R) against one panel: sums [R][16], before the bias.
  template <int R, int Bits>
  static void tile(const Problem& p, int64_t row, int64_t panel, float* sums) {
    const int64_t blocks = p.k / kBlock;
    for (int r = 0; r < R; ++r) {
      const int8_t* q = p.q + (row + r) * p.k;
      const BlockStats* stats = p.stats + (row + r) * blocks;
      for (int64_t i = 0; i < kPanel; ++i) {
        const uint8_t* record = p.packed + panel * blocks * record_bytes(Bits);
        float acc = 0.0f;
        for (int64_t b = 0; b < blocks; ++b, record += record_bytes(Bits)) {
          const float* scales = reinterpret_cast<const float*>(record + code_bytes(Bits));
          int32_t isum = 0;
          for (int64_t t = 0; t < kBlock; ++t) {
            isum += code_at(record, Bits, i, t) * q[b * kBlock + t];
          }
          acc = add_block(acc, isum, scales[i], scales[kPanel + i], stats[b]);
        }
        sums[r * kPanel + i] = acc;
      }
    }
  }
};

#if defined(__x86_64__)

// The 4 activation codes of a group in every 32-bit lane.
inline int32_t group_bits(const int8_t* q) {
  int32_t bits;
  std::memcpy(&bits, q, sizeof bits);
  return bits;
}

// ---- The AVX2 path ---------------------------------------------------------------------------

ENGINE_AVX2_INLINE __m256i load256(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// One 8-lane vector holds 8 panel rows (the low or high 32 bytes of a group's 64), so a panel is
// two halves. vpmaddubsw multiplies unsigned by signed bytes and adds pairs into int16, with
// saturation: the two widths stay exact in different ways (below). GCC would re-associate each
// row's chain of integer adds into a tree of all products at once, which needs more registers
// than there are and spills: saturating adds, which it cannot re-associate, and an empty asm
// keep the order.

// 4-bit codes: a pair is at most 2 * 15 * 127, so a block's 8 groups sum exactly in int16
// (30,480 < 32,767); vpmaddwd widens them once per block. sums[r][half]: int32 per panel row.
template <int R>
ENGINE_AVX2_INLINE void block_sums_avx2_4bit(const uint8_t* codes, const int8_t* const* q,
                                             __m256i (&sums)[R][2]) {
  const __m256i nibbles = _mm256_set1_epi8(0x0F);
  __m256i pairs[R][2];
  for (int r = 0; r < R; ++r) pairs[r][0] = pairs[r][1] = _mm256_setzero_si256();
  for (int g = 0; g < 4; ++g) {
    for (int half = 0; half < 2; ++half) {
      const __m256i both = load256(codes + 64 * g + 32 * half);
      const __m256i low = _mm256_and_si256(both, nibbles);  // group g
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(both, 4), nibbles);  // g + 4
      for (int r = 0; r < R; ++r) {
        const __m256i qlow = _mm256_set1_epi32(group_bits(q[r] + kGroup * g));
        const __m256i qhigh = _mm256_set1_epi32(group_bits(q[r] + kGroup * (g + 4)));
        __m256i& sum = pairs[r][half];
        sum = _mm256_adds_epi16(sum, _mm256_maddubs_epi16(low, qlow));
        sum = _mm256_adds_epi16(sum, _mm256_maddubs_epi16(high, qhigh));
      }
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) {
    for (int half = 0; half < 2; ++half) sums[r][half] = _mm256_madd_epi16(pairs[r][half], ones);
  }
}

// 8-bit codes would overflow a pair (2 * 255 * 127), so they go in as c = u - 128, signed:
// |c| * (q with the sign of c) pairs stay within 2 * 128 * 127, are widened per group, and the
// block's sum gets 128 * sum(q) back: sum u q = sum c q + 128 sum q.
template <int R>
ENGINE_AVX2_INLINE void block_sums_avx2_8bit(const uint8_t* codes, const int8_t* const* q,
                                             const BlockStats* const* stats,
                                             __m256i (&sums)[R][2]) {
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_set1_epi32(128 * stats[r]->qsum);
  for (int g = 0; g < kGroups; ++g) {
    for (int half = 0; half < 2; ++half) {
      const __m256i centred = _mm256_xor_si256(load256(codes + 64 * g + 32 * half), offset);
      const __m256i magnitude = _mm256_abs_epi8(centred);  // -128 reads as 128 unsigned
      for (int r = 0; r < R; ++r) {
        const __m256i qg = _mm256_set1_epi32(group_bits(q[r] + kGroup * g));
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(qg, centred));
        __m256i& sum = sums[r][half];
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
        asm("" : "+x"(sum));
      }
    }
  }
}

// Rows [row, row + R) against one panel: sums [R][16], before the bias.
template <int R, int Bits>
ENGINE_AVX2 void tile_avx2(const Problem& p, int64_t row, int64_t panel, float* sums) {
  const int64_t blocks = p.k / kBlock;
  const uint8_t* record = p.packed + panel * blocks * record_bytes(Bits);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, record += record_bytes(Bits)) {
    for (int64_t line = 0; line < record_bytes(Bits); line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(record + kPrefetchBytes + line), _MM_HINT_T0);
    }
    const int8_t* q[R];
    const BlockStats* stats[R];
    for (int r = 0; r < R; ++r) {
      q[r] = p.q + (row + r) * p.k + b * kBlock;
      stats[r] = p.stats + (row + r) * blocks + b;
    }
    __m256i isum[R][2];
    if constexpr (Bits == 4) {
      block_sums_avx2_4bit<R>(record, q, isum);
    } else {
      block_sums_avx2_8bit<R>(record, q, stats, isum);
    }
    const float* scales = reinterpret_cast<const float*>(record + code_bytes(Bits));
    for (int half = 0; half < 2; ++half) {
      const __m256 scale = _mm256_loadu_ps(scales + 8 * half);
      const __m256 minimum = _mm256_loadu_ps(scales + kPanel + 8 * half);
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(stats[r]->dx);
        const __m256 product = _mm256_mul_ps(_mm256_cvtepi32_ps(isum[r][half]), dx);
        acc[r][half] = _mm256_fmadd_ps(product, scale, acc[r][half]);
        acc[r][half] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(stats[r]->xsum), acc[r][half]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(sums + r * kPanel, acc[r][0]);
    _mm256_storeu_ps(sums + r * kPanel + 8, acc[r][1]);
  }
}

struct Avx2 {
  // 4 rows x 2 halves x (1 int + 1 float) accumulators: some spill to L1, yet each panel load
  // then serves 4 rows, which pays more than the spills cost (better than 2 or 3 rows per tile,
  // and than two passes of half a panel at 4 rows).
  static constexpr int kRows = 4;

  template <int R, int Bits>
  static void tile(const Problem& p, int64_t row, int64_t panel, float* sums) {
    tile_avx2<R, Bits>(p, row, panel, sums);
  }
};

// ---- The AVX512-VNNI path ------------------------------------------------------------------

// Rows [row, row + R) against one panel: sums [R][16]. A group's 64 bytes are one vector of 16
// lanes of 4 codes, one panel row each, so vpdpbusd adds a group of each row's products into its
// lane. Each row keeps two int32 chains per block (groups 0-3 and 4-7, the two nibbles of 4-bit
// codes), so that a single row (a decode step) does not wait on one chain of 8 vpdpbusd.
template <int R, int Bits>
ENGINE_VNNI void tile_vnni(const Problem& p, int64_t row, int64_t panel, float* sums) {
  const int64_t blocks = p.k / kBlock;
  const uint8_t* record = p.packed + panel * blocks * record_bytes(Bits);
  const __m512i nibbles = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, record += record_bytes(Bits)) {
    const int8_t* q[R];
    for (int r = 0; r < R; ++r) q[r] = p.q + (row + r) * p.k + b * kBlock;
    __m512i low_sum[R], high_sum[R];
    for (int r = 0; r < R; ++r) low_sum[r] = high_sum[r] = _mm512_setzero_si512();
    for (int g = 0; g < 4; ++g) {
      __m512i low, high;  // the codes of groups g and g + 4
      if constexpr (Bits == 4) {
        const __m512i both = _mm512_loadu_si512(record + 64 * g);
        low = _mm512_and_si512(both, nibbles);
        high = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibbles);
      } else {
        low = _mm512_loadu_si512(record + 64 * g);
        high = _mm512_loadu_si512(record + 64 * (g + 4));
      }
      for (int r = 0; r < R; ++r) {
        const __m512i qlow = _mm512_set1_epi32(group_bits(q[r] + kGroup * g));
        const __m512i qhigh = _mm512_set1_epi32(group_bits(q[r] + kGroup * (g + 4)));
        low_sum[r] = _mm512_dpbusd_epi32(low_sum[r], low, qlow);
        high_sum[r] = _mm512_dpbusd_epi32(high_sum[r], high, qhigh);
      }
    }
    const float* scales = reinterpret_cast<const float*>(record + code_bytes(Bits));
    const __m512 scale = _mm512_loadu_ps(scales);
    const __m512 minimum = _mm512_loadu_ps(scales + kPanel);
    for (int r = 0; r < R; ++r) {
      const BlockStats& stats = p.stats[(row + r) * blocks + b];
      const __m512i isum = _mm512_add_epi32(low_sum[r], high_sum[r]);
      const __m512 product = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(stats.dx));
      acc[r] = _mm512_fmadd_ps(product, scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(stats.xsum), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(sums + r * kPanel, acc[r]);
}

struct Vnni {
  static constexpr int kRows = 6;  // 6 x (2 int + 1 float) accumulators of 32 registers

  template <int R, int Bits>
  static void tile(const Problem& p, int64_t row, int64_t panel, float* sums) {
    tile_vnni<R, Bits>(p, row, panel, sums);
  }
};

#endif  // __x86_64__

// ---- Work items ------------------------------------------------------------------------------

// Sums [rows][16] of one tile into out, plus the bias, at the panel's `columns` valid columns.
void store_tile(const Problem& p, int64_t row, int rows, int64_t panel, int64_t columns,
                const float* sums) {
  const float* bias = p.bias == nullptr ? nullptr : p.bias + panel * kPanel;
  for (int r = 0; r < rows; ++r) {
    float* o = p.out + (row + r) * p.n + panel * kPanel;
    const float* s = sums + r * kPanel;
    for (int64_t j = 0; j < columns; ++j) o[j] = bias == nullptr ? s[j] : s[j] + bias[j];
  }
}

// The last, short tile of a row block: `rows` < K::kRows, dispatched to its compiled size.
template <class K, int Bits, int R = K::kRows - 1>
void short_tile(const Problem& p, int64_t row, int rows, int64_t panel, float* sums) {
  if constexpr (R >= 1) {
    if (rows == R) return K::template tile<R, Bits>(p, row, panel, sums);
    short_tile<K, Bits, R - 1>(p, row, rows, panel, sums);
  }
}

// One block of up to kBlockRows rows against one panel.
template <class K, int Bits>
void panel_rows(const Problem& p, int64_t first, int64_t panel) {
  const int64_t last = std::min(first + kBlockRows, p.m);
  const int64_t columns = std::min(p.n - panel * kPanel, kPanel);
  float sums[K::kRows * kPanel];
  int64_t row = first;
  for (; row + K::kRows <= last; row += K::kRows) {
    K::template tile<K::kRows, Bits>(p, row, panel, sums);
    store_tile(p, row, K::kRows, panel, columns, sums);
  }
  if (row < last) {
    short_tile<K, Bits>(p, row, static_cast<int>(last - row), panel, sums);
    store_tile(p, row, static_cast<int>(last - row), panel, columns, sums);
  }
}

// One work item: a block of up to kBlockRows rows against a run of p.panels_per_item
// consecutive panels. A run, not one panel: the weight is read from memory as a contiguous
// stream per thread, which the hardware prefetchers follow (panels dealt out one by one leave
// each thread a stream with gaps, and it reads at a fraction of the bandwidth). The row
// block's activations stay in cache while its panels pass by.
template <class K, int Bits>
void block_item(const void* context, int64_t item) {
  const Problem& p = *static_cast<const Problem*>(context);
  const int64_t panels = (p.n + kPanel - 1) / kPanel;
  const int64_t runs = (panels + p.panels_per_item - 1) / p.panels_per_item;
  const int64_t first_panel = item % runs * p.panels_per_item;
  const int64_t last_panel = std::min(first_panel + p.panels_per_item, panels);
  for (int64_t panel = first_panel; panel < last_panel; ++panel) {
    panel_rows<K, Bits>(p, item / runs * kBlockRows, panel);
  }
}

bool path_available(int path) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  switch (path) {
    case kScalar: return true;
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kVnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
#else
  return path == kScalar;
#endif
}

using Item = void (*)(const void*, int64_t);

template <class K>
Item items_of(int bits) {
  return bits == 4 ? block_item<K, 4> : block_item<K, 8>;
}

// The work item of `path` (kBest: the fastest this CPU runs), or null where it cannot run.
Item item_for(int path, int bits) {
  if (path == kBest) {
    path = path_available(kVnni) ? kVnni : path_available(kAvx2) ? kAvx2 : kScalar;
  }
  if (!path_available(path)) return nullptr;
#if defined(__x86_64__)
  if (path == kVnni) return items_of<Vnni>(bits);
  if (path == kAvx2) return items_of<Avx2>(bits);
#endif
  return items_of<Scalar>(bits);
}

}  // namespace

extern "C" {

// Bit p set where path p (1 scalar, 2 AVX2, 3 AVX512-VNNI) runs on this CPU.
int engine_quantized_paths() {
  int mask = 0;
  for (int path = kScalar; path <= kVnni; ++path) mask |= path_available(path) ? 1 << path : 0;
  return mask;
}

// out [m, n] = x [m, k] @ w^T + bias for w [n, k] packed with `bits`-bit codes (layout.py);
// x's rows x_stride floats apart. Returns 0; 1 for bits other than 4 and 8 or k not a multiple
// of 32; 2 for a path this CPU cannot run. engine/kernels/cpu/quantized.py checks the rest.
int engine_quantized_linear(const float* x, int64_t m, int64_t k, int64_t x_stride,
                            const uint8_t* packed, int64_t n, int bits, const float* bias,
                            float* out, int threads, int path) {
  if ((bits != 4 && bits != 8) || k % kBlock != 0 || m < 0 || n < 0) return kBadArgument;
  const Item item = item_for(path, bits);
  if (item == nullptr) return kUnavailable;
  if (m == 0 || n == 0) return kOk;
  // Once, on the calling thread, before the others start: quantizing a row is one pass over its
  // k values, small against the matmul's pass over every column for it.
  const Activations& activations = quantize_rows(x, m, k, x_stride);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  // A few runs per thread: contiguous enough to stream, enough to even out a late helper.
  const int64_t run = std::max<int64_t>(1, panels / (kRunsPerThread * std::max(threads, 1)));
  const Problem problem{activations.q.data(), activations.stats.data(), m, k, packed, n, bias, out,
                        run};
  engine_cpu::Task task;
  task.run = item;
  task.context = &problem;
  task.items = (m + kBlockRows - 1) / kBlockRows * ((panels + run - 1) / run);
  engine_cpu::run_parallel(task, threads);
  return kOk;
}

// out [count, k] = rows `ids` of w, decoded: float(code) * scale + minimum, each rounded to float
// (never one fma), as BlockCodes.dequantize computes it: a quantized embedding table's lookup.
// Returns 0; 1 for bad bits or k; 3 for an id outside [0, n).
#if !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
int engine_quantized_rows(const uint8_t* packed, int64_t n, int64_t k, int bits,
                          const int64_t* ids, int64_t count, float* out) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  if ((bits != 4 && bits != 8) || k % kBlock != 0) return kBadArgument;
  for (int64_t c = 0; c < count; ++c) {
    if (ids[c] < 0 || ids[c] >= n) return kBadId;
  }
  const int64_t blocks = k / kBlock;
  for (int64_t c = 0; c < count; ++c) {
    const int64_t i = ids[c] % kPanel;
    const uint8_t* record = packed + ids[c] / kPanel * blocks * record_bytes(bits);
    for (int64_t b = 0; b < blocks; ++b, record += record_bytes(bits)) {
      const float* scales = reinterpret_cast<const float*>(record + code_bytes(bits));
      const float scale = scales[i], minimum = scales[kPanel + i];
      float* o = out + c * k + b * kBlock;
      // A group's 4 codes at a time: code_at per value would keep this loop scalar.
      for (int64_t g = 0; g < kGroups; ++g) {
        const uint8_t* codes = record + ((bits == 8 ? g : g % 4) * kPanel + i) * kGroup;
        const int shift = bits == 4 && g >= 4 ? 4 : 0;
        const int mask = bits == 4 ? 0x0F : 0xFF;
        for (int64_t t = 0; t < kGroup; ++t) {
          o[g * kGroup + t] = static_cast<float>((codes[t] >> shift) & mask) * scale + minimum;
        }
      }
    }
  }
  return kOk;
}

}  // extern "C"
