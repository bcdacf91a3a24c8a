// MoeInitRouting kernel:
//
// 1. Attributes are checked at kernel creation, the inputs at Compute, both as init_routing.py does,
//    in its order and words, and every expert id before anything is indexed.
// 2. A counting sort (task_plan.h) orders the routed slots by expert (stable: slot order inside an expert) and
//    gives each row of expanded_x its slot (dropless: the first rows; drop/pad: rank < capacity).
// 3. Per chunk of rows (one task each): copy or quantize the slot's token row, in float32 scalar
//    arithmetic exactly as numpy does it (no fused multiply-add, true division).
#include "init_routing.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "attributes.h"
#include "checker.h"
#include "parallel.h"
#include "task_plan.h"
#include "workspace.h"

namespace moe_onnx {
namespace {

enum { X, EXPERT_IDX, SCALE, OFFSET, N_INPUTS };
enum { EXPANDED_X, EXPANDED_ROW_IDX, TOKEN_COUNTS, EXPANDED_SCALE };
enum { NO_QUANT = -1, STATIC_QUANT = 0, DYNAMIC_QUANT = 1 };
enum { CUMSUM = 0, COUNT = 1, KEY_VALUE = 2 };

constexpr ElemType kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr ElemType kInt8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;

RoutingMode read_mode(const Attributes& a) {
  RoutingMode m;
  const int64_t expert_num = a.get_int("expert_num");
  if (expert_num < 1) a.fail("expert_num", "is " + std::to_string(expert_num) + "; expected >= 1");
  m.expert_num = expert_num;
  m.drop_pad = a.choice("drop_pad_mode", {0, 1}) == 1;
  m.count_type = a.choice("expert_tokens_num_type", {CUMSUM, COUNT, KEY_VALUE});
  m.count_flag = a.choice("expert_tokens_num_flag", {0, 1}) == 1;
  m.quant_mode = a.choice("quant_mode", {NO_QUANT, STATIC_QUANT, DYNAMIC_QUANT});
  m.scatter = a.choice("row_idx_type", {0, 1}) == 1;
  m.active_num = a.get_int("active_num");
  if (m.active_num < -1)
    a.fail("active_num", "is " + std::to_string(m.active_num) +
                             "; expected -1 or 0 (no limit) or a positive row limit");
  m.capacity = a.get_int("expert_capacity");
  std::vector<int64_t> range;
  if (!a.has_ints("active_expert_range", &range)) range = {0, expert_num};
  if (range.size() != 2 || !(0 <= range[0] && range[0] < range[1] && range[1] <= expert_num))
    a.fail("active_expert_range", "is " + fmt_shape(range) + "; expected 0 <= start < end <= expert_num (" +
                                      std::to_string(expert_num) + ")");
  m.start = range[0];
  m.end = range[1];

  if (m.drop_pad) {
    const std::string why = " for drop_pad_mode 1 (drop/pad)";
    if (m.capacity < 1) a.fail("expert_capacity", "is " + std::to_string(m.capacity) + "; expected >= 1" + why);
    if (m.scatter) a.fail("row_idx_type", "is 1 (scatter); expected 0 (gather)" + why);
    if (m.start != 0 || m.end != expert_num)
      a.fail("active_expert_range", "is [" + std::to_string(m.start) + ", " + std::to_string(m.end) +
                                        "]; expected [0, " + std::to_string(expert_num) +
                                        "] (all experts: expanded_x is [expert_num, expert_capacity, H])" + why);
    if (m.count_type == KEY_VALUE)
      a.fail("expert_tokens_num_type", "is 2 (key_value); expected 0 (cumsum) or 1 (count)" + why);
    if (m.active_num > 0)
      a.fail("active_num", "is " + std::to_string(m.active_num) + "; expected -1 or 0" + why +
                               ": the capacity bounds the rows");
    int64_t rows = 0;
    if (__builtin_mul_overflow(expert_num, m.capacity, &rows))
      a.fail("expert_capacity", "is " + std::to_string(m.capacity) +
                                    "; expected expert_num * expert_capacity (the rows of expanded_x) <= " +
                                    std::to_string(std::numeric_limits<int64_t>::max()) + " (expert_num " +
                                    std::to_string(expert_num) + ")" + why);
  } else if (m.capacity != 0) {
    a.fail("expert_capacity", "is " + std::to_string(m.capacity) +
                                  "; expected 0 for drop_pad_mode 0 (dropless has no capacity)");
  }
  return m;
}

struct Dims {
  int64_t N, H, k;
};

// _validate_scale_offset of init_routing.py.
void validate_scale_offset(const Checker& v, const RoutingMode& mode, DimBinder& dims) {
  const int64_t quant = mode.quant_mode;
  if (v.has(OFFSET) && quant != STATIC_QUANT)
    v.fail(v.input_name(OFFSET),
           "is given, but quant_mode " + std::to_string(quant) + " does not use it; leave it empty");
  if (quant == STATIC_QUANT) v.require(SCALE);
  for (int i : {SCALE, OFFSET}) {
    if (!v.has(i)) continue;
    v.expect_elem(i);
    if (quant == NO_QUANT) {  // a per-token scale carried along (x quantized earlier)
      v.expect_rank(i, 1);
      dims.shape(i, {"N"});
      continue;
    }
    int64_t first, allowed;
    std::string meaning;
    if (quant == STATIC_QUANT) {
      first = v.expect_rank(i, 1)[0];
      allowed = dims.get("H");
      meaning = "1 (per tensor) or H = " + std::to_string(allowed) + " (per channel) for static quant";
    } else {
      first = v.expect_rank(i, 2)[0];
      dims.shape(i, {"", "H"});
      allowed = mode.active_experts();
      meaning = "1 (one smooth scale) or end - start = " + std::to_string(allowed) + " (one per active expert)";
    }
    if (first != 1 && first != allowed)
      v.fail(v.input_name(i), "dim 0 is " + std::to_string(first) + "; expected " + meaning);
  }
}

Dims validate(const InitRoutingKernel& kernel, const Checker& v) {
  const RoutingMode& mode = kernel.mode;
  const ElemType x_type = v.expect_elem(X);
  v.expect_elem(EXPERT_IDX);
  if (mode.quant_mode != NO_QUANT && x_type == kInt8)
    v.fail(v.input_name(X), "has type int8; expected float32, float16, bfloat16 for quant_mode " +
                                std::to_string(mode.quant_mode) +
                                " (int8 x is already quantized: use quant_mode -1)");
  if (!mode.count_flag && kernel.count_output_named)
    v.fail("output 'expert_tokens_count_or_cumsum'",
           "is named, but attribute 'expert_tokens_num_flag' is 0; drop the output or set the flag to 1");
  DimBinder dims(v);
  v.expect_rank(X, 2);
  dims.shape(X, {"N", "H"});
  v.expect_rank(EXPERT_IDX, 2);
  dims.shape(EXPERT_IDX, {"N", "k"});
  validate_scale_offset(v, mode, dims);
  return Dims{dims.get("N"), dims.get("H"), dims.get("k")};
}

void check_expert_ids(const Input& idx, int64_t expert_num, const std::string& where) {
  for (int64_t f = 0; f < idx.count; ++f) {
    const int64_t id = load_index(idx, f);
    if (id < -1 || id >= expert_num)
      throw_invalid(where + ": expert_idx" + fmt_position(idx.shape, f) + " = " + std::to_string(id) +
                    " is outside [-1, " + std::to_string(expert_num) + ") (expert_num " +
                    std::to_string(expert_num) + "; -1 means no expert)");
  }
}

// Round half to even and saturate to int8; NaN becomes 0 (to_int8 in init_routing.py).
inline int8_t to_int8(float v) {
  if (std::isnan(v)) return 0;
  v = std::nearbyint(v);
  return static_cast<int8_t>(v <= -128.0f ? -128.0f : (v >= 127.0f ? 127.0f : v));
}

// Where each row of expanded_x comes from.
struct Placement {
  std::vector<int64_t> slot_of_row;  // -1: an unused row
  std::vector<int64_t> counts;       // per active expert, as the count output reports them
};

Placement place_slots(const RoutingMode& mode, const Input& idx, int64_t rows) {
  const int64_t experts = mode.active_experts();
  const SlotsByExpert sorted = sort_slots_by_expert(idx, mode.start, mode.end);
  Placement p;
  allocate(p.slot_of_row, rows, int64_t{-1}, "the source slot of each row of expanded_x");
  allocate(p.counts, experts, int64_t{0}, "the row count of each expert");
  if (mode.drop_pad) {  // rank r of expert e goes to row e * C + r when r < C; counts are before the drop
    for (int64_t e = 0; e < experts; ++e) {
      for (int64_t r = 0; r < std::min(sorted.count(e), mode.capacity); ++r)
        p.slot_of_row[e * mode.capacity + r] = sorted.order[sorted.start[e] + r];
      p.counts[e] = sorted.count(e);
    }
  } else {  // the first rows of the sorted order; counts describe those rows
    const int64_t placed = std::min<int64_t>(rows, static_cast<int64_t>(sorted.order.size()));
    for (int64_t r = 0; r < placed; ++r) {
      p.slot_of_row[r] = sorted.order[r];
      ++p.counts[load_index(idx, sorted.order[r]) - mode.start];
    }
  }
  return p;
}

void write_counts(const RoutingMode& mode, const std::vector<int64_t>& counts, int64_t* out) {
  const int64_t experts = mode.active_experts();
  if (mode.count_type == CUMSUM) {
    int64_t total = 0;
    for (int64_t e = 0; e < experts; ++e) out[e] = total += counts[e];
  } else if (mode.count_type == COUNT) {
    std::copy(counts.begin(), counts.end(), out);
  } else {  // (expert, count) for experts with rows, then (-1, 0)
    int64_t used = 0;
    for (int64_t e = 0; e < experts; ++e)
      if (counts[e] > 0) {
        out[2 * used] = e + mode.start;
        out[2 * used + 1] = counts[e];
        ++used;
      }
    for (; used < experts; ++used) {
      out[2 * used] = -1;
      out[2 * used + 1] = 0;
    }
  }
}

}  // namespace

ElemType InitRoutingOp::GetOutputType(size_t i) const {
  switch (i) {
    case EXPANDED_X: return quantized_ ? kInt8 : type_;
    case EXPANDED_ROW_IDX: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    case TOKEN_COUNTS: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    default: return kF32;
  }
}

OrtCustomOpInputOutputCharacteristic InitRoutingOp::GetOutputCharacteristic(size_t i) const {
  return i >= TOKEN_COUNTS ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}

InitRoutingKernel::InitRoutingKernel(const OrtKernelInfo* info, ElemType out_type)
    : NodeKernel(signatures::MoeInitRouting, info), output_type(out_type) {
  Ort::ConstKernelInfo kinfo(info);
  mode = read_mode(Attributes(info, signatures::MoeInitRouting, where));
  count_output_named = node_has_output(kinfo, TOKEN_COUNTS);
}

void InitRoutingKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  const std::vector<Input> inputs = read_inputs(ctx, N_INPUTS);
  const Checker v(where, signatures::MoeInitRouting, inputs);
  const Dims d = validate(*this, v);
  const Input& x = inputs[X];
  const Input& idx = inputs[EXPERT_IDX];
  check_expert_ids(idx, mode.expert_num, where);
  const ElemType wanted = mode.quant_mode == NO_QUANT ? x.type : kInt8;
  if (wanted != output_type)
    throw_invalid(where + ": quant_mode " + std::to_string(mode.quant_mode) + " makes expanded_x " +
                  elem_name(wanted) + ", but this registration of the op outputs " + elem_name(output_type) +
                  " (onnxruntime cannot read quant_mode): run the model through moe_onnx.session(), which "
                  "moves quantizing nodes to the library's domain 'moe_onnx.cpp'");

