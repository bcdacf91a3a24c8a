// MoeRowParallelLinear kernel: Y[rows of expert i] = X[rows of i] @ W[i]^T (+ B[i]); other rows 0.
//
// 1. Validate every input as row_parallel_linear.py's _validate does (same order and words), then
//    the offsets' values (0 <= o_0 <= ... <= o_E <= rows) before any row is touched.
// 2. W is packed per expert into the GEMM's panels: once at kernel creation when it is an
//    initializer, else per Compute for the experts that own rows. Float types use the fp32 GEMM
//    (gemm.h; float16/bfloat16 panels stay 16-bit, accumulation in fp32, rounded once at the end);
//    int8 uses the exact int32 GEMM (int8_gemm.h).
// 3. Tasks are (expert, block of rows, group of panels), so even a few rows keep every thread busy;
//    each output element is computed by one task in a fixed order: 1 and N threads agree bitwise.
#include "row_parallel_linear.h"

#include <algorithm>
#include <memory>

#include "gemm.h"
#include "int8_gemm.h"
#include "kernel_util.h"
#include "parallel.h"

namespace moe_onnx {
namespace {

enum { X, OFFSET, W, B, N_INPUTS };
const char* kSizeAttrs[3] = {"num_experts", "in_features", "out_features"};
const char* kSizeSymbols[3] = {"E", "K", "N"};

constexpr ElemType kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr ElemType kInt8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
constexpr ElemType kInt32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;

constexpr int64_t kRowBlock = 48;     // rows of one task (a multiple of both micro-kernels' 6 rows)
constexpr int64_t kMaxPanelGroup = 8;  // panels (16 columns each) of one task
constexpr int64_t kMinTasks = 8;       // split panels finer until there are this many tasks

ElemType output_elem(ElemType x_type) { return x_type == kInt8 ? kInt32 : x_type; }

struct Dims {
  int64_t E, N, K, rows;
  std::vector<int64_t> out_shape;
};

// _validate of row_parallel_linear.py after the attribute checks done at kernel creation.
Dims validate(const RowParallelLinearKernel& kernel, const Checker& v) {
  const ElemType x_type = v.expect_elem(X);
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
  DimBinder dims(v);
  for (int i = 0; i < 3; ++i) {
    if (!kernel.has_size[i]) continue;
    if (kernel.size[i] < 0)
      v.fail(std::string("attribute '") + kSizeAttrs[i] + "'",
             "is " + std::to_string(kernel.size[i]) + "; expected a size >= 0");
    dims.bind(kSizeSymbols[i], kernel.size[i], std::string("attribute '") + kSizeAttrs[i] + "'");
  }
  const auto& x_shape = v.expect_rank(X, -1, 1);
  dims.bind("K", x_shape.back(), "input 'X' dim -1");
  v.expect_rank(W, 3);
  dims.shape(W, {"E", "N", "K"});
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
  Dims d{E, dims.get("N"), dims.get("K"), product(x_shape, 0, x_shape.size() - 1), {}};
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

bool is_packable(const Input& w) {
  const std::vector<ElemType>& w_types = signatures::MoeRowParallelLinear.inputs[W].types;
  return w.present && w.shape.size() == 3 && std::find(w_types.begin(), w_types.end(), w.type) != w_types.end();
}

// Room for `slots` experts of W (whose type and shape are set).
void allocate(PackedExpertWeights& p, int64_t slots) {
  const int64_t N = p.shape[1], K = p.shape[2];
  if (p.type == kInt8) {
    p.stride = int8_packed_size(N, K);
    p.i16.assign(static_cast<size_t>(slots * p.stride), 0);
    return;
  }
  p.stride = panel_count(N) * K * kPanel;
  if (p.type == kF32)
    p.f32.assign(static_cast<size_t>(slots * p.stride), 0.0f);
  else
    p.bits16.assign(static_cast<size_t>(slots * p.stride), 0);
}

// dst panel n / 16, row k, column n % 16 = src[n, k] (src [N, K] row-major).
template <typename T>
void pack_panels(const T* src, int64_t N, int64_t K, T* dst) {
  for (int64_t n = 0; n < N; ++n) {
    T* panel = dst + (n / kPanel) * K * kPanel + n % kPanel;
    for (int64_t k = 0; k < K; ++k) panel[k * kPanel] = src[n * K + k];
  }
}

// Packs expert e of W into its slot (float16/bfloat16 as their bits).
void pack_expert(const Input& w, int64_t e, PackedExpertWeights& p) {
  const int64_t N = w.shape[1], K = w.shape[2], slot = p.slot_of_expert[e];
  if (w.type == kInt8) {
    pack_int8_weight(w.as<int8_t>() + e * N * K, N, K, p.i16.data() + slot * p.stride);
  } else if (w.type == kF32) {
    pack_panels(w.as<float>() + e * N * K, N, K, p.f32.data() + slot * p.stride);
  } else {
    uint16_t* dst = p.bits16.data() + slot * p.stride;
    pack_panels(static_cast<const uint16_t*>(w.data) + e * N * K, N, K, dst);
    if (w.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16) bf16_interleave_rows(dst, panel_count(N) * K);
  }
}

struct Task {
  int64_t expert, row0, rows, p0, p1;
};

std::vector<Task> make_tasks(const int64_t* o, int64_t E, int64_t panels) {
  int64_t blocks = 0;
  for (int64_t e = 0; e < E; ++e) blocks += (o[e + 1] - o[e] + kRowBlock - 1) / kRowBlock;
  int64_t group = std::min(panels, kMaxPanelGroup);
  while (group > 1 && blocks * ((panels + group - 1) / group) < kMinTasks) group = (group + 1) / 2;
  std::vector<Task> tasks;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = o[e]; r < o[e + 1]; r += kRowBlock)
      for (int64_t p = 0; p < panels; p += group)
        tasks.push_back({e, r, std::min(kRowBlock, o[e + 1] - r), p, std::min(panels, p + group)});
  return tasks;
}

}  // namespace

ElemType RowParallelLinearOp::GetOutputType(size_t) const { return output_elem(x_type_); }

OrtStatusPtr RowParallelLinearOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
  return create_kernel_status(api, kernel, [&] { return new RowParallelLinearKernel(info); });
}

