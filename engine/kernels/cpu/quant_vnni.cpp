// The AVX512-VNNI path's tiles (quant_tile_avx512.h), compiled apart from the other paths'.

#include "quant_tile_avx512.h"
#include "quant_tiles.h"

#if defined(__x86_64__)

namespace {

template <int F, int R>
struct VnniTile {
  static void run(int, const uint8_t* panel, int64_t k, const int8_t* const* q,
                  const BlockStats* const* stats, float* sums) {
    tile_vnni<F, R>(panel, k, q, stats, sums);
  }
};

}  // namespace

// Up to 16 rows: a block's 8 decoded groups serve every row of the tile, so that a decode step
// of 16 sequences decodes each weight block once (its rows' accumulators, in a loop, may live in
// L1). Each size is compiled for each format: only powers of two, to bound the build's time;
// other row counts take several tiles (7 = 4 + 2 + 1).
const engine_quant::Tiles& engine_quant::vnni_tiles() {
  static const Tiles tiles = make_tiles<kTileSizes, VnniTile>();
  return tiles;
}

#endif  // __x86_64__
