// moe_onnx_kernel_check: every kernel the ISA table runs in this process (MOE_ONNX_GEMM caps the
// level, as in the library) against the portable kernels, or against a scalar model of its contract,
// on the same inputs: bit for bit where the contract fixes the bits (the int8 sums, the fp32 chains in
// k order, the activations' operations, the float conversions, level 4's dots), within the stated
// bound otherwise (the bf16 GEMM of accuracy_level 3). Built beside the libraries from the same
// object libraries (custom_ops/CMakeLists.txt); custom_ops/arm64.sh runs it under qemu at each aarch64
// level. (The x86-64 kernels have the pytest suite's checks, tests/test_kernels.py and the others; this
// program's are aarch64's contract: x86's F16C, for one, quiets a signalling fp16 NaN as it widens it.)
// Exit status 0 when every check passes.
//
// Usage: moe_onnx_kernel_check [--expect key=value,...]
//   --expect  the kernel report must hold these values (e.g. level=dotprod,int8_gemm=dotprod): a run
//             that should have found an instruction set fails when it did not.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "activation.h"
#include "bf16_gemm.h"
#include "float_rows.h"
#include "gemm.h"
#include "int8_gemm.h"
#include "isa.h"
#include "packed_weights.h"
#include "qgemm.h"

namespace {

using namespace moe_onnx;

int failures = 0;

// Records one check's outcome: `what` names it, `detail` says where it failed.
void report(const std::string& what, int64_t cases, const std::string& detail) {
  if (detail.empty()) {
    std::printf("ok    %-34s %6lld cases\n", what.c_str(), static_cast<long long>(cases));
  } else {
    std::printf("FAIL  %-34s %s\n", what.c_str(), detail.c_str());
    ++failures;
  }
  std::fflush(stdout);
}

std::string hex(uint32_t b) {
  char s[16];
  std::snprintf(s, sizeof s, "0x%08x", b);
  return s;
}

// The first element where two float arrays differ in their bits, as a message ("" when equal). With
// any_nan, NaNs are equal whatever their sign and payload: which NaN an operation with several NaN
// operands returns differs between x86-64 and aarch64 (and, on x86, with the FMA form the compiler picks).
std::string first_difference(const float* got, const float* want, int64_t n, const std::string& where,
                             bool any_nan = false) {
  for (int64_t i = 0; i < n; ++i)
    if (float_bits(got[i]) != float_bits(want[i]) && !(any_nan && std::isnan(got[i]) && std::isnan(want[i]))) {
      std::ostringstream s;
      s << where << ": element " << i << " is " << got[i] << " (" << hex(float_bits(got[i])) << "), expected "
        << want[i] << " (" << hex(float_bits(want[i])) << ")";
      return s.str();
    }
  return "";
}

std::mt19937_64 rng(20260);

float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }

bool is_portable_level() { return std::string(isa_name(kernels().level)) == "portable"; }

// ---------------------------------------------------------------------------- fp32 GEMM

// The chain of one result element: fused multiply-adds in k order (the SIMD kernels, and the portable
// one on aarch64), or a multiply then an add (the portable kernel on x86-64).
float chain(const float* a, const float* b_column, int64_t K, int64_t b_stride, bool fused) {
  float acc = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    const float b = b_column[k * b_stride];
    if (fused) {
      acc = std::fma(a[k], b, acc);
    } else {
      volatile float product = a[k] * b;  // rounded on its own
      acc = product + acc;
    }
  }
  return acc;
}

bool portable_is_fused() {
#if defined(__aarch64__)
  return true;
#else
  return false;
#endif
}

