// The AVX2 path of the quantized matmul: rows [0, R) of a tile against one panel, one half of the
// panel (8 rows: the low or high 32 bytes of each group) at a time.
//
// vpmaddubsw multiplies unsigned by signed bytes and adds pairs into int16, with saturation, so
// each width stays exact its own way:
// - codes of at most 6 bits (Q4, Q5, Q6_K, the 4-bit load-time codes) go in unsigned. A pair is
//   at most 2 * 63 * 127; int16 sums of pairs are widened to int32 (vpmaddwd) every 4 groups
//   (5 bits and under: 4 * 2 * 31 * 127 = 31,496) or every 2 (6 bits: 2 * 2 * 63 * 127 = 32,004).
// - 8-bit codes (Q8_0's, the load-time 8-bit ones) and IQ4's levels go in signed, c = u - 128:
//   |c| * (q with the sign of c) pairs stay within 2 * 128 * 127 and are widened per group; the
//   offset is then 128 - the format's (U8's sum gets 128 * sum(q) back).
// Either way every block's integer sums are those of the other paths, exactly. GCC would
// re-associate a row's chain of integer adds into a tree that needs more registers than there
// are: saturating adds, which it cannot re-associate, keep the order.

#pragma once

#if defined(__x86_64__)

#include <immintrin.h>

#include <cstdint>

#include "quant_activations.h"
#include "quant_formats.h"

#define ENGINE_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ENGINE_AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline

