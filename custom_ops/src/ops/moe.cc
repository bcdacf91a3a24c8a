// MOE kernel. Layout of the work (T tokens, k slots each, E experts, H hidden, I intermediate):
//
// 1. validate every input as moe_onnx/ops/moe.py's _validate does, with the same messages; with
//    tp_world_size > 1 get the TP group (made at the first run, docs/distributed.md); then the
//    indices' range, before anything is indexed.
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
// 16-bit and are widened in the micro-kernel): when they are initializers (KernelInfo::
// GetTensorConstantInput, API 15+) and pass Compute's checks of the weights (validate_weights), each
// expert once, by the first run that uses it (ConstantExperts), else per Compute for the experts in use. accuracy_level 3, where the
// ISA table has a bf16 GEMM: in bf16 pair panels (weights rounded to bf16), the rows of both GEMMs
// rounded to bf16 (bf16_gemm.h); elsewhere level 0's kernels.
//
// Steps 2-5 (and the attributes, the indices' check) are shared with QMOE: expert_block.h.
#include "moe.h"

#include <algorithm>
#include <tuple>

#include "attributes.h"

namespace moe_onnx {
namespace {

enum { HIDDEN, ROUTING, INDICES, W0, B0, W1, B1, W2, N_INPUTS };

// The checks of moe.py's _validate on the weight inputs, after validate_tokens, in its order and
// words: which inputs the expert type uses, their ranks and shapes.
void validate_weights(ExpertType type, const Checker& v, DimBinder& dims) {
  std::vector<std::pair<int, std::vector<std::string>>> layout;
  switch (type) {
    case ExpertType::kGemm2BiasSwigluClamp:
      layout = {{W0, {"E", "H", "2I"}}, {B0, {"E", "2I"}}, {W1, {"E", "I", "H"}}, {B1, {"E", "H"}}};
      break;
    case ExpertType::kGemm3Swiglu: layout = {{W0, {"E", "I", "H"}}, {W1, {"E", "I", "H"}}, {W2, {"E", "H", "I"}}}; break;
    case ExpertType::kGemm2Act:
      layout = {{W0, {"E", "I", "H"}}, {B0, {"E", "I"}}, {W1, {"E", "H", "I"}}, {B1, {"E", "H"}}};
      break;
  }
  const bool gemm3 = type == ExpertType::kGemm3Swiglu;
  for (int i : gemm3 ? std::vector<int>{W0, W1, W2} : std::vector<int>{W0, W1}) v.require(i);
  for (int i : {B0, W1, B1, W2}) {
    const bool used = std::any_of(layout.begin(), layout.end(), [i](const auto& l) { return l.first == i; });
    if (v.has(i) && !used)
      v.fail(v.input_name(i), std::string("is given, but ") + choice_name(type) + " does not use it; leave it empty");
  }
  for (const auto& [i, symbols] : layout)
    if (v.has(i)) {
      v.expect_rank(i, static_cast<int>(symbols.size()));
      dims.shape(i, symbols);
    }
}

// The checks of moe.py's _validate, in its order and words. Returns the sizes.
MoeDims validate(const MoeKernel& kernel, const Checker& v) {
  DimBinder dims(v);
  validate_tokens(v, {ROUTING, W0, B0, W1, B1, W2}, dims);
  validate_weights(kernel.config.type, v, dims);
  return MoeDims{dims.get("T"), dims.get("k"), dims.get("E"), dims.get("H"), dims.get("I")};
}

// Room for the experts in `slots`: gate/up B [H, 2I] in gate/up panels (GEMM2_ACT: up B [H, I] in
// plain panels), with the bias for the types that have one, and down B [I, H] with its bias (zeros
// when there is none), in the format of the weights' type and the node's accuracy_level.
PackedExperts empty_pack(ExpertType type, int64_t accuracy_level, const std::vector<Input>& inputs, int64_t H, int64_t I,
                         ExpertSlots slots) {
  PackedExperts p;
  const WeightFormat format = weight_format(inputs[W0].type, accuracy_level);
  const FloatType source = float_type(inputs[W0].type);
  p.matrices.emplace_back(format, type != ExpertType::kGemm2Act ? 2 * I : I, H, slots.count(),
                          type != ExpertType::kGemm3Swiglu, source);
  p.matrices.emplace_back(format, H, I, slots.count(), true, source);
  p.slots = std::move(slots);
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
    const int64_t gate0 = parity, up0 = 1 - parity;
    gate_up.pack(slot, {{in[W0].data, e * H * 2 * I + gate0, 2 * I, 2, I, kHalfPanel, 0},
                        {in[W0].data, e * H * 2 * I + up0, 2 * I, 2, I, kHalfPanel, kHalfPanel}});
    if (in[B0].present)
      for (const int64_t lane0 : {int64_t{0}, kHalfPanel})
        gate_up.pack_bias(slot, in[B0].type,
                          {in[B0].data, e * 2 * I + (lane0 == 0 ? gate0 : up0), 0, 2, I, kHalfPanel, lane0});
    // weight_1 [E, I, H] is already [K, N].
    down.pack(slot, {plain_columns(in[W1].data, e, I, H)});
    if (in[B1].present) down.pack_bias(slot, in[B1].type, {in[B1].data, e * H, 0, 1, H});
  } else if (type == ExpertType::kGemm2Act) {
    // up = weight_0 [E, I, H] with bias_0 [E, I], down = weight_1 [E, H, I] with bias_1 [E, H] (x @ W^T).
    gate_up.pack(slot, {transposed_columns(in[W0].data, e, I, H)});
    if (in[B0].present) gate_up.pack_bias(slot, in[B0].type, {in[B0].data, e * I, 0, 1, I});
    down.pack(slot, {transposed_columns(in[W1].data, e, H, I)});
    if (in[B1].present) down.pack_bias(slot, in[B1].type, {in[B1].data, e * H, 0, 1, H});
  } else {
    // gate = weight_0 [E, I, H], up = weight_1 [E, I, H] (x @ W^T), down = weight_2 [E, H, I].
    ColumnSource gate = transposed_columns(in[W0].data, e, I, H), up = transposed_columns(in[W1].data, e, I, H);
    gate.width = up.width = kHalfPanel;
    up.lane0 = kHalfPanel;
    gate_up.pack(slot, {gate, up});
    down.pack(slot, {transposed_columns(in[W2].data, e, H, I)});
  }
}

// The packing of the expert type's weights, in the format of their type and the node's accuracy_level.
ExpertPacker packer(ExpertType type, int64_t parity, int64_t accuracy_level) {
  return {[type, accuracy_level](const std::vector<Input>& inputs, int64_t H, int64_t I, ExpertSlots slots) {
            return empty_pack(type, accuracy_level, inputs, H, I, std::move(slots));
          },
          [type, parity](const std::vector<Input>& inputs, PackedExperts& p, int64_t slot) {
            pack_slot(type, parity, inputs, p, slot);
          }};
}

// Compute's checks of the weight inputs, at kernel creation: their types as validate_tokens checks them
// (against weight_0's), then validate_weights.
void check_constant_weights(ExpertType type, const Checker& v, DimBinder& dims) {
  v.expect_elem(W0);
  for (int i : {B0, W1, B1, W2})
    if (v.has(i)) {
      v.expect_elem(i);
      v.expect_same_elem(i, W0);
    }
  validate_weights(type, v, dims);
}

}  // namespace