void check_gemm() {
  const bool fused = !is_portable_level() || portable_is_fused();
  const FloatType types[] = {FloatType::kF32, FloatType::kF16, FloatType::kBF16};
  const WeightFormat formats[] = {WeightFormat::kF32, WeightFormat::kF16, WeightFormat::kBF16};
  const int64_t Ms[] = {1, 2, 3, 4, 5, 6, 7, 11, 13, 25};
  const int64_t Ks[] = {1, 3, 4, 7, 64, 259, 600};
  const int64_t Ns[] = {16, 37, 70, 128};
  for (int t = 0; t < 3; ++t) {
    int64_t cases = 0;
    std::string detail;
    for (int64_t K : Ks)
      for (int64_t N : Ns) {
        // W as the model reads it (fp32 values of the weights' type) and as packing reads it (their bits)
        std::vector<float> w(static_cast<size_t>(N * K));
        std::vector<uint16_t> w16(w.size());
        for (size_t i = 0; i < w.size(); ++i) {
          float x = uniform(-2.0f, 2.0f);
          if (types[t] == FloatType::kF16) w16[i] = float_to_half(x), x = half_to_float(w16[i]);
          if (types[t] == FloatType::kBF16) w16[i] = float_to_bf16(x), x = bf16_to_float(w16[i]);
          w[i] = x;
        }
        PackedWeights packed(formats[t], N, K, 1, false);
        packed.pack(0, {transposed_columns(types[t] == FloatType::kF32 ? static_cast<const void*>(w.data()) : w16.data(),
                                           0, N, K)});
        for (int64_t M : Ms) {
          const int64_t lda = K + 3, panels = panel_count(N);
          std::vector<float> A(static_cast<size_t>(M * lda));
          for (float& x : A) x = uniform(-2.0f, 2.0f);
          // every panel, then panels [1, panels) where there are several
          for (int64_t p0 : {int64_t{0}, int64_t{1}}) {
            if (p0 >= panels) continue;
            const int64_t ldc = 16 * (panels - p0) + 5;
            std::vector<float> C(static_cast<size_t>(M * ldc), -7.0f), want(C.size(), -7.0f), port(C.size(), -7.0f);
            packed.multiply(0, A.data(), lda, M, p0, panels, C.data(), ldc);
            detail::gemm_panels_portable(types[t], A.data(), lda, M, K, packed.at(0), p0, panels, port.data(), ldc);
            for (int64_t m = 0; m < M; ++m)
              for (int64_t c = 0; c < 16 * (panels - p0); ++c) {
                const int64_t n = 16 * p0 + c;
                want[m * ldc + c] = n < N ? chain(A.data() + m * lda, w.data() + n * K, K, 1, fused) : 0.0f;
              }
            std::ostringstream where;
            where << "M=" << M << " K=" << K << " N=" << N << " p0=" << p0;
            if (detail.empty()) detail = first_difference(C.data(), want.data(), C.size(), where.str() + " (model)");
            if (detail.empty() && fused == portable_is_fused())
              detail = first_difference(C.data(), port.data(), C.size(), where.str() + " (portable kernel)");
            ++cases;
          }
        }
      }
    const char* names[] = {"fp32", "fp16", "bf16"};
    report(std::string("gemm_panels ") + names[t] + " [" + kernels().gemm_panels.name + "]", cases, detail);
  }
}

// ---------------------------------------------------------------------------- float rows

void check_float_rows() {
  // widen: every 16-bit pattern
  std::vector<uint16_t> all(65536 + 3);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i * 40503u);  // a permutation, then 3 more
  for (FloatType type : {FloatType::kF16, FloatType::kBF16}) {
    std::vector<float> got(all.size()), want(all.size());
    widen_row(type, all.data(), got.data(), static_cast<int64_t>(all.size()));
    detail::widen_row_portable(type, all.data(), want.data(), static_cast<int64_t>(all.size()));
    report(std::string("widen_row ") + (type == FloatType::kF16 ? "fp16" : "bf16") + " [" + kernels().widen_row.name +
               "]",
           static_cast<int64_t>(all.size()),
           // an fp16 NaN widens to a NaN: F16C's conversion quiets a signalling one, as IEEE's does, where the
           // portable one keeps its bits (bf16 widening is a shift everywhere)
           first_difference(got.data(), want.data(), got.size(), "all patterns", type == FloatType::kF16));
  }
  // narrow: special values, values at the rounding boundaries, random bit patterns
  std::vector<float> values;
  for (uint32_t b : {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u,
                     0x7fbfffffu, 0x00000001u, 0x807fffffu, 0x477fe000u, 0x477ff000u, 0x477fefffu, 0x38800000u,
                     0x387fffffu, 0x33000000u, 0x33000001u, 0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x7f7fffffu})
    values.push_back(float_from_bits(b));
  for (int i = 0; i < 200000; ++i) values.push_back(float_from_bits(static_cast<uint32_t>(rng())));
  for (int i = 0; i < 20000; ++i) values.push_back(uniform(-70000.0f, 70000.0f));
  for (FloatType type : {FloatType::kF16, FloatType::kBF16}) {
    std::vector<uint16_t> got(values.size()), want(values.size());
    narrow_row(type, values.data(), got.data(), static_cast<int64_t>(values.size()));
    detail::narrow_row_portable(type, values.data(), want.data(), static_cast<int64_t>(values.size()));
    std::string detail;
    for (size_t i = 0; i < values.size() && detail.empty(); ++i)
      if (got[i] != want[i])
        detail = "input " + hex(float_bits(values[i])) + " gives " + hex(got[i]) + ", expected " + hex(want[i]);
    report(std::string("narrow_row ") + (type == FloatType::kF16 ? "fp16" : "bf16") + " [" + kernels().narrow_row.name +
               "]",
           static_cast<int64_t>(values.size()), detail);
  }
}

