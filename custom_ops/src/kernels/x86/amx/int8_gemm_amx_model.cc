// int8_gemm_amx.h's kernel on the model of the tile instructions (any CPU).
#include "amx_tiles_model.h"
#include "int8_gemm_amx.h"

namespace moe_onnx::detail {

void int8_gemm_quads_amx_model(const void* A, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0,
                               int64_t p1, int32_t* C, int64_t ldc) {
  int8_gemm_quads_tiles<amx::ModelTiles>(A, lda, M, K, W_packed, p0, p1, C, ldc);
}

}  // namespace moe_onnx::detail
