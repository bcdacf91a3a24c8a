#include "expert_block.h"

#include <algorithm>
#include <cmath>

#include "attributes.h"
#include "float_rows.h"
#include "messages.h"
#include "parallel.h"
#include "status.h"

namespace moe_onnx {
namespace {

// Tasks of up to 96 rows (A block per K block: 192 KB, in L2), an expert's rows in equal blocks,
// and 8 panels.
constexpr TaskShape kTaskShape{/*max_rows=*/96, /*equal_rows=*/true, /*max_panels=*/8, /*min_tasks=*/0};

// moe.py's _check_activation: GEMM2_ACT names its activation and leaves the SwiGLU attributes at
// their defaults; the SwiGLU types name none.
void read_activation(const Attributes& attrs, ExpertConfig& config, float alpha, float beta) {
  const std::string name = attrs.get_string("activation");
  const char* gemm2_act = choice_name(ExpertType::kGemm2Act);
  if (config.type != ExpertType::kGemm2Act) {
    if (!name.empty())
      attrs.fail("activation", "is " + py_str(name) + "; " + choice_name(config.type) +
                                   " does not use it (its activation is SwiGLU): leave it empty");
    return;
  }
  if (name.empty()) attrs.fail("activation", std::string("is required for ") + gemm2_act);
  config.pointwise.form = attrs.choice<Activation>();
  const auto unused = [&](const char* attr, const std::string& value, const char* default_text) {
    attrs.fail(attr, "is " + value + "; " + gemm2_act + " does not use it: leave the default " + default_text);
  };
  if (alpha != 1.0f) unused("expert_alpha", py_float(alpha), "1.0");
  if (!(beta == 0.0f)) unused("expert_beta", py_float(beta), "0.0");
  if (config.parity != 0) unused("gate_parity", std::to_string(config.parity), "0");
}

// Nothing reaches any token (no slots, or I == 0 without a down bias; with I == 0, GEMM2 still adds
// its down bias: the general path): out = 0.
void write_zeros(ElemType type, const MoeDims& d, char* out) {
  const std::vector<float> zeros(static_cast<size_t>(d.H), 0.0f);
  for (int64_t t = 0; t < d.T; ++t) narrow_row(float_type(type), zeros.data(), out + t * d.H * elem_size(type), d.H);
}

// Steps 2-5 of one Compute on checked inputs, each a parallel pass over the run buffers. The GEMMs'
// rows (xs, act) are fp32, or bf16 when the weights are bf16 pair panels (accuracy_level 3,
// bf16_gemm.h): then gather_rows rounds hidden_states' rows to bf16 and gate_up its activations, each
// value once. QMOE's level 4 (int8 activations, qgemm.h) quantizes each row of xs and act once
// (xq, actq), and every panel task of the row reads it.
struct MoeRun {
  Ort::KernelContext& ctx;
  const MoeDims& d;
  const SlotsByExpert& sorted;  // the T*k slots by expert: rows of xs, act in this order
  const PackedExperts& weights;
  Workspace& ws;                // the run's buffers
  int64_t ldx = 0, ldact = 0;  // row strides of xs and act (elements)
  float *xs = nullptr, *act = nullptr, *y = nullptr;
  uint16_t *xs16 = nullptr, *act16 = nullptr;  // bf16 rows in place of xs, act
  Int8Rows xq{}, actq{};                       // level 4: xs and act quantized

  bool bf16_rows() const { return weights.matrices[GATE_UP].takes_bf16_rows(); }

  int64_t slots() const { return d.T * d.k; }
  std::vector<Task> tasks(const PackedWeights& w) const {
    return make_tasks(sorted.start.data(), d.E, w.panels(), kTaskShape);
  }

