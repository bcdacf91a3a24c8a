// MoeFinalizeRouting kernel:
//
// 1. Validate every input as finalize_routing.py does (same order and words), then the index values:
//    range, scatter rows past expanded_x, a slot listed twice, and the bias experts of routed slots.
// 2. Per chunk of tokens (one task each), in fp32 and in the reference's order:
//    out[t] = ((0 + x1[t]) + x2[t]) + (s_0 + s_1 + ... + s_{k-1}),
//    s_j = (expanded_x[row(t, j)] + bias[expert_idx[t, j]]) * scales[t, j], 0 for a slot without a row.
//    The order over k is fixed, so 1 and N threads agree bitwise.
#include "finalize_routing.h"

#include <algorithm>

#include "attributes.h"
#include "checker.h"
#include "float_rows.h"
#include "parallel.h"
#include "workspace.h"

namespace moe_onnx {
namespace {

enum { EXPANDED_X, EXPANDED_ROW_IDX, X1, X2, BIAS, SCALES, EXPERT_IDX, N_INPUTS };

struct Dims {
  int64_t N, H, k, entries;
};

Dims validate(const FinalizeRoutingKernel& kernel, const Checker& v) {
  v.expect_elem(EXPANDED_X);
  for (int i : {X1, X2, BIAS, SCALES})
    if (v.has(i)) {
      v.expect_elem(i);
      v.expect_same_elem(i, EXPANDED_X);
    }
  v.expect_elem(EXPANDED_ROW_IDX);
  if (v.has(BIAS) && !v.has(EXPERT_IDX))
    v.fail(v.input_name(EXPERT_IDX), "is required when 'bias' is given (it says which expert's bias each slot adds)");
  if (v.has(EXPERT_IDX)) v.expect_elem(EXPERT_IDX);  // without bias it is unused, but checked all the same
  if (!v.has(X1) && !v.has(X2) && !v.has(SCALES) && !v.has(EXPERT_IDX))
    v.fail("inputs 'x1', 'x2', 'scales' and 'expert_idx'",
           "are all absent; expected at least one of them, to give the number of tokens N");

  DimBinder dims(v);
  const std::vector<std::string> y_symbols =
      kernel.drop_pad ? std::vector<std::string>{"E", "C", "H"} : std::vector<std::string>{"R", "H"};
  v.expect_rank(EXPANDED_X, static_cast<int>(y_symbols.size()));
  dims.shape(EXPANDED_X, y_symbols);
  v.expect_rank(EXPANDED_ROW_IDX, 1);
  dims.shape(EXPANDED_ROW_IDX, {"L"});
  const std::vector<std::pair<int, std::vector<std::string>>> layout = {
      {X1, {"N", "H"}}, {X2, {"N", "H"}}, {BIAS, {"E", "H"}}, {SCALES, {"N", "k"}}, {EXPERT_IDX, {"N", "k"}}};
  for (const auto& [i, symbols] : layout)
    if (v.has(i)) {
      v.expect_rank(i, 2);
      dims.shape(i, symbols);
    }
  const int64_t N = dims.get("N"), k = dims.get("k"), L = dims.get("L");
  if (k >= 0 && L != N * k)
    v.fail(v.input_name(EXPANDED_ROW_IDX), "has " + std::to_string(L) + " entries; expected N * k = " +
                                               std::to_string(N) + " * " + std::to_string(k) + " = " +
                                               std::to_string(N * k));
  if (N ? L % N : L)
    v.fail(v.input_name(EXPANDED_ROW_IDX), "has " + std::to_string(L) + " entries; expected a multiple of N = " +
                                               std::to_string(N) + " (one per token and expert slot)");
  return Dims{N, dims.get("H"), N ? L / N : 1, L};
}

// The row of every slot (-1: none), after checking the index values (_routed_pairs).
std::vector<int64_t> rows_of_slots(const Input& idx, int64_t n_rows, bool scatter, const std::string& where) {
  const int64_t L = idx.count;
  const int64_t limit = scatter ? L : n_rows;
  for (int64_t i = 0; i < L; ++i) {
    const int64_t value = load_index(idx, i);
    if (value < -1 || value >= limit)
      throw_invalid(where + ": expanded_row_idx[" + std::to_string(i) + "] = " + std::to_string(value) +
                    " is outside [-1, " + std::to_string(limit) + ")" +
                    (scatter ? " (a slot, or -1)" : " (a row of expanded_x, or -1)"));
  }
  std::vector<int64_t> row_of_slot(static_cast<size_t>(L), -1);
  if (!scatter) {
    for (int64_t f = 0; f < L; ++f) row_of_slot[f] = load_index(idx, f);
    return row_of_slot;
  }
  for (int64_t i = 0; i < L; ++i) {
    const int64_t slot = load_index(idx, i);
    if (slot >= 0 && i >= n_rows)
      throw_invalid(where + ": expanded_row_idx[" + std::to_string(i) + "] = " + std::to_string(slot) +
                    " names a slot for row " + std::to_string(i) + ", past the " + std::to_string(n_rows) +
                    " rows of expanded_x; expected -1");
  }
  std::vector<int64_t> second_row(static_cast<size_t>(L), -1);
  for (int64_t i = 0; i < L; ++i) {
    const int64_t slot = load_index(idx, i);
    if (slot < 0) continue;
    if (row_of_slot[slot] < 0)
      row_of_slot[slot] = i;
    else if (second_row[slot] < 0)
      second_row[slot] = i;
  }
  for (int64_t slot = 0; slot < L; ++slot)  // the smallest slot listed twice
    if (second_row[slot] >= 0)
      throw_invalid(where + ": expanded_row_idx names slot " + std::to_string(slot) + " at rows " +
                    std::to_string(row_of_slot[slot]) + " and " + std::to_string(second_row[slot]) +
                    "; expected each slot at most once");
  return row_of_slot;
}

// Every routed slot's expert must index bias; checked in the reference's order (gather: by slot,
// scatter: by row).
void check_bias_experts(const Input& experts, int64_t n_bias, const std::vector<int64_t>& row_of_slot,
                        const Input& idx, bool scatter, int64_t k, const std::string& where) {
  auto check = [&](int64_t f) {
    const int64_t e = load_index(experts, f);
    if (e < 0 || e >= n_bias)
      throw_invalid(where + ": expert_idx[" + std::to_string(f / k) + ", " + std::to_string(f % k) + "] = " +
                    std::to_string(e) + " is outside [0, " + std::to_string(n_bias) +
                    ") (the experts of bias) for a slot routed to row " + std::to_string(row_of_slot[f]));
  };
  const int64_t L = static_cast<int64_t>(row_of_slot.size());
  for (int64_t i = 0; i < L; ++i) {
    const int64_t f = scatter ? load_index(idx, i) : i;
    if (f >= 0 && row_of_slot[f] >= 0) check(f);
  }
}

}  // namespace

FinalizeRoutingKernel::FinalizeRoutingKernel(const OrtKernelInfo* info)
    : NodeKernel(signatures::MoeFinalizeRouting, info) {
  const Attributes attrs(info, signatures::MoeFinalizeRouting, where);
  drop_pad = attrs.choice("drop_pad_mode", {0, 1}) == 1;
  scatter = attrs.choice("row_idx_type", {0, 1}) == 1;
  if (drop_pad && scatter)
    attrs.fail("row_idx_type",
               "is 1 (scatter); expected 0 (gather) for drop_pad_mode 1, the only form MoeInitRouting gives in "
               "drop/pad mode");
}

void FinalizeRoutingKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  const std::vector<Input> inputs = read_inputs(ctx, N_INPUTS);
  const Checker v(where, signatures::MoeFinalizeRouting, inputs);
  const Dims d = validate(*this, v);
  const Input& y = inputs[EXPANDED_X];
  const int64_t N = d.N, H = d.H, k = d.k;
  const int64_t n_rows = product(y.shape, 0, y.shape.size() - 1);
  const Input& idx = inputs[EXPANDED_ROW_IDX];
  const std::vector<int64_t> row_of_slot = rows_of_slots(idx, n_rows, scatter, where);
  const Input& bias = inputs[BIAS];
  if (bias.present) check_bias_experts(inputs[EXPERT_IDX], bias.shape[0], row_of_slot, idx, scatter, k, where);

