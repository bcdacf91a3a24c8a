// widen_row with AVX2 + F16C (float_rows_simd.h on 8 lanes); this file alone is compiled with -mavx2 -mfma
// -mf16c and is only called after a run-time check of the CPU.
#include "x86/avx2/simd_avx2.h"
#include "float_rows_simd.h"

namespace moe_onnx {
namespace detail {

void widen_row_avx2(FloatType type, const void* src, float* dst, int64_t n) { widen_row_simd<Avx2>(type, src, dst, n); }

}  // namespace detail
}  // namespace moe_onnx