namespace {

constexpr bool signed_codes(const Traits& t) { return t.codes == kBytes || t.lookup; }

// IQ4_NL's levels as signed bytes, in both 16-byte lanes.
alignas(32) constexpr int8_t kIq4Levels[32] = {
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

ENGINE_AVX2_INLINE __m256i load256(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

template <int bit, int to, int width>
ENGINE_AVX2_INLINE __m256i move_bits_256(__m256i plane) {
  const __m256i mask = _mm256_set1_epi8(static_cast<char>(((1 << width) - 1) << to));
  if constexpr (to > bit) return _mm256_and_si256(_mm256_slli_epi16(plane, to - bit), mask);
  if constexpr (to < bit) return _mm256_and_si256(_mm256_srli_epi16(plane, bit - to), mask);
  return _mm256_and_si256(plane, mask);
}

template <int F, int g>
ENGINE_AVX2_INLINE __m256i high_bits_256(const uint8_t* high) {
  if constexpr (traits(F).high_bits == 1) return move_bits_256<g, 4, 1>(load256(high));
  return move_bits_256<2 * (g % 4), 4, 2>(load256(high + 64 * (g / 4)));
}

// Groups g and g + 4 of one half (`codes`, `high` already offset to the half): unsigned codes,
// or signed ones where signed_codes.
template <int F, int g>
ENGINE_AVX2_INLINE void decode_pair_256(const uint8_t* codes, const uint8_t* high, __m256i& first,
                                        __m256i& second) {
  constexpr Traits t = traits(F);
  if constexpr (t.codes == kBytes) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    first = _mm256_xor_si256(load256(codes + 64 * g), flip);
    second = _mm256_xor_si256(load256(codes + 64 * (g + 4)), flip);
  } else {
    const __m256i nibbles = _mm256_set1_epi8(0x0F);
    const __m256i both = load256(codes + 64 * g);
    first = _mm256_and_si256(both, nibbles);
    second = _mm256_and_si256(_mm256_srli_epi16(both, 4), nibbles);
    if constexpr (t.lookup) {
      const __m256i levels = _mm256_load_si256(reinterpret_cast<const __m256i*>(kIq4Levels));
      first = _mm256_shuffle_epi8(levels, first);
      second = _mm256_shuffle_epi8(levels, second);
    }
    if constexpr (t.high_bits > 0) {
      first = _mm256_or_si256(first, high_bits_256<F, g>(high));
      second = _mm256_or_si256(second, high_bits_256<F, g + 4>(high));
    }
  }
}

ENGINE_AVX2_INLINE __m256 halves_256(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
ENGINE_AVX2_INLINE __m256 unsigned_bytes_256(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
ENGINE_AVX2_INLINE __m256 signed_bytes_256(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
ENGINE_AVX2_INLINE __m256 negated_256(__m256 v) {
  return _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u))));
}

// scales_512's values for the 8 rows of half h.
template <int F>
ENGINE_AVX2_INLINE void scales_256(const uint8_t* s, int h, __m256 d, __m256 dmin, __m256& scale,
                                   __m256& second) {
  if constexpr (F == kU4 || F == kU8) {
    scale = _mm256_loadu_ps(reinterpret_cast<const float*>(s) + 8 * h);
    second = _mm256_loadu_ps(reinterpret_cast<const float*>(s + 64) + 8 * h);
  } else if constexpr (F == kQ4_1 || F == kQ5_1) {
    scale = halves_256(s + 16 * h);
    second = halves_256(s + 32 + 16 * h);
  } else if constexpr (F == kQ4_K || F == kQ5_K) {
    scale = _mm256_mul_ps(d, unsigned_bytes_256(s + 8 * h));
    second = negated_256(_mm256_mul_ps(dmin, unsigned_bytes_256(s + 16 + 8 * h)));
  } else if constexpr (F == kQ6_K) {
    scale = _mm256_mul_ps(d, signed_bytes_256(s + 8 * h));
    second = _mm256_mul_ps(d, signed_bytes_256(s + 16 + 8 * h));
  } else if constexpr (F == kIQ4_XS) {
    scale = _mm256_mul_ps(d, signed_bytes_256(s + 8 * h));
  } else {
    scale = halves_256(s + 16 * h);
  }
}

ENGINE_AVX2_INLINE __m256i group_256(const int8_t* q) {
  int32_t bits;
  std::memcpy(&bits, q, sizeof bits);
  return _mm256_set1_epi32(bits);
}

// One row's integer sums over one half of a block: low (groups 0-3), high (groups 4-7), offset
// included.
template <int F>
ENGINE_AVX2_INLINE void row_sums_256(const __m256i* c, const int8_t* x, const BlockStats& st,
                                     __m256i& low, __m256i& high) {
  constexpr Traits t = traits(F);
  const __m256i ones = _mm256_set1_epi16(1);
  constexpr int offset = signed_codes(t) ? t.offset - 128 : t.offset;
  low = _mm256_set1_epi32(-offset * st.half[0]);
  high = _mm256_set1_epi32(-offset * st.half[1]);
  if constexpr (signed_codes(t)) {
    for (int g = 0; g < 4; ++g) {
      const __m256i ql = group_256(x + kGroup * g), qh = group_256(x + kGroup * (g + 4));
      const __m256i pl = _mm256_maddubs_epi16(_mm256_abs_epi8(c[g]), _mm256_sign_epi8(ql, c[g]));
      const __m256i ph =
          _mm256_maddubs_epi16(_mm256_abs_epi8(c[g + 4]), _mm256_sign_epi8(qh, c[g + 4]));
      low = _mm256_add_epi32(low, _mm256_madd_epi16(pl, ones));
      high = _mm256_add_epi32(high, _mm256_madd_epi16(ph, ones));
      asm("" : "+x"(low), "+x"(high));
    }
  } else {
    constexpr int widen = t.high_bits == 2 ? 2 : 4;  // groups summed in int16 (see above)
    for (int start = 0; start < 4; start += widen) {
      __m256i pl = _mm256_setzero_si256(), ph = _mm256_setzero_si256();
      for (int g = start; g < start + widen; ++g) {
        pl = _mm256_adds_epi16(pl, _mm256_maddubs_epi16(c[g], group_256(x + kGroup * g)));
        ph = _mm256_adds_epi16(ph, _mm256_maddubs_epi16(c[g + 4], group_256(x + kGroup * (g + 4))));
      }
      low = _mm256_add_epi32(low, _mm256_madd_epi16(pl, ones));
      high = _mm256_add_epi32(high, _mm256_madd_epi16(ph, ones));
    }
  }
}

template <int F, int R>
ENGINE_AVX2 void tile_avx2(const uint8_t* panel, int64_t k, const int8_t* const* q,
                           const BlockStats* const* stats, float* sums) {
  constexpr Traits t = traits(F);
  const int64_t blocks = k / kBlock;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const uint8_t* chunk = panel;
  for (int64_t first = 0; first < blocks; first += kChunkBlocks) {
    const int64_t count = blocks - first < kChunkBlocks ? blocks - first : kChunkBlocks;
    const ChunkLayout layout = chunk_layout(t, count);
    for (int64_t line = 0; line < layout.bytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(chunk + 4096 + line), _MM_HINT_T0);
    }
    for (int64_t b = 0; b < count; ++b) {
      const uint8_t* codes = chunk + layout.codes + b * code_bytes(t);
      const uint8_t* high = chunk + layout.high + b * high_bytes(t);
      const uint8_t* scale_bytes = chunk + layout.scales + b * t.scale_bytes;
      for (int h = 0; h < 2; ++h) {
        __m256 d = _mm256_setzero_ps(), dmin = _mm256_setzero_ps();
        if constexpr (t.header > 0) {
          d = halves_256(chunk + 16 * h);
          dmin = halves_256(chunk + 32 + 16 * h);
        }
        __m256 scale, second = _mm256_setzero_ps();
        scales_256<F>(scale_bytes, h, d, dmin, scale, second);
        __m256i c[8];
        decode_pair_256<F, 0>(codes + 32 * h, high + 32 * h, c[0], c[4]);
        decode_pair_256<F, 1>(codes + 32 * h, high + 32 * h, c[1], c[5]);
        decode_pair_256<F, 2>(codes + 32 * h, high + 32 * h, c[2], c[6]);
        decode_pair_256<F, 3>(codes + 32 * h, high + 32 * h, c[3], c[7]);
        for (int r = 0; r < R; ++r) {
          const BlockStats& st = stats[r][first + b];
          __m256i low, high_sum;
          row_sums_256<F>(c, q[r] + (first + b) * kBlock, st, low, high_sum);
          const __m256 dx = _mm256_set1_ps(st.dx);
          __m256& a = acc[r][h];
          if constexpr (t.epilogue == kHalves) {
            a = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(low), dx), scale, a);
            a = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(high_sum), dx), second, a);
          } else {
            const __m256i isum = _mm256_add_epi32(low, high_sum);
            a = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(isum), dx), scale, a);
            if constexpr (t.epilogue == kWithMinimum) {
              a = _mm256_fmadd_ps(second, _mm256_set1_ps(st.xsum), a);
            }
          }
        }
      }
    }
    chunk += layout.bytes;
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(sums + r * kPanel, acc[r][0]);
    _mm256_storeu_ps(sums + r * kPanel + 8, acc[r][1]);
  }
}

}  // namespace

#endif  // __x86_64__