RowParallelLinearKernel::RowParallelLinearKernel(const OrtKernelInfo* info) {
  Ort::ConstKernelInfo kinfo(info);
  where = node_where(signatures::MoeRowParallelLinear.name, kinfo);
  const Attributes attrs(info, signatures::MoeRowParallelLinear, where);
  attrs.choice("input_is_parallel", {0, 1});  // no effect on one process
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
  auto packed = std::make_unique<PackedExpertWeights>();
  packed->type = w.type;
  packed->shape = w.shape;
  const int64_t E = w.shape[0];
  packed->slot_of_expert.resize(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) packed->slot_of_expert[e] = e;
  allocate(*packed, E);
  for (int64_t e = 0; e < E; ++e) pack_expert(w, e, *packed);
  constant = std::move(packed);
}

OrtStatusPtr RowParallelLinearKernel::ComputeV2(OrtKernelContext* context) {
  return compute_status(where, [&] { Compute(context); });
}

void RowParallelLinearKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  const std::vector<Input> inputs = read_inputs(ctx, N_INPUTS);
  const Checker v(where, signatures::MoeRowParallelLinear, inputs);
  const Dims d = validate(*this, v);
  const int64_t E = d.E, N = d.N, K = d.K;
  const int64_t* o = inputs[OFFSET].as<int64_t>();
  check_offsets(v, o, E, d.rows);

  const Input& x = inputs[X];
  const Input& w = inputs[W];
  const bool int8 = x.type == kInt8;
  const ElemType y_type = output_elem(x.type);
  const size_t y_size = elem_size(y_type);
  Ort::UnownedValue y_value = ctx.GetOutput(0, d.out_shape);
  char* y = static_cast<char*>(y_value.GetTensorMutableRawData());
  if (d.rows == 0 || N == 0) return;
  // Rows no expert owns are zero.
  std::memset(y, 0, static_cast<size_t>(o[0] * N) * y_size);
  std::memset(y + o[E] * N * y_size, 0, static_cast<size_t>((d.rows - o[E]) * N) * y_size);
  const int64_t first = o[0], covered = o[E] - o[0];
  if (covered == 0) return;

  // Weights: the constant pack, or the experts that own rows packed now.
  const PackedExpertWeights* packed = constant.get();
  PackedExpertWeights local;
  if (!packed || packed->type != w.type || packed->shape != w.shape) {
    local.type = w.type;
    local.shape = w.shape;
    local.slot_of_expert.assign(static_cast<size_t>(E), -1);
    std::vector<int64_t> used;
    for (int64_t e = 0; e < E; ++e)
      if (o[e + 1] > o[e]) {
        local.slot_of_expert[e] = static_cast<int64_t>(used.size());
        used.push_back(e);
      }
    allocate(local, static_cast<int64_t>(used.size()));
    parallel_for(ctx, used.size(), [&](size_t u) { pack_expert(w, used[u], local); });
    packed = &local;
  }

  // A: the covered rows of X as the GEMM reads them. float32 X is read in place unless its row
  // stride is a multiple of 4 KB (rows of a tile would share L1 sets): then it is copied, padded.
  const int64_t pairs = int8_pairs(K);
  const bool in_place = x.type == kF32 && K % 1024 != 0;
  const int64_t lda = int8 ? 2 * pairs : (K % 1024 ? K : K + kPanel);
  std::unique_ptr<int16_t[]> a16;  // every element written by widen_int8_rows
  std::vector<float> a32;
  const float* a_f32 = nullptr;
  size_t chunk = 1;
  const size_t n_chunks = chunk_count(static_cast<size_t>(covered), 16, 64, &chunk);
  auto chunk_rows = [&](size_t c, int64_t* r0, int64_t* r1) {
    *r0 = static_cast<int64_t>(c * chunk);
    *r1 = std::min<int64_t>(covered, static_cast<int64_t>((c + 1) * chunk));
  };
  if (int8) {
    a16.reset(new int16_t[static_cast<size_t>(covered * lda)]);
    parallel_for(ctx, n_chunks, [&](size_t c) {
      int64_t r0, r1;
      chunk_rows(c, &r0, &r1);
      widen_int8_rows(x.as<int8_t>() + (first + r0) * K, r1 - r0, K, a16.get() + r0 * lda);
    });
  } else if (in_place) {
    a_f32 = x.as<float>() + first * K;
  } else {
    a32.resize(static_cast<size_t>(covered * lda));
    parallel_for(ctx, n_chunks, [&](size_t c) {
      int64_t r0, r1;
      chunk_rows(c, &r0, &r1);
      for (int64_t r = r0; r < r1; ++r)
        widen_row(panel_type(x.type), static_cast<const char*>(x.data) + (first + r) * K * elem_size(x.type),
                  a32.data() + r * lda, K);
    });
    a_f32 = a32.data();
  }

  const Input& b = inputs[B];
  const PanelType panels_type = panel_type(w.type);
  auto panels = [&](int64_t slot) -> const void* {
    if (panels_type == PanelType::kF32) return packed->f32.data() + slot * packed->stride;
    return packed->bits16.data() + slot * packed->stride;
  };
  const std::vector<Task> tasks = make_tasks(o, E, panel_count(N));
  parallel_for(ctx, tasks.size(), [&](size_t ti) {
    const Task& t = tasks[ti];
    const int64_t slot = packed->slot_of_expert[t.expert];
    const int64_t c0 = t.p0 * kPanel, c1 = std::min(N, t.p1 * kPanel);
    // The GEMM writes whole 16-column panels: straight into Y when they lie inside it and Y is
    // int32/float32, else into a scratch tile that is then copied (and converted).
    const bool direct = t.p1 * kPanel <= N && (int8 || y_type == kF32);
    const int64_t ldc = direct ? N : (t.p1 - t.p0) * kPanel;
    if (int8) {
      int32_t* out = reinterpret_cast<int32_t*>(y) + t.row0 * N + c0;
      int32_t* C = direct ? out : scratch<int32_t>(static_cast<size_t>(t.rows * ldc));
      int8_gemm_panels(a16.get() + (t.row0 - first) * lda, lda, t.rows, pairs, packed->i16.data() + slot * packed->stride,
                       t.p0, t.p1, C, ldc);
      if (direct && !b.present) return;
      const int32_t* bias = b.present ? b.as<int32_t>() + t.expert * N + c0 : nullptr;
      for (int64_t r = 0; r < t.rows; ++r)
        for (int64_t c = 0; c < c1 - c0; ++c) {
          uint32_t value = static_cast<uint32_t>(C[r * ldc + c]);  // bias wraps like numpy's int32
          if (bias) value += static_cast<uint32_t>(bias[c]);
          out[r * N + c] = static_cast<int32_t>(value);
        }
      return;
    }
    float* out = direct ? reinterpret_cast<float*>(y) + t.row0 * N + c0 : nullptr;
    float* C = direct ? out : scratch<float>(static_cast<size_t>(t.rows * ldc));
    gemm_panels(panels_type, a_f32 + (t.row0 - first) * lda, lda, t.rows, K, panels(slot), t.p0, t.p1, C, ldc);
    for (int64_t r = 0; r < t.rows; ++r) {
      float* row = C + r * ldc;
      if (b.present)
        for (int64_t c = c0; c < c1; ++c) row[c - c0] += load_float(b.type, b.data, t.expert * N + c);
      if (!direct) from_float(y_type, row, y + ((t.row0 + r) * N + c0) * y_size, c1 - c0);
    }
  });
}

}  // namespace moe_onnx
