// MoeRowParallelLinear kernel: Y[rows of expert i] = X[rows of i] @ W[i]^T (+ B[i]); other rows 0.
//
// 1. Validate every input as row_parallel_linear.py's _validate does (same order and words), then
//    the offsets' values (0 <= o_0 <= ... <= o_E <= rows) before any row is touched.
// 2. W is packed per expert into the GEMM's panels (packed_weights.h), multiplied through
//    PackedWeights::multiply: each expert once, by the first run that uses it, when W is an initializer
//    (ConstantExperts), else per Compute for the experts that own rows. Float types use the fp32 GEMM (gemm.h; float16/bfloat16 panels stay
//    16-bit, accumulation in fp32, rounded once at the end), or with accuracy_level 3, where the ISA
//    table has one, the bf16 GEMM (bf16_gemm.h: W in bf16 pair panels, X's rows rounded to bf16);
//    int8 uses the exact int32 GEMM (int8_gemm.h; its kernel fixes the layout of X's rows and W's
//    panels).
// 3. With tp_world_size > 1 (docs/distributed.md), W is this rank's K-slice [E, N, K_q]: the rank
//    reads X's columns [k_q, k_q + K_q) (k_q: the K_q of the TP ranks before it, all-gathered) unless
//    input_is_parallel, computes its partial without B in float32 (int32 for int8), all-reduces it over
//    the group and then adds B once and rounds.
// 4. Tasks are (expert, block of rows, group of panels) (task_plan.h), so even a few rows keep every
//    thread busy; each output element is computed by one task in a fixed order: 1 and N threads
//    agree bitwise.
#include "row_parallel_linear.h"

#include <algorithm>
#include <memory>
#include <tuple>

#include "attributes.h"
#include "checker.h"
#include "float_rows.h"
#include "int8_gemm.h"
#include "parallel.h"
#include "task_plan.h"

