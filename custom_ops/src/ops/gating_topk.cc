// MoeGatingTopK kernel:
//
// 1. At creation: the attributes alone, as gating_topk.py checks them (same order and words).
//    At Compute: the inputs, then the rules that need E.
// 2. One pass per row (rows split in chunks, one task each), in float32: scores, selection values,
//    group scores and the kept groups, the k best allowed experts (a total order: NaN first, larger
//    first, lower index first), weights renormalized in slot order and scaled, in the task's scratch
//    (workspace.h); a row's result depends on that row only, so 1 and N threads agree bitwise.
#include "gating_topk.h"

#include <algorithm>
#include <cmath>

#include "attributes.h"
#include "checker.h"
#include "float_rows.h"
#include "parallel.h"
#include "workspace.h"

namespace moe_onnx {
namespace {

enum { LOGITS, BIAS, N_INPUTS };
enum { WEIGHTS, INDICES, SCORES };

GatingMode read_mode(const Attributes& attrs) {
  GatingMode m;
  m.k = attrs.get_int("k");
  if (m.k < 1) attrs.fail("k", "is " + std::to_string(m.k) + "; expected a value >= 1");
  m.sigmoid = attrs.choice<ScoreFunc>() == ScoreFunc::kSigmoid;
  m.n_group = attrs.get_int("n_group");
  if (m.n_group < 1) attrs.fail("n_group", "is " + std::to_string(m.n_group) + "; expected a value >= 1");
  m.topk_group = attrs.get_int("topk_group");
  if (m.topk_group < 0 || m.topk_group > m.n_group)
    attrs.fail("topk_group", "is " + std::to_string(m.topk_group) + "; expected 0 (all groups) or 1..n_group = " +
                                 std::to_string(m.n_group));
  m.sum_top2 = attrs.choice<GroupSelect>() == GroupSelect::kSumTop2;
  m.renormalize = attrs.choice("renormalize", {0, 1}) == 1;
  m.eps = attrs.get_float("eps");
  if (!std::isfinite(m.eps)) attrs.fail("eps", "is " + py_float(m.eps) + "; expected a finite number");
  m.scale = attrs.get_float("routed_scaling_factor");
  if (!std::isfinite(m.scale))
    attrs.fail("routed_scaling_factor", "is " + py_float(m.scale) + "; expected a finite number");
  return m;
}

// The number of experts E, after checking the inputs and the rules that need it.
int64_t validate(const GatingMode& m, const Checker& v) {
  v.expect_elem(LOGITS);
  if (v.has(BIAS)) {
    v.expect_elem(BIAS);
    v.expect_same_elem(BIAS, LOGITS);
  }
  DimBinder dims(v);
  const std::vector<int64_t>& shape = v.expect_rank(LOGITS, -1, 1);
  dims.bind("E", shape.back(), "input 'logits' dim " + std::to_string(shape.size() - 1));
  if (v.has(BIAS)) {
    v.expect_rank(BIAS, 1);
    dims.shape(BIAS, {"E"});
  }
  const int64_t E = dims.get("E");
  const std::string k = std::to_string(m.k), n_group = std::to_string(m.n_group), experts = std::to_string(E);
  if (m.k > E)
    v.fail("attribute 'k'", "is " + k + "; expected at most E = " + experts + " (the last dim of input 'logits')");
  if (E % m.n_group) v.fail("attribute 'n_group'", "is " + n_group + "; expected a divisor of E = " + experts);
  const int64_t group_size = E / m.n_group;
  if (m.n_group > 1 && m.sum_top2 && group_size < 2) {
    const char* sum_top2 = choice_name(GroupSelect::kSumTop2);
    v.fail("attribute 'group_select'", "is " + py_str(sum_top2) + "; expected " +
                                           py_str(choice_name(GroupSelect::kMax)) + " for groups of " +
                                           std::to_string(group_size) + " expert (E / n_group = " + experts + " / " +
                                           n_group + "): " + sum_top2 + " needs at least 2 experts per group");
  }
  const int64_t kept = m.topk_group ? m.topk_group : m.n_group;
  if (m.k > kept * group_size)
    v.fail("attribute 'k'", "is " + k + "; expected at most topk_group * E / n_group = " + std::to_string(kept) +
                                " * " + experts + " / " + n_group + " = " + std::to_string(kept * group_size) +
                                ", the experts of the kept groups");
  return E;
}

// Whether value a at position i goes before value b at position j (best_first in gating_topk.py).
inline bool before(float a, int64_t i, float b, int64_t j) {
  const bool a_nan = std::isnan(a), b_nan = std::isnan(b);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a != b) return a > b;
  return i < j;
}

// Moves the `count` best of positions[0, n) to its front, best first, by values[position]: one pass
// keeping the best so far in order (most positions lose to the last of them in one comparison).
void best_first(int64_t* positions, int64_t n, int64_t count, const float* values) {
  auto better = [values](int64_t i, int64_t j) { return before(values[i], i, values[j], j); };
  std::sort(positions, positions + count, better);
  for (int64_t p = count; p < n; ++p) {
    const int64_t candidate = positions[p];
    if (!better(candidate, positions[count - 1])) continue;
    int64_t at = count - 1;
    for (; at > 0 && better(candidate, positions[at - 1]); --at) positions[at] = positions[at - 1];
    positions[at] = candidate;
  }
}

// s = softmax or sigmoid of x over E, in float32 (a NaN anywhere makes a softmax row NaN, as np.max).
void score_row(const float* x, int64_t E, bool sigmoid, float* s) {
  if (sigmoid) {
    for (int64_t e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + std::exp(-x[e]));
    return;
  }
  float top = -INFINITY;
  for (int64_t e = 0; e < E; ++e) top = std::isnan(x[e]) || std::isnan(top) ? NAN : std::max(top, x[e]);
  float total = 0.0f;
  for (int64_t e = 0; e < E; ++e) total += s[e] = std::exp(x[e] - top);
  for (int64_t e = 0; e < E; ++e) s[e] /= total;
}

// A group's score: its largest selection value (max) or the sum of its two largest (sum_top2); NaN
// counts as the largest, so a group holding one has a NaN score.
float group_score(const float* sel, int64_t size, bool sum_top2) {
  float first = -INFINITY, second = -INFINITY;
  for (int64_t e = 0; e < size; ++e) {
    if (std::isnan(sel[e])) return NAN;
    if (sel[e] > first) {
      second = first;
      first = sel[e];
    } else if (sel[e] > second) {
      second = sel[e];
    }
  }
  return sum_top2 ? first + second : first;
}

}  // namespace

