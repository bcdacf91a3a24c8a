// MOE kernel. Layout of the work (T tokens, k slots each, E experts, H hidden, I intermediate):
//
// 1. check_inputs: validate every input as moe_onnx/ops/moe.py's _validate does, with the same
//    messages, and the indices' range, before anything is indexed.
// 2. Route: sort the T*k slots by expert (task_plan.h's counting sort, stable: slot order inside an
//    expert is the token order); gather_rows copies their rows of hidden_states, as fp32, into one
//    [T*k, H] buffer: each expert's rows are contiguous, so its weights are read once per block of
//    up to 96 rows.
// 3. gate_up, per (expert, block of rows, group of panels) task: gate/up = x @ W0 (+ b0) with gate
//    and up side by side in one 16-wide panel (8 gate columns, the 8 matching up columns), the
//    expert type's activation (activation.h) in the epilogue on the task's [rows, 128] tile
//    -> act [T*k, I]; the [T*k, 2I] gate/up product is never stored. GEMM2_ACT (no gate): up =
//    x @ W0 (+ b0) in plain panels, its pointwise activation in the same epilogue.
// 4. down, per (expert, block of rows, group of panels) task: y = (act @ W1 + b1) * routing weight,
//    stored per slot.
// 5. sum_slots, per token: out[t] = sum over j = 0..k-1 of y[t*k + j], in that order, then to T.
// Every element is computed by one task in a fixed order, so 1 or N threads give the same bits.
// Tasks split every expert's columns into groups of 8 panels, so even one token (decode, bound by
// reading the weights) keeps every thread streaming weights. Run buffers (xs, act, y: O(T*k*
// max(H, 2I))) are kept by the kernel between runs (MoeWorkspace).
//
// Weights are packed into the GEMM's panels (packed_weights.h), in their own type (fp16/bf16 stay
// 16-bit and are widened in the micro-kernel): once at kernel creation when they are initializers
// (KernelInfo::GetTensorConstantInput, API 15+; a few threads), else per Compute for the experts in
// use.
#include "moe.h"

#include <algorithm>
#include <cmath>

#include "gemm.h"
#include "kernel_util.h"
#include "parallel.h"
#include "task_plan.h"

