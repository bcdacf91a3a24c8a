// The GEMM operands of the expert ops (MOE, QMOE, MoeRowParallelLinear) in one place: the weight
// formats and where each weight element lands in their panels, the packed expert weights (huge-page
// buffers, one slot per packed expert) and their GEMM, which experts are packed, and the row stride of
// the activation rows the GEMMs read. PackedWeights::multiply is the ops' one entry to the GEMM
// kernels (gemm.h, int8_gemm.h, qgemm.h): a new weight format or a new panel layout for another ISA
// is a new WeightFormat here: its element, its slot size and its placement (packed_weights.cc), and
// its kernel in multiply; the ops only name the columns of their weight tensors (QMOE's quantized
// ones: QuantizedColumns).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <atomic>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "bf16_gemm.h"
#include "gemm.h"
#include "packed_file.h"
#include "parallel.h"
#include "qgemm.h"
#include "tensor.h"
#include "workspace.h"

namespace moe_onnx {

// How one expert's weight matrix B [K, N] (y = x @ B) is stored, all as ceil(N / 16) panels of 16
// columns, zero padded:
//   kF32, kF16, kBF16  the float GEMM's panels (gemm.h): [K][16] in the weights' own type (16-bit
//                      weights stay 16-bit); bf16 rows in the interleaved lane order (bf16_lane).
//   kInt8              the int8 GEMM's pair panels (int8_gemm.h): [pairs][16][2] int16, the two k
//                      of a pair side by side, K padded to even with a zero.
//   kInt8Quads         the int8 GEMM's quad panels (int8_gemm.h, AVX512-VNNI): 16 int32
//                      corrections -128 * (column sum), then [quads][16][4] int8, K padded to a
//                      multiple of 4 with zeros.
//   kQuantized         QMOE's int4/int8/E2M1 codes with per-block scales (and zero points), blocks
//                      of 64-byte code groups (qgemm.h: QuantPanels), decoded in the GEMM.
//   kBF16Pairs         the bf16 GEMM's pair panels (bf16_gemm.h, accuracy_level 3): [pairs][16][2]
//                      bf16, the weights rounded to bf16 (nearest even), K padded with zeros to a
//                      multiple of 32; the activation rows are bf16 too (bf16_row).
enum class WeightFormat { kF32, kF16, kBF16, kInt8, kInt8Quads, kQuantized, kBF16Pairs };

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

// Where one expert's columns come from in a weight tensor of the format's element type, and where
// they go: column c (c < columns) of B has element (k, c) at data[first + k * k_stride + c * c_stride]
// and becomes lane lane0 + c % width of panel c / width. Plain panels: width 16, lane0 0; MOE's
// gate/up panels: the gate columns at width 8, lane0 0, the up columns at width 8, lane0 8.
struct ColumnSource {
  const void* data;
  int64_t first;
  int64_t k_stride, c_stride;
  int64_t columns;
  int64_t width = kPanel, lane0 = 0;
};
// Expert e of a [E, N, K] tensor used as x @ W[e]^T (nn.Linear layout): B [K, N] = W[e]^T.
inline ColumnSource transposed_columns(const void* data, int64_t e, int64_t N, int64_t K) {
  return {data, e * N * K, 1, K, N};
}
// Expert e of a [E, K, N] tensor used as x @ W[e].
inline ColumnSource plain_columns(const void* data, int64_t e, int64_t K, int64_t N) {
  return {data, e * K * N, N, 1, N};
}

// Where one expert's quantized columns come from (QMOE: [E, N, K] codes, [E, N, blocks] scales,
// zero points packed along their last dim), and where they go (lane0 + c % width of panel c / width).
// Column c has code k at element codes_first + c * codes_stride + k of `codes` (an element is a
// nibble for 4-bit codes: the low one of a byte first), the scale of block b at element
// scales_first + c * scales_stride + b of `scales` (float32/float16/bfloat16, or uint8 E8M0 for
// E2M1 codes), and, when zero_points is not null, the zero point of block b at element
// zero_points_first + c * zero_points_stride + b * zero_points_block_stride (same bits as the codes).
struct QuantizedColumns {
  const uint8_t* codes;
  int64_t codes_first, codes_stride;
  const void* scales;
  ElemType scale_type;
  int64_t scales_first, scales_stride;
  const uint8_t* zero_points;
  int64_t zero_points_first, zero_points_stride, zero_points_block_stride;
  int64_t columns;
  int64_t width = kPanel, lane0 = 0;
};

// Frees a PackedWeights' own panels: an anonymous mapping of `mapped` bytes (munmap), or malloc's (0).
struct PanelsFree {
  size_t mapped = 0;
  void operator()(char* p) const;
};

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

// The packed experts of initializer weights, made at kernel creation with room for every expert:
// each expert is packed by the first run that routes rows to it (on that run's intra-op pool), then
// kept, so creating a session reads no weights and a model holds packed only the experts it uses.
// Before an expert is packed, its pages that onnxruntime mapped from an external data file are mapped
// at once (MADV_POPULATE_READ); then they are reclaimed (MADV_PAGEOUT: clean file pages, a later read
// maps them again from the file), so the weights are resident once, packed.
// With a packed-weights file (packed_file.h) that matches the weights, the panels are the file's
// pages instead: nothing is packed, and a run maps an expert's pages before its first use. In write
// mode every expert is packed at creation into the file (one expert at a time per thread), which is
// then used so.
class ConstantExperts {
 public:
  using MakeEmpty = std::function<PackedExperts(ExpertSlots)>;
  using PackSlot = std::function<void(PackedExperts&, int64_t slot)>;
  // `weights`: the initializers pack_slot reads, each with the experts as its first dim; make_empty
  // gives the matrices of the experts in its slots, pack_slot packs one of them.
  ConstantExperts(int64_t experts, const MakeEmpty& make_empty, PackSlot pack_slot, const std::vector<Input>& weights,
                  const PackedFileRequest& file);