namespace moe_onnx {
namespace {

enum { X, OFFSET, W, B, N_INPUTS };
const char* kSizeAttrs[3] = {"num_experts", "in_features", "out_features"};
const char* kSizeSymbols[3] = {"E", "K", "N"};

constexpr ElemType kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr ElemType kInt8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
constexpr ElemType kInt32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;

// Tasks of 48 rows (a multiple of the float GEMM's 6-row tiles and of the int8 GEMM's 4-row tiles)
// and up to 8 panels, split into smaller panel groups until there are 8 tasks.
constexpr TaskShape kTaskShape{/*max_rows=*/48, /*equal_rows=*/false, /*max_panels=*/8, /*min_tasks=*/8};

ElemType output_elem(ElemType x_type) { return x_type == kInt8 ? kInt32 : x_type; }

struct Dims {
  int64_t E, N, K, rows;  // K: W's dim 2 (this rank's K_q with tp_world_size > 1)
  int64_t x_width;        // X's dim -1
  std::vector<int64_t> out_shape;
};

// _validate of row_parallel_linear.py after the attribute checks done at kernel creation.
Dims validate(const RowParallelLinearKernel& kernel, const Checker& v) {
  const ElemType x_type = v.expect_elem(X);
  if (x_type == kInt8 && kernel.accuracy_level != 0)
    v.fail("attribute 'accuracy_level'", "is " + std::to_string(kernel.accuracy_level) +
                                             "; int8 X expects 0 (the int8 product is exact int32)");
  v.expect_elem(W);
  v.expect_same_elem(W, X);
  v.expect_elem(OFFSET);
  const ElemType y_type = output_elem(x_type);
  if (v.has(B)) {
    const ElemType b_type = v.require(B).type;
    if (b_type != y_type)
      v.fail(v.input_name(B), std::string("has type ") + elem_name(b_type) + "; expected " + elem_name(y_type) +
                                  " (" + (x_type == kInt8 ? "int8 X and W accumulate in int32" : "the type of input 'X'") +
                                  ")");
  }
  // K is the full input width; with tp_world_size > 1, W holds this rank's K_q, and so does X when
  // input_is_parallel is 1.
  const char* w_k = kernel.tp_size > 1 ? "K_q" : "K";
  const char* x_k = kernel.input_is_parallel ? w_k : "K";
  DimBinder dims(v);
  for (int i = 0; i < 3; ++i) {
    if (!kernel.has_size[i]) continue;
    if (kernel.size[i] < 0)
      v.fail(std::string("attribute '") + kSizeAttrs[i] + "'",
             "is " + std::to_string(kernel.size[i]) + "; expected a size >= 0");
    dims.bind(kSizeSymbols[i], kernel.size[i], std::string("attribute '") + kSizeAttrs[i] + "'");
  }
  const auto& x_shape = v.expect_rank(X, -1, 1);
  dims.bind(x_k, x_shape.back(), "input 'X' dim -1");
  v.expect_rank(W, 3);
  dims.shape(W, {"E", "N", w_k});
  if (v.has(B)) {
    v.expect_rank(B, 2);
    dims.shape(B, {"E", "N"});
  }
  const int64_t length = v.expect_rank(OFFSET, 1)[0];
  const int64_t E = dims.get("E");
  if (length != E + 1)
    v.fail(v.input_name(OFFSET), "dim 0 is " + std::to_string(length) + "; expected E + 1 = " + std::to_string(E + 1) +
                                     " (E from " + (kernel.has_size[0] ? "attribute 'num_experts'" : "input 'W' dim 0") +
                                     ")");
  Dims d{E, dims.get("N"), dims.get(w_k), product(x_shape, 0, x_shape.size() - 1), x_shape.back(), {}};
  d.out_shape.assign(x_shape.begin(), x_shape.end() - 1);
  d.out_shape.push_back(d.N);
  return d;
}

// _check_offsets: 0 <= offset[0] <= offset[1] <= ... <= offset[E] <= rows.
void check_offsets(const Checker& v, const int64_t* o, int64_t E, int64_t rows) {
  if (o[0] < 0)
    v.fail("input 'expert_offset'[0]", "= " + std::to_string(o[0]) + " is negative; expected 0 <= expert_offset[0]");
  for (int64_t i = 1; i <= E; ++i)
    if (o[i] < o[i - 1])
      v.fail("input 'expert_offset'[" + std::to_string(i) + "]",
             "= " + std::to_string(o[i]) + " is less than expert_offset[" + std::to_string(i - 1) +
                 "] = " + std::to_string(o[i - 1]) + "; expected expert_offset[i] <= expert_offset[i+1]");
  if (o[E] > rows)
    v.fail("input 'expert_offset'[" + std::to_string(E) + "]",
           "= " + std::to_string(o[E]) + " is greater than the " + std::to_string(rows) +
               " rows of input 'X' (the product of its leading dims); expected expert_offset[E] <= " +
               std::to_string(rows));
}

// Whether W is packed for the session (ConstantExperts): valid, and with elements (the pack is then in
// proportion to W's data, whatever E is).
bool is_packable(const Input& w) {
  return w.present && w.count > 0 && w.shape.size() == 3 && signatures::MoeRowParallelLinear.inputs[W].allows(w.type);
}

// Room for W's experts in `slots` in the format of W's type and the node's accuracy_level, packed by
// pack_slot.
PackedExperts empty_pack(const Input& w, int64_t accuracy_level, ExpertSlots slots) {
  PackedExperts p;
  const ElemType type = w.type;
  p.matrices.emplace_back(weight_format(type, accuracy_level), /*N=*/w.shape[1], /*K=*/w.shape[2], slots.count(), false,
                          type == kInt8 ? FloatType::kF32 : float_type(type));
  p.slots = std::move(slots);
  return p;
}

void pack_slot(const Input& w, PackedExperts& p, int64_t slot) {
  p.matrices[0].pack(slot, {transposed_columns(w.data, p.slots.expert_of_slot[slot], w.shape[1], w.shape[2])});
}

// The covered rows of X as the GEMM reads them, K columns from column k0 of X's x_width: int8
// prepared for the int8 GEMM (ld in bytes); for bf16 pair panels (`bf16`) rounded to bf16 rows
// (bf16_row, ld bf16_row_stride); float32 in place when gemm_rows_in_place allows, else widened or
// copied to fp32 at gemm_row_stride, in the run's workspace.
struct GemmRows {
  const char* int8_rows = nullptr;  // every byte written by prepare_int8_rows
  const uint16_t* bf16 = nullptr;
  const float* f = nullptr;
  int64_t ld = 0;
};

GemmRows gemm_rows(const Ort::KernelContext& ctx, Workspace& run, const Input& x, int64_t first, int64_t rows,
                   int64_t K, int64_t x_width, int64_t k0, bool bf16) {
  GemmRows a;
  if (x.type == kF32 && !bf16 && gemm_rows_in_place(x_width)) {
    a.f = x.as<float>() + first * x_width + k0;
    a.ld = x_width;
    return a;
  }
  size_t chunk = 1;
  const size_t n_chunks = chunk_count(static_cast<size_t>(rows), 16, 64, &chunk);
  auto for_chunks = [&](auto&& widen) {
    parallel_for(ctx, n_chunks, [&](size_t c) {
      const int64_t r0 = static_cast<int64_t>(c * chunk);
      widen(r0, std::min<int64_t>(rows, static_cast<int64_t>((c + 1) * chunk)));
    });
  };
  if (x.type == kInt8) {
    a.ld = int8_row_bytes(K);
    char* prepared = run.take<char>(rows * a.ld, "the int8 rows of input 'X'");
    for_chunks([&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        prepare_int8_rows(x.as<int8_t>() + (first + r) * x_width + k0, 1, K, prepared + r * a.ld);
    });
    a.int8_rows = prepared;
    return a;
  }
  const size_t x_size = elem_size(x.type);
  const FloatType x_type = float_type(x.type);
  if (bf16) {
    a.ld = bf16_row_stride(K);
    uint16_t* rounded = run.take<uint16_t>(rows * a.ld, "the bfloat16 rows of input 'X'");
    for_chunks([&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        bf16_row(x_type, static_cast<const char*>(x.data) + ((first + r) * x_width + k0) * x_size, K,
                 rounded + r * a.ld);
    });
    a.bf16 = rounded;
    return a;
  }
  a.ld = gemm_row_stride(K);
  float* widened = run.take<float>(rows * a.ld, "the float32 rows of input 'X'");
  for_chunks([&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      widen_row(x_type, static_cast<const char*>(x.data) + ((first + r) * x_width + k0) * x_size,
                widened + r * a.ld, K);
  });
  a.f = widened;
  return a;
}

// Writes the tasks' tiles of Y: each task's rows x 16-column panels through the GEMM, written
// straight into Y when the panels lie inside it and Y is int32/float32, else into a scratch tile
// that is then copied (and converted); then the bias (when b is present).
struct OutputTiles {
  const PackedExperts& packed;
  const GemmRows& a;
  const Input& b;
  int64_t N, first;  // first: the first covered row (row 0 of a)
  ElemType y_type;
  char* y;           // row y_first of the output (0: Y itself; first: a TP rank's partial)
  int64_t y_first;