namespace moe_onnx {
namespace {

enum { HIDDEN, ROUTING, INDICES, W0, B0, W1, B1, W2, N_INPUTS };
const char* kGemm2 = "GEMM2_BIAS_SWIGLU_CLAMP";
const char* kGemm3 = "GEMM3_SWIGLU";
const char* kGemm2Act = "GEMM2_ACT";

const char* type_name(ExpertType type) {
  switch (type) {
    case ExpertType::kGemm2BiasSwigluClamp: return kGemm2;
    case ExpertType::kGemm3Swiglu: return kGemm3;
    case ExpertType::kGemm2Act: return kGemm2Act;
  }
  return kGemm2;
}
// Whether the first GEMM's panels are gate/up panels (8 gate, 8 up columns), not plain ones.
bool gated(ExpertType type) { return type != ExpertType::kGemm2Act; }

constexpr int64_t kHalf = kPanel / 2;  // gate (or up) columns per gate/up panel
// Tasks of up to 96 rows (A block per K block: 192 KB, in L2), an expert's rows in equal blocks,
// and 8 panels.
constexpr TaskShape kTaskShape{/*max_rows=*/96, /*equal_rows=*/true, /*max_panels=*/8, /*min_tasks=*/0};
enum { GATE_UP, DOWN };  // the packed matrices of an expert

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
  std::vector<std::pair<int, std::vector<std::string>>> layout;
  switch (kernel.type) {
    case ExpertType::kGemm2BiasSwigluClamp:
      layout = {{W0, {"E", "H", "2I"}}, {B0, {"E", "2I"}}, {W1, {"E", "I", "H"}}, {B1, {"E", "H"}}};
      break;
    case ExpertType::kGemm3Swiglu: layout = {{W0, {"E", "I", "H"}}, {W1, {"E", "I", "H"}}, {W2, {"E", "H", "I"}}}; break;
    case ExpertType::kGemm2Act:
      layout = {{W0, {"E", "I", "H"}}, {B0, {"E", "I"}}, {W1, {"E", "H", "I"}}, {B1, {"E", "H"}}};
      break;
  }
  const bool gemm3 = kernel.type == ExpertType::kGemm3Swiglu;
  for (int i : gemm3 ? std::vector<int>{W0, W1, W2} : std::vector<int>{W0, W1}) v.require(i);
  for (int i : {B0, W1, B1, W2}) {
    const bool used = std::any_of(layout.begin(), layout.end(), [i](const auto& l) { return l.first == i; });
    if (v.has(i) && !used)
      v.fail(v.input_name(i), std::string("is given, but ") + type_name(kernel.type) + " does not use it; leave it empty");
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

// Validation, then the indices' range: the sizes.
Dims check_inputs(const MoeKernel& kernel, const std::vector<Input>& inputs) {
  const Checker v(kernel.where, signatures::MOE, inputs);
  const Dims d = validate(kernel, v);
  check_indices(inputs[INDICES], d.E, kernel.where);
  return d;
}

// The weight inputs a pack is made from.
WeightSignature moe_signature(const std::vector<Input>& inputs) {
  return weight_signature({&inputs[W0], &inputs[B0], &inputs[W1], &inputs[B1], &inputs[W2]});
}

// Room for the experts in `slots`: gate/up B [H, 2I] in gate/up panels (GEMM2_ACT: up B [H, I] in
// plain panels), with the bias for the types that have one, and down B [I, H] with its bias (zeros
// when there is none).
PackedExperts empty_pack(ExpertType type, const std::vector<Input>& inputs, int64_t H, int64_t I, ExpertSlots slots) {
  PackedExperts p;
  const WeightFormat format = weight_format(inputs[W0].type);
  p.matrices.emplace_back(format, gated(type) ? 2 * I : I, H, slots.count(), type != ExpertType::kGemm3Swiglu);
  p.matrices.emplace_back(format, H, I, slots.count(), true);
  p.slots = std::move(slots);
  p.signature = moe_signature(inputs);
  return p;
}

// Packs the weights of the expert of `slot`.
void pack_slot(ExpertType type, int64_t parity, const std::vector<Input>& in, PackedExperts& p, int64_t slot) {
  const int64_t e = p.slots.expert_of_slot[slot];
  PackedWeights& gate_up = p.matrices[GATE_UP];
  PackedWeights& down = p.matrices[DOWN];
  const int64_t H = down.N(), I = down.K();
  if (type == ExpertType::kGemm2BiasSwigluClamp) {
    // weight_0 [E, H, 2I] and bias_0 [E, 2I]: gate column c is 2c + parity, up column c is 2c + 1 - parity.
    for (const int64_t lane0 : {int64_t{0}, kHalf}) {
      const int64_t column0 = lane0 == 0 ? parity : 1 - parity;
      gate_up.pack(slot, {in[W0].data, e * H * 2 * I + column0, 2 * I, 2, I, kHalf, lane0});
      if (in[B0].present) gate_up.pack_bias(slot, in[B0].type, {in[B0].data, e * 2 * I + column0, 0, 2, I, kHalf, lane0});
    }
    // weight_1 [E, I, H] is already [K, N].
    down.pack(slot, plain_columns(in[W1].data, e, I, H));
    if (in[B1].present) down.pack_bias(slot, in[B1].type, {in[B1].data, e * H, 0, 1, H});
  } else if (type == ExpertType::kGemm2Act) {
    // up = weight_0 [E, I, H] with bias_0 [E, I], down = weight_1 [E, H, I] with bias_1 [E, H] (x @ W^T).
    gate_up.pack(slot, transposed_columns(in[W0].data, e, I, H));
    if (in[B0].present) gate_up.pack_bias(slot, in[B0].type, {in[B0].data, e * I, 0, 1, I});
    down.pack(slot, transposed_columns(in[W1].data, e, H, I));
    if (in[B1].present) down.pack_bias(slot, in[B1].type, {in[B1].data, e * H, 0, 1, H});
  } else {
    // gate = weight_0 [E, I, H], up = weight_1 [E, I, H] (x @ W^T), down = weight_2 [E, H, I].
    ColumnSource gate = transposed_columns(in[W0].data, e, I, H), up = transposed_columns(in[W1].data, e, I, H);
    gate.width = up.width = kHalf;
    up.lane0 = kHalf;
    gate_up.pack(slot, gate);
    gate_up.pack(slot, up);
    down.pack(slot, transposed_columns(in[W2].data, e, H, I));
  }
}

// All experts packed at kernel creation when every weight the expert type uses is an initializer,
// their shapes agree and the matrices have elements (H, I > 0: the pack is then in proportion to the
// weights' data, whatever E is); else null (Compute packs per run and reports any error).
std::unique_ptr<PackedExperts> pack_constant_weights(const Ort::ConstKernelInfo& kinfo, ExpertType type,
                                                     int64_t parity) {
  std::vector<Input> inputs(N_INPUTS);
  const bool gemm2 = type == ExpertType::kGemm2BiasSwigluClamp;
  const bool act = type == ExpertType::kGemm2Act;
  for (int i : {W0, B0, W1, B1, W2}) {
    if (!node_has_input(kinfo, i)) continue;
    inputs[i] = constant_input(kinfo, i);
    if (!inputs[i].present) return nullptr;  // a runtime weight: pack per Compute
  }
  const Input& w0 = inputs[W0];
  const Input& w1 = inputs[W1];
  if (!w0.present || !w1.present || !signatures::MOE.inputs[W0].allows(w0.type) || w0.shape.size() != 3) return nullptr;
  const int64_t E = w0.shape[0];
  const int64_t H = gemm2 ? w0.shape[1] : w0.shape[2];
  const int64_t I = gemm2 ? w0.shape[2] / 2 : w0.shape[1];
  if ((gemm2 && w0.shape[2] % 2) || H == 0 || I == 0) return nullptr;
  auto same = [&](const Input& in, std::vector<int64_t> shape) {
    return in.present && in.type == w0.type && in.shape == shape;
  };
  if (gemm2 || act) {
    if (!same(w1, gemm2 ? std::vector<int64_t>{E, I, H} : std::vector<int64_t>{E, H, I}) || inputs[W2].present)
      return nullptr;
    if (inputs[B0].present && !same(inputs[B0], {E, gemm2 ? 2 * I : I})) return nullptr;
    if (inputs[B1].present && !same(inputs[B1], {E, H})) return nullptr;
  } else {
    if (!same(w1, {E, I, H}) || !same(inputs[W2], {E, H, I}) || inputs[B0].present || inputs[B1].present)
      return nullptr;
  }
  auto packed = std::make_unique<PackedExperts>(empty_pack(type, inputs, H, I, ExpertSlots::all(E)));
  pack_on_own_threads(E, [&](int64_t slot) { pack_slot(type, parity, inputs, *packed, slot); });
  return packed;
}

// Nothing reaches any token (no slots, or I == 0 without a down bias; with I == 0, GEMM2 still adds
// its down bias: the general path): out = 0.
void write_zeros(ElemType type, const Dims& d, char* out) {
  const std::vector<float> zeros(static_cast<size_t>(d.H), 0.0f);
  for (int64_t t = 0; t < d.T; ++t) from_float(type, zeros.data(), out + t * d.H * elem_size(type), d.H);
}

// The kernel's run buffers for one Compute: taken from the kernel (new ones while another run holds
// them) and given back at the end unless another run already has.
class WorkspaceLease {
 public:
  explicit WorkspaceLease(MoeKernel& kernel) : kernel_(kernel) {
    std::lock_guard<std::mutex> lock(kernel_.workspace_mutex);
    ws_ = std::move(kernel_.workspace);
    if (!ws_) ws_ = std::make_unique<MoeWorkspace>();
  }
  ~WorkspaceLease() {
    std::lock_guard<std::mutex> lock(kernel_.workspace_mutex);
    if (!kernel_.workspace) kernel_.workspace = std::move(ws_);
  }
  MoeWorkspace& get() { return *ws_; }

 private:
  MoeKernel& kernel_;
  std::unique_ptr<MoeWorkspace> ws_;
};

// Steps 2-5 of one Compute on checked inputs, each a parallel pass over the run buffers.
struct MoeRun {
  Ort::KernelContext& ctx;
  const Dims& d;
  const SlotsByExpert& sorted;  // the T*k slots by expert: rows of xs, act in this order
  const PackedExperts& weights;
  MoeWorkspace& ws;
  int64_t ldx = 0, ldact = 0;  // row strides of xs and act
  float *xs = nullptr, *act = nullptr, *y = nullptr;

  int64_t slots() const { return d.T * d.k; }
  std::vector<Task> tasks(const PackedWeights& w) const {
    return make_tasks(sorted.start.data(), d.E, w.panels(), kTaskShape);
  }

  // xs[position] = the hidden_states row of the slot at that sorted position, as fp32.
  void gather_rows(const Input& x) {
    ldx = gemm_row_stride(d.H);
    xs = ws.get(ws.xs, static_cast<size_t>(slots() * ldx));
    const size_t row_bytes = static_cast<size_t>(d.H) * elem_size(x.type);
    const PanelType x_panel = panel_type(x.type);
    size_t chunk = 1;
    const size_t n_chunks = chunk_count(static_cast<size_t>(slots()), 16, 64, &chunk);
    parallel_for(ctx, n_chunks, [&](size_t c) {
      const int64_t end = std::min<int64_t>(slots(), static_cast<int64_t>((c + 1) * chunk));
      for (int64_t pos = static_cast<int64_t>(c * chunk); pos < end; ++pos)
        widen_row(x_panel, static_cast<const char*>(x.data) + (sorted.order[pos] / d.k) * row_bytes, xs + pos * ldx,
                  d.H);
    });
  }

  // act = activation(xs @ W0 (+ b0)), I columns (rounded up to the half panel, GEMM2_ACT: the panel)
  // per row.
  void gate_up(const MoeKernel& kernel) {
    const PackedWeights& w = weights.matrices[GATE_UP];
    const int64_t act_columns = gated(kernel.type) ? kHalf : kPanel;  // per panel of W0
    ldact = gemm_row_stride(w.panels() * act_columns);
    act = ws.get(ws.act, static_cast<size_t>(slots() * ldact));
    const std::vector<Task> plan = tasks(w);
    parallel_for(ctx, plan.size(), [&](size_t ti) {
      const Task& t = plan[ti];
      const int64_t slot = weights.slots.slot_of_expert[t.expert];
      const int64_t ldc = (t.p1 - t.p0) * kPanel;
      float* C = scratch<float>(static_cast<size_t>(t.rows * ldc));
      gemm_panels(gemm_panel_type(w.format()), xs + t.row0 * ldx, ldx, t.rows, d.H, w.at(slot), t.p0, t.p1, C, ldc);
      const float* bias = w.bias_at(slot);
      if (bias) bias += t.p0 * kPanel;
      float* dst = act + t.row0 * ldact + t.p0 * act_columns;
      if (gated(kernel.type))
        kernel.activation.apply(C, ldc, bias, t.rows, t.p1 - t.p0, dst, ldact);
      else
        kernel.pointwise.apply(C, ldc, bias, t.rows, t.p1 - t.p0, dst, ldact);
    });
  }

  // y[slot] = (act @ W1 + b1) * the slot's routing weight, per slot (tokens-major: y[t*k + j]).
  void down(const Input& routing) {
    const PackedWeights& w = weights.matrices[DOWN];
    const int64_t H = d.H;
    y = ws.get(ws.y, static_cast<size_t>(slots() * H));
    const std::vector<Task> plan = tasks(w);
    parallel_for(ctx, plan.size(), [&](size_t ti) {
      const Task& t = plan[ti];
      const int64_t slot = weights.slots.slot_of_expert[t.expert];
      const int64_t ldc = (t.p1 - t.p0) * kPanel;
      float* C = scratch<float>(static_cast<size_t>(t.rows * ldc));
      gemm_panels(gemm_panel_type(w.format()), act + t.row0 * ldact, ldact, t.rows, d.I, w.at(slot), t.p0, t.p1, C,
                  ldc);
      const int64_t h0 = t.p0 * kPanel, h1 = std::min(H, t.p1 * kPanel);
      const float* b = w.bias_at(slot) + h0;
      for (int64_t r = 0; r < t.rows; ++r) {
        const int64_t f = sorted.order[t.row0 + r];
        const float weight = load_float(routing.type, routing.data, f);
        const float* src = C + r * ldc;
        float* dst = y + f * H + h0;
        for (int64_t h = 0; h < h1 - h0; ++h) dst[h] = (src[h] + b[h]) * weight;
      }
    });
  }

  // out[t] = sum over j of y[t*k + j], j in order, converted to the output's type.
  void sum_slots(ElemType type, char* out) {
    const int64_t H = d.H, k = d.k;
    const size_t row_bytes = static_cast<size_t>(H) * elem_size(type);
    size_t chunk = 1;
    const size_t n_chunks = chunk_count(static_cast<size_t>(d.T), 4, 64, &chunk);
    parallel_for(ctx, n_chunks, [&](size_t c) {
      float* row = scratch<float>(static_cast<size_t>(H));
      const int64_t end = std::min<int64_t>(d.T, static_cast<int64_t>((c + 1) * chunk));
      for (int64_t t = static_cast<int64_t>(c * chunk); t < end; ++t) {
        std::fill(row, row + H, 0.0f);
        for (int64_t j = 0; j < k; ++j) {
          const float* src = y + (t * k + j) * H;
          for (int64_t h = 0; h < H; ++h) row[h] += src[h];
        }
        from_float(type, row, out + t * row_bytes, H);
      }
    });
  }
};

}  // namespace

// Every input is optional for onnxruntime, so that a missing one gets the op's own message.
OrtCustomOpInputOutputCharacteristic MoeOp::GetInputCharacteristic(size_t) const { return INPUT_OUTPUT_OPTIONAL; }

OrtStatusPtr MoeOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
  return create_kernel_status(api, signatures::MOE.name, info, kernel, [&] { return new MoeKernel(api, info); });
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
  else if (expert_type == kGemm2Act)
    type = ExpertType::kGemm2Act;
  else
    attrs.fail("expert_type", "is " + py_str(expert_type) + "; expected one of '" + kGemm2 + "', '" + kGemm3 + "', '" +
                                  kGemm2Act + "'");
  const float alpha = attrs.get_float("expert_alpha");
  if (!std::isfinite(alpha)) attrs.fail("expert_alpha", "is " + py_float(alpha) + "; expected a finite number");
  const float beta = attrs.get_float("expert_beta");
  if (type == ExpertType::kGemm2BiasSwigluClamp) {
    if (std::isnan(beta) || beta == -INFINITY)
      attrs.fail("expert_beta", "is " + py_float(beta) + "; expected a finite number or inf");
    if (!(beta > 0)) attrs.fail("expert_beta", "is " + py_float(beta) + "; expected a value > 0");
  }
  parity = attrs.choice("gate_parity", {0, 1});
  read_activation(attrs, alpha, beta);
  const bool gemm2 = type == ExpertType::kGemm2BiasSwigluClamp;
  activation = {gemm2 ? GatedActivation::Form::kClampedSwiglu : GatedActivation::Form::kSwiglu, alpha, beta};
  constant = pack_constant_weights(kinfo, type, parity);
}

// moe.py's _check_activation: GEMM2_ACT names its activation and leaves the SwiGLU attributes at
// their defaults; the SwiGLU types name none.
void MoeKernel::read_activation(const Attributes& attrs, float alpha, float beta) {
  const std::string name = attrs.get_string("activation");
  if (type != ExpertType::kGemm2Act) {
    if (!name.empty())
      attrs.fail("activation", "is " + py_str(name) + "; " + type_name(type) +
                                   " does not use it (its activation is SwiGLU): leave it empty");
    return;
  }
  if (name.empty()) attrs.fail("activation", std::string("is required for ") + kGemm2Act);
  if (!pointwise_form(name, &pointwise.form))
    attrs.fail("activation", "is " + py_str(name) + "; expected one of " + pointwise_names());
  const auto unused = [&](const char* attr, const std::string& value, const char* default_text) {
    attrs.fail(attr, "is " + value + "; " + kGemm2Act + " does not use it: leave the default " + default_text);
  };
  if (alpha != 1.0f) unused("expert_alpha", py_float(alpha), "1.0");
  if (!(beta == 0.0f)) unused("expert_beta", py_float(beta), "0.0");
  if (parity != 0) unused("gate_parity", std::to_string(parity), "0");
}

OrtStatusPtr MoeKernel::ComputeV2(OrtKernelContext* context) {
  return compute_status(where, [&] { Compute(context); });
}

void MoeKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  const std::vector<Input> inputs = read_inputs(ctx, N_INPUTS);
  const Dims d = check_inputs(*this, inputs);
  const Input& x = inputs[HIDDEN];
  Ort::UnownedValue out_value = ctx.GetOutput(0, x.shape);
  char* out = static_cast<char*>(out_value.GetTensorMutableRawData());
  if (d.T == 0 || d.H == 0) return;
  if (d.k == 0 || (d.I == 0 && !inputs[B1].present)) return write_zeros(x.type, d, out);
  const SlotsByExpert sorted = sort_slots_by_expert(inputs[INDICES], 0, d.E);
  PackedExperts local;
  const PackedExperts& weights = experts_for_run(
      ctx, constant.get(), moe_signature(inputs), sorted.start.data(), d.E, local,
      [&](ExpertSlots slots) { return empty_pack(type, inputs, d.H, d.I, std::move(slots)); },
      [&](PackedExperts& p, int64_t slot) { pack_slot(type, parity, inputs, p, slot); });
  WorkspaceLease workspace(*this);
  MoeRun run{ctx, d, sorted, weights, workspace.get()};
  run.gather_rows(x);
  run.gate_up(*this);
  run.down(inputs[ROUTING]);
  run.sum_slots(x.type, out);
}

}  // namespace moe_onnx
