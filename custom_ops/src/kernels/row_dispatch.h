// A micro-kernel's row count as a template argument: with_rows<kMax>(rows, f) calls
// f(std::integral_constant<int, rows>{}) for a run-time `rows` in [1, kMax], nothing for another count.
// The GEMMs that split C's rows into tiles of equal height (gemm_avx2.cc, gemm_avx512.cc, gemm_neon.cc,
// bf16_gemm_avx512bf16.cc) instantiate their micro-kernel once per height this way.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

namespace moe_onnx::detail {

template <class F, int... kRows>
inline void with_rows_of(int64_t rows, F& f, std::integer_sequence<int, kRows...>) {
  (void)((rows == kRows + 1 ? (f(std::integral_constant<int, kRows + 1>{}), true) : false) || ...);
}

template <int kMax, class F>
inline void with_rows(int64_t rows, F&& f) {
  with_rows_of(rows, f, std::make_integer_sequence<int, kMax>{});
}

}  // namespace moe_onnx::detail