  bool direct(const Task& t) const { return t.p1 * kPanel <= N && (y_type == kInt32 || y_type == kF32); }
  int64_t slot(const Task& t) const { return packed.slots.slot_of_expert[t.expert]; }

  // int32 results; the bias wraps like numpy's int32.
  void int8_task(const Task& t) const {
    const int64_t c0 = t.p0 * kPanel, c1 = std::min(N, t.p1 * kPanel);
    const int64_t ldc = direct(t) ? N : (t.p1 - t.p0) * kPanel;
    int32_t* out = reinterpret_cast<int32_t*>(y) + (t.row0 - y_first) * N + c0;
    Scratch scratch;
    int32_t* C = direct(t) ? out : scratch.take<int32_t>(t.rows * ldc, "a task's tile");
    packed.matrices[0].multiply(slot(t), a.int8_rows + (t.row0 - first) * a.ld, a.ld, t.rows, t.p0, t.p1, C, ldc);
    if (direct(t) && !b.present) return;
    const int32_t* bias = b.present ? b.as<int32_t>() + t.expert * N + c0 : nullptr;
    for (int64_t r = 0; r < t.rows; ++r)
      for (int64_t c = 0; c < c1 - c0; ++c) {
        uint32_t value = static_cast<uint32_t>(C[r * ldc + c]);
        if (bias) value += static_cast<uint32_t>(bias[c]);
        out[r * N + c] = static_cast<int32_t>(value);
      }
  }

