// QMOE kernel: MOE's steps (expert_block.h) on quantized panels. Per Compute:
// 1. check_inputs: validate every input as moe_onnx/ops/qmoe.py does, with the same messages, and the
//    indices' range, before anything is indexed.
// 2. The packed experts: when every weight, scale and zero point is an initializer and passes
//    Compute's checks of them (validate_weights), each expert once, by the first run that uses it (for
//    the life of the session: ConstantExperts), else packed per run for the experts in use.
//    Each linear is packed as quantized panels (qgemm.h): the codes stay 4 or 8 bits, the scales
//    become block headers (int: fp32; mxfp4: the E8M0 bytes), and GEMM2's interleaved gate/up rows go
//    to MOE's gate/up panels.
// 3. run_experts: MOE's routing, tasks, activations and sums; the GEMMs decode the panels (accuracy_level
//    3, where the ISA table has a bf16 GEMM: prefill-sized tasks into bf16 pair panels, qgemm.h).
#include "qmoe.h"

#include <algorithm>

#include "attributes.h"

namespace moe_onnx {
namespace {

enum { HIDDEN, ROUTING, INDICES, W0, B0, W1, B1, W2, S0, S1, S2, Z0, Z1, Z2, N_INPUTS };

// One quantized linear of an expert: its weight, scales and zero points inputs, and the symbols of
// its N (outputs) and K (inputs).
struct Linear {
  int weight, scales, zero_points;
  const char* n;
  const char* k;
};

std::vector<Linear> linears(ExpertType type) {
  switch (type) {
    case ExpertType::kGemm2BiasSwigluClamp: return {{W0, S0, Z0, "2I", "H"}, {W1, S1, Z1, "H", "I"}};
    case ExpertType::kGemm3Swiglu: return {{W0, S0, Z0, "I", "H"}, {W1, S1, Z1, "I", "H"}, {W2, S2, Z2, "H", "I"}};
    case ExpertType::kGemm2Act: return {{W0, S0, Z0, "I", "H"}, {W1, S1, Z1, "H", "I"}};
  }
  return {};
}

// "quant_type 'mxfp4'", as the messages name a quant type.
std::string quant_type_words(QuantType type) { return "quant_type " + py_str(choice_name(type)); }

// The bytes that hold n elements of `bits` bits.
int64_t packed_bytes(int64_t n, int64_t bits) { return (n * bits + 7) / 8; }

// The value of a shape symbol, "2I" being twice I.
int64_t symbol_value(const DimBinder& dims, const std::string& symbol) {
  return symbol[0] == '2' ? 2 * dims.get(symbol.substr(1)) : dims.get(symbol);
}

// The inputs an expert type may or must leave out (MOE's), then QMOE's own companions of the weights.
constexpr int kOptionalInputs[] = {B0, W1, B1, W2, S0, S1, S2, Z0, Z1, Z2};

// One weight's packed dim (K * bits / 8), the block size against its K, its scales and zero points
// (qmoe.py's _validate_quantized).
void validate_quantized(const Quantization& q, const Checker& v, DimBinder& dims, const Linear& l, ElemType elem) {
  const std::string k = l.k, n = l.n;
  const int64_t K = dims.get(k);
  const int64_t packed = v.require(l.weight).shape[2];
  if (K * q.bits % 8)
    v.fail(v.input_name(l.weight), "packs " + k + " = " + std::to_string(K) + " weights of " + std::to_string(q.bits) +
                                       " bits per row; expected an even " + k + " (two weights per byte)");
  if (packed != K * q.bits / 8)
    v.fail(v.input_name(l.weight), "dim 2 is " + std::to_string(packed) + "; expected " + k + " * bits / 8 = " +
                                       std::to_string(K * q.bits / 8) + " (" + k + " = " + std::to_string(K) +
                                       ", bits = " + std::to_string(q.bits) + ")");
  if (q.block_size && K % q.block_size)
    v.fail("attribute 'block_size'", "is " + std::to_string(q.block_size) + "; expected a divisor of " + k + " = " +
                                         std::to_string(K) + " (the K of " + v.input_name(l.weight) + ")");
  const int64_t blocks = q.block_size ? K / q.block_size : 1;
  const auto expect_dim = [&](int i, int axis, int64_t expected, const std::string& what) {
    const int64_t dim = v.require(i).shape[axis];
    if (dim != expected)
      v.fail(v.input_name(i), "dim " + std::to_string(axis) + " is " + std::to_string(dim) + "; expected " + what +
                                  " = " + std::to_string(expected));
  };

  const ElemType scale_elem = v.expect_elem(l.scales);
  std::vector<ElemType> allowed{ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8};
  if (!q.mxfp4) {
    allowed = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
    if (elem != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) allowed.push_back(elem);
  }
  if (std::find(allowed.begin(), allowed.end(), scale_elem) == allowed.end()) {
    std::string names;
    for (size_t a = 0; a < allowed.size(); ++a) names += (a ? " or " : "") + std::string(elem_name(allowed[a]));
    v.fail(v.input_name(l.scales), std::string("has type ") + elem_name(scale_elem) + "; " +
                                       quant_type_words(q.mxfp4 ? QuantType::kMxfp4 : QuantType::kInt) + " expects " +
                                       names);
  }
  if (q.block_size) {
    v.expect_rank(l.scales, 3);
    dims.shape(l.scales, {"E", n});
    expect_dim(l.scales, 2, blocks, k + " / block_size");
  } else {
    v.expect_rank(l.scales, 2);
    dims.shape(l.scales, {"E", n});
  }

  if (!v.has(l.zero_points)) return;
  if (q.mxfp4)
    v.fail(v.input_name(l.zero_points),
           "is given; " + quant_type_words(QuantType::kMxfp4) + " has no zero points: leave it empty");
  if (q.block_size) {
    v.expect_rank(l.zero_points, 3);
    dims.shape(l.zero_points, {"E", n});
    expect_dim(l.zero_points, 2, packed_bytes(blocks, q.bits), "ceil(" + k + " / block_size * bits / 8)");
  } else {
    v.expect_rank(l.zero_points, 2);
    dims.shape(l.zero_points, {"E"});
    expect_dim(l.zero_points, 1, packed_bytes(symbol_value(dims, n), q.bits), "ceil(" + n + " * bits / 8)");
  }
}

// The checks of qmoe.py's _validate on the weights, scales and zero points, after validate_tokens
// (`elem`: hidden_states' type), in its order and words.
void validate_weights(const QMoeKernel& kernel, const Checker& v, DimBinder& dims, ElemType elem) {
  const ExpertType type = kernel.config.type;
  for (int i : {W0, W1, W2, Z0, Z1, Z2})
    if (v.has(i)) v.expect_elem(i);
  // check_expert_inputs
  const std::vector<Linear> used = linears(type);
  const bool biased = type != ExpertType::kGemm3Swiglu;
  for (const Linear& l : used) {
    v.require(l.weight);
    v.require(l.scales);
  }
  for (int i : kOptionalInputs) {
    const bool uses = ((i == B0 || i == B1) && biased) || std::any_of(used.begin(), used.end(), [i](const Linear& l) {
                        return l.weight == i || l.scales == i || l.zero_points == i;
                      });
    if (v.has(i) && !uses)
      v.fail(v.input_name(i), std::string("is given, but ") + choice_name(type) + " does not use it; leave it empty");
  }
  for (const Linear& l : used) {
    v.expect_rank(l.weight, 3);
    dims.shape(l.weight, {"E", l.n});
    const int bias = l.weight == W0 ? B0 : B1;
    if (biased && l.weight != W2 && v.has(bias)) {
      v.expect_rank(bias, 2);
      dims.shape(bias, {"E", l.n});
    }
  }
  for (const Linear& l : used) validate_quantized(kernel.quant, v, dims, l, elem);
}

// The checks of qmoe.py's _validate, in its order and words (the attributes' were made at kernel
// creation). Returns the sizes.
MoeDims validate(const QMoeKernel& kernel, const Checker& v) {
  DimBinder dims(v);
  const ElemType elem = validate_tokens(v, {ROUTING, B0, B1}, dims);
  validate_weights(kernel, v, dims, elem);
  return MoeDims{dims.get("T"), dims.get("k"), dims.get("E"), dims.get("H"), dims.get("I")};
}

// Validation, then the indices' range: the sizes.
MoeDims check_inputs(const QMoeKernel& kernel, const std::vector<Input>& inputs) {
  const Checker v(kernel.where, signatures::QMOE, inputs);
  const MoeDims d = validate(kernel, v);
  check_indices(inputs[INDICES], d.E, kernel.where);
  return d;
}

// The panel layout of one linear with K inputs.
QuantPanels layout_of(const Quantization& q, int64_t K, bool zero_points) {
  QuantPanels p;
  p.code = q.mxfp4 ? QuantCode::kE2M1 : q.bits == 8 ? QuantCode::kInt8 : QuantCode::kInt4;
  p.K = K;
  p.block = q.block_size > 0 ? q.block_size : K;
  p.zero_points = zero_points;
  p.int8_activations = q.int8_activations;
  p.bf16_prefill = q.bf16_prefill;
  return p;
}

// Room for the experts in `slots`: gate/up in gate/up panels (GEMM2_ACT: up in plain panels) with the
// bias for the types that have one, and down with its bias (zeros when there is none).
PackedExperts empty_pack(const ExpertConfig& config, const Quantization& q, const std::vector<Input>& inputs, int64_t H,
                         int64_t I, ExpertSlots slots) {
  const std::vector<Linear> used = linears(config.type);
  PackedExperts p;
  // GEMM3's gate and up share the gate/up panels: they carry zero points when either linear has them
  const bool gate_up_zero_points = std::any_of(used.begin(), used.end() - 1, [&](const Linear& l) {
    return inputs[l.zero_points].present;
  });
  p.matrices.emplace_back(layout_of(q, H, gate_up_zero_points), config.gated() ? 2 * I : I,
                          slots.count(), config.type != ExpertType::kGemm3Swiglu);
  p.matrices.emplace_back(layout_of(q, I, inputs[used.back().zero_points].present), H, slots.count(), true);
  p.slots = std::move(slots);
  return p;
}

// Rows row0, row0 + step, ... (`columns` of them) of expert e of a linear with N outputs, K inputs.
QuantizedColumns columns_of(const Quantization& q, const std::vector<Input>& in, const Linear& l, int64_t e, int64_t N,
                            int64_t K, int64_t row0, int64_t step, int64_t columns) {
  const int64_t blocks = q.block_size > 0 ? K / q.block_size : 1;
  const int64_t first = e * N + row0;
  QuantizedColumns c{};
  c.codes = in[l.weight].as<uint8_t>();
  c.codes_first = first * K;
  c.codes_stride = step * K;
  c.scales = in[l.scales].data;
  c.scale_type = in[l.scales].type;
  c.scales_first = first * blocks;
  c.scales_stride = step * blocks;
  if (in[l.zero_points].present) {
    c.zero_points = in[l.zero_points].as<uint8_t>();
    const int64_t per_byte = 8 / q.bits;
    if (q.block_size > 0) {  // [E, N, ceil(blocks * bits / 8)]
      const int64_t row = packed_bytes(blocks, q.bits) * per_byte;
      c.zero_points_first = first * row;
      c.zero_points_stride = step * row;
      c.zero_points_block_stride = 1;
    } else {  // [E, ceil(N * bits / 8)]
      c.zero_points_first = e * packed_bytes(N, q.bits) * per_byte + row0;
      c.zero_points_stride = step;
      c.zero_points_block_stride = 0;
    }
  }
  c.columns = columns;
  return c;
}

// Columns into half of each gate/up panel, from lane lane0.
QuantizedColumns half_panel_columns(QuantizedColumns c, int64_t lane0) {
  c.width = kHalfPanel;
  c.lane0 = lane0;
  return c;
}

// Packs the weights of the expert of `slot`.
void pack_slot(const ExpertConfig& config, const Quantization& q, const std::vector<Input>& in, PackedExperts& p,
               int64_t slot) {
  const int64_t e = p.slots.expert_of_slot[slot];
  PackedWeights& gate_up = p.matrices[GATE_UP];
  PackedWeights& down = p.matrices[DOWN];
  const int64_t H = down.N(), I = down.K();
  const std::vector<Linear> used = linears(config.type);
  const Linear& down_linear = used.back();
  if (config.type == ExpertType::kGemm2BiasSwigluClamp) {
    // weight_0 [E, 2I, H]: gate column c is row 2c + parity, up column c is row 2c + 1 - parity.
    const int64_t gate0 = config.parity, up0 = 1 - config.parity;
    gate_up.pack_quantized(slot, {half_panel_columns(columns_of(q, in, used[0], e, 2 * I, H, gate0, 2, I), 0),
                                  half_panel_columns(columns_of(q, in, used[0], e, 2 * I, H, up0, 2, I), kHalfPanel)});
    if (in[B0].present)
      for (const int64_t lane0 : {int64_t{0}, kHalfPanel})
        gate_up.pack_bias(slot, in[B0].type,
                          {in[B0].data, e * 2 * I + (lane0 == 0 ? gate0 : up0), 0, 2, I, kHalfPanel, lane0});
  } else if (config.type == ExpertType::kGemm2Act) {
    gate_up.pack_quantized(slot, {columns_of(q, in, used[0], e, I, H, 0, 1, I)});
    if (in[B0].present) gate_up.pack_bias(slot, in[B0].type, {in[B0].data, e * I, 0, 1, I});
  } else {
    // gate = weight_0 [E, I, H] in lanes 0-7, up = weight_1 [E, I, H] in lanes 8-15.
    gate_up.pack_quantized(slot, {half_panel_columns(columns_of(q, in, used[0], e, I, H, 0, 1, I), 0),
                                  half_panel_columns(columns_of(q, in, used[1], e, I, H, 0, 1, I), kHalfPanel)});
  }
  down.pack_quantized(slot, {columns_of(q, in, down_linear, e, H, I, 0, 1, H)});
  if (in[B1].present) down.pack_bias(slot, in[B1].type, {in[B1].data, e * H, 0, 1, H});
}

// The packing of the expert type's quantized weights.
ExpertPacker packer(const ExpertConfig& config, const Quantization& q) {
  return {[config, q](const std::vector<Input>& inputs, int64_t H, int64_t I, ExpertSlots slots) {
            return empty_pack(config, q, inputs, H, I, std::move(slots));
          },
          [config, q](const std::vector<Input>& inputs, PackedExperts& p, int64_t slot) {
            pack_slot(config, q, inputs, p, slot);
          }};
}

// The quantization attributes after qmoe.py's checks (_validate_quant_attrs).
Quantization read_quantization(const Attributes& attrs) {
  Quantization q;
  q.mxfp4 = attrs.choice<QuantType>() == QuantType::kMxfp4;
  q.bits = attrs.choice("bits", {4, 8});
  q.block_size = attrs.get_int("block_size");
  const int64_t accuracy_level = attrs.choice("accuracy_level", {0, 3, 4});
  const std::string block_size = std::to_string(q.block_size);
  if (q.mxfp4) {
    const std::string expects = "; " + quant_type_words(QuantType::kMxfp4) + " expects ";
    if (q.bits != 4) attrs.fail("bits", "is " + std::to_string(q.bits) + expects + "4");
    if (q.block_size != 32) attrs.fail("block_size", "is " + block_size + expects + "32");
    if (accuracy_level == 4)
      attrs.fail("accuracy_level", "is " + std::to_string(accuracy_level) + expects + "0 or 3 (int8 activations are for " +
                                       quant_type_words(QuantType::kInt) + ")");
  } else if (q.block_size != 0 &&
             !(q.block_size >= 16 && q.block_size <= 256 && (q.block_size & (q.block_size - 1)) == 0)) {
    attrs.fail("block_size", "is " + block_size + "; expected 0 or a power of two in [16, 256]");
  }
  q.int8_activations = accuracy_level == 4;
  q.bf16_prefill = accuracy_level == 3 && bf16_compute_available();
  return q;
}

}  // namespace

QMoeKernel::QMoeKernel(const OrtKernelInfo* info, ElemType hidden_type, const PackedWeightsFiles* files)
    : NodeKernel(signatures::QMOE, info) {
  Ort::ConstKernelInfo kinfo(info);
  const Attributes attrs(info, signatures::QMOE, where);
  config = ExpertConfig::read(attrs);
  quant = read_quantization(attrs);
  packing = packer(config, quant);
  // At kernel creation, Compute's checks of the weights, scales and zero points: the biases' types, then
  // validate_weights with the scales' types against the hidden_states type this kernel is registered for.
  if (!signatures::QMOE.inputs[HIDDEN].allows(hidden_type)) return;
  std::vector<int> weights;
  for (int i = W0; i < N_INPUTS; ++i) weights.push_back(i);
  constant = constant_experts(
      kinfo, signatures::QMOE, where, weights,
      [&](const Checker& v, DimBinder& dims) {
        for (int i : {B0, B1})
          if (v.has(i)) v.expect_elem(i);
        validate_weights(*this, v, dims, hidden_type);
      },
      packing, files);
}

void QMoeKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  const std::vector<Input> inputs = read_inputs(ctx, N_INPUTS);
  const MoeDims d = check_inputs(*this, inputs);
  Ort::UnownedValue out_value = ctx.GetOutput(0, inputs[HIDDEN].shape);
  run_experts(ctx, config, d, inputs[HIDDEN], inputs[ROUTING], inputs[INDICES], inputs[B1].present,
              {constant.get(), packing, inputs}, static_cast<char*>(out_value.GetTensorMutableRawData()));
}

}  // namespace moe_onnx
