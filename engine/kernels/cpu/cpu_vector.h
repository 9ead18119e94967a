// What the CPU kernels share: the cache and activation dtypes, and 8-lane float vectors written
// with GCC's vector extension (AVX on x86, two NEON registers on Arm), with an exp of 8 lanes.
// Header-only, in an anonymous namespace: each kernel source compiles its own copy.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

enum Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline float to_float(float x) { return x; }

struct BFloat16 {
  uint16_t bits;
};
inline float to_float(BFloat16 x) {
  uint32_t widened = static_cast<uint32_t>(x.bits) << 16;
  float out;
  std::memcpy(&out, &widened, sizeof out);
  return out;
}
inline void store(BFloat16* p, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a (quiet) NaN
    p->bits = static_cast<uint16_t>((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even, as torch does
  p->bits = static_cast<uint16_t>(bits >> 16);
}

struct Float16 {
  _Float16 value;
};
inline float to_float(Float16 x) { return static_cast<float>(x.value); }
inline void store(Float16* p, float x) { p->value = static_cast<_Float16>(x); }
inline void store(float* p, float x) { *p = x; }

// 8 floats in one vector register (GCC's vector extension: AVX on x86, two NEON on Arm).
typedef float Vec8 __attribute__((vector_size(32)));
inline Vec8 load8(const float* p) {
  Vec8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, Vec8 v) { std::memcpy(p, &v, sizeof v); }
inline float sum8(Vec8 v) {
  const float low = (v[0] + v[4]) + (v[1] + v[5]);
  const float high = (v[2] + v[6]) + (v[3] + v[7]);
  return low + high;
}

typedef int32_t Int8 __attribute__((vector_size(32)));

// exp(x) of 8 floats at once (a scalar std::exp per attention score was a fifth of the attention
// kernel's time at 32 x 1,024 keys). x = n ln2 + r with |r| <= ln2 / 2; exp(r) by Cephes' expf
// polynomial; 2^n written into the exponent bits: at most 2 ulp from std::exp over [-87, 88].
// Below -87 (exp under float's smallest normal) it gives 0, as for -inf; above 88, +inf (exp
// reaches float's largest finite value only at 88.72); NaN stays NaN.
inline Vec8 exp8(Vec8 x) {
  const Vec8 low = x < -87.0f ? Vec8{} - 87.0f : x;  // keeps 2^n a normal float
  const Vec8 clamped = low > 88.0f ? Vec8{} + 88.0f : low;
  const Vec8 rounder = Vec8{} + 12582912.0f;         // 1.5 * 2^23: adding it rounds to integer
  const Vec8 n = (clamped * 1.44269504088896341f + rounder) - rounder;
  const Vec8 r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;  // ln 2 in two parts
  Vec8 poly = Vec8{} + 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const Vec8 er = poly * r * r + r + 1.0f;
  const Int8 bits = (__builtin_convertvector(n, Int8) + 127) << 23;
  Vec8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const Vec8 result = er * scale;
  const Vec8 bounded = x > 88.0f ? Vec8{} + INFINITY : result;
  return x < -87.0f ? Vec8{} : bounded;
}

}  // namespace