  // fp32 results, rounded once to Y's type.
  void float_task(const Task& t) const {
    const int64_t c0 = t.p0 * kPanel, c1 = std::min(N, t.p1 * kPanel);
    const int64_t ldc = direct(t) ? N : (t.p1 - t.p0) * kPanel;
    Scratch scratch;
    float* C = direct(t) ? reinterpret_cast<float*>(y) + (t.row0 - y_first) * N + c0
                         : scratch.take<float>(t.rows * ldc, "a task's tile");
    if (a.bf16)
      packed.matrices[0].multiply(slot(t), a.bf16 + (t.row0 - first) * a.ld, a.ld, t.rows, t.p0, t.p1, C, ldc);
    else
      packed.matrices[0].multiply(slot(t), a.f + (t.row0 - first) * a.ld, a.ld, t.rows, t.p0, t.p1, C, ldc);
    const size_t y_size = elem_size(y_type);
    float* bias = nullptr;  // the task's columns of the expert's bias, converted once
    if (b.present) {
      bias = scratch.take<float>(c1 - c0, "a task's bias");
      widen_row(float_type(b.type), static_cast<const char*>(b.data) + (t.expert * N + c0) * elem_size(b.type), bias,
                c1 - c0);
    }
    for (int64_t r = 0; r < t.rows; ++r) {
      float* row = C + r * ldc;
      if (bias)
        for (int64_t c = 0; c < c1 - c0; ++c) row[c] += bias[c];
      if (!direct(t)) narrow_row(float_type(y_type), row, y + ((t.row0 - y_first + r) * N + c0) * y_size, c1 - c0);
    }
  }
};

// TP: the first column of X this rank reads (k_q, an exclusive scan of the group's K_q; 0 with
// input_is_parallel), after checking that the group's K_q add up to the full K (X's width, or
// in_features with input_is_parallel), as rank_input (row_parallel_linear.py) does.
int64_t slice_start(RowParallelLinearKernel& kernel, const comm::Group& group, const Checker& v, const Dims& d) {
  const bool full_known = !kernel.input_is_parallel || kernel.has_size[1];
  if (!full_known) return 0;  // X is this rank's own slice, and nothing to check the widths against
  const std::vector<int64_t> widths = kernel.group_widths(group, d.K);
  int64_t start = 0, total = 0;
  for (size_t q = 0; q < widths.size(); ++q) {
    if (static_cast<int64_t>(q) < group.rank()) start += widths[q];
    total += widths[q];
  }
  const int64_t full = kernel.input_is_parallel ? kernel.size[1] : d.x_width;
  const char* source = kernel.input_is_parallel ? "attribute 'in_features'" : "input 'X' dim -1";
  if (total != full)
    v.fail("input 'W' dim 2", "adds up to " + std::to_string(total) + " over the " + std::to_string(widths.size()) +
                                  " TP ranks (" + fmt_shape(widths) + "); expected K = " + std::to_string(full) +
                                  " (from " + source + ")");
  return kernel.input_is_parallel ? 0 : start;
}

// TP: sums this rank's partial (the covered rows [o[0], o[E]) x N, int32 or float32, without B) over
// the group, then adds B once and writes those rows of Y (y_type; the partial may be Y's own rows).
void reduce_partial(const Ort::KernelContext& ctx, const comm::Group& tp, const char* where, char* partial,
                    ElemType partial_type, const Input& b, const int64_t* o, int64_t E, int64_t N, ElemType y_type,
                    char* y) {
  const int64_t first = o[0], covered = o[E] - o[0];
  if (partial_type == kInt32)
    tp.all_reduce_sum(reinterpret_cast<int32_t*>(partial), covered * N, where, "the partial products");
  else
    tp.all_reduce_sum(reinterpret_cast<float*>(partial), covered * N, where, "the partial products");
  const size_t y_size = elem_size(y_type);
  size_t chunk = 1;
  const size_t n_chunks = chunk_count(static_cast<size_t>(covered), 16, 64, &chunk);
  parallel_for(ctx, n_chunks, [&](size_t c) {
    Scratch scratch;
    float* bias = b.present ? scratch.take<float>(N, "an expert's bias") : nullptr;
    const int64_t end = std::min<int64_t>(covered, static_cast<int64_t>((c + 1) * chunk));
    for (int64_t i = static_cast<int64_t>(c * chunk); i < end; ++i) {
      const int64_t row = first + i;
      const int64_t expert = std::upper_bound(o, o + E + 1, row) - o - 1;  // o[expert] <= row < o[expert + 1]
      if (partial_type == kInt32) {
        if (!b.present) continue;
        int32_t* out = reinterpret_cast<int32_t*>(partial) + i * N;
        const int32_t* add = b.as<int32_t>() + expert * N;
        for (int64_t n = 0; n < N; ++n)  // wraps like numpy's int32
          out[n] = static_cast<int32_t>(static_cast<uint32_t>(out[n]) + static_cast<uint32_t>(add[n]));
        continue;
      }
      float* sums = reinterpret_cast<float*>(partial) + i * N;
      if (b.present) {
        widen_row(float_type(b.type), static_cast<const char*>(b.data) + expert * N * elem_size(b.type), bias, N);
        for (int64_t n = 0; n < N; ++n) sums[n] += bias[n];
      }
      if (y_type != kF32) narrow_row(float_type(y_type), sums, y + row * N * y_size, N);
    }
  });
}

}  // namespace

ElemType RowParallelLinearOp::GetOutputType(size_t) const { return output_elem(type_); }

RowParallelLinearKernel::RowParallelLinearKernel(const OrtKernelInfo* info, const PackedWeightsFiles* files)
    : NodeKernel(signatures::MoeRowParallelLinear, info) {
  Ort::ConstKernelInfo kinfo(info);
  const Attributes attrs(info, signatures::MoeRowParallelLinear, where);
  input_is_parallel = attrs.choice("input_is_parallel", {0, 1}) == 1;  // no effect on one process
  std::tie(tp_size, tp_rank) = read_group(attrs, "tp_world_size", "tp_rank_id");
  accuracy_level = attrs.choice("accuracy_level", {0, 3});
  int64_t bias_term = 0;
  if (attrs.has_int("bias_term", &bias_term)) {
    bias_term = attrs.choice("bias_term", {0, 1});
    const bool has_b = node_has_input(kinfo, B);
    if (bias_term && !has_b) attrs.fail("bias_term", "is 1, but input 'B' is absent; expected B [E, N], or bias_term = 0");
    if (!bias_term && has_b)
      throw_invalid(where + ": input 'B' is given, but attribute 'bias_term' is 0; expected no B, or bias_term = 1");
  }
  for (int i = 0; i < 3; ++i) has_size[i] = attrs.has_int(kSizeAttrs[i], &size[i]);

  const Input w = constant_input(kinfo, W);
  if (!is_packable(w)) return;  // computed at run time (or invalid: Compute reports it)
  constant = std::make_unique<ConstantExperts>(
      w.shape[0], [&](ExpertSlots slots) { return empty_pack(w, accuracy_level, std::move(slots)); },
      [w](PackedExperts& p, int64_t slot) { pack_slot(w, p, slot); }, std::vector<Input>{w},
      packed_file_request(files, kinfo, signatures::MoeRowParallelLinear.name, where, {W}));
}

std::vector<int64_t> RowParallelLinearKernel::group_widths(const comm::Group& group, int64_t K_q) {
  std::lock_guard<std::mutex> lock(widths_mutex);
  if (!constant_widths.empty()) return constant_widths;
  std::vector<int64_t> widths(static_cast<size_t>(group.size()));
  group.all_gather(&K_q, 1, widths.data(), where.c_str(), "the K-slice widths");
  if (constant) constant_widths = widths;
  return widths;
}

void RowParallelLinearKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  const std::vector<Input> inputs = read_inputs(ctx, N_INPUTS);
  const Checker v(where, signatures::MoeRowParallelLinear, inputs);
  const Dims d = validate(*this, v);
  const int64_t E = d.E, N = d.N, K = d.K;
  const int64_t* o = inputs[OFFSET].as<int64_t>();
  check_offsets(v, o, E, d.rows);
  // The TP group after the inputs' checks, in row_parallel_linear.py's order.
  const comm::Group* group = tp.get(tp_size, tp_rank, where);
  const int64_t k0 = group ? slice_start(*this, *group, v, d) : 0;