// ---------------------------------------------------------------------------- activations

// The SIMD kernels' algorithm (activation_avx2.cc, activation_avx512.cc, arm64/neon/activation_neon.cc)
// on one lane: the same operations in the same order.
float min_x86(float a, float b) { return a < b ? a : b; }
float max_x86(float a, float b) { return a > b ? a : b; }

float exp_model(float x) {
  const float hi = 88.7228394f, lo = -87.3365447f;
  const bool over = x > hi;
  float xc = max_x86(lo, min_x86(hi, x));
  float fx = std::floor(std::fma(xc, 1.44269504088896341f, 0.5f));
  xc = std::fma(-fx, 0.693359375f, xc);
  xc = std::fma(-fx, -2.12194440e-4f, xc);
  float y = 1.9875691500E-4f;
  y = std::fma(y, xc, 1.3981999507E-3f);
  y = std::fma(y, xc, 8.3334519073E-3f);
  y = std::fma(y, xc, 4.1665795894E-2f);
  y = std::fma(y, xc, 1.6666665459E-1f);
  y = std::fma(y, xc, 5.0000001201E-1f);
  const float x2 = xc * xc;
  y = std::fma(y, x2, xc + 1.0f);
  if (std::isnan(fx)) return y;  // y is NaN
  const int n = std::min(std::max(static_cast<int>(fx) + 127, 1), 254);
  y = y * float_from_bits(static_cast<uint32_t>(n) << 23);
  return over ? INFINITY : y;
}
float sigmoid_model(float z) { return 1.0f / (1.0f + exp_model(0.0f - z)); }
float normal_cdf_model(float z) {
  const float x = std::fabs(z) * detail::kInvSqrt2;
  const float t = 1.0f / std::fma(detail::kErfP, x, 1.0f);
  float poly = detail::kErfA[4];
  for (int i = 3; i >= 0; --i) poly = std::fma(poly, t, detail::kErfA[i]);
  const float e = exp_model(0.0f - x * x);
  const float tail = (0.5f * (poly * t)) * e;
  return z >= 0.0f ? 1.0f - tail : tail;
}
float pointwise_model(PointwiseActivation::Form form, float z) {
  using Form = PointwiseActivation::Form;
  switch (form) {
    case Form::kRelu: return max_x86(0.0f, z);
    case Form::kRelu2: {
      const float r = max_x86(0.0f, z);
      return r * r;
    }
    case Form::kGelu: return z * normal_cdf_model(z);
    case Form::kGeluTanh:
      return z * sigmoid_model(z * std::fma(detail::kGeluTanhC3, z * z, detail::kGeluTanhC1));
    case Form::kSilu: return z * sigmoid_model(z);
    case Form::kIdentity: return z;
  }
  return z;
}
float gated_model(const GatedActivation& act, float gate, float up) {
  if (act.form == GatedActivation::Form::kClampedSwiglu) {
    gate = min_x86(act.limit, gate);
    up = min_x86(act.limit, max_x86(-act.limit, up));
    return ((up + 1.0f) * gate) * sigmoid_model(act.alpha * gate);
  }
  return (gate * sigmoid_model(act.alpha * gate)) * up;
}

// Inputs that reach every branch: the clamps, exp's limits, signed zeros, NaN, infinities, denormals.
std::vector<float> activation_inputs(int64_t n) {
  std::vector<float> v = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 88.8f, 88.7f, -87.4f, -87.3f, -100.0f, 100.0f,
                          1e-40f, -1e-40f, 7.0f, -7.0f, 7.0001f, -7.0001f, 1.0f, -1.0f, 30.0f, -30.0f};
  while (static_cast<int64_t>(v.size()) < n) v.push_back(uniform(-12.0f, 12.0f));
  return v;
}