  // The experts e with offsets[e + 1] > offsets[e] packed (offsets: experts + 1 row offsets).
  const PackedExperts& for_run(const Ort::KernelContext& ctx, const int64_t* offsets);

 private:
  // One weight tensor's bytes, when its pages are reclaimed after packing (mapped from a file).
  struct MappedWeight {
    const char* data;
    size_t bytes;
  };
  // madvise(advice) on the pages of the expert's weights in mapped_, the pages wholly inside them (inner)
  // or every page they touch.
  void advise_mapped_pages(int64_t expert, int advice, bool inner) const;
  // Packs the expert into its slot, its source pages mapped at once before and reclaimed after.
  void pack_expert(PackedExperts& into, int64_t slot, int64_t expert) const;
  // Makes the expert's slot ready: packed, or its pages of the file mapped.
  void prepare_expert(int64_t expert);
  // Packs every expert into a new file at `file.path` (threads: file.threads).
  void write_file(const PackedFileRequest& file, const PackedFileLayout& layout, const MakeEmpty& make_empty) const;

  PackedExperts experts_;
  PackSlot pack_slot_;
  std::vector<MappedWeight> mapped_;
  std::unique_ptr<MappedPackedFile> file_;  // the panels, when they come from a file
  std::unique_ptr<std::atomic<bool>[]> packed_;  // per expert
  std::mutex packing_;
};

// The packed experts a run reads: `constant`'s when the weights are initializers (after their
// checks at kernel creation: a run that passes its own checks has the same weights); else `local`,
// made by empty(slots of the experts that have rows: offsets[e + 1] > offsets[e]) and filled by
// pack_slot(local, slot) on the intra-op pool.
template <class Empty, class PackSlot>
const PackedExperts& experts_for_run(const Ort::KernelContext& ctx, ConstantExperts* constant, const int64_t* offsets,
                                     int64_t experts, PackedExperts& local, Empty&& empty, PackSlot&& pack_slot) {
  if (constant) return constant->for_run(ctx, offsets);
  local = empty(ExpertSlots::with_rows(offsets, experts));
  parallel_for(ctx, static_cast<size_t>(local.slots.count()),
               [&](size_t slot) { pack_slot(local, static_cast<int64_t>(slot)); });
  return local;
}

}  // namespace moe_onnx
