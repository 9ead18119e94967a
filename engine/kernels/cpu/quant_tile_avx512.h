// The AVX512-VNNI path of the quantized matmul: rows [0, R) of a tile against one panel.
//
// A group's 64 bytes hold 16 lanes of 4 codes, one panel row each, so vpdpbusd adds a group of a
// row's products (unsigned codes by signed activations) into its lane. A block's 8 groups are
// decoded once into 8 vectors of unsigned codes (nibbles masked out, high-bit planes or'ed in,
// IQ4's levels looked up) and serve every row of the tile; each row keeps two int32 chains per
// block (groups 0-3 and 4-7: Q6_K's two scales, and two chains of 4 instead of one of 8).

#pragma once

#if defined(__x86_64__)

#include <immintrin.h>

#include <cstdint>

#include "quant_activations.h"
#include "quant_formats.h"

#define ENGINE_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define ENGINE_VNNI_INLINE \
  __attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) inline

namespace {

// How far ahead of the chunk in use a tile asks for the weight: the hardware prefetchers stop
// at each 4 KB page, and a chunk's arithmetic is long enough to hide a fetch from memory if it
// starts a page ahead. (A prefetch past the weight's end is harmless: it never faults.)
constexpr int64_t kPrefetchBytes = 4096;

ENGINE_VNNI_INLINE __m512i load512(const uint8_t* p) { return _mm512_loadu_si512(p); }

// Bit `bit` of each byte of `plane` moved to bit `to` (the rest cleared). The shifts are 16-bit
// wide, but the mask keeps only bits that came from the same byte.
template <int bit, int to, int width>
ENGINE_VNNI_INLINE __m512i move_bits_512(__m512i plane) {
  const __m512i mask = _mm512_set1_epi8(static_cast<char>(((1 << width) - 1) << to));
  if constexpr (to > bit) return _mm512_and_si512(_mm512_slli_epi16(plane, to - bit), mask);
  if constexpr (to < bit) return _mm512_and_si512(_mm512_srli_epi16(plane, bit - to), mask);
  return _mm512_and_si512(plane, mask);
}

// Group g's high bits (4 and up) from the block's planes.
template <int F, int g>
ENGINE_VNNI_INLINE __m512i high_bits_512(const uint8_t* high) {
  if constexpr (traits(F).high_bits == 1) return move_bits_512<g, 4, 1>(load512(high));
  return move_bits_512<2 * (g % 4), 4, 2>(load512(high + 64 * (g / 4)));
}

template <int F, int g>
ENGINE_VNNI_INLINE void decode_pair_512(const uint8_t* codes, const uint8_t* high, __m512i* u) {
  constexpr Traits t = traits(F);
  if constexpr (t.codes == kBytes) {
    u[g] = load512(codes + 64 * g);
    u[g + 4] = load512(codes + 64 * (g + 4));
  } else {
    const __m512i nibbles = _mm512_set1_epi8(0x0F);
    const __m512i both = load512(codes + 64 * g);
    __m512i low = _mm512_and_si512(both, nibbles);
    __m512i high_nibble = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibbles);
    if constexpr (t.lookup) {
      const __m512i levels = _mm512_broadcast_i32x4(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Codes)));
      low = _mm512_shuffle_epi8(levels, low);
      high_nibble = _mm512_shuffle_epi8(levels, high_nibble);
    }
    if constexpr (t.high_bits > 0) {
      low = _mm512_or_si512(low, high_bits_512<F, g>(high));
      high_nibble = _mm512_or_si512(high_nibble, high_bits_512<F, g + 4>(high));
    }
    u[g] = low;
    u[g + 4] = high_nibble;
  }
}

// The block's 8 groups of unsigned codes.
template <int F>
ENGINE_VNNI_INLINE void decode_512(const uint8_t* codes, const uint8_t* high, __m512i* u) {
  decode_pair_512<F, 0>(codes, high, u);
  decode_pair_512<F, 1>(codes, high, u);
  decode_pair_512<F, 2>(codes, high, u);
  decode_pair_512<F, 3>(codes, high, u);
}