void check_activations() {
  const bool model = !is_portable_level();
  const int64_t rows = 3, panels = 5, ldc = 16 * panels + 4, ldd = 16 * panels + 8;
  const std::vector<float> C = activation_inputs(rows * ldc);
  std::vector<float> bias(16 * panels);
  for (float& b : bias) b = uniform(-1.0f, 1.0f);
  int64_t cases = 0;
  std::string detail;
  using Form = PointwiseActivation::Form;
  for (Form form : {Form::kRelu, Form::kRelu2, Form::kGelu, Form::kGeluTanh, Form::kSilu, Form::kIdentity})
    for (const float* b : {static_cast<const float*>(nullptr), static_cast<const float*>(bias.data())}) {
      PointwiseActivation act{form};
      std::vector<float> got(rows * ldd, -3.0f), want(got.size(), -3.0f), port(got.size(), -3.0f);
      act.apply(C.data(), ldc, b, rows, panels, got.data(), ldd);
      detail::pointwise_activation_portable(act, C.data(), ldc, b, rows, panels, port.data(), ldd);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < 16 * panels; ++c)
          want[r * ldd + c] = pointwise_model(form, b ? C[r * ldc + c] + b[c] : C[r * ldc + c]);
      const std::string where = "pointwise form " + std::to_string(static_cast<int>(form)) + (b ? " with bias" : "");
      if (detail.empty()) detail = first_difference(got.data(), (model ? want : port).data(), got.size(), where, true);
      if (detail.empty() && model)  // the SIMD algorithm against the portable one's libm: a few ulp
        for (size_t i = 0; i < got.size() && detail.empty(); ++i)
          if (!(std::fabs(got[i] - port[i]) <= 1e-5f * std::fabs(port[i]) + 1e-37f) &&
              !(std::isnan(got[i]) && std::isnan(port[i])) && got[i] != port[i])
            detail = where + ": element " + std::to_string(i) + " is " + std::to_string(got[i]) + ", the portable kernel " +
                     std::to_string(port[i]);
      ++cases;
    }
  report(std::string("pointwise_activation [") + kernels().pointwise_activation.name + "]", cases, detail);

  cases = 0;
  detail.clear();
  for (auto form : {GatedActivation::Form::kSwiglu, GatedActivation::Form::kClampedSwiglu})
    for (const float* b : {static_cast<const float*>(nullptr), static_cast<const float*>(bias.data())}) {
      GatedActivation act;
      act.form = form;
      act.alpha = form == GatedActivation::Form::kClampedSwiglu ? 1.702f : 1.0f;
      act.limit = 7.0f;
      std::vector<float> got(rows * ldd, -3.0f), want(got.size(), -3.0f), port(got.size(), -3.0f);
      act.apply(C.data(), ldc, b, rows, panels, got.data(), ldd);
      detail::gated_activation_portable(act, C.data(), ldc, b, rows, panels, port.data(), ldd);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t p = 0; p < panels; ++p)
          for (int64_t l = 0; l < 8; ++l) {
            const int64_t g = p * 16 + l, u = g + 8;
            want[r * ldd + p * 8 + l] = gated_model(act, b ? C[r * ldc + g] + b[g] : C[r * ldc + g],
                                                    b ? C[r * ldc + u] + b[u] : C[r * ldc + u]);
          }
      const std::string where = std::string(form == GatedActivation::Form::kSwiglu ? "swiglu" : "clamped swiglu") +
                                (b ? " with bias" : "");
      if (detail.empty()) detail = first_difference(got.data(), (model ? want : port).data(), got.size(), where, true);
      ++cases;
    }
  report(std::string("gated_activation [") + kernels().gated_activation.name + "]", cases, detail);
}

// ---------------------------------------------------------------------------- int8 GEMM