ElemType GatingTopKOp::GetOutputType(size_t i) const {
  return i == INDICES ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : type_;
}

OrtCustomOpInputOutputCharacteristic GatingTopKOp::GetOutputCharacteristic(size_t i) const {
  return i == SCORES ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}

GatingTopKKernel::GatingTopKKernel(const OrtKernelInfo* info) : NodeKernel(signatures::MoeGatingTopK, info) {
  Ort::ConstKernelInfo kinfo(info);
  mode = read_mode(Attributes(info, signatures::MoeGatingTopK, where));
  scores_named = node_has_output(kinfo, SCORES);
}

void GatingTopKKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  const std::vector<Input> inputs = read_inputs(ctx, N_INPUTS);
  const Checker v(where, signatures::MoeGatingTopK, inputs);
  const int64_t E = validate(mode, v);
  const Input& logits = inputs[LOGITS];
  const Input& bias = inputs[BIAS];
  const int64_t k = mode.k, rows = product(logits.shape, 0, logits.shape.size() - 1);
  std::vector<int64_t> out_shape = logits.shape;
  out_shape.back() = k;
  const ElemType type = logits.type;
  char* weights = static_cast<char*>(ctx.GetOutput(WEIGHTS, out_shape).GetTensorMutableRawData());
  int64_t* indices = ctx.GetOutput(INDICES, out_shape).GetTensorMutableData<int64_t>();
  char* scores = scores_named ? static_cast<char*>(ctx.GetOutput(SCORES, logits.shape).GetTensorMutableRawData())
                              : nullptr;
  if (rows == 0) return;

  const FloatType values = float_type(type);
  Scratch run;
  float* bias_f = bias.present ? run.take<float>(E, "input 'bias' in float32") : nullptr;
  if (bias.present) widen_row(values, bias.data, bias_f, E);
  const int64_t n_group = mode.n_group, group_size = E / n_group;
  const int64_t kept = mode.topk_group ? mode.topk_group : n_group;
  const size_t value_bytes = elem_size(type);
  size_t chunk = 1;
  const size_t n_chunks = chunk_count(static_cast<size_t>(rows), 16, 64, &chunk);
  parallel_for(ctx, n_chunks, [&](size_t c) {
    // per task: x, s, sel [E], group scores [n_group], w [k]; candidate experts [E], groups [n_group]
    Scratch scratch;
    float* x = scratch.take<float>(3 * E + n_group + k, "a row's scores");
    float *s = x + E, *sel = s + E, *groups = sel + E, *w = groups + n_group;
    int64_t* candidates = scratch.take<int64_t>(E + n_group, "a row's candidate experts");
    int64_t* group_order = candidates + E;
    const int64_t end = std::min<int64_t>(rows, static_cast<int64_t>((c + 1) * chunk));
    for (int64_t r = static_cast<int64_t>(c * chunk); r < end; ++r) {
      widen_row(values, static_cast<const char*>(logits.data) + r * E * value_bytes, x, E);
      score_row(x, E, mode.sigmoid, s);
      for (int64_t e = 0; e < E; ++e) sel[e] = bias.present ? s[e] + bias_f[e] : s[e];
      int64_t n_candidates = 0;
      if (n_group > 1) {
        for (int64_t g = 0; g < n_group; ++g) {
          groups[g] = group_score(sel + g * group_size, group_size, mode.sum_top2);
          group_order[g] = g;
        }
        best_first(group_order, n_group, kept, groups);
        for (int64_t i = 0; i < kept; ++i)
          for (int64_t e = group_order[i] * group_size; e < (group_order[i] + 1) * group_size; ++e)
            candidates[n_candidates++] = e;
      } else {
        for (int64_t e = 0; e < E; ++e) candidates[n_candidates++] = e;
      }
      best_first(candidates, n_candidates, k, sel);
      float total = 0.0f;
      for (int64_t j = 0; j < k; ++j) total += w[j] = s[candidates[j]];
      for (int64_t j = 0; j < k; ++j) {
        if (mode.renormalize) w[j] = w[j] / (total + mode.eps);
        w[j] *= mode.scale;
        indices[r * k + j] = candidates[j];
      }
      narrow_row(values, w, weights + r * k * value_bytes, k);
      if (scores) narrow_row(values, s, scores + r * E * value_bytes, E);
    }
  });
}

}  // namespace moe_onnx
