// Paged attention on the CPU for tokens that attend to their cached context in place.
//
// Each token reads the keys and values it may see where they lie in the paged KV cache, block
// by block through its sequence's block table: no gather, no padding, no copy of the context.
// One work item is one token, or a run of tokens of one chunk (attend()): it reads each cache
// slot's row (every KV head) once, contiguously, and scores every query head of every token of
// the run against it (grouped-query attention and a speculative chunk cost no extra traffic).
// Softmax is exact (max-subtracted; a pass over the keys for the scores, which stay in a
// per-thread buffer, then one over the values), accumulated in float32 whatever the cache dtype:
// a block's rows are widened (or dequantized, kv_rows.h) to float32 as it is read, so a cache of
// 16-bit or int8 rows is read in half or a quarter of the bytes with the same arithmetic after.
// Two variants of a layer: a sliding window (a token sees itself and the window - 1 keys before
// it: the blocks before every token's window are skipped, the keys before a token's own are
// -inf) and soft-capped scores (cap * tanh(score / cap), before the softmax).
//
// Built by engine/kernels/cpu/build.py with the system's C++ compiler and loaded through
// ctypes: the interface is plain C, no torch or Python headers, so the build takes seconds.
// Threads: the library's pool (thread_pool.h), whose idle threads sleep.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vector.h"
#include "kv_rows.h"
#include "thread_pool.h"

