// MOE kernel. Layout of the work (T tokens, k slots each, E experts, H hidden, I intermediate):
//
// 1. Validate every input as moe_onnx/ops/moe.py's _validate does, with the same messages, and the
//    indices' range, before anything is indexed.
// 2. Sort the T*k slots by expert (stable counting sort: slot order inside an expert is the token
//    order) and gather their rows of hidden_states, as fp32, into one [T*k, H] buffer: each expert's
//    rows are contiguous, so its weights are read once per block of up to kMaxRowBlock rows.
// 3. Per (expert, block of rows, group of panels) task: gate/up = x @ W0 (+ b0) with gate and up
//    side by side in one 16-wide panel (8 gate columns, the 8 matching up columns), the activation
//    in the epilogue on the task's [rows, 128] tile (vectorized exp) -> act [T*k, I]; the [T*k, 2I]
//    gate/up product is never stored.
// 4. Per (expert, block of rows, group of panels) task: y = (act @ W1 + b1) * routing weight,
//    stored per slot.
// 5. Per token: out[t] = sum over j = 0..k-1 of y[t*k + j], in that order, then to T.
// Every element is computed by one task in a fixed order, so 1 or N threads give the same bits.
// Tasks split every expert's columns into groups of 8 panels, so even one token (decode, bound by
// reading the weights) keeps every thread streaming weights. Run buffers (xs, act, y: O(T*k*
// max(H, 2I))) are kept by the kernel between runs (MoeWorkspace).
//
// Weights are packed into the GEMM's panels, in their own type (fp16/bf16 stay 16-bit and are
// widened in the micro-kernel), in huge-page-backed buffers: once at kernel creation when they are
// initializers (KernelInfo::GetTensorConstantInput, API 15+; a few threads), else per Compute for
// the experts in use.
#include "moe.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <system_error>
#include <thread>

#include "gemm.h"
#include "kernel_util.h"
#include "parallel.h"

