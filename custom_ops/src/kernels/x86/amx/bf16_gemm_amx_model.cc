// bf16_gemm_amx.h's kernel on the model of the tile instructions (any CPU; MOE_ONNX_AMX=model).
#include "amx_tiles_model.h"
#include "bf16_gemm_amx.h"

namespace moe_onnx::detail {

void bf16_gemm_amx_model(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const void* B_packed, int64_t p0,
                         int64_t p1, float* C, int64_t ldc) {
  bf16_gemm_tiles<amx::ModelTiles>(A, lda, M, K, B_packed, p0, p1, C, ldc);
}

}  // namespace moe_onnx::detail
