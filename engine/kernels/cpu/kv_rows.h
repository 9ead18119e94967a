// How the paged KV cache stores one token's K (or V): a slot of `kv_heads` head rows, each in
// the cache's element type. float32, bfloat16 and float16 rows are `head_dim` elements; an int8
// row is `head_dim` codes followed by its float32 scale (the row's largest magnitude / 127), so
// that a block's bytes hold everything needed to read it back (a P/D transfer or a restarted
// worker copies or maps bytes and never learns the format). engine/kernels/kv_cache.py lays the
// cache out the same way and quantizes alike (torch), bit for bit.
//
// Header-only, in an anonymous namespace, as cpu_vector.h.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_vector.h"

namespace {

enum CacheDtype : int { kCacheFloat32 = 0, kCacheBFloat16 = 1, kCacheFloat16 = 2, kCacheInt8 = 3 };

constexpr int64_t kInt8ScaleBytes = 4;  // the float32 scale after an int8 row's codes

struct Int8Row {
  int8_t code;
};

// Bytes of one head row in a cache of `dtype`; 0 for an unknown dtype.
inline int64_t head_row_bytes(int dtype, int64_t head_dim) {
  switch (dtype) {
    case kCacheFloat32: return head_dim * 4;
    case kCacheBFloat16:
    case kCacheFloat16: return head_dim * 2;
    case kCacheInt8: return head_dim + kInt8ScaleBytes;
    default: return 0;
  }
}

// `count` slots of `kv_heads` head rows from `bytes`, as float32 [count, kv_heads, head_dim]:
// the cache itself when it is float32, else widened (or dequantized) into `buffer`.
template <typename C>
const float* slots_as_float(const char* bytes, int64_t count, int64_t kv_heads, int64_t head_dim,
                            std::vector<float>& buffer) {
  const int64_t elements = count * kv_heads * head_dim;
  if constexpr (std::is_same_v<C, float>) {
    return reinterpret_cast<const float*>(bytes);
  } else if constexpr (std::is_same_v<C, Int8Row>) {
    buffer.resize(elements);
    const int64_t row_bytes = head_dim + kInt8ScaleBytes;
    for (int64_t r = 0; r < count * kv_heads; ++r) {
      const int8_t* codes = reinterpret_cast<const int8_t*>(bytes + r * row_bytes);
      float scale;
      std::memcpy(&scale, codes + head_dim, sizeof scale);
      float* out = buffer.data() + r * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) out[d] = static_cast<float>(codes[d]) * scale;
    }
    return buffer.data();
  } else {
    buffer.resize(elements);
    const C* rows = reinterpret_cast<const C*>(bytes);
    for (int64_t i = 0; i < elements; ++i) buffer[i] = to_float(rows[i]);
    return buffer.data();
  }
}

// One head row of float32 values into the cache's format at `row`.
inline void store_head_row(int dtype, const float* x, int64_t head_dim, char* row) {
  switch (dtype) {
    case kCacheFloat32: std::memcpy(row, x, head_dim * sizeof(float)); return;
    case kCacheBFloat16: {
      BFloat16* out = reinterpret_cast<BFloat16*>(row);
      for (int64_t d = 0; d < head_dim; ++d) store(out + d, x[d]);
      return;
    }
    case kCacheFloat16: {
      Float16* out = reinterpret_cast<Float16*>(row);
      for (int64_t d = 0; d < head_dim; ++d) store(out + d, x[d]);
      return;
    }
    default: {  // int8: codes round(x / scale) (ties to even), scale = largest |x| / 127
      float peak = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) peak = std::fmax(peak, std::fabs(x[d]));
      const float scale = peak / 127.0f;
      int8_t* codes = reinterpret_cast<int8_t*>(row);
      for (int64_t d = 0; d < head_dim; ++d) {
        const float q = scale > 0.0f ? std::nearbyint(x[d] / scale) : 0.0f;
        codes[d] = static_cast<int8_t>(std::fmin(127.0f, std::fmax(-127.0f, q)));
      }
      std::memcpy(codes + head_dim, &scale, sizeof scale);
    }
  }
}

}  // namespace
