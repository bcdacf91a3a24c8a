// tile_dot.h's kernel on the model of the tile instructions (any CPU).
#include "amx_tiles_model.h"
#include "tile_dot.h"

namespace moe_onnx::amx {

void tile_dots_model(const TileDot* dots, int64_t count, int64_t first, int64_t step) {
  detail::tile_dots<ModelTiles>(dots, count, first, step);
}

}  // namespace moe_onnx::amx
