// The AVX2 path's tiles (quant_tile_avx2.h), compiled apart from the other paths'.

#include "quant_tile_avx2.h"
#include "quant_tiles.h"

#if defined(__x86_64__)

namespace {

template <int F, int R>
struct Avx2Tile {
  static void run(int, const uint8_t* panel, int64_t k, const int8_t* const* q,
                  const BlockStats* const* stats, float* sums) {
    tile_avx2<F, R>(panel, k, q, stats, sums);
  }
};

}  // namespace

// Up to 4 rows x 2 halves of float accumulators, the integer sums of a row at a time.
const engine_quant::Tiles& engine_quant::avx2_tiles() {
  static const Tiles tiles = make_tiles<3, Avx2Tile>();
  return tiles;
}

#endif  // __x86_64__
