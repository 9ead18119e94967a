// A step's K (or V) into its cache slots, in the cache's format (kv_rows.h): copied, rounded to
// 16 bits, or quantized to int8 rows with their scales. The compiled CPU backend's cache writes
// and the fused decode step's both come here, so a slot holds the same bytes whichever wrote it.

#include <cstdint>

#include "cpu_vector.h"
#include "kv_rows.h"

namespace {

constexpr int64_t kMaxHeadDim = 512;

template <typename T>
void store_rows(const T* src, int64_t token_stride, int64_t tokens, const int64_t* slots,
                int cache_dtype, char* cache, int64_t kv_heads, int64_t head_dim) {
  const int64_t row_bytes = head_row_bytes(cache_dtype, head_dim);
  float row[kMaxHeadDim];
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t g = 0; g < kv_heads; ++g) {
      const T* x = src + t * token_stride + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) row[d] = to_float(x[d]);
      store_head_row(cache_dtype, row, head_dim, cache + (slots[t] * kv_heads + g) * row_bytes);
    }
  }
}

}  // namespace

extern "C" {

// src [tokens, kv_heads, head_dim] of `dtype` (Dtype), tokens `token_stride` elements apart and
// each token's heads contiguous, into cache [slots, kv_heads, head row] of `cache_dtype` at
// slots[t]. Returns 0, -1 for an unknown dtype, -2 for a head size over kMaxHeadDim.
int engine_kv_store(int dtype, const void* src, int64_t token_stride, int64_t tokens,
                    const int64_t* slots, int cache_dtype, void* cache, int64_t kv_heads,
                    int64_t head_dim) {
  if (head_row_bytes(cache_dtype, head_dim) == 0) return -1;
  if (head_dim > kMaxHeadDim) return -2;
  char* bytes = static_cast<char*>(cache);
  switch (dtype) {
    case kFloat32:
      store_rows(static_cast<const float*>(src), token_stride, tokens, slots, cache_dtype, bytes,
                 kv_heads, head_dim);
      return 0;
    case kBFloat16:
      store_rows(static_cast<const BFloat16*>(src), token_stride, tokens, slots, cache_dtype,
                 bytes, kv_heads, head_dim);
      return 0;
    case kFloat16:
      store_rows(static_cast<const Float16*>(src), token_stride, tokens, slots, cache_dtype,
                 bytes, kv_heads, head_dim);
      return 0;
    default: return -1;
  }
}

}  // extern "C"
