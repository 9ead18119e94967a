// The quantized matmul's tiles, as the paths' sources (quant_avx2.cpp, quant_vnni.cpp: compiled
// apart, so that a build runs them on several cores) hand them to quantized_linear.cpp: for
// every format and tile size, the function that runs rows [0, R) of a tile against one panel.

#pragma once

#include <cstdint>

#include "quant_activations.h"
#include "quant_formats.h"

namespace engine_quant {

constexpr int kTileSizes = 5;  // tiles of 1, 2, 4, 8 and 16 rows at most
constexpr int kMaxRows = 1 << (kTileSizes - 1);

// Rows [0, R) of a tile against one panel of a part in `format`: sums [R][16], before the bias.
// (The vector paths' tiles are compiled for their format; the scalar one reads it.)
using Tile = void (*)(int format, const uint8_t* panel, int64_t k, const int8_t* const* q,
                      const BlockStats* const* stats, float* sums);

// The tiles of one path for every format and size: kinds[format][log2 of its rows].
struct Tiles {
  int sizes;  // the path has tiles of 1, 2, ... 2^(sizes - 1) rows
  Tile kinds[kLastFormat + 1][kTileSizes];
};

template <int F, int Log, template <int, int> class K>
void fill_sizes(Tiles& tiles) {
  tiles.kinds[F][Log] = K<F, 1 << Log>::run;
  if constexpr (Log > 0) fill_sizes<F, Log - 1, K>(tiles);
}

template <int F, int Sizes, template <int, int> class K>
void fill_formats(Tiles& tiles) {
  fill_sizes<F, Sizes - 1, K>(tiles);
  if constexpr (F < kLastFormat) fill_formats<F + 1, Sizes, K>(tiles);
}

// Every format's tiles of 1 .. 2^(Sizes - 1) rows, K<F, R>::run each.
template <int Sizes, template <int, int> class K>
Tiles make_tiles() {
  Tiles tiles{Sizes, {}};
  fill_formats<kFirstFormat, Sizes, K>(tiles);
  return tiles;
}

#if defined(__x86_64__)
const Tiles& avx2_tiles();  // quant_avx2.cpp
const Tiles& vnni_tiles();  // quant_vnni.cpp
#endif

}  // namespace engine_quant