  const ElemType type = y.type;
  Ort::UnownedValue out_value = ctx.GetOutput(0, {N, H});
  char* out = static_cast<char*>(out_value.GetTensorMutableRawData());
  if (N == 0 || H == 0) return;
  const size_t row_bytes = static_cast<size_t>(H) * elem_size(type);
  const Input& x1 = inputs[X1];
  const Input& x2 = inputs[X2];
  const Input& scales = inputs[SCALES];
  const Input& experts = inputs[EXPERT_IDX];

  const FloatType values = float_type(type);
  size_t chunk = 1;
  const size_t n_chunks = chunk_count(static_cast<size_t>(N), 4, 64, &chunk);
  parallel_for(ctx, n_chunks, [&](size_t c) {
    Scratch scratch;
    float* acc = scratch.take<float>(H, "a token's sum");
    float* sum = scratch.take<float>(H, "a token's routed sum");
    float* term = scratch.take<float>(H, "a slot's term");
    float* add = scratch.take<float>(H, "a row to add");
    const int64_t end = std::min<int64_t>(N, static_cast<int64_t>((c + 1) * chunk));
    for (int64_t t = static_cast<int64_t>(c * chunk); t < end; ++t) {
      std::fill(acc, acc + H, 0.0f);
      for (const Input* residual : {&x1, &x2})
        if (residual->present) {
          widen_row(values, static_cast<const char*>(residual->data) + t * row_bytes, add, H);
          for (int64_t h = 0; h < H; ++h) acc[h] += add[h];
        }
      for (int64_t j = 0; j < k; ++j) {
        const int64_t f = t * k + j, row = row_of_slot[f];
        if (row < 0) {
          std::fill(term, term + H, 0.0f);
        } else {
          widen_row(values, static_cast<const char*>(y.data) + row * row_bytes, term, H);
          if (bias.present) {
            widen_row(values, static_cast<const char*>(bias.data) + load_index(experts, f) * row_bytes, add, H);
            for (int64_t h = 0; h < H; ++h) term[h] += add[h];
          }
          if (scales.present) {
            const float weight = load_float(values, scales.data, f);
            for (int64_t h = 0; h < H; ++h) term[h] *= weight;
          }
        }
        if (j == 0)
          std::copy(term, term + H, sum);
        else
          for (int64_t h = 0; h < H; ++h) sum[h] += term[h];
      }
      if (k > 0)
        for (int64_t h = 0; h < H; ++h) acc[h] += sum[h];
      narrow_row(values, acc, out + t * row_bytes, H);
    }
  });
}

}  // namespace moe_onnx