  // For every task of w's plan, on the pool: C = the task's rows of A times its panels of the expert's
  // matrix w (A's rows in the form w takes: bf16 a16, quantized aq at level 4, or fp32 a; ld apart), a
  // tile of the task's scratch (`what`), then epilogue(t, slot, C, ldc, scratch).
  template <class Epilogue>
  void for_each_tile(const PackedWeights& w, const char* what, const float* a, const uint16_t* a16, const Int8Rows& aq,
                     int64_t ld, Epilogue&& epilogue) {
    const std::vector<Task> plan = tasks(w);
    parallel_for(ctx, plan.size(), [&](size_t ti) {
      const Task& t = plan[ti];
      const int64_t slot = weights.slots.slot_of_expert[t.expert];
      const int64_t ldc = (t.p1 - t.p0) * kPanel;
      Scratch scratch;
      float* C = scratch.take<float>(t.rows * ldc, what);
      if (a16)
        w.multiply(slot, a16 + t.row0 * ld, ld, t.rows, t.p0, t.p1, C, ldc);
      else if (aq.qa)
        w.multiply(slot, aq.from(t.row0), t.rows, t.p0, t.p1, C, ldc);
      else
        w.multiply(slot, a + t.row0 * ld, ld, t.rows, t.p0, t.p1, C, ldc);
      epilogue(t, slot, C, ldc, scratch);
    });
  }

  // xs[position] = the hidden_states row of the slot at that sorted position, as fp32.
  // (bf16 rows: xs16, zero padded to bf16_padded_k(H); level 4: only xq, each row quantized from
  // hidden_states' row, fp32 as it is, else widened into a scratch row first.)
  void gather_rows(const Input& x) {
    const bool bf16 = bf16_rows();
    const PackedWeights& w = weights.matrices[GATE_UP];
    ldx = bf16 ? bf16_row_stride(d.H) : gemm_row_stride(d.H);
    if (w.takes_int8_rows())
      xq = w.int8_rows(slots(), ws);
    else if (bf16)
      xs16 = ws.take<uint16_t>(slots() * ldx, "the gathered rows");
    else
      xs = ws.take<float>(slots() * ldx, "the gathered rows");
    const size_t row_bytes = static_cast<size_t>(d.H) * elem_size(x.type);
    const FloatType x_type = float_type(x.type);
    size_t chunk = 1;
    const size_t n_chunks = chunk_count(static_cast<size_t>(slots()), 16, 64, &chunk);
    parallel_for(ctx, n_chunks, [&](size_t c) {
      const int64_t begin = static_cast<int64_t>(c * chunk);
      const int64_t end = std::min<int64_t>(slots(), static_cast<int64_t>((c + 1) * chunk));
      Scratch scratch;
      float* widened = xq.qa && x_type != FloatType::kF32 ? scratch.take<float>(d.H, "a widened row") : nullptr;
      for (int64_t pos = begin; pos < end; ++pos) {
        const char* row = static_cast<const char*>(x.data) + (sorted.order[pos] / d.k) * row_bytes;
        if (xq.qa) {
          if (widened) widen_row(x_type, row, widened, d.H);
          w.quantize_rows(widened ? widened : reinterpret_cast<const float*>(row), d.H, 1, xq.from(pos));
        } else if (bf16) {
          bf16_row(x_type, row, d.H, xs16 + pos * ldx);
        } else {
          widen_row(x_type, row, xs + pos * ldx, d.H);
        }
      }
    });
  }

  // Level 4: act's rows quantized for down (actq).
  void quantize_activations() {
    const PackedWeights& w = weights.matrices[DOWN];
    actq = w.int8_rows(slots(), ws);
    parallel_chunks(ctx, slots(), 16, [&](int64_t begin, int64_t end) {
      w.quantize_rows(act + begin * ldact, ldact, end - begin, actq.from(begin));
    });
  }

