// Every decoder layer of a decode step in one call, for a model whose matmul weights the CPU
// kernels hold (quantized codes, float32 or bfloat16 panels; engine/model/architectures/
// fused_decode.py decides when): the same kernels the Python path calls one at a time (RMSNorm,
// rotary and SwiGLU from pointwise.cpp, the matmuls, the paged attention), in the same order on
// the same values, so the hidden states come out bit-identical; only the Python between them
// is gone.
//
// Why: a 30-layer model's decode step issues ~15 Python-level operations per layer, each with
// its dispatch, checks and a fresh output tensor. At one sequence the matmuls only stream the
// weights once, so that overhead weighs as much as the arithmetic.
//
// float32 activations (quantized codes or float32 panels), or bfloat16 ones (bfloat16 panels,
// bf16_linear.cpp), as the model's dtype has them. Scratch buffers are this thread's, grown once
// and reused.

#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vector.h"

extern "C" {
int engine_linear(const float* x, int64_t m, int64_t k, int64_t x_stride, const float* packed,
                  int64_t n, const float* bias, float* out, int num_threads);
int engine_bf16_linear(int x_dtype, const void* x, int64_t m, int64_t k, int64_t x_stride,
                       const uint16_t* packed, int64_t n, const float* bias, int out_dtype,
                       void* out, int threads, int path);
int engine_quantized_linear(const float* x, int64_t m, int64_t k, int64_t x_stride,
                            const void* parts, int64_t count, int64_t n, const float* bias,
                            float* out, int threads, int path);
int engine_rms_norm(int dtype, const void* x, int64_t token_stride, int64_t tokens,
                    int64_t heads, int64_t dim, const void* weight, int64_t weight_head_stride,
                    float eps, void* out);
int engine_rotary(int dtype, const void* x, int64_t token_stride, int64_t tokens, int64_t heads,
                  int64_t dim, const void* cos, const void* sin, void* out);
int engine_silu_and_mul(int dtype, const void* gate_up, int64_t tokens, int64_t width,
                        void* out);
int engine_kv_store(int dtype, const void* src, int64_t token_stride, int64_t tokens,
                    const int64_t* slots, int cache_dtype, void* cache, int64_t kv_heads,
                    int64_t head_dim);
int engine_paged_attention(int dtype, int cache_dtype, const void* query,
                           int64_t query_token_stride,
                           const void* key_cache, const void* value_cache,
                           const int64_t* block_tables, int64_t table_width,
                           const int64_t* token_chunk, const int64_t* seen, const int64_t* rows,
                           int64_t num_tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, void* out, int num_threads);
}

