// MoeDistributeCombine kernel (docs/distributed.md): dispatch's path backwards.
//
// 1. Attributes at kernel creation, the inputs at Compute, as distribute_combine.py checks them (same
//    order and words); then assist_info against the node and its inputs, section by section
//    (read_assist_info in _exchange.py): a corrupted handle is an error, never a read out of bounds.
// 2. Gather the arrival rows of expand_y (arrival_to_row) in float32; with TP, reduce-scatter-v them
//    over the TP group (tp_blocks); all-to-all-v this rank's block back in the EP group (recv_counts
//    out, send_counts in): the rows come back in this rank's send order. The rows are widened (or
//    reduced) straight into the all-to-all-v's own buffer and summed from it in place; without TP the
//    rows of this rank's own EP rank skip MPI.
// 3. Per token, in float32: out[t] = ((sum over kept j ascending of scales[t, j] * y(t, j)) + x1[t])
//    + x2[t], rounded once; with gather_tokens, all-gather-v of every rank's tokens over the world.
// Tasks write disjoint rows in a fixed order: the result does not depend on the thread count.
#include "distribute_combine.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "checker.h"
#include "float_rows.h"
#include "parallel.h"

namespace moe_onnx {
namespace {

enum { EXPAND_Y, ASSIST_INFO, SCALES, X1, X2, N_INPUTS };

// assist_info's sections: the counts copied, the maps viewed in the tensor.
struct AssistInfo {
  int64_t arrivals = 0;
  std::vector<int64_t> tokens_per_rank, tp_blocks, recv_counts, send_counts;
  const int64_t* slot_to_send = nullptr;    // [Bs * K]
  const int64_t* arrival_to_row = nullptr;  // [R]
};

// A 128-bit value in decimal (a length Python computes without overflow).
std::string fmt_wide(__int128 value) {
  if (value >= 0 && value <= INT64_MAX) return std::to_string(static_cast<int64_t>(value));
  std::string digits;
  const bool negative = value < 0;
  unsigned __int128 magnitude = negative ? -static_cast<unsigned __int128>(value) : value;
  do {
    digits.insert(digits.begin(), static_cast<char>('0' + static_cast<int>(magnitude % 10)));
    magnitude /= 10;
  } while (magnitude);
  return negative ? "-" + digits : digits;
}

// The sum as numpy's int64 sum gives it (wrapping), as the reference's messages print it.
int64_t wrapping_sum(const std::vector<int64_t>& values) {
  uint64_t total = 0;
  for (int64_t v : values) total += static_cast<uint64_t>(v);
  return static_cast<int64_t>(total);
}

// assist_info of this rank for a combine of `tokens` x `k` slots over `rows` rows of expand_y, checked
// as read_assist_info in _exchange.py (same order and words), then for what the reference cannot
// meet on one process (sections of several counts whose int64 sums wrap).
AssistInfo read_assist_info(const Input& info, const ExpertLayout& layout, int64_t tokens, int64_t k, int64_t rows,
                            const std::string& where) {
  auto fail = [&](const std::string& what, const std::string& expected) {
    throw_invalid(where + ": input 'assist_info'" + what + "; expected " + expected +
                  " (the assist_info of the matching MoeDistributeDispatch)");
  };
  const comm::Layout& r = layout.ranks;
  const int64_t n = info.count;
  const int64_t* v = info.as<int64_t>();
  if (n < kHeaderLength)
    fail(" has " + std::to_string(n) + " entries", "at least the " + std::to_string(kHeaderLength) + " of its header");
  const std::pair<int64_t, const char*> header[] = {
      {r.ep_size, "attribute 'ep_world_size'"}, {r.tp_size, "attribute 'tp_world_size'"},
      {layout.num_experts, "attribute 'num_experts'"}, {tokens, "dim 0 of input 'scales'"},
      {k, "dim 1 of input 'scales'"}, {rows, "dim 0 of input 'expand_y'"}};
  for (int i = 0; i < static_cast<int>(std::size(header)); ++i)
    if (v[i] != header[i].first)
      fail("[" + std::to_string(i) + "] (" + kHeaderNames[i] + ") is " + std::to_string(v[i]),
           std::to_string(header[i].first) + ", " + header[i].second);
  AssistInfo a;
  a.arrivals = v[H_ARRIVALS];
  const int64_t W = r.world_size(), slots = tokens * k;
  const __int128 expected = static_cast<__int128>(kHeaderLength) + W + r.tp_size + 2 * r.ep_size + slots +
                            std::max<int64_t>(a.arrivals, 0);
  if (a.arrivals < 0 || n != expected)
    fail(" has " + std::to_string(n) + " entries with R = " + std::to_string(a.arrivals),
         "8 + W + tp + 2 * ep + Bs * K + R = " + fmt_wide(expected));
  const int64_t* p = v + kHeaderLength;
  const std::pair<const char*, std::vector<int64_t>*> sections[] = {
      {"tokens_per_rank", &a.tokens_per_rank}, {"tp_blocks", &a.tp_blocks},
      {"recv_counts", &a.recv_counts}, {"send_counts", &a.send_counts}};
  const int64_t lengths[] = {W, r.tp_size, r.ep_size, r.ep_size};
  for (int s = 0; s < 4; ++s) {
    sections[s].second->assign(p, p + lengths[s]);
    p += lengths[s];
    const int64_t smallest = *std::min_element(sections[s].second->begin(), sections[s].second->end());
    if (smallest < 0)
      fail(" section " + std::string(sections[s].first) + " has a negative count " + std::to_string(smallest),
           "counts >= 0");
  }
  a.slot_to_send = p;
  a.arrival_to_row = p + slots;
  const int64_t g = r.global_rank();
  if (a.tokens_per_rank[g] != tokens)
    fail(" section tokens_per_rank has [" + std::to_string(g) + "] = " + std::to_string(a.tokens_per_rank[g]),
         "Bs = " + std::to_string(tokens) + " on this rank (dim 0 of input 'scales')");
  const int64_t received = wrapping_sum(a.recv_counts), own_block = a.tp_blocks[r.tp_rank];
  if (wrapping_sum(a.tp_blocks) != a.arrivals || own_block != received)
    fail(" section tp_blocks does not add up", "sum = R = " + std::to_string(a.arrivals) + " and tp_blocks[" +
                                                  std::to_string(r.tp_rank) + "] = the sum of recv_counts (" +
                                                  std::to_string(received) + ")");
  const int64_t own = r.ep_rank;
  if (a.send_counts[own] != a.recv_counts[own])  // the rows a rank sends its own EP rank come back to it
    fail(" sections send_counts and recv_counts differ at [" + std::to_string(own) + "] (" +
             std::to_string(a.send_counts[own]) + " and " + std::to_string(a.recv_counts[own]) + ")",
         "equal counts for this rank's own EP rank (it sends those rows to itself)");
  const int64_t sent = wrapping_sum(a.send_counts);
  std::vector<char> used(static_cast<size_t>(std::max<int64_t>({slots, rows, 0})), 0);
  int64_t kept = 0;
  bool one_to_one = true;
  for (int64_t f = 0; f < slots && one_to_one; ++f) {
    const int64_t s = a.slot_to_send[f];
    if (s < -1 || s >= sent || (s >= 0 && s >= slots) || (s >= 0 && used[s]++)) one_to_one = false;
    kept += s >= 0;
  }
  if (!one_to_one || kept != sent)
    fail(" section slot_to_send is not a one-to-one map of slots onto the send buffer",
         "each of the " + std::to_string(sent) + " send positions once, -1 for a dropped slot");
  std::fill(used.begin(), used.end(), 0);
  for (int64_t i = 0; i < a.arrivals; ++i) {
    const int64_t row = a.arrival_to_row[i];
    if (row < 0 || row >= rows || used[row]++)
      fail(" section arrival_to_row is not a one-to-one map into expand_y",
           "distinct rows in [0, " + std::to_string(rows) + ")");
  }
  // Past the reference: every count of a section within what the section's (wrapped) sum allows.
  const std::pair<const std::vector<int64_t>*, int64_t> bounded[] = {
      {&a.tokens_per_rank, INT64_MAX}, {&a.tp_blocks, a.arrivals}, {&a.recv_counts, own_block},
      {&a.send_counts, sent}};
  for (const auto& [counts, total] : bounded) {
    int64_t left = total;
    for (int64_t c : *counts) {
      if (c > left) fail(" has counts that sum past int64", "the counts of the matching dispatch");
      left -= c;
    }
  }
  return a;
}

}  // namespace

DistributeCombineKernel::DistributeCombineKernel(const OrtKernelInfo* info) : NodeKernel(signatures::MoeDistributeCombine, info) {
  const OpSignature& sig = signatures::MoeDistributeCombine;
  const Attributes attrs(info, sig, where);
  layout = read_layout(attrs);
  gather_tokens = attrs.choice("gather_tokens", {0, 1}) == 1;
}

void DistributeCombineKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  const std::vector<Input> inputs = read_inputs(ctx, N_INPUTS);
  const Checker v(where, signatures::MoeDistributeCombine, inputs);
  v.expect_elem(EXPAND_Y);
  for (int i : {SCALES, X1, X2})
    if (v.has(i)) {
      v.expect_elem(i);
      v.expect_same_elem(i, EXPAND_Y);
    }
  v.expect_elem(ASSIST_INFO);
  DimBinder dims(v);
  v.expect_rank(EXPAND_Y, 2);
  dims.shape(EXPAND_Y, {"rows", "H"});
  v.expect_rank(ASSIST_INFO, 1);
  v.expect_rank(SCALES, 2);
  dims.shape(SCALES, {"Bs", "K"});
  for (int i : {X1, X2})
    if (v.has(i)) {
      v.expect_rank(i, 2);
      dims.shape(i, {"Bs", "H"});
    }
  const int64_t tokens = dims.get("Bs"), H = dims.get("H"), k = dims.get("K"), rows = dims.get("rows");
  const AssistInfo a = read_assist_info(inputs[ASSIST_INFO], layout, tokens, k, rows, where);

