// The packed expert weights the ops multiply with: one matrix per expert slot in a weight format
// (panel_layout.h says where each element lands), its panels' memory (panel_memory.h), and
// PackedWeights::multiply, the ops' one entry to the GEMM kernels (gemm.h, int8_gemm.h, qgemm.h,
// bf16_gemm.h); which experts have slots (ExpertSlots, PackedExperts); the format a node's weights take,
// and the row stride of the activation rows the GEMMs read. The ops only name the columns of their
// weight tensors (ColumnSource; QMOE's quantized ones: QuantizedColumns). The expert cache of
// initializer weights: constant_experts.h.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "bf16_gemm.h"
#include "gemm.h"
#include "panel_layout.h"
#include "panel_memory.h"
#include "qgemm.h"
#include "tensor.h"
#include "workspace.h"

namespace moe_onnx {

// The format that holds weights of this element type (float32, float16, bfloat16 or int8; int8:
// the layout of the int8 GEMM in use, int8_layout()) for a node's accuracy_level: 3 (float types)
// takes kBF16Pairs where the ISA table has a bf16 GEMM (isa.h), else the exact format of level 0.
WeightFormat weight_format(ElemType weights, int64_t accuracy_level = 0);
// Whether accuracy_level 3 runs the bf16 GEMM here (else level 0's kernels, exact).
bool bf16_compute_available();

// Row stride, in fp32 elements, of activation rows of n elements laid out for the GEMM: n rounded
// up to 16 (64-byte rows), plus 16 when that is a multiple of 256 (1 KB), so the rows of a
// micro-kernel tile do not crowd the same L1 sets.
inline int64_t gemm_row_stride(int64_t n) {
  const int64_t ld = (n + 15) / 16 * 16;
  return ld % 256 == 0 ? ld + 16 : ld;
}
// Whether a caller's fp32 rows of n elements (MoeRowParallelLinear's X) are read in place rather
// than copied at gemm_row_stride: only a stride that is a multiple of 4 KB (every row of a tile in
// the same L1 set) is worth the copy.
inline bool gemm_rows_in_place(int64_t n) { return n % 1024 != 0; }

// One weight matrix B [K, N] per packed expert (a slot), in one format, in a huge-page buffer whose
// pages are first touched by pack (a slot never packed costs no memory); optionally an fp32 bias per
// slot in the panels' column order (natural lanes).
class PackedWeights {
 public:
  // `source`: the element type of the weights pack() reads, for kBF16Pairs (the other float formats
  // read their own type).
  PackedWeights(WeightFormat format, int64_t N, int64_t K, int64_t slots, bool with_bias,
                FloatType source = FloatType::kF32);
  // Quantized panels of this layout (format kQuantized; K is the layout's).
  PackedWeights(const QuantPanels& layout, int64_t N, int64_t slots, bool with_bias);

  WeightFormat format() const { return format_; }
  int64_t N() const { return N_; }
  int64_t K() const { return K_; }
  int64_t panels() const { return panel_count(N_); }
  // Bytes of one slot's panels.
  int64_t slot_bytes() const { return slot_bytes_; }
  // The slot's panels (elements of the format: float, uint16_t bits, int16_t pairs, int8 quads).
  const void* at(int64_t slot) const { return panels_ + slot * slot_bytes_; }
  // The slot's bias (panels() * 16 floats), or null without one.
  const float* bias_at(int64_t slot) const { return bias_.empty() ? nullptr : bias_.data() + slot * panels() * kPanel; }
  // Bytes of every slot's biases (0 without them).
  int64_t bias_bytes() const { return static_cast<int64_t>(bias_.size() * sizeof(float)); }
  // The layout of the panels, as one line of `key:value` items (packed_file.h compares it): the
  // format, its sizes and everything else that decides where each weight lands.
  std::string layout() const;

  // Reads the slots' panels from `panels` (every slot, laid out as pack writes them, read-only memory
  // that outlives this object: a packed-weights file's mapping) instead of packing them; the biases
  // are copied from `biases` (bias_bytes() of them).
  void use_packed(const char* panels, const void* biases);

  // Writes the slot's panels from the columns of `sources` (MOE's gate/up panels: the gate and the up
  // columns), panel by panel, each panel whole: lanes no source fills and padding rows are zero.
  void pack(int64_t slot, std::initializer_list<ColumnSource> sources);
  // Writes a bias (`type` float32/float16/bfloat16; k_stride unused) into the slot's bias, as fp32
  // (a matrix made with_bias).
  void pack_bias(int64_t slot, ElemType type, const ColumnSource& src);
  // As pack, from quantized columns (format kQuantized).
  void pack_quantized(int64_t slot, std::initializer_list<QuantizedColumns> sources);