namespace moe_onnx {
namespace {

enum { HIDDEN, ROUTING, INDICES, W0, B0, W1, B1, W2, N_INPUTS };
const char* kGemm2 = "GEMM2_BIAS_SWIGLU_CLAMP";
const char* kGemm3 = "GEMM3_SWIGLU";
const std::vector<ElemType> kFloatTypes = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16,
                                           ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16};

constexpr int64_t kHalf = kPanel / 2;  // gate (or up) columns per gate/up panel
constexpr int64_t kMaxRowBlock = 96;   // most rows of one task (A block per K block: 192 KB, in L2)
constexpr int64_t kPanelGroup = 8;     // panels of one task

// A row stride for n floats that is not a multiple of 4 KB (rows of a micro-kernel tile would share
// L1 sets): n rounded up to 16, plus 16 when that is a multiple of 256 (1 KB).
inline int64_t padded_ld(int64_t n) {
  const int64_t ld = (n + 15) / 16 * 16;
  return ld % 256 == 0 ? ld + 16 : ld;
}

struct WeightSrc {
  ExpertType type;
  int64_t parity;
  const Input* in[N_INPUTS];
};

// Packs expert e of the weights into slot `slot` of dst (whose E, H, I, type are set and buffers
// sized). Elem is the panels' element: float, or uint16_t (fp16/bf16 bits copied as they are).
template <class Elem>
void pack_expert_as(const WeightSrc& src, int64_t e, MoePacked& dst, int64_t slot, Elem* w0, Elem* w1) {
  const int64_t H = dst.H, I = dst.I;
  const int64_t p1 = panel_count(H);
  float* b0 = dst.b0.data() + slot * dst.b0_stride();
  float* b1 = dst.b1.data() + slot * H;
  std::fill(w0, w0 + dst.w0_stride(), Elem{});
  std::fill(b0, b0 + dst.b0_stride(), 0.0f);
  std::fill(w1, w1 + dst.w1_stride(), Elem{});
  std::fill(b1, b1 + H, 0.0f);
  const Elem* W0in = src.in[W0]->as<Elem>();
  const Elem* W1in = src.in[W1]->as<Elem>();
  if (src.type == ExpertType::kGemm2BiasSwigluClamp) {
    // weight_0 [E, H, 2I]: gate column c is 2c + parity, up column c is 2c + 1 - parity.
    for (int64_t h = 0; h < H; ++h) {
      const Elem* row = W0in + (e * H + h) * 2 * I;
      for (int64_t c = 0; c < I; ++c) {
        Elem* out = w0 + ((c / kHalf) * H + h) * kPanel + c % kHalf;
        out[0] = row[2 * c + src.parity];
        out[kHalf] = row[2 * c + 1 - src.parity];
      }
    }
    if (src.in[B0] && src.in[B0]->present) {
      const Input& B0in = *src.in[B0];
      for (int64_t c = 0; c < I; ++c) {
        const int64_t p = c / kHalf, l = c % kHalf;
        b0[p * kPanel + l] = load_float(B0in.type, B0in.data, e * 2 * I + 2 * c + src.parity);
        b0[p * kPanel + kHalf + l] = load_float(B0in.type, B0in.data, e * 2 * I + 2 * c + 1 - src.parity);
      }
    }
    // weight_1 [E, I, H] is already [K, N].
    for (int64_t i = 0; i < I; ++i) {
      const Elem* row = W1in + (e * I + i) * H;
      for (int64_t p = 0; p < p1; ++p) {
        const int64_t n = std::min<int64_t>(kPanel, H - p * kPanel);
        std::copy(row + p * kPanel, row + p * kPanel + n, w1 + (p * I + i) * kPanel);
      }
    }
    if (src.in[B1] && src.in[B1]->present)
      for (int64_t h = 0; h < H; ++h) b1[h] = load_float(src.in[B1]->type, src.in[B1]->data, e * H + h);
  } else {
    // gate = weight_0 [E, I, H], up = weight_1 [E, I, H] (x @ W^T), down = weight_2 [E, H, I].
    const Elem* W2in = src.in[W2]->as<Elem>();
    for (int64_t c = 0; c < I; ++c) {
      const Elem* g = W0in + (e * I + c) * H;
      const Elem* u = W1in + (e * I + c) * H;
      Elem* out = w0 + (c / kHalf) * H * kPanel + c % kHalf;
      for (int64_t h = 0; h < H; ++h) {
        out[h * kPanel] = g[h];
        out[h * kPanel + kHalf] = u[h];
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      const Elem* d = W2in + (e * H + h) * I;
      Elem* out = w1 + (h / kPanel) * I * kPanel + h % kPanel;
      for (int64_t i = 0; i < I; ++i) out[i * kPanel] = d[i];
    }
  }
}

void pack_expert(const WeightSrc& src, int64_t e, MoePacked& dst, int64_t slot) {
  if (dst.type == PanelType::kF32)
    pack_expert_as<float>(src, e, dst, slot, dst.w0.data() + slot * dst.w0_stride(),
                          dst.w1.data() + slot * dst.w1_stride());
  else {
    uint16_t* w0 = dst.w0h.data() + slot * dst.w0_stride();
    uint16_t* w1 = dst.w1h.data() + slot * dst.w1_stride();
    pack_expert_as<uint16_t>(src, e, dst, slot, w0, w1);
    if (dst.type == PanelType::kBF16) {
      bf16_interleave_rows(w0, dst.w0_stride() / kPanel);
      bf16_interleave_rows(w1, dst.w1_stride() / kPanel);
    }
  }
}

void allocate(MoePacked& packed, int64_t slots) {
  if (packed.type == PanelType::kF32) {
    packed.w0.resize(static_cast<size_t>(slots * packed.w0_stride()));
    packed.w1.resize(static_cast<size_t>(slots * packed.w1_stride()));
  } else {
    packed.w0h.resize(static_cast<size_t>(slots * packed.w0_stride()));
    packed.w1h.resize(static_cast<size_t>(slots * packed.w1_stride()));
  }
  packed.b0.assign(static_cast<size_t>(slots * packed.b0_stride()), 0.0f);
  packed.b1.assign(static_cast<size_t>(slots * packed.H), 0.0f);
}

struct Dims {
  int64_t T, k, E, H, I;
};

// The checks of moe.py's _validate, in its order and words. Returns the sizes.
Dims validate(const MoeKernel& kernel, const Checker& v) {
  v.expect_elem(HIDDEN);
  for (int i : {ROUTING, W0, B0, W1, B1, W2})
    if (v.has(i)) {
      v.expect_elem(i);
      v.expect_same_elem(i, HIDDEN);
    }
  v.expect_elem(INDICES);

  DimBinder dims(v);
  const auto& hidden = v.expect_rank(HIDDEN, -1, 2);
  dims.bind("H", hidden.back(), "input 'hidden_states' dim -1");
  dims.bind("T", product(hidden, 0, hidden.size() - 1), "input 'hidden_states' leading dims (product)");
  for (int i : {ROUTING, INDICES}) {
    const auto& shape = v.expect_rank(i, -1, 1);
    const std::string name = v.name(i);
    dims.bind("k", shape.back(), "input '" + name + "' dim -1");
    dims.bind("T", product(shape, 0, shape.size() - 1), "input '" + name + "' leading dims (product)");
  }
  const bool gemm2 = kernel.type == ExpertType::kGemm2BiasSwigluClamp;
  const char* type_name = gemm2 ? kGemm2 : kGemm3;
  std::vector<std::pair<int, std::vector<std::string>>> layout;
  if (gemm2)
    layout = {{W0, {"E", "H", "2I"}}, {B0, {"E", "2I"}}, {W1, {"E", "I", "H"}}, {B1, {"E", "H"}}};
  else
    layout = {{W0, {"E", "I", "H"}}, {W1, {"E", "I", "H"}}, {W2, {"E", "H", "I"}}};
  for (int i : gemm2 ? std::vector<int>{W0, W1} : std::vector<int>{W0, W1, W2}) v.require(i);
  for (int i : {B0, W1, B1, W2}) {
    const bool used = std::any_of(layout.begin(), layout.end(), [i](const auto& l) { return l.first == i; });
    if (v.has(i) && !used) v.fail(v.input_name(i), std::string("is given, but ") + type_name + " does not use it; leave it empty");
  }
  for (const auto& [i, symbols] : layout)
    if (v.has(i)) {
      v.expect_rank(i, static_cast<int>(symbols.size()));
      dims.shape(i, symbols);
    }
  return Dims{dims.get("T"), dims.get("k"), dims.get("E"), dims.get("H"), dims.get("I")};
}

void check_indices(const Input& in, int64_t E, const std::string& where) {
  for (int64_t f = 0; f < in.count; ++f) {
    const int64_t value = load_index(in, f);
    if (value < 0 || value >= E)
      throw_invalid(where + ": router_topk_output_indices" + fmt_position(in.shape, f) + " = " +
                    std::to_string(value) + " is outside [0, " + std::to_string(E) + ") (num_experts from weight_0)");
  }
}

}  // namespace

void* allocate_panels(size_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  if (bytes < 2 * kHuge) {
    void* p = std::malloc(bytes ? bytes : 1);
    if (!p) throw std::bad_alloc();
    return p;
  }
  const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, rounded);
  if (!p) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  madvise(p, rounded, MADV_HUGEPAGE);  // a hint: failure only costs TLB misses
#endif
  return p;
}