  // act = activation(xs @ W0 (+ b0)), I columns (rounded up to the half panel, GEMM2_ACT: the panel)
  // per row. (bf16 rows: act16, each task's activations rounded from an fp32 tile; the task of the last
  // panels writes the zeros up to bf16_padded_k(I), down's K.)
  void gate_up(const ExpertConfig& config) {
    const PackedWeights& w = weights.matrices[GATE_UP];
    const bool bf16 = bf16_rows();
    const int64_t act_columns = config.gated() ? kHalfPanel : kPanel;  // per panel of W0
    const int64_t act_width = w.panels() * act_columns, down_k = weights.matrices[DOWN].K();
    ldact = bf16 ? bf16_row_stride(down_k) : gemm_row_stride(act_width);
    if (bf16)
      act16 = ws.take<uint16_t>(slots() * ldact, "the activations");
    else
      act = ws.take<float>(slots() * ldact, "the activations");
    const auto activate = [&](const Task& t, int64_t slot, const float* C, int64_t ldc, Scratch& scratch) {
      const float* bias = w.bias_at(slot);
      if (bias) bias += t.p0 * kPanel;
      const int64_t width = (t.p1 - t.p0) * act_columns;  // the task's activations per row
      float* dst = bf16 ? scratch.take<float>(t.rows * width, "a task's activations")
                        : act + t.row0 * ldact + t.p0 * act_columns;
      const int64_t ldd = bf16 ? width : ldact;
      if (config.gated())
        config.activation.apply(C, ldc, bias, t.rows, t.p1 - t.p0, dst, ldd);
      else
        config.pointwise.apply(C, ldc, bias, t.rows, t.p1 - t.p0, dst, ldd);
      if (!bf16) return;
      const int64_t pad = t.p1 == w.panels() ? bf16_padded_k(down_k) - act_width : 0;
      for (int64_t r = 0; r < t.rows; ++r) {
        uint16_t* row = act16 + (t.row0 + r) * ldact + t.p0 * act_columns;
        round_to_bf16(FloatType::kF32, dst + r * width, width, row);
        std::fill(row + width, row + width + pad, uint16_t{0});
      }
    };
    for_each_tile(w, "a task's gate/up tile", xs, xs16, xq, ldx, activate);
  }

  // y[slot] = (act @ W1 (+ b1)) * the slot's routing weight, per slot (tokens-major: y[t*k + j]).
  void down(const Input& routing, bool add_bias) {
    const PackedWeights& w = weights.matrices[DOWN];
    const int64_t H = d.H;
    y = ws.take<float>(slots() * H, "the weighted expert outputs");
    const FloatType routing_type = float_type(routing.type);
    if (w.takes_int8_rows()) quantize_activations();
    const auto weigh = [&](const Task& t, int64_t slot, const float* C, int64_t ldc, Scratch&) {
      const int64_t h0 = t.p0 * kPanel, h1 = std::min(H, t.p1 * kPanel);
      const float* b = add_bias ? w.bias_at(slot) + h0 : nullptr;
      for (int64_t r = 0; r < t.rows; ++r) {
        const int64_t f = sorted.order[t.row0 + r];
        const float weight = load_float(routing_type, routing.data, f);
        const float* src = C + r * ldc;
        float* dst = y + f * H + h0;
        if (b)
          for (int64_t h = 0; h < h1 - h0; ++h) dst[h] = (src[h] + b[h]) * weight;
        else
          for (int64_t h = 0; h < h1 - h0; ++h) dst[h] = src[h] * weight;
      }
    };
    for_each_tile(w, "a task's down tile", act, act16, actq, ldact, weigh);
  }