  const Input& x = inputs[X];
  const ElemType y_type = output_elem(x.type);
  const size_t y_size = elem_size(y_type);
  Ort::UnownedValue y_value = ctx.GetOutput(0, d.out_shape);
  char* y = static_cast<char*>(y_value.GetTensorMutableRawData());
  if (d.rows == 0 || N == 0) return;
  // Rows no expert owns are zero.
  std::memset(y, 0, static_cast<size_t>(o[0] * N) * y_size);
  std::memset(y + o[E] * N * y_size, 0, static_cast<size_t>((d.rows - o[E]) * N) * y_size);
  const int64_t first = o[0], covered = o[E] - o[0];
  if (covered == 0) return;  // the same on every TP rank (the same offsets)

  const Input& w = inputs[W];
  PackedExperts local;
  const PackedExperts& packed = experts_for_run(
      ctx, constant.get(), o, E, local, [&](ExpertSlots slots) { return empty_pack(w, accuracy_level, std::move(slots)); },
      [&](PackedExperts& p, int64_t slot) { pack_slot(w, p, slot); });
  const WorkspacePool::Lease buffers = workspaces.lease();
  const GemmRows a =
      gemm_rows(ctx, *buffers, x, first, covered, K, d.x_width, k0, packed.matrices[0].takes_bf16_rows());
  // TP: the partial without B, float32 (in Y itself when Y is float32) or int32 (in Y); the tasks
  // write all of it.
  const bool partial_in_y = !group || y_type == kF32 || y_type == kInt32;
  const Input no_bias;
  char* out = partial_in_y ? y + (group ? first * N * y_size : 0)
                           : reinterpret_cast<char*>(buffers->take<float>(covered * N, "the partial products"));
  const OutputTiles tiles{packed, a, group ? no_bias : inputs[B], N, first, partial_in_y ? y_type : kF32, out,
                          group ? first : 0};
  const std::vector<Task> tasks = make_tasks(o, E, panel_count(N), kTaskShape);
  parallel_for(ctx, tasks.size(), [&](size_t ti) {
    if (x.type == kInt8)
      tiles.int8_task(tasks[ti]);
    else
      tiles.float_task(tasks[ti]);
  });
  if (group) reduce_partial(ctx, *group, where.c_str(), tiles.y, tiles.y_type, inputs[B], o, E, N, y_type, y);
}

}  // namespace moe_onnx