  // C[m, 16 * (p - p0) + c] = (A @ B)[m, 16 p + c] for m < M, p in [p0, p1), C's row stride ldc.
  // Float and quantized formats: A fp32 rows of stride lda, C fp32 (gemm.h; qgemm.h).
  void multiply(int64_t slot, const float* A, int64_t lda, int64_t M, int64_t p0, int64_t p1, float* C,
                int64_t ldc) const;
  // int8 formats: A rows prepared by prepare_int8_rows, lda bytes apart; C int32, wrapping (int8_gemm.h).
  void multiply(int64_t slot, const void* A, int64_t lda, int64_t M, int64_t p0, int64_t p1, int32_t* C,
                int64_t ldc) const;
  // kBF16Pairs: A bf16 rows as bf16_row writes them, lda elements apart (bf16_row_stride(K)); C fp32
  // (bf16_gemm.h).
  void multiply(int64_t slot, const uint16_t* A, int64_t lda, int64_t M, int64_t p0, int64_t p1, float* C,
                int64_t ldc) const;
  // Whether multiply takes bf16 rows (kBF16Pairs) rather than fp32 ones.
  bool takes_bf16_rows() const { return format_ == WeightFormat::kBF16Pairs; }
  // Quantized panels of accuracy level 4 (qgemm.h): multiply takes rows quantized once by
  // quantize_rows, which every panel task of them reads.
  bool takes_int8_rows() const { return format_ == WeightFormat::kQuantized && quant_.int8_activations; }
  // Level 4: room for `rows` quantized rows, taken from `ws`.
  Int8Rows int8_rows(int64_t rows, Workspace& ws) const {
    const int64_t ldq = quant_.activation_row_bytes(), blocks = quant_.blocks();
    return {ws.take<int8_t>(rows * ldq, "the int8 activation rows"), ldq,
            ws.take<float>(rows * blocks, "the int8 activations' scales"),
            ws.take<int32_t>(rows * blocks, "the int8 activations' sums"), blocks};
  }
  // Level 4: fp32 rows m < M of A (stride lda, K valid elements) quantized into `rows`.
  void quantize_rows(const float* A, int64_t lda, int64_t M, const Int8Rows& rows) const {
    quantize_int8_rows(quant_, A, lda, M, rows);
  }
  // Level 4: C as multiply's, from M rows quantized by quantize_rows.
  void multiply(int64_t slot, const Int8Rows& rows, int64_t M, int64_t p0, int64_t p1, float* C, int64_t ldc) const;

 private:
  PackedWeights(WeightFormat format, const QuantPanels& layout, int64_t N, int64_t K, int64_t slot_bytes, int64_t slots,
                bool with_bias, FloatType source);
  WeightFormat format_;
  FloatType source_;   // kBF16Pairs: the weights' element type
  QuantPanels quant_;  // kQuantized only
  int64_t N_, K_;
  int64_t slot_bytes_;
  std::unique_ptr<char, PanelsFree> owned_;  // the panels pack writes, unless use_packed gave others
  char* panels_ = nullptr;
  std::vector<float> bias_;
};

// The experts that have slots: all of them (initializer weights: ConstantExperts) or those that have
// rows in a run (packed per run).
struct ExpertSlots {
  std::vector<int64_t> slot_of_expert;  // -1: not packed
  std::vector<int64_t> expert_of_slot;

  int64_t count() const { return static_cast<int64_t>(expert_of_slot.size()); }
  static ExpertSlots all(int64_t experts);
  // The experts e with offsets[e + 1] > offsets[e] (offsets: experts + 1 row offsets), in order.
  static ExpertSlots with_rows(const int64_t* offsets, int64_t experts);
};

// An op's packed experts: its weight matrices (MOE: gate/up and down; MoeRowParallelLinear: W),
// all in the same slots.
struct PackedExperts {
  ExpertSlots slots;
  std::vector<PackedWeights> matrices;
};

// Room for the experts of some slots (an op's matrices, not yet packed), and the packing of one slot:
// what an op gives the expert cache (constant_experts.h) and a run that packs its experts.
using MakeExperts = std::function<PackedExperts(ExpertSlots)>;
using PackSlot = std::function<void(PackedExperts&, int64_t slot)>;

}  // namespace moe_onnx