  const comm::Layout& r = layout.ranks;
  const comm::Groups groups = comm::groups(r, where);
  const Input& y = inputs[EXPAND_Y];
  const ElemType type = y.type;
  const int64_t esize = static_cast<int64_t>(elem_size(type)), row_floats = H * static_cast<int64_t>(sizeof(float));
  const FloatType values = float_type(type);
  // The arrival rows in float32, widened into the all-to-all-v's send buffer (with TP: into the arrival
  // rows, then summed over the group into it); those of this rank's own EP rank (without TP) stay here.
  const OwnRows own = own_rows(r, a.send_counts, a.recv_counts);
  const WorkspacePool::Lease buffers = exchange_workspaces().lease();
  const std::unique_ptr<comm::AllToAll> exchange =
      groups.ep->all_to_all_v(sum(own.arrived) * row_floats, sum(own.sent) * row_floats, where.c_str(),
                              "the expert outputs back to their tokens");
  float* to_send = reinterpret_cast<float*>(exchange->send());
  float* own_rows_out = buffers->take<float>(own.rows * H, "the rows of this rank's own EP rank");
  float* arrival = r.tp_size > 1 ? buffers->take<float>(a.arrivals * H, "the arrival rows") : nullptr;
  auto arrival_target = [&](int64_t i) {  // where arrival row i is widened to
    if (arrival) return arrival + i * H;
    return own.is_arrival(i) ? own_rows_out + (i - own.arrival_first) * H : to_send + own.arrived_at(i) * H;
  };
  if (H)
    parallel_chunks(ctx, a.arrivals, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        widen_row(values, static_cast<const char*>(y.data) + a.arrival_to_row[i] * H * esize, arrival_target(i), H);
    });
  if (arrival)
    groups.tp->reduce_scatter_v_sum(arrival, to_send, scaled(a.tp_blocks, H).data(), where.c_str(),
                                    "the partial expert outputs");
  exchange->run(scaled(own.arrived, row_floats).data(), scaled(own.sent, row_floats).data());
  const float* back = reinterpret_cast<const float*>(exchange->recv());
  auto returned_row = [&](int64_t s) -> const float* {  // the expert output of send position s
    return own.is_sent(s) ? own_rows_out + (s - own.send_first) * H : back + own.sent_at(s) * H;
  };

  const int64_t out_tokens = gather_tokens ? sum(a.tokens_per_rank) : tokens;
  try {
    check_allocatable({out_tokens, H}, static_cast<size_t>(esize), "output 'out'");
  } catch (const AllocationFailure& failure) {
    throw_invalid(where + ": " + failure.what());
  }
  char* out = static_cast<char*>(ctx.GetOutput(0, {out_tokens, H}).GetTensorMutableRawData());
  char* mine = gather_tokens ? buffers->take<char>(tokens * H * esize, "this rank's tokens") : nullptr;
  char* result = gather_tokens ? mine : out;
  const Input& scales = inputs[SCALES];
  parallel_chunks(ctx, H ? tokens : 0, 4, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    float* acc = scratch.take<float>(H, "a token's sum");
    float* add = scratch.take<float>(H, "a row to add");
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc, acc + H, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t s = a.slot_to_send[t * k + j];
        if (s < 0) continue;
        const float weight = load_float(values, scales.data, t * k + j);
        const float* row = returned_row(s);
        for (int64_t h = 0; h < H; ++h) acc[h] += weight * row[h];
      }
      for (int i : {X1, X2})
        if (inputs[i].present) {
          widen_row(values, static_cast<const char*>(inputs[i].data) + t * H * esize, add, H);
          for (int64_t h = 0; h < H; ++h) acc[h] += add[h];
        }
      narrow_row(values, acc, result + t * H * esize, H);
    }
  });
  if (gather_tokens)
    groups.world->all_gather_v(mine, tokens * H * esize, out, scaled(a.tokens_per_rank, H * esize).data(),
                               where.c_str(), "the tokens of every rank");
}

}  // namespace moe_onnx