void free_panels(void* p, size_t) { std::free(p); }

int64_t MoePacked::w0_stride() const { return ((I + kHalf - 1) / kHalf) * H * kPanel; }
int64_t MoePacked::b0_stride() const { return ((I + kHalf - 1) / kHalf) * kPanel; }
int64_t MoePacked::w1_stride() const { return panel_count(H) * I * kPanel; }
const void* MoePacked::w0_at(int64_t slot) const {
  return type == PanelType::kF32 ? static_cast<const void*>(w0.data() + slot * w0_stride())
                                 : static_cast<const void*>(w0h.data() + slot * w0_stride());
}
const void* MoePacked::w1_at(int64_t slot) const {
  return type == PanelType::kF32 ? static_cast<const void*>(w1.data() + slot * w1_stride())
                                 : static_cast<const void*>(w1h.data() + slot * w1_stride());
}

// Every input is optional for onnxruntime, so that a missing one gets the op's own message.
OrtCustomOpInputOutputCharacteristic MoeOp::GetInputCharacteristic(size_t) const { return INPUT_OUTPUT_OPTIONAL; }

OrtStatusPtr MoeOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
  return create_kernel_status(api, kernel, [&] { return new MoeKernel(api, info); });
}

MoeKernel::MoeKernel(const OrtApi&, const OrtKernelInfo* info) {
  Ort::ConstKernelInfo kinfo(info);
  where = node_where(signatures::MOE.name, kinfo);
  const Attributes attrs(info, signatures::MOE, where);
  const std::string expert_type = attrs.get_string("expert_type");
  if (expert_type == kGemm2)
    type = ExpertType::kGemm2BiasSwigluClamp;
  else if (expert_type == kGemm3)
    type = ExpertType::kGemm3Swiglu;
  else
    attrs.fail("expert_type", "is '" + expert_type + "'; expected one of '" + kGemm2 + "', '" + kGemm3 + "'");
  alpha = attrs.get_float("expert_alpha");
  if (!std::isfinite(alpha)) attrs.fail("expert_alpha", "is " + py_float(alpha) + "; expected a finite number");
  beta = attrs.get_float("expert_beta");
  if (type == ExpertType::kGemm2BiasSwigluClamp) {
    if (std::isnan(beta) || beta == -INFINITY)
      attrs.fail("expert_beta", "is " + py_float(beta) + "; expected a finite number or inf");
    if (!(beta > 0)) attrs.fail("expert_beta", "is " + py_float(beta) + "; expected a value > 0");
  }
  parity = attrs.choice("gate_parity", {0, 1});

  // Constant weights: pack them all now, if every weight the expert type uses is an initializer
  // and their shapes agree (otherwise Compute packs per run and reports any error).
  std::vector<Input> inputs(N_INPUTS);
  const bool gemm2 = type == ExpertType::kGemm2BiasSwigluClamp;
  for (int i : {W0, B0, W1, B1, W2}) {
    if (!node_has_input(kinfo, i)) continue;
    inputs[i] = constant_input(kinfo, i);
    if (!inputs[i].present) return;  // a runtime weight: pack per Compute
  }
  auto is_float = [](const Input& in) {
    return std::find(kFloatTypes.begin(), kFloatTypes.end(), in.type) != kFloatTypes.end();
  };
  const Input& w0 = inputs[W0];
  const Input& w1 = inputs[W1];
  if (!w0.present || !w1.present || !is_float(w0) || w0.shape.size() != 3) return;
  const int64_t E = w0.shape[0];
  const int64_t H = gemm2 ? w0.shape[1] : w0.shape[2];
  const int64_t I = gemm2 ? w0.shape[2] / 2 : w0.shape[1];
  if (gemm2 && w0.shape[2] % 2) return;
  auto same = [&](const Input& in, std::vector<int64_t> shape) {
    return in.present && in.type == w0.type && in.shape == shape;
  };
  if (gemm2) {
    if (!same(w1, {E, I, H}) || inputs[W2].present) return;
    if (inputs[B0].present && !same(inputs[B0], {E, 2 * I})) return;
    if (inputs[B1].present && !same(inputs[B1], {E, H})) return;
  } else {
    if (!same(w1, {E, I, H}) || !same(inputs[W2], {E, H, I}) || inputs[B0].present || inputs[B1].present) return;
  }
  auto packed = std::make_unique<MoePacked>();
  packed->H = H;
  packed->I = I;
  packed->type = panel_type(w0.type);
  allocate(*packed, E);
  WeightSrc src{type, parity, {}};
  for (int i = 0; i < N_INPUTS; ++i) src.in[i] = &inputs[i];
  // Session creation has no intra-op pool: pack the experts on a few threads of our own (each expert
  // is packed by one thread into its own slot, so the result does not depend on the split).
  const int64_t n_threads = std::min<int64_t>({E, 8, std::max<int64_t>(1, std::thread::hardware_concurrency())});
  std::vector<std::thread> threads;
  auto pack_some = [&](int64_t first) {
    for (int64_t e = first; e < E; e += n_threads) pack_expert(src, e, *packed, e);
  };
  int64_t started = 1;
  try {
    for (; started < n_threads; ++started) threads.emplace_back(pack_some, started);
  } catch (const std::system_error&) {  // no threads to be had: this thread packs their share too
  }
  pack_some(0);
  for (int64_t i = started; i < n_threads; ++i) pack_some(i);
  for (auto& t : threads) t.join();
  for (int i : {W0, B0, W1, B1, W2}) constant_shapes[i] = inputs[i].present ? inputs[i].shape : std::vector<int64_t>{-1};
  constant = std::move(packed);
}

