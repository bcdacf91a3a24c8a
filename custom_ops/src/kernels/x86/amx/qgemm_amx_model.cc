// qgemm_amx.h's kernel on the model of the tile instructions (any CPU).
#include "amx_tiles_model.h"
#include "qgemm_amx.h"

namespace moe_onnx::detail {

void quant_dots_amx_model(const QuantTileSteps& steps, const QuantPanels& layout, const int8_t* qa, int64_t ldq,
                          const int32_t* qa_sums, const float* sa, int64_t M, const uint8_t* B, int64_t p0,
                          int64_t p1, float* C, int64_t ldc) {
  quant_dots_tiles<amx::ModelTiles>(steps, layout, qa, ldq, qa_sums, sa, M, B, p0, p1, C, ldc);
}

}  // namespace moe_onnx::detail
