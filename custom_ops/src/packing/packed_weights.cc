#include "packed_weights.h"

#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#include "allocation.h"
#include "int8_gemm.h"
#include "isa.h"

namespace moe_onnx {
namespace {

// The panels' element type of a float format.
FloatType panel_type(WeightFormat format) {
  switch (format) {
    case WeightFormat::kF16: return FloatType::kF16;
    case WeightFormat::kBF16: return FloatType::kBF16;
    default: return FloatType::kF32;
  }
}

bool is_int8(WeightFormat format) {
  return format == WeightFormat::kInt8 || format == WeightFormat::kInt8Quads || format == WeightFormat::kInt8Octets;
}

}  // namespace

bool bf16_compute_available() { return static_cast<bool>(kernels().bf16_gemm); }

WeightFormat weight_format(ElemType weights, int64_t accuracy_level) {
  const bool floats = weights == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || weights == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ||
                      weights == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
  if (floats && accuracy_level == 3 && bf16_compute_available()) return WeightFormat::kBF16Pairs;
  switch (weights) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return WeightFormat::kF16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return WeightFormat::kBF16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8:
      switch (int8_layout()) {
        case Int8Layout::kQuads: return WeightFormat::kInt8Quads;
        case Int8Layout::kOctets: return WeightFormat::kInt8Octets;
        default: return WeightFormat::kInt8;
      }
    default: return WeightFormat::kF32;
  }
}

PackedWeights::PackedWeights(WeightFormat format, int64_t N, int64_t K, int64_t slots, bool with_bias,
                             FloatType source)
    : PackedWeights(format, QuantPanels{}, N, K, panel_slot_bytes(format, N, K), slots, with_bias, source) {}

PackedWeights::PackedWeights(const QuantPanels& layout, int64_t N, int64_t slots, bool with_bias)
    : PackedWeights(WeightFormat::kQuantized, layout, N, layout.K, panel_count(N) * layout.panel_bytes(), slots,
                    with_bias, FloatType::kF32) {}

PackedWeights::PackedWeights(WeightFormat format, const QuantPanels& layout, int64_t N, int64_t K, int64_t slot_bytes,
                             int64_t slots, bool with_bias, FloatType source)
    : format_(format), source_(source), quant_(layout), N_(N), K_(K), slot_bytes_(slot_bytes) {
  const auto bytes = static_cast<unsigned __int128>(slots) * static_cast<uint64_t>(slot_bytes_);
  try {
    if (bytes > SIZE_MAX) throw std::bad_alloc();
    size_t mapped = 0;
    char* panels = allocate_panels(static_cast<size_t>(bytes), &mapped);
    owned_ = std::unique_ptr<char, PanelsFree>(panels, PanelsFree{mapped});
    panels_ = owned_.get();
  } catch (const std::bad_alloc&) {
    throw AllocationFailure(static_cast<uint64_t>(slots), static_cast<size_t>(slot_bytes_), "packed weights");
  }
  if (with_bias) allocate(bias_, slots * panels() * kPanel, 0.0f, "packed biases");
}

std::string PackedWeights::layout() const {
  static const char* const kNames[] = {"f32",       "f16",        "bf16",       "int8_pairs",
                                       "int8_quads", "quantized", "bf16_pairs", "int8_octets"};
  std::string s = std::string("format:") + kNames[static_cast<int>(format_)] + ",N:" + std::to_string(N_) +
                  ",K:" + std::to_string(K_) + ",slot_bytes:" + std::to_string(slot_bytes_) +
                  ",bias:" + std::to_string(bias_bytes()) + ",source:" + std::to_string(static_cast<int>(source_));
  if (format_ == WeightFormat::kQuantized)
    s += ",code:" + std::to_string(static_cast<int>(quant_.code)) + ",block:" + std::to_string(quant_.block) +
         ",zero_points:" + std::to_string(quant_.zero_points) + ",int8_activations:" +
         std::to_string(quant_.int8_activations) + ",bf16_prefill:" + std::to_string(quant_.bf16_prefill);
  return s;
}