OrtStatusPtr MoeKernel::ComputeV2(OrtKernelContext* context) {
  return compute_status(where, [&] { Compute(context); });
}

void MoeKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  const std::vector<Input> inputs = read_inputs(ctx, N_INPUTS);
  const Checker v(where, signatures::MOE, inputs);
  const Dims d = validate(*this, v);
  const Input& idx = inputs[INDICES];
  check_indices(idx, d.E, where);

  const Input& x_in = inputs[HIDDEN];
  const ElemType T_type = x_in.type;
  Ort::UnownedValue out_value = ctx.GetOutput(0, x_in.shape);
  void* out = out_value.GetTensorMutableRawData();
  const int64_t T = d.T, k = d.k, H = d.H, I = d.I, E = d.E;
  if (T == 0 || H == 0) return;
  const int64_t S = T * k;  // slots
  if (S == 0 || (I == 0 && type == ExpertType::kGemm3Swiglu)) {
    // Nothing reaches any token (with I == 0, GEMM2 still adds its down bias: the general path).
    std::vector<float> zeros(static_cast<size_t>(H), 0.0f);
    for (int64_t t = 0; t < T; ++t)
      from_float(T_type, zeros.data(), static_cast<char*>(out) + t * H * elem_size(T_type), H);
    return;
  }

  // Slots sorted by expert (counting sort, stable).
  std::vector<int64_t> expert_of(static_cast<size_t>(S));
  for (int64_t f = 0; f < S; ++f) expert_of[f] = load_index(idx, f);
  std::vector<int64_t> start(static_cast<size_t>(E + 1), 0);
  for (int64_t f = 0; f < S; ++f) ++start[expert_of[f] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> order(static_cast<size_t>(S));  // position -> slot
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t f = 0; f < S; ++f) order[fill[expert_of[f]]++] = f;
  }
  std::vector<int64_t> used;
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) used.push_back(e);

  // Weights: the constant pack, or the experts in use packed now.
  const MoePacked* packed = nullptr;
  MoePacked local;
  std::vector<int64_t> slot_of_expert;  // expert -> slot in the packed buffers
  bool constant_ok = constant != nullptr;
  if (constant_ok)
    for (int i : {W0, B0, W1, B1, W2}) {
      const std::vector<int64_t> shape = inputs[i].present ? inputs[i].shape : std::vector<int64_t>{-1};
      if (shape != constant_shapes[i]) constant_ok = false;
    }
  if (constant_ok) {
    packed = constant.get();
    slot_of_expert.resize(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) slot_of_expert[e] = e;
  } else {
    local.H = H;
    local.I = I;
    local.type = panel_type(inputs[W0].type);
    allocate(local, static_cast<int64_t>(used.size()));
    slot_of_expert.assign(static_cast<size_t>(E), -1);
    for (size_t u = 0; u < used.size(); ++u) slot_of_expert[used[u]] = static_cast<int64_t>(u);
    WeightSrc src{type, parity, {}};
    for (int i = 0; i < N_INPUTS; ++i) src.in[i] = &inputs[i];
    parallel_for(ctx, used.size(), [&](size_t u) { pack_expert(src, used[u], local, static_cast<int64_t>(u)); });
    packed = &local;
  }

  // Gather the rows of x in sorted slot order, as fp32 (row stride padded off 4 KB multiples).
  const int64_t ldx = padded_ld(H);
  std::unique_ptr<MoeWorkspace> ws;
  {
    std::lock_guard<std::mutex> lock(workspace_mutex);
    ws = std::move(workspace);
  }
  if (!ws) ws = std::make_unique<MoeWorkspace>();
  struct GiveBack {
    MoeKernel* kernel;
    std::unique_ptr<MoeWorkspace>& ws;
    ~GiveBack() {
      std::lock_guard<std::mutex> lock(kernel->workspace_mutex);
      if (!kernel->workspace) kernel->workspace = std::move(ws);
    }
  } give_back{this, ws};
  float* xs = ws->get(ws->xs, static_cast<size_t>(S * ldx));
  const size_t esz = elem_size(T_type);
  size_t chunk = 1;
  size_t n_chunks = chunk_count(static_cast<size_t>(S), 16, 64, &chunk);
  parallel_for(ctx, n_chunks, [&](size_t c) {
    const int64_t end = std::min<int64_t>(S, static_cast<int64_t>((c + 1) * chunk));
    for (int64_t pos = static_cast<int64_t>(c * chunk); pos < end; ++pos)
      widen_row(panel_type(T_type), static_cast<const char*>(x_in.data) + (order[pos] / k) * H * esz, xs + pos * ldx, H);
  });

  // Tasks: (expert, first row, rows, first panel, last panel) for both GEMMs. An expert's rows are
  // split into as few blocks of equal size as fit kMaxRowBlock (each block reads the expert's weights
  // once); its panels into groups of kPanelGroup, so one expert's work (decode: one row) is spread
  // over every thread.
  struct Task {
    int64_t e, row0, rows, p0, p1;
  };
  auto make_tasks = [&](int64_t panels) {
    std::vector<Task> tasks;
    for (int64_t e : used) {
      const int64_t n = start[e + 1] - start[e];
      const int64_t blocks = (n + kMaxRowBlock - 1) / kMaxRowBlock;
      const int64_t block = (n + blocks - 1) / blocks;
      for (int64_t r = start[e]; r < start[e + 1]; r += block)
        for (int64_t p = 0; p < panels; p += kPanelGroup)
          tasks.push_back({e, r, std::min(block, start[e + 1] - r), p, std::min(panels, p + kPanelGroup)});
    }
    return tasks;
  };

  const int64_t P0 = (I + kHalf - 1) / kHalf;
  const int64_t ldact = padded_ld(P0 * kHalf);  // act row stride (I rounded up to the half panel, padded)
  float* act = ws->get(ws->act, static_cast<size_t>(S * ldact));
  const bool gemm2 = type == ExpertType::kGemm2BiasSwigluClamp;
  const PanelType ptype = packed->type;
  {
    const std::vector<Task> tasks = make_tasks(P0);
    parallel_for(ctx, tasks.size(), [&](size_t ti) {
      const Task& t = tasks[ti];
      const int64_t slot = slot_of_expert[t.e];
      const int64_t ldc = (t.p1 - t.p0) * kPanel;
      float* C = scratch<float>(static_cast<size_t>(t.rows * ldc));
      gemm_panels(ptype, xs + t.row0 * ldx, ldx, t.rows, H, packed->w0_at(slot), t.p0, t.p1, C, ldc);
      const float* bias = gemm2 ? packed->b0.data() + slot * packed->b0_stride() + t.p0 * kPanel : nullptr;
      gated_activation(gemm2, alpha, beta, C, ldc, bias, t.rows, t.p1 - t.p0,
                       act + t.row0 * ldact + t.p0 * kHalf, ldact);
    });
  }

  // y per slot (tokens-major: y[t*k + j]), weighted.
  const int64_t P1 = panel_count(H);
  float* y = ws->get(ws->y, static_cast<size_t>(S * H));
  const Input& rw = inputs[ROUTING];
  {
    const std::vector<Task> tasks = make_tasks(P1);
    parallel_for(ctx, tasks.size(), [&](size_t ti) {
      const Task& t = tasks[ti];
      const int64_t slot = slot_of_expert[t.e];
      const int64_t ldc = (t.p1 - t.p0) * kPanel;
      float* C = scratch<float>(static_cast<size_t>(t.rows * ldc));
      gemm_panels(ptype, act + t.row0 * ldact, ldact, t.rows, I, packed->w1_at(slot), t.p0, t.p1, C, ldc);
      const float* bias = packed->b1.data() + slot * H;
      for (int64_t r = 0; r < t.rows; ++r) {
        const int64_t f = order[t.row0 + r];
        const float w = load_float(rw.type, rw.data, f);
        const int64_t h0 = t.p0 * kPanel, h1 = std::min(H, t.p1 * kPanel);
        const float* src = C + r * ldc;
        float* dst = y + f * H + h0;
        const float* b = bias + h0;
        for (int64_t h = 0; h < h1 - h0; ++h) dst[h] = (src[h] + b[h]) * w;
      }
    });
  }

  // out[t] = sum_j y[t*k + j], j in order.
  n_chunks = chunk_count(static_cast<size_t>(T), 4, 64, &chunk);
  parallel_for(ctx, n_chunks, [&](size_t c) {
    float* row = scratch<float>(static_cast<size_t>(H));
    const int64_t end = std::min<int64_t>(T, static_cast<int64_t>((c + 1) * chunk));
    for (int64_t t = static_cast<int64_t>(c * chunk); t < end; ++t) {
      std::fill(row, row + H, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const float* src = y + (t * k + j) * H;
        for (int64_t h = 0; h < H; ++h) row[h] += src[h];
      }
      from_float(T_type, row, static_cast<char*>(out) + t * H * esz, H);
    }
  });
}

}  // namespace moe_onnx