MoeKernel::MoeKernel(const OrtKernelInfo* info, const PackedWeightsFiles* files) : NodeKernel(signatures::MOE, info) {
  Ort::ConstKernelInfo kinfo(info);
  const Attributes attrs(info, signatures::MOE, where);
  config = ExpertConfig::read(attrs);
  std::tie(tp_size, tp_rank) = read_group(attrs, "tp_world_size", "tp_rank_id");
  accuracy_level = attrs.choice("accuracy_level", {0, 3});
  packing = packer(config.type, config.parity, accuracy_level);
  const ExpertType type = config.type;
  constant = constant_experts(
      kinfo, signatures::MOE, where, {W0, B0, W1, B1, W2},
      [type](const Checker& v, DimBinder& dims) { check_constant_weights(type, v, dims); }, packing, files);
}

void MoeKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  const std::vector<Input> inputs = read_inputs(ctx, N_INPUTS);
  const MoeDims d = validate(*this, Checker(where, signatures::MOE, inputs));
  // The TP group after the inputs' checks and before the indices' range, in moe.py's order.
  const comm::Group* group = tp.get(tp_size, tp_rank, where);
  check_indices(inputs[INDICES], d.E, where);
  Ort::UnownedValue out_value = ctx.GetOutput(0, inputs[HIDDEN].shape);
  run_experts(ctx, config, d, inputs[HIDDEN], inputs[ROUTING], inputs[INDICES], inputs[B1].present,
              {constant.get(), packing, inputs}, static_cast<char*>(out_value.GetTensorMutableRawData()),
              TensorParallel{group, where.c_str()});
}

}  // namespace moe_onnx
