// The packed formats of quantized weights, as engine/quantization/layout.py states the contract:
// each GGUF block type at its own width (never widened), and the two formats of weights quantized
// at load (codes with a float32 scale and minimum). What every kernel path shares: the format's
// sizes, where a block's codes and scales lie, and the scalar reading of one code or one value
// (the reference the vector paths must equal).
//
// A weight [rows, k] is cut into panels of 16 rows and each panel's row into chunks of up to 8
// blocks of 32 values (256, a K-quant's super-block). A chunk is
//
//   header (64 bytes, K-quants and IQ4_XS: 16 float16 d, then 16 float16 dmin or padding)
//   | codes of its blocks | high-bit planes of its blocks | scales of its blocks | padding to 64
//
// Every block reads as u, an unsigned code per value, and an integer offset: the block's value
// is s * (u - offset) + mn with s and mn per 32 values (Q6_K: an s per 16, no mn). A group of 4
// consecutive values of one row is what a VNNI dot product sums; a block's 8 groups split into
// the first half (groups 0-3, values 0-15) and the second (4-7).

#pragma once

#include <cstdint>
#include <cstring>

namespace {

enum Format : int {
  kU4 = 1,  // 4-bit codes, float32 scale and minimum (a float weight quantized at load)
  kU8 = 2,  // 8-bit codes, float32 scale and minimum
  kQ4_0 = 3,
  kQ4_1 = 4,
  kQ5_0 = 5,
  kQ5_1 = 6,
  kQ8_0 = 7,
  kIQ4_NL = 8,
  kQ4_K = 9,
  kQ5_K = 10,
  kQ6_K = 11,
  kIQ4_XS = 12,
};
constexpr int kFirstFormat = kU4, kLastFormat = kIQ4_XS;

constexpr int64_t kBlock = 32;        // values per block (layout.BLOCK)
constexpr int64_t kPanel = 16;        // rows per panel (layout.PANEL)
constexpr int64_t kGroup = 4;         // consecutive values of a row per group (layout.GROUP)
constexpr int64_t kChunkBlocks = 8;   // blocks per chunk (layout.CHUNK_BLOCKS)
constexpr int64_t kAlign = 64;

// How a block's codes are stored.
enum Codes : int {
  kNibbles,     // 256 bytes: group g's codes in the low nibbles, group g + 4's in the high ones
  kBytes,       // 512 bytes: one byte per code, group by group
};

// How the float part of a block is done (quantized_linear.cpp's comment has the formulas).
enum Epilogue : int {
  kSymmetric,   // one scale per 32 values, no minimum
  kWithMinimum, // a scale and a minimum per 32 values
  kHalves,      // a scale per 16 values (Q6_K), no minimum
};

struct Traits {
  Codes codes;
  int high_bits;      // code bits above the low nibble, in their own planes (Q5: 1, Q6_K: 2)
  bool lookup;        // the nibble indexes kIq4Values (IQ4_NL, IQ4_XS)
  int offset;         // subtracted from every code
  Epilogue epilogue;
  int64_t header;     // bytes per chunk before its codes
  int64_t scale_bytes;  // per block
  bool whole_chunks;  // K-quants: k must be a multiple of 256
};

constexpr Traits traits(int format) {
  switch (format) {
    case kU4: return {kNibbles, 0, false, 0, kWithMinimum, 0, 128, false};
    case kU8: return {kBytes, 0, false, 0, kWithMinimum, 0, 128, false};
    case kQ4_0: return {kNibbles, 0, false, 8, kSymmetric, 0, 32, false};
    case kQ4_1: return {kNibbles, 0, false, 0, kWithMinimum, 0, 64, false};
    case kQ5_0: return {kNibbles, 1, false, 16, kSymmetric, 0, 32, false};
    case kQ5_1: return {kNibbles, 1, false, 0, kWithMinimum, 0, 64, false};
    case kQ8_0: return {kBytes, 0, false, 128, kSymmetric, 0, 32, false};
    case kIQ4_NL: return {kNibbles, 0, true, 128, kSymmetric, 0, 32, false};
    case kQ4_K: return {kNibbles, 0, false, 0, kWithMinimum, 64, 32, true};
    case kQ5_K: return {kNibbles, 1, false, 0, kWithMinimum, 64, 32, true};
    case kQ6_K: return {kNibbles, 2, false, 32, kHalves, 64, 32, true};
    default: return {kNibbles, 0, true, 128, kSymmetric, 64, 16, true};  // kIQ4_XS
  }
}

// IQ4_NL's 16 levels (ggml's kvalues_iq4nl), plus 128: unsigned codes with offset 128.
constexpr uint8_t kIq4Codes[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                   129, 141, 153, 166, 181, 197, 217, 241};

constexpr int64_t code_bytes(const Traits& t) { return t.codes == kBytes ? 512 : 256; }
constexpr int64_t high_bytes(const Traits& t) { return t.high_bits * 64; }

// Where the parts of a chunk of `blocks` blocks lie, from the chunk's first byte.
struct ChunkLayout {
  int64_t codes, high, scales, bytes;
};
constexpr ChunkLayout chunk_layout(const Traits& t, int64_t blocks) {
  const int64_t codes = t.header;
  const int64_t high = codes + blocks * code_bytes(t);
  const int64_t scales = high + blocks * high_bytes(t);
  const int64_t end = scales + blocks * t.scale_bytes;
  return {codes, high, scales, (end + kAlign - 1) / kAlign * kAlign};
}

// Bytes of one panel of a row of k values (k a multiple of 32; 256 where whole_chunks).
constexpr int64_t panel_bytes(const Traits& t, int64_t k) {
  const int64_t blocks = k / kBlock;
  const int64_t full = blocks / kChunkBlocks, rest = blocks % kChunkBlocks;
  return full * chunk_layout(t, kChunkBlocks).bytes + (rest ? chunk_layout(t, rest).bytes : 0);
}

inline float half_to_float(const uint8_t* p) {
  _Float16 h;
  std::memcpy(&h, p, sizeof h);
  return static_cast<float>(h);
}

// The scalar reading of one block: a row's code u for value t (0-31), and its scales.
struct BlockView {
  const Traits* t;
  const uint8_t* header;  // the chunk's, or null
  const uint8_t* codes;
  const uint8_t* high;
  const uint8_t* scales;
};

inline BlockView block_view(const Traits& t, const uint8_t* chunk, int64_t blocks, int64_t b) {
  const ChunkLayout l = chunk_layout(t, blocks);
  return {&t, t.header ? chunk : nullptr, chunk + l.codes + b * code_bytes(t),
          chunk + l.high + b * high_bytes(t), chunk + l.scales + b * t.scale_bytes};
}

inline int code_at(const BlockView& v, int64_t i, int64_t t) {
  const int64_t group = t / kGroup, within = t % kGroup;
  if (v.t->codes == kBytes) return v.codes[(group * kPanel + i) * kGroup + within];
  const uint8_t both = v.codes[((group % 4) * kPanel + i) * kGroup + within];
  int code = group < 4 ? both & 0x0F : both >> 4;
  if (v.t->lookup) return kIq4Codes[code];
  const int64_t lane = i * kGroup + within;
  if (v.t->high_bits == 1) code |= ((v.high[lane] >> group) & 1) << 4;
  if (v.t->high_bits == 2) code |= ((v.high[64 * (group / 4) + lane] >> (2 * (group % 4))) & 3) << 4;
  return code;
}

// Row i's scales: s (the first half's, for kHalves), s2 (the second half's) or mn.
struct RowScales {
  float s, second;
};

inline float header_half(const BlockView& v, int64_t i, int which) {
  return half_to_float(v.header + 32 * which + 2 * i);
}

// The products are float32 ones, as gguf.quants forms them (d * scale, dmin * min).
inline RowScales row_scales(int format, const BlockView& v, int64_t i) {
  const uint8_t* s = v.scales;
  switch (format) {
    case kU4:
    case kU8: {
      float pair[2];
      std::memcpy(&pair[0], s + 4 * i, 4);
      std::memcpy(&pair[1], s + 64 + 4 * i, 4);
      return {pair[0], pair[1]};
    }
    case kQ4_1:
    case kQ5_1: return {half_to_float(s + 2 * i), half_to_float(s + 32 + 2 * i)};
    case kQ4_K:
    case kQ5_K: {
      const float scale = header_half(v, i, 0) * static_cast<float>(s[i]);
      return {scale, -(header_half(v, i, 1) * static_cast<float>(s[16 + i]))};
    }
    case kQ6_K: {
      const float d = header_half(v, i, 0);
      return {d * static_cast<float>(static_cast<int8_t>(s[i])),
              d * static_cast<float>(static_cast<int8_t>(s[16 + i]))};
    }
    case kIQ4_XS:
      return {header_half(v, i, 0) * static_cast<float>(static_cast<int8_t>(s[i])), 0.0f};
    default: return {half_to_float(s + 2 * i), 0.0f};  // Q4_0, Q5_0, Q8_0, IQ4_NL: d
  }
}

// Value t of row i of the block, as gguf.quants.dequantize computes it (the same float
// operations in the same order: the embedding lookup gives its bits).
inline float value_at(int format, const BlockView& v, int64_t i, int64_t t) {
  const int u = code_at(v, i, t);
  const RowScales r = row_scales(format, v, i);
  switch (format) {
    case kU4:
    case kU8:
    case kQ4_1:
    case kQ5_1:
    case kQ4_K:
    case kQ5_K: {
      volatile float scaled = static_cast<float>(u) * r.s;  // rounded: never one fma
      return scaled + r.second;
    }
    case kQ6_K: return static_cast<float>(u - 32) * (t < 16 ? r.s : r.second);
    case kQ4_0:
    case kQ5_0: return static_cast<float>(u - v.t->offset) * r.s;
    default: return r.s * static_cast<float>(u - 128);  // Q8_0, IQ4_NL, IQ4_XS
  }
}

}  // namespace