void check_int8_gemm() {
  const int64_t Ks[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 63, 130, 2049, 4100};
  const int64_t Ms[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17};
  int64_t cases = 0;
  std::string detail;
  for (int64_t K : Ks)
    for (int64_t N : {int64_t{16}, int64_t{37}, int64_t{50}}) {
      if (K > 1000 && N != 37) continue;
      std::vector<int8_t> W(static_cast<size_t>(N * K));
      for (auto& w : W) w = static_cast<int8_t>(rng());
      for (int64_t k = 0; k < K; ++k) W[k] = -128;  // column 0: every weight -128
      PackedWeights packed(weight_format(ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8), N, K, 1, false);
      packed.pack(0, {transposed_columns(W.data(), 0, N, K)});
      for (int64_t M : Ms) {
        if (K > 1000 && M > 9) continue;
        std::vector<int8_t> X(static_cast<size_t>(M * K));
        for (auto& x : X) x = static_cast<int8_t>(rng());
        for (int64_t k = 0; k < K; ++k) X[k] = -128;  // row 0 too: its sum with column 0 is 16384 K
        const int64_t lda = int8_row_bytes(K) + 8;
        std::vector<uint8_t> rows(static_cast<size_t>(M * lda));
        for (int64_t m = 0; m < M; ++m) prepare_int8_rows(X.data() + m * K, 1, K, rows.data() + m * lda);
        const int64_t panels = panel_count(N);
        for (int64_t p0 : {int64_t{0}, panels - 1}) {
          const int64_t ldc = 16 * (panels - p0) + 3;
          std::vector<int32_t> C(static_cast<size_t>(M * ldc), 77);
          packed.multiply(0, rows.data(), lda, M, p0, panels, C.data(), ldc);
          for (int64_t m = 0; m < M && detail.empty(); ++m)
            for (int64_t c = 0; c < 16 * (panels - p0) && detail.empty(); ++c) {
              const int64_t n = 16 * p0 + c;
              uint32_t want = 0;  // numpy's int32 sum: modulo 2^32
              for (int64_t k = 0; n < N && k < K; ++k)
                want += static_cast<uint32_t>(int32_t{X[m * K + k]} * int32_t{W[n * K + k]});
              if (static_cast<uint32_t>(C[m * ldc + c]) != want) {
                std::ostringstream s;
                s << "M=" << M << " K=" << K << " N=" << N << " p0=" << p0 << ": C[" << m << ", " << n << "] is "
                  << C[m * ldc + c] << ", expected " << static_cast<int32_t>(want);
                detail = s.str();
              }
            }
          ++cases;
        }
      }
    }
  report(std::string("int8_gemm [") + kernels().int8_gemm.name + ", " + int8_layout_name(int8_layout()) + "]", cases,
         detail);
}

// ---------------------------------------------------------------------------- bf16 GEMM (accuracy_level 3)

// acc + (a0 * b0 + a1 * b1) as Arm's BFDOT defines it (FPCR.EBF = 0): each product and sum rounded to
// odd, denormal inputs and results as zeros (the test data stay in the normal range, where this model
// is exact: products of bf16 are exact in fp32).
float round_to_odd_add(float a, float b) {
  const float s = a + b;
  const float bb = s - a;
  const float e = (a - (s - bb)) + (b - bb);  // a + b = s + e exactly (no overflow)
  if (e == 0.0f || std::isinf(s)) return s;
  const float truncated = (e > 0.0f) == (s > 0.0f) ? s : std::nextafter(s, 0.0f);
  return float_from_bits(float_bits(truncated) | 1u);
}
float bfdot_step(float acc, uint16_t a0, uint16_t a1, uint16_t b0, uint16_t b1) {
  const float sum = round_to_odd_add(bf16_to_float(a0) * bf16_to_float(b0), bf16_to_float(a1) * bf16_to_float(b1));
  return round_to_odd_add(acc, sum);
}