namespace {

// Hardware prefetchers stop at page boundaries, and a sequence's blocks lie anywhere: the next
// block (its rows are contiguous) is fetched ahead while this one is read, so the loads of a
// shuffled cache do not wait on memory. The hint is non-temporal: a step reads each K and V row
// once, and a large context streaming through the last-level cache would evict the weights the
// step's matmuls read next (a small context fits in the cache either way, and the hint costs
// it nothing).
inline void prefetch_row(const char* bytes, int64_t size) {
  for (int64_t offset = 0; offset < size; offset += 64) __builtin_prefetch(bytes + offset, 0, 0);
}

struct Problem {
  int dtype;                   // the query's and the output's (Dtype)
  int cache_dtype;             // the cache's (CacheDtype)
  int64_t slot_bytes;          // one slot's rows, every KV head
  const void* query;
  int64_t query_token_stride;  // elements between consecutive tokens' queries
  const void* key_cache;       // [slots, kv_heads, head row] (kv_rows.h)
  const void* value_cache;
  const int64_t* block_tables;  // [chunks, table_width]
  int64_t table_width;
  const int64_t* token_chunk;  // [tokens] row of block_tables each token reads
  const int64_t* seen;         // [tokens] keys each token attends to (positions 0..seen-1)
  const int64_t* rows;         // [tokens] step row of each token (query and output), or null
  int64_t heads;
  int64_t kv_heads;
  int64_t head_dim;
  int64_t block_size;
  float scale;
  void* out;  // [step rows, heads * head_dim]
  int64_t window;  // keys a token sees at most, itself included; 0: all before it
  float softcap;   // 0: scores as they are
};

// The first key the token that sees `seen` keys may attend to.
inline int64_t first_key(const Problem& p, int64_t seen) {
  return p.window > 0 && seen > p.window ? seen - p.window : 0;
}

struct Scratch {
  std::vector<float> query;   // [heads, head_dim], scaled
  std::vector<float> scores;  // [heads, seen rounded up to 8]
  std::vector<float> acc;     // [heads, head_dim]
  std::vector<float> inverse_sums;  // [heads] 1 / sum of each head's exp(score - max)
  std::vector<float> block;   // one block's rows in float32 (caches of other dtypes)
};


// One dot product of a query head and a key of DIM values (a multiple of 16) as 8 partial sums,
// unrolled into two independent vector accumulators: sum8 of it is the score.
template <int DIM>
inline Vec8 dot_lanes(const float* qh, const float* key) {
  Vec8 even = {}, odd = {};
  for (int c = 0; c < DIM; c += 16) {
    even += load8(qh + c) * load8(key + c);
    odd += load8(qh + c + 8) * load8(key + c + 8);
  }
  return even + odd;
}

// Lane i: sum8(v[i]), bit for bit (the same additions in the same order), for 8 vectors at once:
// a transposing tree of vector adds instead of 8 sums across lanes, which dominated the scores'
// cost (a horizontal sum is ~8 dependent operations for 8 multiply-adds of the dot product).
inline Vec8 sum8_each(const Vec8 (&v)[8]) {
  Vec8 x[4];  // x[i]: lanes 0-3 the low + high halves of v[i], lanes 4-7 those of v[i + 4]
  for (int i = 0; i < 4; ++i) {
    x[i] = __builtin_shufflevector(v[i], v[i + 4], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[i], v[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  auto pairs = [](Vec8 a, Vec8 b) {  // adjacent lanes added, per 128-bit half (vhaddps)
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
  };
  return pairs(pairs(x[0], x[1]), pairs(x[2], x[3]));
}

// Scores of every query head against `count` consecutive slot rows, prefetching `next`'s rows
// one by one. DIM > 0: the head size known at compile time (a multiple of 16): keys go 8 at a
// time through dot_lanes and sum8_each, the rest one by one.
template <int DIM>
void score_rows(const Problem& p, const float* query, const float* rows, int64_t count,
                float* scores, int64_t head_stride, const char* next) {
  const int64_t dim = DIM > 0 ? DIM : p.head_dim;
  const int64_t group = p.heads / p.kv_heads;
  const int64_t slot_stride = p.kv_heads * dim;
  int64_t i = 0;
  if constexpr (DIM > 0) {
    for (; i + 8 <= count; i += 8) {
      if (next != nullptr) {
        for (int j = 0; j < 8; ++j) prefetch_row(next + (i + j) * p.slot_bytes, p.slot_bytes);
      }
      const float* row = rows + i * slot_stride;
      for (int64_t g = 0; g < p.kv_heads; ++g) {
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          Vec8 dots[8];
          for (int j = 0; j < 8; ++j) {
            dots[j] = dot_lanes<DIM>(query + h * dim, row + j * slot_stride + g * dim);
          }
          store8(scores + h * head_stride + i, sum8_each(dots));
        }
      }
    }
  }
  for (; i < count; ++i) {
    if (next != nullptr) prefetch_row(next + i * p.slot_bytes, p.slot_bytes);
    const float* row = rows + i * slot_stride;
    for (int64_t g = 0; g < p.kv_heads; ++g) {
      const float* key = row + g * dim;
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const float* qh = query + h * dim;
        float dot;
        if constexpr (DIM > 0) {
          dot = sum8(dot_lanes<DIM>(qh, key));
        } else {
          dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qh[d] * key[d];
        }
        scores[h * head_stride + i] = dot;
      }
    }
  }
}

// acc[h] += sum over the `count` rows of weight[h, row] * value[row, kv head of h]; `next`'s
// rows are prefetched first.
template <int DIM>
void accumulate_rows(const Problem& p, const float* weights, int64_t head_stride,
                     const float* rows, int64_t count, float* acc, const char* next) {
  const int64_t dim = DIM > 0 ? DIM : p.head_dim;
  const int64_t group = p.heads / p.kv_heads;
  const int64_t slot_stride = p.kv_heads * dim;
  if (next != nullptr) {
    for (int64_t i = 0; i < count; ++i) prefetch_row(next + i * p.slot_bytes, p.slot_bytes);
  }
  for (int64_t h = 0; h < p.heads; ++h) {
    const float* wh = weights + h * head_stride;
    const float* value = rows + (h / group) * dim;
    float* ah = acc + h * dim;
    if constexpr (DIM > 0) {
      Vec8 sums[DIM / 8];  // the head's whole output in registers across the block's rows
      for (int c = 0; c < DIM / 8; ++c) sums[c] = load8(ah + 8 * c);
      for (int64_t i = 0; i < count; ++i) {
        const float* v = value + i * slot_stride;
        for (int c = 0; c < DIM / 8; ++c) sums[c] += wh[i] * load8(v + 8 * c);
      }
      for (int c = 0; c < DIM / 8; ++c) store8(ah + 8 * c, sums[c]);
    } else {
      for (int64_t i = 0; i < count; ++i) {
        const float* v = value + i * slot_stride;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) ah[d] += wh[i] * v[d];
      }
    }
  }
}

// Each head's scores -> exp(score - max); returns nothing but writes each head's 1 / sum of
// them into `inverse_sums` (the output is scaled once at the end rather than every weight), and
// where asked, each head's max and sum (a part of a context, merged later: merge_parts).
// Scores are padded to a multiple of 8 by the caller.
inline void softmax_rows(float* scores, int64_t heads, int64_t seen, int64_t padded,
                         float* inverse_sums, float* peaks_and_sums = nullptr) {
  for (int64_t h = 0; h < heads; ++h) {
    float* sh = scores + h * padded;
    for (int64_t j = seen; j < padded; ++j) sh[j] = -INFINITY;  // exp8 makes them 0
    Vec8 peaks = Vec8{} - INFINITY;
    for (int64_t j = 0; j < padded; j += 8) {
      const Vec8 v = load8(sh + j);
      peaks = v > peaks ? v : peaks;
    }
    float peak = peaks[0];
    for (int i = 1; i < 8; ++i) peak = std::max(peak, peaks[i]);
    Vec8 totals = {};
    for (int64_t j = 0; j < padded; j += 8) {
      const Vec8 e = exp8(load8(sh + j) - peak);
      store8(sh + j, e);
      totals += e;
    }
    const float total = sum8(totals);
    inverse_sums[h] = 1.0f / total;
    if (peaks_and_sums != nullptr) {
      peaks_and_sums[2 * h] = peak;
      peaks_and_sums[2 * h + 1] = total;
    }
  }
}

// A token's scores [heads, padded] before its softmax: the first `hidden` (before its window)
// -inf, the visible ones up to `count` soft-capped where the layer caps them.
inline void shape_scores(const Problem& p, float* scores, int64_t padded, int64_t hidden,
                         int64_t count) {
  if (hidden == 0 && p.softcap == 0.0f) return;
  for (int64_t h = 0; h < p.heads; ++h) {
    float* sh = scores + h * padded;
    for (int64_t j = 0; j < hidden; ++j) sh[j] = -INFINITY;
    if (p.softcap == 0.0f) continue;
    for (int64_t j = hidden; j < count; ++j) sh[j] = p.softcap * std::tanh(sh[j] / p.softcap);
  }
}

// Consecutive tokens of the piece that belong to one chunk (a speculative chunk's 1 + k tokens,
// a short prefill chunk): each attends to its own context, but their contexts are the same
// blocks, so attend() goes block by block and scores (then weighs) every token of the run
// against a block while its rows are in the L1 cache. Token by token, each would read the
// context from memory again (prefetched non-temporal, it is not kept).
//
// A run whose context is longer than kPartKeys is also split into parts of that many keys (whole
// blocks), one work item each, so that one long decode token spreads over the threads; each part
// leaves its tokens' per-head max, sum and unnormalised output, merged in part order
// (merge_parts). The parts' bounds depend on the keys alone, never on the threads or the tokens
// beside, so a token's output stays the same bits whatever the batch or the thread count.
struct Run {
  int64_t first;  // the run's first token in the piece
  int64_t count;
  int64_t begin = 0;      // the keys of this part: [begin, end) of each token's context
  int64_t end = 0;        // (clipped to each token's own)
  int64_t partial = -1;   // where the part leaves its result in the partials; -1: a whole run
};

// Fixed, so that a token's bits never depend on the threads; engine/kernels/cpu/attention.py's
// PARALLEL_KEYS must stay equal, so that a context of two parts or more runs on every core.
// Small enough to split even a few hundred keys two ways, large enough that 2-6 parts even out
// over two threads (README, CPU kernels, has the figures).
constexpr int64_t kPartKeys = 256;
constexpr int64_t kMaxHeadDim = 512;  // merge_parts' accumulator

// Values per token of a part's partial result: each head's max and sum, then the output.
inline int64_t partial_size(const Problem& p) { return p.heads * (2 + p.head_dim); }

// The step row (query and output) of the piece's `token`.
inline int64_t token_row(const Problem& p, int64_t token) {
  return p.rows ? p.rows[token] : token;
}

// The run's queries as float32, scaled, into s.query [tokens, heads * head_dim].
template <typename T>
void load_queries_of(const Problem& p, const Run& run, Scratch& s) {
  const int64_t query_size = p.heads * p.head_dim;
  s.query.resize(run.count * query_size);
  for (int64_t t = 0; t < run.count; ++t) {
    const int64_t row = token_row(p, run.first + t);
    const T* q = static_cast<const T*>(p.query) + row * p.query_token_stride;
    float* scaled = s.query.data() + t * query_size;
    for (int64_t i = 0; i < query_size; ++i) scaled[i] = to_float(q[i]) * p.scale;
  }
}

inline void load_queries(const Problem& p, const Run& run, Scratch& s) {
  switch (p.dtype) {
    case kFloat32: return load_queries_of<float>(p, run, s);
    case kBFloat16: return load_queries_of<BFloat16>(p, run, s);
    default: return load_queries_of<Float16>(p, run, s);
  }
}

// The run's outputs from s.acc and s.inverse_sums; a part's unnormalised output to `partials`.
template <typename T>
void finish_run_of(const Problem& p, const Run& run, const Scratch& s, float* partials) {
  const int64_t query_size = p.heads * p.head_dim;
  for (int64_t t = 0; t < run.count; ++t) {
    const float* acc = s.acc.data() + t * query_size;
    if (run.partial >= 0) {
      float* part = partials + (run.partial + t) * partial_size(p) + 2 * p.heads;
      std::memcpy(part, acc, query_size * sizeof(float));
      continue;
    }
    T* out = static_cast<T*>(p.out) + token_row(p, run.first + t) * query_size;
    const float* inverse_sums = s.inverse_sums.data() + t * p.heads;
    for (int64_t i = 0; i < query_size; ++i) {
      store(out + i, acc[i] * inverse_sums[i / p.head_dim]);
    }
  }
}

inline void finish_run(const Problem& p, const Run& run, const Scratch& s, float* partials) {
  switch (p.dtype) {
    case kFloat32: return finish_run_of<float>(p, run, s, partials);
    case kBFloat16: return finish_run_of<BFloat16>(p, run, s, partials);
    default: return finish_run_of<Float16>(p, run, s, partials);
  }
}

// One run of tokens, or one part of it: both passes over their context, block by block through
// their chunk's block table, each block's rows read as float32 (C: the cache's row type). A
// token's arithmetic is the same whatever run it is in (its scores padded further with -inf only
// add zeros), so its output is the same bits as alone.
template <typename C, int DIM>
void attend(const Problem& p, const Run& run, Scratch& s, float* partials) {
  const int64_t heads = p.heads;
  const int64_t dim = p.head_dim;
  const int64_t* table = p.block_tables + p.token_chunk[run.first] * p.table_width;
  const int64_t* seen = p.seen + run.first;
  int64_t longest = 0;  // the token with the most keys: it goes first, prefetching for all
  for (int64_t t = 1; t < run.count; ++t) longest = seen[t] > seen[longest] ? t : longest;
  const int64_t begin = run.begin;
  const int64_t keys = run.partial < 0 ? seen[longest] : std::min(run.end, seen[longest]);
  const int64_t padded = (keys - begin + 7) / 8 * 8;  // each head's scores, whole vectors
  const int64_t query_size = heads * dim;

  load_queries(p, run, s);
  s.scores.resize(run.count * heads * padded);
  s.acc.assign(run.count * query_size, 0.0f);
  s.inverse_sums.resize(run.count * heads);

  int64_t lowest = first_key(p, seen[0]);  // blocks wholly before it are no token's
  for (int64_t t = 1; t < run.count; ++t) lowest = std::min(lowest, first_key(p, seen[t]));
  const int64_t skip = std::max(begin, lowest / p.block_size * p.block_size);

  for (int pass = 0; pass < 2; ++pass) {  // 0: scores from keys; 1: values weighted by them
    const char* cache = static_cast<const char*>(pass == 0 ? p.key_cache : p.value_cache);
    const int64_t block_bytes = p.block_size * p.slot_bytes;
    for (int64_t start = skip; start < keys; start += p.block_size) {
      const int64_t block = start / p.block_size;
      const char* next =
          start + p.block_size < keys ? cache + table[block + 1] * block_bytes : nullptr;
      const char* first = cache + table[block] * block_bytes;
      const float* rows = slots_as_float<C>(first, std::min(p.block_size, keys - start),
                                            p.kv_heads, dim, s.block);
      for (int64_t i = 0; i < run.count; ++i) {
        const int64_t t = i == 0 ? longest : i <= longest ? i - 1 : i;
        if (seen[t] <= start) continue;
        const int64_t count = std::min(p.block_size, seen[t] - start);
        float* scores = s.scores.data() + t * heads * padded + (start - begin);
        const char* prefetch = i == 0 ? next : nullptr;
        if (pass == 0) {
          score_rows<DIM>(p, s.query.data() + t * query_size, rows, count, scores, padded,
                          prefetch);
        } else {
          accumulate_rows<DIM>(p, scores, padded, rows, count, s.acc.data() + t * query_size,
                               prefetch);
        }
      }
    }
    if (pass == 0) {
      for (int64_t t = 0; t < run.count; ++t) {
        const int64_t count = std::min(seen[t], keys) - begin;
        const int64_t hidden = std::max<int64_t>(first_key(p, seen[t]) - begin, 0);
        float* part = run.partial < 0 ? nullptr
                                      : partials + (run.partial + t) * partial_size(p);
        if (count > hidden) {
          shape_scores(p, s.scores.data() + t * heads * padded, padded, hidden, count);
          softmax_rows(s.scores.data() + t * heads * padded, heads, count, padded,
                       s.inverse_sums.data() + t * heads, part);
        } else {  // no key of this part is the token's: it adds nothing (merge_parts skips it)
          for (int64_t h = 0; h < heads; ++h) part[2 * h + 1] = 0.0f;
        }
      }
    }
  }
  finish_run(p, run, s, partials);
}

// The output of the tokens [first, first + count) of a run split into `parts` consecutive work
// items, from their partial results: each part's output and sum rescaled to the largest max.
template <typename T>
void merge_parts_of(const Problem& p, const Run* parts, int64_t num_parts,
                    const float* partials) {
  const int64_t heads = p.heads, dim = p.head_dim, query_size = heads * dim;
  const Run& whole = parts[0];
  for (int64_t t = 0; t < whole.count; ++t) {
    T* out = static_cast<T*>(p.out) + token_row(p, whole.first + t) * query_size;
    for (int64_t h = 0; h < heads; ++h) {
      float peak = -INFINITY;
      for (int64_t k = 0; k < num_parts; ++k) {
        const float* part = partials + (parts[k].partial + t) * partial_size(p);
        if (part[2 * h + 1] != 0.0f) peak = std::max(peak, part[2 * h]);
      }
      float total = 0.0f;
      float acc[kMaxHeadDim] = {};
      for (int64_t k = 0; k < num_parts; ++k) {
        const float* part = partials + (parts[k].partial + t) * partial_size(p);
        // A sum is 0 only for a part without the token's keys (else its max adds exp(0) = 1);
        // a NaN sum is kept, so that a NaN in the context still makes the output NaN.
        if (part[2 * h + 1] == 0.0f) continue;
        const float factor = std::exp(part[2 * h] - peak);
        total += part[2 * h + 1] * factor;
        const float* values = part + 2 * heads + h * dim;
        for (int64_t d = 0; d < dim; ++d) acc[d] += values[d] * factor;
      }
      const float inverse = 1.0f / total;
      for (int64_t d = 0; d < dim; ++d) store(out + h * dim + d, acc[d] * inverse);
    }
  }
}

inline void merge_parts(const Problem& p, const Run* parts, int64_t num_parts,
                        const float* partials) {
  switch (p.dtype) {
    case kFloat32: return merge_parts_of<float>(p, parts, num_parts, partials);
    case kBFloat16: return merge_parts_of<BFloat16>(p, parts, num_parts, partials);
    default: return merge_parts_of<Float16>(p, parts, num_parts, partials);
  }
}

struct Runs {
  const Problem* problem;
  const Run* runs;
  float* partials;
};

template <typename C>
void attend_item(const void* context, int64_t item) {
  const Runs& work = *static_cast<const Runs*>(context);
  const Problem& p = *work.problem;
  thread_local Scratch scratch;
  switch (p.head_dim) {  // the usual head sizes get register-blocked code
    case 64: return attend<C, 64>(p, work.runs[item], scratch, work.partials);
    case 128: return attend<C, 128>(p, work.runs[item], scratch, work.partials);
    default: return attend<C, 0>(p, work.runs[item], scratch, work.partials);
  }
}

// The piece's tokens as runs of one chunk each, of at most an even share of the tokens per
// thread (a lone speculative chunk still spreads over the threads: each thread then reads the
// context once), each run of more than kPartKeys keys split into parts (Run). Returns the
// partial results' size, in tokens.
int64_t split_runs(const Problem& p, int64_t num_tokens, int threads, std::vector<Run>& runs) {
  const int64_t most = std::max(threads, 1);
  const int64_t share = (num_tokens + most - 1) / most;
  thread_local std::vector<Run> whole;
  whole.clear();
  for (int64_t token = 0; token < num_tokens; ++token) {
    if (!whole.empty() && p.token_chunk[whole.back().first] == p.token_chunk[token] &&
        whole.back().count < share) {
      ++whole.back().count;
    } else {
      whole.push_back({token, 1});
    }
  }
  const int64_t part_keys = (kPartKeys + p.block_size - 1) / p.block_size * p.block_size;
  int64_t partial_tokens = 0;
  runs.clear();
  for (const Run& run : whole) {
    int64_t keys = 0;
    int64_t lowest = INT64_MAX;
    for (int64_t t = 0; t < run.count; ++t) {
      keys = std::max(keys, p.seen[run.first + t]);
      lowest = std::min(lowest, first_key(p, p.seen[run.first + t]));
    }
    if (keys <= part_keys) {
      runs.push_back(run);
      continue;
    }
    for (int64_t begin = lowest / part_keys * part_keys; begin < keys; begin += part_keys) {
      runs.push_back({run.first, run.count, begin, begin + part_keys, partial_tokens});
      partial_tokens += run.count;
    }
  }
  return partial_tokens;
}

}  // namespace

