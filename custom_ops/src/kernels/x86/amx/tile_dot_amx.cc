// tile_dot.h's kernel on the AMX instructions; compiled with the AMX flags, called only where the ISA
// table says AMX is usable.
#include "amx_tiles_hardware.h"
#include "tile_dot.h"

namespace moe_onnx::amx {

void tile_dots_hardware(const TileDot* dots, int64_t count, int64_t first, int64_t step) {
  detail::tile_dots<HardwareTiles>(dots, count, first, step);
}

}  // namespace moe_onnx::amx