void check_bf16_gemm() {
  const KernelTable& t = kernels();
  if (!t.bf16_gemm) {
    report("bf16_gemm [none: level 3 runs level 0]", 0, "");
    return;
  }
  const std::string small = t.bf16_gemm.name, tiles = t.bf16_gemm_tiles.name;
  const bool arm = small == "bfdot";
  const int64_t Ms[] = {1, 2, 3, 4, 5, 6, 7, 9, 12, 13};
  const int64_t Ks[] = {1, 31, 32, 70, 300, 520};
  int64_t cases = 0;
  std::string detail;
  for (int64_t K : Ks)
    for (int64_t N : {int64_t{16}, int64_t{40}}) {
      std::vector<float> W(static_cast<size_t>(N * K));
      for (float& w : W) w = bf16_to_float(float_to_bf16(uniform(-3.0f, 3.0f)));
      PackedWeights packed(WeightFormat::kBF16Pairs, N, K, 1, false, FloatType::kF32);
      packed.pack(0, {transposed_columns(W.data(), 0, N, K)});
      const int64_t ldr = bf16_row_stride(K), panels = panel_count(N);
      for (int64_t M : Ms) {
        std::vector<float> X(static_cast<size_t>(M * K));
        for (float& x : X) x = uniform(-3.0f, 3.0f);
        std::vector<uint16_t> rows(static_cast<size_t>(M * ldr));
        for (int64_t m = 0; m < M; ++m) bf16_row(FloatType::kF32, X.data() + m * K, K, rows.data() + m * ldr);
        const int64_t ldc = 16 * panels;
        std::vector<float> C(static_cast<size_t>(M * ldc));
        packed.multiply(0, rows.data(), ldr, M, 0, panels, C.data(), ldc);
        for (int64_t m = 0; m < M && detail.empty(); ++m)
          for (int64_t n = 0; n < N && detail.empty(); ++n) {
            double exact = 0.0, magnitude = 0.0;
            float model = 0.0f;
            const uint16_t* a = rows.data() + m * ldr;
            for (int64_t k = 0; k < K; ++k) {
              const double term = double(bf16_to_float(a[k])) * W[n * K + k];
              exact += term;
              magnitude += std::fabs(term);
            }
            for (int64_t k = 0; arm && k < bf16_padded_k(K); k += 2) {
              auto w = [&](int64_t kk) { return kk < K ? float_to_bf16(W[n * K + kk]) : uint16_t{0}; };
              model = bfdot_step(model, a[k], a[k + 1], w(k), w(k + 1));
            }
            const float got = C[m * ldc + n];
            // fp32 summation with roundings of up to one ulp (round to odd): (K + 2) 2^-23 of the terms
            const double bound = (K + 2) * std::ldexp(1.0, -23) * magnitude;
            std::ostringstream s;
            s << "M=" << M << " K=" << K << " N=" << N << ": C[" << m << ", " << n << "] is " << got;
            if (!(std::fabs(got - exact) <= bound)) {
              s << ", beyond " << bound << " of the exact " << exact;
              detail = s.str();
            } else if (arm && float_bits(got) != float_bits(model)) {
              s << " (" << hex(float_bits(got)) << "), BFDOT's chain gives " << model << " ("
                << hex(float_bits(model)) << ")";
              detail = s.str();
            }
          }
        ++cases;
      }
    }
  report("bf16_gemm [" + small + " below " + std::to_string(kBf16TileRows) + " rows, " + tiles + "]", cases, detail);
}

// ---------------------------------------------------------------------------- QMOE's quantized GEMMs

struct QuantCase {
  QuantCode code;
  int64_t K, block;
  bool zero_points;

  // Its panels' layout, with fp32 (level 0) or int8 (level 4) activations.
  QuantPanels layout(bool int8_activations) const {
    QuantPanels out;
    out.code = code;
    out.K = K;
    out.block = block;
    out.zero_points = zero_points;
    out.int8_activations = int8_activations;
    return out;
  }
};

// Random codes, scales (E2M1: E8M0 codes) and zero points of N columns in QMOE's layout, packed for
// `layout`; value(n, k) is the code's value v(q) (q - zp, or E2M1's), scale(n, k) its block's scale.
struct QuantWeights {
  QuantPanels layout;
  std::vector<uint8_t> codes, zero_points, e8m0;
  std::vector<float> scales;
  PackedWeights packed;