ENGINE_VNNI_INLINE __m512 halves_512(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
ENGINE_VNNI_INLINE __m512 unsigned_bytes_512(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
}
ENGINE_VNNI_INLINE __m512 signed_bytes_512(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}
ENGINE_VNNI_INLINE __m512 negated_512(__m512 v) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), sign));
}

// The block's 16 rows' scales: s and `second` (the minimum, or Q6_K's second scale), from its
// scale bytes and the chunk's d and dmin (row_scales' products, 16 lanes at once).
template <int F>
ENGINE_VNNI_INLINE void scales_512(const uint8_t* s, __m512 d, __m512 dmin, __m512& scale,
                                   __m512& second) {
  if constexpr (F == kU4 || F == kU8) {
    scale = _mm512_loadu_ps(s);
    second = _mm512_loadu_ps(s + 64);
  } else if constexpr (F == kQ4_1 || F == kQ5_1) {
    scale = halves_512(s);
    second = halves_512(s + 32);
  } else if constexpr (F == kQ4_K || F == kQ5_K) {
    scale = _mm512_mul_ps(d, unsigned_bytes_512(s));
    second = negated_512(_mm512_mul_ps(dmin, unsigned_bytes_512(s + 16)));
  } else if constexpr (F == kQ6_K) {
    scale = _mm512_mul_ps(d, signed_bytes_512(s));
    second = _mm512_mul_ps(d, signed_bytes_512(s + 16));
  } else if constexpr (F == kIQ4_XS) {
    scale = _mm512_mul_ps(d, signed_bytes_512(s));
  } else {
    scale = halves_512(s);
  }
}

ENGINE_VNNI_INLINE __m512i group_512(const int8_t* q) {
  int32_t bits;
  std::memcpy(&bits, q, sizeof bits);
  return _mm512_set1_epi32(bits);
}

// Rows [0, R) of the tile (activations q[r], their blocks' stats[r]) against one panel (`panel`
// its first chunk, a row of k values): sums [R][16], before the bias.
template <int F, int R>
ENGINE_VNNI void tile_vnni(const uint8_t* panel, int64_t k, const int8_t* const* q,
                           const BlockStats* const* stats, float* sums) {
  constexpr Traits t = traits(F);
  const int64_t blocks = k / kBlock;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* chunk = panel;
  for (int64_t first = 0; first < blocks; first += kChunkBlocks) {
    const int64_t count = blocks - first < kChunkBlocks ? blocks - first : kChunkBlocks;
    const ChunkLayout layout = chunk_layout(t, count);
    for (int64_t line = 0; line < layout.bytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetchBytes + line), _MM_HINT_T0);
    }
    __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
    if constexpr (t.header > 0) {
      d = halves_512(chunk);
      dmin = halves_512(chunk + 32);
    }
    for (int64_t b = 0; b < count; ++b) {
      __m512i u[8];
      decode_512<F>(chunk + layout.codes + b * code_bytes(t), chunk + layout.high + b * high_bytes(t),
                    u);
      __m512 scale, second = _mm512_setzero_ps();
      scales_512<F>(chunk + layout.scales + b * t.scale_bytes, d, dmin, scale, second);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = q[r] + (first + b) * kBlock;
        const BlockStats& st = stats[r][first + b];
        __m512i low = _mm512_set1_epi32(-t.offset * st.half[0]);
        __m512i high = _mm512_set1_epi32(-t.offset * st.half[1]);
        for (int g = 0; g < 4; ++g) {
          low = _mm512_dpbusd_epi32(low, u[g], group_512(x + kGroup * g));
          high = _mm512_dpbusd_epi32(high, u[g + 4], group_512(x + kGroup * (g + 4)));
        }
        const __m512 dx = _mm512_set1_ps(st.dx);
        if constexpr (t.epilogue == kHalves) {
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(low), dx), scale, acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(high), dx), second, acc[r]);
        } else {
          const __m512i isum = _mm512_add_epi32(low, high);
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum), dx), scale, acc[r]);
          if constexpr (t.epilogue == kWithMinimum) {
            acc[r] = _mm512_fmadd_ps(second, _mm512_set1_ps(st.xsum), acc[r]);
          }
        }
      }
    }
    chunk += layout.bytes;
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(sums + r * kPanel, acc[r]);
}

}  // namespace

#endif  // __x86_64__