extern "C" {

// dtype: the query's and the output's (Dtype); cache_dtype: the cache's rows (kv_rows.h).
// Returns 0, -1 for an unknown dtype, -2 for a head size over kMaxHeadDim. Arguments are checked
// by the Python caller. `window` 0: no sliding window; `softcap` 0: no soft-capping.
int engine_paged_attention_variant(int dtype, int cache_dtype, const void* query,
                                   int64_t query_token_stride, const void* key_cache,
                                   const void* value_cache, const int64_t* block_tables,
                                   int64_t table_width, const int64_t* token_chunk,
                                   const int64_t* seen, const int64_t* rows, int64_t num_tokens,
                                   int64_t heads, int64_t kv_heads, int64_t head_dim,
                                   int64_t block_size, float scale, void* out, int num_threads,
                                   int64_t window, float softcap) {
  const int64_t slot_bytes = kv_heads * head_row_bytes(cache_dtype, head_dim);
  const Problem problem{dtype,       cache_dtype,  slot_bytes, query,      query_token_stride,
                        key_cache,   value_cache,  block_tables, table_width, token_chunk,
                        seen,        rows,         heads,      kv_heads,   head_dim,
                        block_size,  scale,        out,        window,     softcap};
  engine_cpu::Task task;
  if (dtype != kFloat32 && dtype != kBFloat16 && dtype != kFloat16) return -1;
  switch (cache_dtype) {
    case kCacheFloat32: task.run = attend_item<float>; break;
    case kCacheBFloat16: task.run = attend_item<BFloat16>; break;
    case kCacheFloat16: task.run = attend_item<Float16>; break;
    case kCacheInt8: task.run = attend_item<Int8Row>; break;
    default: return -1;
  }
  if (head_dim > kMaxHeadDim) return -2;
  // Read and written by the pool's helpers during this call only.
  thread_local std::vector<Run> runs;
  thread_local std::vector<float> partials;
  const int64_t partial_tokens = split_runs(problem, num_tokens, num_threads, runs);
  partials.resize(partial_tokens * partial_size(problem));
  const Runs work{&problem, runs.data(), partials.data()};
  task.context = &work;
  task.items = static_cast<int64_t>(runs.size());
  engine_cpu::run_parallel(task, num_threads);
  for (size_t i = 0; i < runs.size();) {  // the split runs' parts are consecutive
    size_t j = i + 1;
    if (runs[i].partial >= 0) {
      while (j < runs.size() && runs[j].partial >= 0 && runs[j].first == runs[i].first) ++j;
      merge_parts(problem, &runs[i], j - i, partials.data());
    }
    i = j;
  }
  return 0;
}

// Every key before the token, scores as they are (the decoder layers of engine/kernels/cpu/
// decode_step.cpp, and every family without a window or a cap).
int engine_paged_attention(int dtype, int cache_dtype, const void* query,
                           int64_t query_token_stride, const void* key_cache,
                           const void* value_cache, const int64_t* block_tables,
                           int64_t table_width, const int64_t* token_chunk, const int64_t* seen,
                           const int64_t* rows, int64_t num_tokens, int64_t heads,
                           int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                           void* out, int num_threads) {
  return engine_paged_attention_variant(dtype, cache_dtype, query, query_token_stride, key_cache,
                                        value_cache, block_tables, table_width, token_chunk,
                                        seen, rows, num_tokens, heads, kv_heads, head_dim,
                                        block_size, scale, out, num_threads, 0, 0.0f);
}

}  // extern "C"