  QuantWeights(const QuantPanels& q, int64_t N) : layout(q), packed(q, N, 1, false) {
    const int64_t K = q.K, blocks = q.blocks(), bits = q.bits();
    codes.resize(static_cast<size_t>((N * K * bits + 7) / 8));
    for (auto& c : codes) c = static_cast<uint8_t>(rng());
    scales.resize(static_cast<size_t>(N * blocks));
    e8m0.resize(scales.size());
    for (size_t i = 0; i < scales.size(); ++i) {
      e8m0[i] = static_cast<uint8_t>(120 + rng() % 7);
      scales[i] = q.code == QuantCode::kE2M1 ? std::ldexp(1.0f, e8m0[i] - 127) : uniform(0.001f, 0.05f);
    }
    zero_points.resize(static_cast<size_t>((N * blocks * bits + 7) / 8));
    for (auto& z : zero_points) z = static_cast<uint8_t>(rng());
    const bool mx = q.code == QuantCode::kE2M1;
    QuantizedColumns src{codes.data(), 0, K, mx ? static_cast<const void*>(e8m0.data()) : scales.data(),
                         mx ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, 0, blocks,
                         q.zero_points ? zero_points.data() : nullptr, 0, blocks, 1, N};
    packed.pack_quantized(0, {src});
  }
  static int element(const std::vector<uint8_t>& data, int64_t i, int bits) {
    return bits == 8 ? data[i] : (data[i / 2] >> (4 * (i % 2))) & 15;
  }
  float value(int64_t n, int64_t k) const {
    const int q = element(codes, n * layout.K + k, layout.bits());
    if (layout.code == QuantCode::kE2M1) return kE2M1Values[q];
    const int zp = layout.zero_points ? element(zero_points, n * layout.blocks() + k / layout.block, layout.bits())
                                      : layout.default_zero_point();
    return static_cast<float>(q - zp);
  }
  float scale(int64_t n, int64_t k) const { return scales[n * layout.blocks() + k / layout.block]; }
};

// Level 0: the fused kernels' arithmetic (up to kFusedRows rows where the table has one: per block a
// chain of FMAs with the code values, then an FMA with the scale), else the fp32 GEMM's on the weights
// dequantized (v(q) * scale, one rounding).
void check_quant_level0() {
  const QuantCase layouts[] = {{QuantCode::kInt4, 128, 32, false}, {QuantCode::kInt4, 192, 64, true},
                               {QuantCode::kInt8, 96, 16, true},   {QuantCode::kInt8, 256, 128, false},
                               {QuantCode::kInt8, 102, 102, true}, {QuantCode::kInt4, 100, 100, false},
                               {QuantCode::kE2M1, 128, 32, false}};
  const bool gemm_fused = !is_portable_level() || portable_is_fused();
  int64_t cases = 0;
  std::string detail;
  for (const QuantCase& q : layouts) {
    const QuantPanels layout = q.layout(false);
    const int64_t N = 40, panels = panel_count(N);
    QuantWeights weights(layout, N);
    for (int64_t M : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{4}, int64_t{5}, int64_t{9}}) {
      const int64_t lda = q.K + 5, ldc = 16 * panels;
      std::vector<float> A(static_cast<size_t>(M * lda));
      for (float& a : A) a = uniform(-2.0f, 2.0f);
      std::vector<float> C(static_cast<size_t>(M * ldc)), want(C.size(), 0.0f);
      quant_gemm_panels(layout, A.data(), lda, M, weights.packed.at(0), 0, panels, C.data(), ldc);
      const bool fused = M <= kFusedRows && kernels().quant_fused;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          const float* a = A.data() + m * lda;
          float acc = 0.0f;
          if (fused) {
            for (int64_t k0 = 0; k0 < q.K; k0 += q.block) {
              float dot = 0.0f;
              for (int64_t k = k0; k < k0 + q.block; ++k) dot = std::fma(a[k], weights.value(n, k), dot);
              acc = std::fma(weights.scale(n, k0), dot, acc);
            }
          } else {
            std::vector<float> w(static_cast<size_t>(q.K));
            for (int64_t k = 0; k < q.K; ++k) w[k] = weights.value(n, k) * weights.scale(n, k);
            acc = chain(a, w.data(), q.K, 1, gemm_fused);
          }
          want[m * ldc + n] = acc;
        }
      if (detail.empty())
        detail = first_difference(C.data(), want.data(), C.size(),
                                  "code " + std::to_string(static_cast<int>(q.code)) + " K=" + std::to_string(q.K) +
                                      " block=" + std::to_string(q.block) + " M=" + std::to_string(M) +
                                      (fused ? " (fused)" : " (decoded)"));
      ++cases;
    }
  }
  report(std::string("quant level 0 [") + kernels().quant_fused.name + ", " + kernels().quant_decode.name + "]", cases,
         detail);
}