  const int64_t N = d.N, H = d.H, k = d.k, slots = N * k;
  const int64_t rows = mode.drop_pad ? mode.expert_num * mode.capacity
                                     : (mode.active_num > 0 ? std::min(mode.active_num, slots) : slots);
  const std::vector<int64_t> x_shape =
      mode.drop_pad ? std::vector<int64_t>{mode.expert_num, mode.capacity, H} : std::vector<int64_t>{rows, H};
  const std::vector<int64_t> scale_shape =
      mode.drop_pad ? std::vector<int64_t>{mode.expert_num, mode.capacity} : std::vector<int64_t>{rows};
  const size_t n_outputs = ctx.GetOutputCount();
  auto output = [&](size_t i, const std::vector<int64_t>& shape) -> void* {
    if (i >= n_outputs) return nullptr;
    const FormalParam& formal = signatures::MoeInitRouting.outputs[i];
    try {  // sizes set by the attributes: a contract error, in the reference's words
      check_allocatable(shape, elem_size(i == EXPANDED_X ? output_type : formal.types[0]),
                        std::string("output '") + formal.name + "'");
    } catch (const AllocationFailure& failure) {
      throw_invalid(where + ": " + failure.what());
    }
    Ort::UnownedValue value = ctx.GetOutput(i, shape);
    return value ? value.GetTensorMutableRawData() : nullptr;
  };
  auto* expanded_x = static_cast<char*>(output(EXPANDED_X, x_shape));
  auto* row_idx = static_cast<int32_t*>(output(EXPANDED_ROW_IDX, {slots}));
  const std::vector<int64_t> count_shape = mode.count_type == KEY_VALUE
                                               ? std::vector<int64_t>{mode.active_experts(), 2}
                                               : std::vector<int64_t>{mode.active_experts()};
  auto* counts = mode.count_flag ? static_cast<int64_t*>(output(TOKEN_COUNTS, count_shape)) : nullptr;
  auto* expanded_scale = static_cast<float*>(output(EXPANDED_SCALE, scale_shape));