void PackedWeights::use_packed(const char* panels, const void* biases) {
  owned_.reset();
  panels_ = const_cast<char*>(panels);  // read only: pack is never called on them
  if (!bias_.empty()) std::memcpy(bias_.data(), biases, bias_.size() * sizeof(float));
}

void PackedWeights::pack(int64_t slot, std::initializer_list<ColumnSource> sources) {
  if (format_ == WeightFormat::kQuantized) throw std::logic_error("internal: quantized panels are packed by pack_quantized");
  place_panels(format_, source_, sources, N_, K_, panels_ + slot * slot_bytes_);
}

void PackedWeights::pack_quantized(int64_t slot, std::initializer_list<QuantizedColumns> sources) {
  place_quantized_panels(quant_, sources, panels(), reinterpret_cast<uint8_t*>(panels_ + slot * slot_bytes_));
}

void PackedWeights::multiply(int64_t slot, const float* A, int64_t lda, int64_t M, int64_t p0, int64_t p1, float* C,
                             int64_t ldc) const {
  if (format_ == WeightFormat::kQuantized) return quant_gemm_panels(quant_, A, lda, M, at(slot), p0, p1, C, ldc);
  if (is_int8(format_)) throw std::logic_error("internal: int8 panels multiply prepared int8 rows");
  if (format_ == WeightFormat::kBF16Pairs) throw std::logic_error("internal: bf16 pair panels multiply bf16 rows");
  gemm_panels(panel_type(format_), A, lda, M, K_, at(slot), p0, p1, C, ldc);
}

void PackedWeights::multiply(int64_t slot, const Int8Rows& rows, int64_t M, int64_t p0, int64_t p1, float* C,
                             int64_t ldc) const {
  if (!takes_int8_rows()) throw std::logic_error("internal: quantized rows multiply level-4 panels only");
  quant_gemm_int8_rows(quant_, rows, M, at(slot), p0, p1, C, ldc);
}

void PackedWeights::multiply(int64_t slot, const uint16_t* A, int64_t lda, int64_t M, int64_t p0, int64_t p1, float* C,
                             int64_t ldc) const {
  if (format_ != WeightFormat::kBF16Pairs) throw std::logic_error("internal: bf16 rows multiply bf16 pair panels only");
  bf16_gemm_panels(A, lda, M, K_, at(slot), p0, p1, C, ldc);
}

void PackedWeights::multiply(int64_t slot, const void* A, int64_t lda, int64_t M, int64_t p0, int64_t p1, int32_t* C,
                             int64_t ldc) const {
  if (!is_int8(format_)) throw std::logic_error("internal: prepared int8 rows multiply int8 panels only");
  int8_gemm_panels(A, lda, M, K_, at(slot), p0, p1, C, ldc);
}

void PackedWeights::pack_bias(int64_t slot, ElemType type, const ColumnSource& src) {
  float* dst = bias_.data() + slot * panels() * kPanel;
  const FloatType bias_type = float_type(type);
  for (int64_t c = 0; c < src.columns; ++c)
    dst[(c / src.width) * kPanel + src.lane0 + c % src.width] =
        load_float(bias_type, src.data, src.first + c * src.c_stride);
}

ExpertSlots ExpertSlots::all(int64_t experts) {
  ExpertSlots s;
  allocate(s.slot_of_expert, experts, int64_t{0}, "the expert slot table");
  for (int64_t e = 0; e < experts; ++e) s.slot_of_expert[e] = e;
  s.expert_of_slot = s.slot_of_expert;
  return s;
}

ExpertSlots ExpertSlots::with_rows(const int64_t* offsets, int64_t experts) {
  ExpertSlots s;
  allocate(s.slot_of_expert, experts, int64_t{-1}, "the expert slot table");
  for (int64_t e = 0; e < experts; ++e)
    if (offsets[e + 1] > offsets[e]) {
      s.slot_of_expert[e] = s.count();
      s.expert_of_slot.push_back(e);
    }
  return s;
}

}  // namespace moe_onnx
