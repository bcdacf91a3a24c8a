// int8_gemm_amx.h's kernel on the AMX instructions; compiled with the AMX flags, called only where the
// ISA table says AMX is usable.
#include "amx_tiles_hardware.h"
#include "int8_gemm_amx.h"

namespace moe_onnx::detail {

void int8_gemm_quads_amx(const void* A, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0,
                         int64_t p1, int32_t* C, int64_t ldc) {
  int8_gemm_quads_tiles<amx::HardwareTiles>(A, lda, M, K, W_packed, p0, p1, C, ldc);
}

}  // namespace moe_onnx::detail
