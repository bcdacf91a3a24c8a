// qgemm_amx.h's kernel on the AMX instructions; compiled with the AMX flags, called only where the ISA
// table says AMX is usable.
#include "amx_tiles_hardware.h"
#include "qgemm_amx.h"

namespace moe_onnx::detail {

void quant_dots_amx(const QuantTileSteps& steps, const QuantPanels& layout, const int8_t* qa, int64_t ldq,
                    const int32_t* qa_sums, const float* sa, int64_t M, const uint8_t* B, int64_t p0, int64_t p1,
                    float* C, int64_t ldc) {
  quant_dots_tiles<amx::HardwareTiles>(steps, layout, qa, ldq, qa_sums, sa, M, B, p0, p1, C, ldc);
}

}  // namespace moe_onnx::detail