  // store(t, row) for every token t, row = sum over j of y[t*k + j] (float32, j in order).
  template <class Store>
  void sum_slots(Store&& store) {
    const int64_t H = d.H, k = d.k;
    size_t chunk = 1;
    const size_t n_chunks = chunk_count(static_cast<size_t>(d.T), 4, 64, &chunk);
    parallel_for(ctx, n_chunks, [&](size_t c) {
      Scratch scratch;
      float* row = scratch.take<float>(H, "a token's sum");
      const int64_t end = std::min<int64_t>(d.T, static_cast<int64_t>((c + 1) * chunk));
      for (int64_t t = static_cast<int64_t>(c * chunk); t < end; ++t) {
        std::fill(row, row + H, 0.0f);
        for (int64_t j = 0; j < k; ++j) {
          const float* src = y + (t * k + j) * H;
          for (int64_t h = 0; h < H; ++h) row[h] += src[h];
        }
        store(t, row);
      }
    });
  }
};

// The [T, H] float32 rows of `partial` converted to `type` in `out`.
void round_rows(Ort::KernelContext& ctx, const MoeDims& d, const float* partial, ElemType type, char* out) {
  const size_t row_bytes = static_cast<size_t>(d.H) * elem_size(type);
  const FloatType out_type = float_type(type);
  size_t chunk = 1;
  const size_t n_chunks = chunk_count(static_cast<size_t>(d.T), 4, 64, &chunk);
  parallel_for(ctx, n_chunks, [&](size_t c) {
    const int64_t end = std::min<int64_t>(d.T, static_cast<int64_t>((c + 1) * chunk));
    for (int64_t t = static_cast<int64_t>(c * chunk); t < end; ++t)
      narrow_row(out_type, partial + t * d.H, out + t * row_bytes, d.H);
  });
}

}  // namespace

ExpertConfig ExpertConfig::read(const Attributes& attrs) {
  ExpertConfig config;
  config.type = attrs.choice<ExpertType>();
  const float alpha = attrs.get_float("expert_alpha");
  if (!std::isfinite(alpha)) attrs.fail("expert_alpha", "is " + py_float(alpha) + "; expected a finite number");
  const float beta = attrs.get_float("expert_beta");
  const bool gemm2 = config.type == ExpertType::kGemm2BiasSwigluClamp;
  if (gemm2) {
    if (std::isnan(beta) || beta == -INFINITY)
      attrs.fail("expert_beta", "is " + py_float(beta) + "; expected a finite number or inf");
    if (!(beta > 0)) attrs.fail("expert_beta", "is " + py_float(beta) + "; expected a value > 0");
  }
  config.parity = attrs.choice("gate_parity", {0, 1});
  read_activation(attrs, config, alpha, beta);
  config.activation = {gemm2 ? GatedActivation::Form::kClampedSwiglu : GatedActivation::Form::kSwiglu, alpha, beta};
  return config;
}

ElemType validate_tokens(const Checker& v, std::initializer_list<int> same_type, DimBinder& dims) {
  enum { HIDDEN, ROUTING, INDICES };
  const ElemType elem = v.expect_elem(HIDDEN);
  for (int i : same_type)
    if (v.has(i)) {
      v.expect_elem(i);
      v.expect_same_elem(i, HIDDEN);
    }
  v.expect_elem(INDICES);
  const auto& hidden = v.expect_rank(HIDDEN, -1, 2);
  dims.bind("H", hidden.back(), "input 'hidden_states' dim -1");
  dims.bind("T", product(hidden, 0, hidden.size() - 1), "input 'hidden_states' leading dims (product)");
  for (int i : {ROUTING, INDICES}) {
    const auto& shape = v.expect_rank(i, -1, 1);
    const std::string name = v.name(i);
    dims.bind("k", shape.back(), "input '" + name + "' dim -1");
    dims.bind("T", product(shape, 0, shape.size() - 1), "input '" + name + "' leading dims (product)");
  }
  return elem;
}

void check_indices(const Input& in, int64_t E, const std::string& where) {
  for (int64_t f = 0; f < in.count; ++f) {
    const int64_t value = load_index(in, f);
    if (value < 0 || value >= E)
      throw_invalid(where + ": router_topk_output_indices" + fmt_position(in.shape, f) + " = " +
                    std::to_string(value) + " is outside [0, " + std::to_string(E) + ") (num_experts from weight_0)");
  }
}

std::unique_ptr<ConstantExperts> constant_experts(const Ort::ConstKernelInfo& kinfo, const OpSignature& op,
                                                  const std::string& where, const std::vector<int>& weights,
                                                  const std::function<void(const Checker&, DimBinder&)>& check_weights,
                                                  const ExpertPacker& packer, const PackedWeightsFiles* files) {
  std::vector<Input> inputs(op.inputs.size());
  for (int i : weights) {
    if (!node_has_input(kinfo, i)) continue;
    inputs[i] = constant_input(kinfo, i);
    if (!inputs[i].present) return nullptr;  // a runtime weight: pack per run
  }
  const Checker v(where, op, inputs);
  DimBinder dims(v);
  try {
    check_weights(v, dims);
  } catch (const Ort::Exception&) {
    return nullptr;  // Compute reports it
  }
  const int64_t E = dims.get("E"), H = dims.get("H"), I = dims.get("I");
  if (H == 0 || I == 0) return nullptr;
  return std::make_unique<ConstantExperts>(
      E, [&](ExpertSlots slots) { return packer.empty(inputs, H, I, std::move(slots)); },
      [packer, inputs](PackedExperts& p, int64_t slot) { packer.pack(inputs, p, slot); }, inputs,
      packed_file_request(files, kinfo, op.name, where, weights));
}

WorkspacePool& run_workspaces() {
  static auto* pool = new WorkspacePool(2);  // never destroyed: a lease may end during exit
  return *pool;
}

void run_experts(Ort::KernelContext& ctx, const ExpertConfig& config, const MoeDims& d, const Input& hidden,
                 const Input& routing, const Input& indices, bool down_bias, const ExpertWeights& experts,
                 char* out, const TensorParallel& tp) {
  if (d.T == 0 || d.H == 0) return;  // the same on every TP rank (the same tokens)
  const bool add_down_bias = down_bias && (!tp.group || tp.group->rank() == 0);
  // Whether some expert output reaches a token (this rank's I-slice may be empty, its bias absent).
  const bool any_output = d.k > 0 && (d.I > 0 || add_down_bias);
  if (!tp.group && !any_output) return write_zeros(hidden.type, d, out);
  const WorkspacePool::Lease buffers = run_workspaces().lease();
  float* partial = nullptr;  // TP: this rank's y in float32, then the group's sum
  if (tp.group) {
    partial = buffers->take<float>(d.T * d.H, "the partial outputs");
    if (!any_output) std::fill(partial, partial + d.T * d.H, 0.0f);  // else sum_slots writes every row
  }
  if (any_output) {
    const SlotsByExpert sorted = sort_slots_by_expert(indices, 0, d.E);
    PackedExperts local;
    const PackedExperts& weights = experts_for_run(
        ctx, experts.cache, sorted.start.data(), d.E, local,
        [&](ExpertSlots slots) { return experts.packer.empty(experts.inputs, d.H, d.I, std::move(slots)); },
        [&](PackedExperts& p, int64_t slot) { experts.packer.pack(experts.inputs, p, slot); });
    MoeRun run{ctx, d, sorted, weights, *buffers};
    run.gather_rows(hidden);
    run.gate_up(config);
    run.down(routing, add_down_bias);
    const size_t row_bytes = static_cast<size_t>(d.H) * elem_size(hidden.type);
    const FloatType out_type = float_type(hidden.type);
    if (partial)
      run.sum_slots([&](int64_t t, const float* row) { std::copy(row, row + d.H, partial + t * d.H); });
    else
      run.sum_slots([&](int64_t t, const float* row) { narrow_row(out_type, row, out + t * row_bytes, d.H); });
  }
  if (!partial) return;
  tp.group->all_reduce_sum(partial, d.T * d.H, tp.where, "the partial outputs");
  round_rows(ctx, d, partial, hidden.type, out);
}

}  // namespace moe_onnx