namespace {

constexpr int64_t kFloatPanels = 0;   // Matrix::parts of a float32 weight in linear.cpp's panels
constexpr int64_t kBf16Panels = -1;   // ... of a bfloat16 weight in bf16_linear.cpp's panels

// One matmul weight: `parts` quantized parts (quantized_linear.cpp's Part array), float32 panels
// (linear.cpp) or bfloat16 ones (bf16_linear.cpp), and an optional float32 bias.
struct Matrix {
  const void* packed;
  int64_t parts;
  const float* bias;  // or null
};

// One layer's weights and KV cache, as engine/model/architectures/fused_decode.py lays them out (ctypes).
struct Layer {  // norms in the activations' dtype
  const void* input_norm;      // [hidden]
  const void* post_norm;       // [hidden]
  const void* qk_norm;         // [heads + kv_heads, head_dim], or null (no q/k norm)
  Matrix qkv, o, gate_up, down;
  void* keys;                  // [slots + 1, kv_heads, head row] (kv_rows.h)
  void* values;
};

struct Shape {
  int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size;
  float eps, scale;
  int64_t cache_dtype;  // kv_rows.h's CacheDtype
};

// The step's attention inputs (AttentionMetadata with one TableRows piece over every token).
struct Step {
  const void* cos;  // [tokens, head_dim / 2], in the activations' dtype
  const void* sin;
  const int64_t* slots;        // [tokens] cache slot of each token's K/V
  const int64_t* tables;       // [chunks, table_width]
  int64_t table_width;
  const int64_t* token_chunk;  // [tokens]
  const int64_t* seen;         // [tokens]
  int matmul_threads, attention_threads;
};

template <typename T>
T* grow(std::vector<T>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

constexpr int dtype_of(float*) { return kFloat32; }
constexpr int dtype_of(BFloat16*) { return kBFloat16; }

int linear(const BFloat16* x, int64_t m, int64_t k, const Matrix& w, int64_t n, BFloat16* out,
           int threads) {
  if (w.parts != kBf16Panels) return -1;
  return engine_bf16_linear(kBFloat16, x, m, k, k, static_cast<const uint16_t*>(w.packed), n,
                            w.bias, kBFloat16, out, threads, 0);
}

int linear(const float* x, int64_t m, int64_t k, const Matrix& w, int64_t n, float* out,
           int threads) {
  if (w.parts == kBf16Panels) return -1;
  if (w.parts == kFloatPanels) {
    return engine_linear(x, m, k, k, static_cast<const float*>(w.packed), n, w.bias, out,
                         threads);
  }
  return engine_quantized_linear(x, m, k, k, w.packed, w.parts, n, w.bias, out, threads, 0);
}

// h += add, each sum rounded to T (torch's add of two tensors of T).
template <typename T>
void add_into(T* h, const T* add, int64_t size) {
  for (int64_t i = 0; i < size; ++i) store(h + i, to_float(h[i]) + to_float(add[i]));
}

template <typename T>
int layer_step(const Layer& layer, const Shape& s, const Step& step, T* h, int64_t m) {
  thread_local std::vector<T> x_buf, qkv_buf, qk_buf, rot_buf, attn_buf, gu_buf, act_buf,
      add_buf;
  constexpr int dtype = dtype_of(static_cast<T*>(nullptr));
  const int64_t qk_heads = s.heads + s.kv_heads;
  const int64_t qk_size = qk_heads * s.head_dim;
  const int64_t kv_size = s.kv_heads * s.head_dim;
  const int64_t qkv_size = qk_size + kv_size;
  const int64_t attn_size = s.heads * s.head_dim;
  T* x = grow(x_buf, m * s.hidden);
  T* qkv = grow(qkv_buf, m * qkv_size);
  T* normed = grow(qk_buf, m * qk_size);
  T* qk = grow(rot_buf, m * qk_size);
  T* attn = grow(attn_buf, m * attn_size);
  T* gate_up = grow(gu_buf, m * 2 * s.intermediate);
  T* act = grow(act_buf, m * s.intermediate);
  T* add = grow(add_buf, m * s.hidden);
  int status = 0;
  // h + attention(norm(h))
  status |= engine_rms_norm(dtype, h, s.hidden, m, 1, s.hidden, layer.input_norm, 0, s.eps, x);
  status |= linear(x, m, s.hidden, layer.qkv, qkv_size, qkv, step.matmul_threads);
  const T* qk_in = qkv;  // [m, qk_heads, head_dim] rows qkv_size apart
  int64_t qk_stride = qkv_size;
  if (layer.qk_norm != nullptr) {
    status |= engine_rms_norm(dtype, qkv, qkv_size, m, qk_heads, s.head_dim, layer.qk_norm,
                              s.head_dim, s.eps, normed);
    qk_in = normed;
    qk_stride = qk_size;
  }
  status |= engine_rotary(dtype, qk_in, qk_stride, m, qk_heads, s.head_dim, step.cos,
                          step.sin, qk);
  const int cache_dtype = static_cast<int>(s.cache_dtype);  // the cache write: K after rotary
  status |= engine_kv_store(dtype, qk + attn_size, qk_size, m, step.slots, cache_dtype,
                            layer.keys, s.kv_heads, s.head_dim);
  status |= engine_kv_store(dtype, qkv + qk_size, qkv_size, m, step.slots, cache_dtype,
                            layer.values, s.kv_heads, s.head_dim);
  status |= engine_paged_attention(dtype, cache_dtype, qk, qk_size, layer.keys, layer.values,
                                   step.tables,
                                   step.table_width, step.token_chunk, step.seen, nullptr, m,
                                   s.heads, s.kv_heads, s.head_dim, s.block_size, s.scale, attn,
                                   step.attention_threads);
  status |= linear(attn, m, attn_size, layer.o, s.hidden, add, step.matmul_threads);
  add_into(h, add, m * s.hidden);
  // h + mlp(norm(h))
  status |= engine_rms_norm(dtype, h, s.hidden, m, 1, s.hidden, layer.post_norm, 0, s.eps, x);
  status |= linear(x, m, s.hidden, layer.gate_up, 2 * s.intermediate, gate_up,
                   step.matmul_threads);
  status |= engine_silu_and_mul(dtype, gate_up, m, s.intermediate, act);
  status |= linear(act, m, s.intermediate, layer.down, s.hidden, add, step.matmul_threads);
  add_into(h, add, m * s.hidden);
  return status;
}

}  // namespace

extern "C" {

// h [m, hidden] (contiguous, of `dtype`: float32 or bfloat16) goes through `num_layers` layers
// in place. Returns 0, or nonzero when a kernel refused its arguments (the Python caller checks
// them beforehand).
int engine_decode_layers(int dtype, const Layer* layers, int64_t num_layers, const Shape* shape,
                         const Step* step, void* h, int64_t m) {
  int status = dtype == kFloat32 || dtype == kBFloat16 ? 0 : -1;
  for (int64_t l = 0; l < num_layers && status == 0; ++l) {
    status = dtype == kFloat32
                 ? layer_step(layers[l], *shape, *step, static_cast<float*>(h), m)
                 : layer_step(layers[l], *shape, *step, static_cast<BFloat16*>(h), m);
  }
  return status;
}

}  // extern "C"