void check_quant_level4() {
  const QuantCase layouts[] = {{QuantCode::kInt4, 128, 32, false}, {QuantCode::kInt4, 192, 64, true},
                               {QuantCode::kInt8, 96, 16, true},   {QuantCode::kInt8, 256, 128, false},
                               {QuantCode::kInt8, 102, 102, true}, {QuantCode::kInt4, 100, 100, false}};
  int64_t cases = 0;
  std::string detail;
  for (const QuantCase& q : layouts) {
    const QuantPanels layout = q.layout(true);
    const int64_t N = 40, panels = panel_count(N), blocks = layout.blocks(), ldq = layout.activation_row_bytes();
    QuantWeights weights(layout, N);
    for (int64_t M : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{4}, int64_t{5}, int64_t{9}}) {
      const int64_t lda = q.K + 5;
      std::vector<float> A(static_cast<size_t>(M * lda));
      for (float& a : A) a = uniform(-4.0f, 4.0f);
      A[1] = 0.5f * 4.0f / 127.0f * 3;  // a value at a half: the rounding's ties
      std::vector<int8_t> qa(static_cast<size_t>(M * ldq)), qa_port(qa.size());
      std::vector<float> sa(static_cast<size_t>(M * blocks)), sa_port(sa.size());
      std::vector<int32_t> sums(sa.size()), sums_port(sa.size());
      const Int8Rows rows{qa.data(), ldq, sa.data(), sums.data(), blocks};
      quantize_int8_rows(layout, A.data(), lda, M, rows);
      detail::quant_activations_portable(layout, A.data(), lda, M, qa_port.data(), ldq, sa_port.data(), sums_port.data());
      if (detail.empty() && (qa != qa_port || sums != sums_port ||
                             std::memcmp(sa.data(), sa_port.data(), sa.size() * sizeof(float)) != 0))
        detail = "quant_activations differ from the portable kernel's (M=" + std::to_string(M) + ")";
      const int64_t ldc = 16 * panels;
      std::vector<float> C(static_cast<size_t>(M * ldc)), want(C.size());
      const auto* B = static_cast<const uint8_t*>(weights.packed.at(0));
      quant_gemm_int8_rows(layout, rows, M, B, 0, panels, C.data(), ldc);
      detail::quant_dots_portable(layout, qa_port.data(), ldq, sums_port.data(), sa_port.data(), M, B, 0, panels,
                                  want.data(), ldc);
      if (detail.empty())
        detail = first_difference(C.data(), want.data(), C.size(),
                                  "code " + std::to_string(static_cast<int>(q.code)) + " K=" + std::to_string(q.K) +
                                      " block=" + std::to_string(q.block) + " M=" + std::to_string(M));
      ++cases;
    }
  }
  report(std::string("quant level 4 [") + kernels().quant_activations.name + ", " + kernels().quant_dots.name + "]",
         cases, detail);
}

// ---------------------------------------------------------------------------- --expect

std::string expect_report(const std::string& expected) {
  const std::string report = ";" + kernels().report() + ";";
  std::stringstream items(expected);
  std::string item, missing;
  while (std::getline(items, item, ','))
    if (!item.empty() && report.find(";" + item + ";") == std::string::npos) missing += (missing.empty() ? "" : ", ") + item;
  return missing.empty() ? "" : "the kernel report lacks " + missing;
}

}  // namespace

int main(int argc, char** argv) {
  std::string expected;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--expect" && i + 1 < argc) {
      expected = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--expect key=value,...]\n", argv[0]);
      return 2;
    }
  }
  try {
    std::printf("report %s\n", kernels().report().c_str());
  } catch (const std::exception& e) {
    std::printf("FAIL  the ISA table: %s\n", e.what());
    return 1;
  }
  if (!expected.empty()) report("kernel report " + expected, 1, expect_report(expected));
  const std::pair<const char*, std::function<void()>> checks[] = {
      {"gemm", check_gemm},           {"float rows", check_float_rows}, {"activations", check_activations},
      {"int8", check_int8_gemm},      {"bf16", check_bf16_gemm},        {"quant level 0", check_quant_level0},
      {"quant level 4", check_quant_level4}};
  for (const auto& [name, check] : checks) {
    try {
      check();
    } catch (const std::exception& e) {
      report(name, 0, std::string("threw: ") + e.what());
    }
  }
  std::printf("%s at level %s\n", failures ? "FAILED" : "all checks passed", isa_name(kernels().level));
  return failures ? 1 : 0;
}