  const Placement p = place_slots(mode, idx, rows);
  std::fill(row_idx, row_idx + slots, -1);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t f = p.slot_of_row[r];
    if (f < 0) continue;
    if (mode.scatter)
      row_idx[r] = static_cast<int32_t>(f);
    else
      row_idx[f] = static_cast<int32_t>(r);
  }
  if (counts) write_counts(mode, p.counts, counts);

  const size_t x_size = elem_size(x.type), out_row = static_cast<size_t>(H) * elem_size(output_type);
  const Input& scale = inputs[SCALE];
  const Input& offset = inputs[OFFSET];
  const float* sc = scale.present ? scale.as<float>() : nullptr;
  const float* off = offset.present ? offset.as<float>() : nullptr;
  const bool scale_per_channel = scale.present && scale.count > 1;
  const bool offset_per_channel = offset.present && offset.count > 1;
  const bool smooth_per_expert = scale.present && scale.shape[0] > 1;
  // The quant modes read x as fp32 (x is then float32, float16 or bfloat16); -1 copies its bytes.
  const FloatType x_type = mode.quant_mode == NO_QUANT ? FloatType::kF32 : float_type(x.type);

  // One row of expanded_x (and its scale) from slot f.
  auto fill_row = [&](int64_t r, float* values) {
    char* dst = expanded_x + r * out_row;
    const int64_t f = p.slot_of_row[r];
    float row_scale = 0.0f;
    if (f < 0) {
      std::fill(dst, dst + out_row, 0);
    } else {
      const int64_t t = f / k;
      const void* src = static_cast<const char*>(x.data) + static_cast<size_t>(t * H) * x_size;
      auto* q = reinterpret_cast<int8_t*>(dst);
      if (mode.quant_mode == NO_QUANT) {
        if (out_row) std::memcpy(dst, src, out_row);
        if (sc) row_scale = sc[t];
      } else if (mode.quant_mode == STATIC_QUANT) {
        for (int64_t h = 0; h < H; ++h) {
          float value = load_float(x_type, src, h) * sc[scale_per_channel ? h : 0];
          if (off) value = value + off[offset_per_channel ? h : 0];
          q[h] = to_int8(value);
        }
      } else {
        const float* smooth = sc ? sc + (smooth_per_expert ? (load_index(idx, f) - mode.start) * H : 0) : nullptr;
        float biggest = 0.0f;
        bool nan = false;
        for (int64_t h = 0; h < H; ++h) {
          float value = load_float(x_type, src, h);
          if (smooth) value = value * smooth[h];
          values[h] = value;
          const float magnitude = std::fabs(value);
          if (std::isnan(magnitude))
            nan = true;
          else if (magnitude > biggest)
            biggest = magnitude;
        }
        row_scale = nan ? std::numeric_limits<float>::quiet_NaN() : biggest / 127.0f;
        for (int64_t h = 0; h < H; ++h) q[h] = to_int8(values[h] / row_scale);
      }
    }
    if (expanded_scale) expanded_scale[r] = row_scale;
  };

  size_t chunk = 1;
  const size_t n_chunks = chunk_count(static_cast<size_t>(rows), 16, 64, &chunk);
  parallel_for(ctx, n_chunks, [&](size_t c) {
    Scratch scratch;
    float* values = mode.quant_mode == DYNAMIC_QUANT ? scratch.take<float>(H, "a row in float32") : nullptr;
    const int64_t end = std::min<int64_t>(rows, static_cast<int64_t>((c + 1) * chunk));
    for (int64_t r = static_cast<int64_t>(c * chunk); r < end; ++r) fill_row(r, values);
  });
}

}  // namespace moe_onnx
