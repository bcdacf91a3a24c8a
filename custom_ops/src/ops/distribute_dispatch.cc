// MoeDistributeDispatch kernel on rank g = (EP rank p, TP rank q) (docs/distributed.md):
//
// 1. Attributes at kernel creation, the inputs at Compute, as distribute_dispatch.py checks them (same
//    order and words), the expert ids (in range, distinct in a row) before anything indexes with them.
// 2. All-gather every rank's [Bs, slots per expert] over the world; from that table alone every rank
//    plans the same drops and every count of the exchange (Plan).
// 3. Send order: the kept slots by expert (destination EP rank, then local expert), slot order inside, so
//    that a receiver knows each row's expert from the counts alone. The rows are written straight into
//    the all-to-all-v's own buffer (comm::AllToAll); without TP the rows this rank keeps for its own EP
//    rank skip MPI and go straight to expand_x. All-to-all-v in the EP group, all-gather-v in the TP group.
// 4. Each arrival row goes to its row of expand_x, by (local expert, global token), read in place from
//    the all-to-all-v's buffer (or, with TP, from the all-gathered arrival buffer).
// The row copies are split into tasks writing disjoint rows: the result does not depend on the threads.
#include "distribute_dispatch.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

#include "checker.h"
#include "parallel.h"

namespace moe_onnx {
namespace {

enum { X, EXPERT_IDS, N_INPUTS };
enum { EXPAND_X, EXPERT_OFFSET, ASSIST_INFO };

// Every count of one dispatch, from the all-gathered [W, 1 + E] table: identical on every rank.
struct Plan {
  int64_t world = 0, experts = 0, local_experts = 0;
  int64_t first_expert = 0;              // this rank's local expert 0
  std::vector<int64_t> tokens_per_rank;  // [W]
  std::vector<int64_t> kept;             // [W * E]: slots of rank g' that expert e keeps
  std::vector<int64_t> tp_blocks;        // [tp]: rows each TP rank of this group receives
  std::vector<int64_t> recv_counts;      // [ep]: rows this rank receives from each EP rank
  std::vector<int64_t> send_counts;      // [ep]: rows this rank sends to each EP rank
  std::vector<int64_t> block_sources;    // [tp * ep]: the global rank of each block of the arrival buffer
  std::vector<int64_t> first_row;        // [E_local * W]: expand_x's first row of local expert l from rank g'
  std::vector<int64_t> expert_offset;    // [E_local + 1]
  std::vector<int64_t> arrival_to_row;   // [R]: each arrival row's row of expand_x
  int64_t rows = 0;                      // of expand_x

  int64_t kept_of(int64_t g, int64_t e) const { return kept[g * experts + e]; }
};

// The table after checking what the other ranks sent (a rank of another model sends other counts).
void check_table(const std::vector<int64_t>& table, int64_t world, int64_t experts, const std::string& where) {
  for (int64_t g = 0; g < world; ++g) {
    const int64_t* row = &table[g * (1 + experts)];
    for (int64_t e = 0; e < experts; ++e)
      if (row[0] < 0 || row[1 + e] < 0 || row[1 + e] > row[0])
        throw_invalid(where + ": rank " + std::to_string(g) + " reports " + std::to_string(row[0]) +
                      " tokens and " + std::to_string(row[1 + e]) + " slots of expert " + std::to_string(e) +
                      "; expected 0 <= slots <= tokens (do all ranks run the same model?)");
  }
}

Plan make_plan(const ExpertLayout& layout, int64_t capacity, const std::vector<int64_t>& table) {
  const comm::Layout& r = layout.ranks;
  Plan plan;
  const int64_t W = plan.world = r.world_size(), E = plan.experts = layout.num_experts;
  const int64_t L = plan.local_experts = layout.local_experts();
  plan.tokens_per_rank.resize(W);
  plan.kept.assign(W * E, 0);
  for (int64_t g = 0; g < W; ++g) plan.tokens_per_rank[g] = table[g * (1 + E)];
  for (int64_t e = 0; e < E; ++e) {  // drop/pad: an expert keeps its first C slots in global-token order
    int64_t before = 0;
    for (int64_t g = 0; g < W; ++g) {
      const int64_t count = table[g * (1 + E) + 1 + e];
      plan.kept[g * E + e] = capacity ? std::clamp<int64_t>(capacity - before, 0, count) : count;
      before += count;
    }
  }
  const int64_t p = r.ep_rank, q = r.tp_rank;
  plan.first_expert = p * L;
  auto kept_to = [&](int64_t g, int64_t ep_rank) {  // rows rank g sends to EP rank ep_rank
    int64_t n = 0;
    for (int64_t l = 0; l < L; ++l) n += plan.kept_of(g, ep_rank * L + l);
    return n;
  };
  plan.tp_blocks.assign(r.tp_size, 0);
  plan.recv_counts.assign(r.ep_size, 0);
  plan.send_counts.assign(r.ep_size, 0);
  for (int64_t q2 = 0; q2 < r.tp_size; ++q2)
    for (int64_t p2 = 0; p2 < r.ep_size; ++p2) {  // the arrival buffer: TP block q2, then source EP rank p2
      const int64_t g = p2 * r.tp_size + q2, n = kept_to(g, p);
      plan.block_sources.push_back(g);
      plan.tp_blocks[q2] += n;
      if (q2 == q) plan.recv_counts[p2] = n;
    }
  for (int64_t p2 = 0; p2 < r.ep_size; ++p2) plan.send_counts[p2] = kept_to(r.global_rank(), p2);

  plan.first_row.resize(L * W);
  plan.expert_offset.assign(L + 1, 0);
  int64_t row = 0;
  for (int64_t l = 0; l < L; ++l) {  // expand_x: by local expert, then global token (rank, then row)
    plan.expert_offset[l] = row = capacity ? l * capacity : row;
    for (int64_t g = 0; g < W; ++g) {
      plan.first_row[l * W + g] = row;
      row += plan.kept_of(g, p * L + l);
    }
  }
  plan.rows = plan.expert_offset[L] = capacity ? L * capacity : row;
  for (size_t b = 0; b < plan.block_sources.size(); ++b) {  // a source sends its rows by local expert
    const int64_t g = plan.block_sources[b];
    for (int64_t l = 0; l < L; ++l)
      for (int64_t n = 0; n < plan.kept_of(g, p * L + l); ++n)
        plan.arrival_to_row.push_back(plan.first_row[l * W + g] + n);
  }
  return plan;
}

// Expert ids in [0, E) (the first outside, row-major), then distinct in a row (the first row with a
// repeat, its smallest repeated expert): check_expert_ids in _exchange.py.
void check_expert_ids(const Input& ids, int64_t experts, const std::string& where) {
  for (int64_t f = 0; f < ids.count; ++f) {
    const int64_t e = load_index(ids, f);
    if (e < 0 || e >= experts)
      throw_invalid(where + ": expert_ids" + fmt_position(ids.shape, f) + " = " + std::to_string(e) +
                    " is outside [0, " + std::to_string(experts) + ") (num_experts)");
  }
  const int64_t k = ids.shape[1];
  std::vector<int64_t> row(static_cast<size_t>(k));
  for (int64_t t = 0; t < ids.shape[0]; ++t) {
    for (int64_t j = 0; j < k; ++j) row[j] = load_index(ids, t * k + j);
    std::sort(row.begin(), row.end());
    const auto repeat = std::adjacent_find(row.begin(), row.end());
    if (repeat == row.end()) continue;
    std::vector<int64_t> at;
    for (int64_t j = 0; j < k && at.size() < 2; ++j)
      if (load_index(ids, t * k + j) == *repeat) at.push_back(j);
    const std::string pos = "expert_ids[" + std::to_string(t) + ", ";
    throw_invalid(where + ": " + pos + std::to_string(at[1]) + "] = " + std::to_string(*repeat) + " repeats " + pos +
                  std::to_string(at[0]) + "]; expected the K experts of a row to be distinct");
  }
}

// slot t * K + j -> its row of the send buffer (kept slots by expert, slot order inside), -1 if dropped.
std::vector<int64_t> send_positions(const Input& ids, const Plan& plan, int64_t g) {
  const int64_t E = plan.experts;
  std::vector<int64_t> next(E, 0), seen(E, 0);
  for (int64_t e = 1; e < E; ++e) next[e] = next[e - 1] + plan.kept_of(g, e - 1);
  std::vector<int64_t> position(static_cast<size_t>(ids.count), -1);
  for (int64_t f = 0; f < ids.count; ++f) {  // a slot is kept when its expert keeps its rank's first slots
    const int64_t e = load_index(ids, f);
    if (seen[e]++ < plan.kept_of(g, e)) position[f] = next[e]++;
  }
  return position;
}

// With a capacity, expand_x's rows past each local expert's kept rows (its padding) are zeros; the
// others are all written by the arrival rows.
void zero_padding_rows(const Plan& plan, char* expand_x, int64_t row_bytes) {
  const int64_t W = plan.world;
  for (int64_t l = 0; l < plan.local_experts; ++l) {
    const int64_t filled = plan.first_row[l * W + W - 1] + plan.kept_of(W - 1, plan.first_expert + l);
    std::memset(expand_x + filled * row_bytes, 0, static_cast<size_t>((plan.expert_offset[l + 1] - filled) * row_bytes));
  }
}

void write_assist_info(const Plan& plan, const ExpertLayout& layout, int64_t capacity, int64_t tokens, int64_t k,
                       const std::vector<int64_t>& slot_to_send, const std::vector<int64_t>& arrival_to_row,
                       int64_t* out) {
  const comm::Layout& r = layout.ranks;
  const int64_t header[kHeaderLength] = {r.ep_size, r.tp_size, layout.num_experts, tokens, k, plan.rows,
                                         static_cast<int64_t>(arrival_to_row.size()), capacity};
  out = std::copy(header, header + kHeaderLength, out);
  for (const std::vector<int64_t>* section : {&plan.tokens_per_rank, &plan.tp_blocks, &plan.recv_counts,
                                              &plan.send_counts, &slot_to_send, &arrival_to_row})
    out = std::copy(section->begin(), section->end(), out);
}

}  // namespace

DistributeDispatchKernel::DistributeDispatchKernel(const OrtKernelInfo* info) : NodeKernel(signatures::MoeDistributeDispatch, info) {
  const OpSignature& sig = signatures::MoeDistributeDispatch;
  const Attributes attrs(info, sig, where);
  layout = read_layout(attrs);
  capacity = attrs.get_int("expert_capacity");
  if (capacity < 0)
    attrs.fail("expert_capacity", "is " + std::to_string(capacity) + "; expected 0 (dropless) or a capacity >= 1");
  int64_t rows = 0;
  if (__builtin_mul_overflow(layout.local_experts(), capacity, &rows))
    attrs.fail("expert_capacity", "is " + std::to_string(capacity) +
                                      "; expected E_local * expert_capacity (the rows of expand_x) <= " +
                                      std::to_string(std::numeric_limits<int64_t>::max()) + " (E_local " +
                                      std::to_string(layout.local_experts()) + ")");
}

void DistributeDispatchKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  const std::vector<Input> inputs = read_inputs(ctx, N_INPUTS);
  const Checker v(where, signatures::MoeDistributeDispatch, inputs);
  v.expect_elem(X);
  v.expect_elem(EXPERT_IDS);
  DimBinder dims(v);
  v.expect_rank(X, 2);
  dims.shape(X, {"Bs", "H"});
  v.expect_rank(EXPERT_IDS, 2);
  dims.shape(EXPERT_IDS, {"Bs", "K"});
  const int64_t tokens = dims.get("Bs"), H = dims.get("H"), k = dims.get("K"), E = layout.num_experts;
  if (k > E)
    v.fail(v.input_name(EXPERT_IDS), "dim 1 is " + std::to_string(k) + "; expected K <= num_experts = " +
                                         std::to_string(E) + " (the K experts of a row are distinct)");
  const Input& x = inputs[X];
  const Input& ids = inputs[EXPERT_IDS];
  check_expert_ids(ids, E, where);

  const comm::Layout& r = layout.ranks;
  const comm::Groups groups = comm::groups(r, where);
  const int64_t W = r.world_size(), L = layout.local_experts();
  const char* counts_what = "the slot counts of every rank";
  const unsigned __int128 entries = static_cast<unsigned __int128>(W) * (static_cast<uint64_t>(E) + 1);
  if (entries > static_cast<unsigned __int128>(INT64_MAX))  // num_experts past any table of counts
    throw AllocationFailure(entries > UINT64_MAX ? UINT64_MAX : static_cast<uint64_t>(entries), sizeof(int64_t),
                            counts_what);
  std::vector<int64_t> counts = buffer<int64_t>(1 + E, "this rank's slot counts");
  std::vector<int64_t> table = buffer<int64_t>(static_cast<int64_t>(entries), counts_what);
  counts[0] = tokens;
  for (int64_t f = 0; f < ids.count; ++f) ++counts[1 + load_index(ids, f)];
  groups.world->all_gather(counts.data(), 1 + E, table.data(), where.c_str(), counts_what);
  check_table(table, W, E, where);
  const Plan plan = make_plan(layout, capacity, table);
  try {
    check_allocatable({plan.rows, H}, elem_size(x.type), "output 'expand_x'");
  } catch (const AllocationFailure& failure) {
    throw_invalid(where + ": " + failure.what());
  }

  const std::vector<int64_t> slot_to_send = send_positions(ids, plan, r.global_rank());
  const int64_t row_bytes = H * static_cast<int64_t>(elem_size(x.type));
  const int64_t received = plan.tp_blocks[r.tp_rank], arrivals = sum(plan.tp_blocks);
  char* expand_x = static_cast<char*>(ctx.GetOutput(EXPAND_X, {plan.rows, H}).GetTensorMutableRawData());
  auto* offsets = ctx.GetOutput(EXPERT_OFFSET, {L + 1}).GetTensorMutableData<int64_t>();
  std::copy(plan.expert_offset.begin(), plan.expert_offset.end(), offsets);
  const int64_t info_length = kHeaderLength + W + r.tp_size + 2 * r.ep_size + tokens * k + arrivals;
  write_assist_info(plan, layout, capacity, tokens, k, slot_to_send, plan.arrival_to_row,
                    ctx.GetOutput(ASSIST_INFO, {info_length}).GetTensorMutableData<int64_t>());
  if (capacity && row_bytes) zero_padding_rows(plan, expand_x, row_bytes);

  // The rows this rank keeps for its own EP rank (without TP) go from x to expand_x; MPI moves the others.
  const OwnRows own = own_rows(r, plan.send_counts, plan.recv_counts);
  const std::unique_ptr<comm::AllToAll> exchange =
      groups.ep->all_to_all_v(sum(own.sent) * row_bytes, sum(own.arrived) * row_bytes, where.c_str(),
                              "the rows to their experts");
  auto send_target = [&](int64_t s) {  // where the row of send position s goes
    if (!own.is_sent(s)) return exchange->send() + own.sent_at(s) * row_bytes;
    return expand_x + plan.arrival_to_row[own.arrival_first + s - own.send_first] * row_bytes;
  };
  if (row_bytes)
    parallel_chunks(ctx, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t f = begin * k; f < end * k; ++f)
        if (slot_to_send[f] >= 0)
          std::memcpy(send_target(slot_to_send[f]), static_cast<const char*>(x.data) + (f / k) * row_bytes,
                      static_cast<size_t>(row_bytes));
    });
  exchange->run(scaled(own.sent, row_bytes).data(), scaled(own.arrived, row_bytes).data());

  const char* arrival = exchange->recv();  // without TP: the arrival rows but this rank's own
  const WorkspacePool::Lease buffers = exchange_workspaces().lease();
  if (r.tp_size > 1) {  // every TP rank's received rows, in TP rank order
    char* gathered = buffers->take<char>(arrivals * row_bytes, "the arrival rows");
    groups.tp->all_gather_v(exchange->recv(), received * row_bytes, gathered, scaled(plan.tp_blocks, row_bytes).data(),
                            where.c_str(), "the received rows");
    arrival = gathered;
  }
  if (row_bytes == 0) return;
  parallel_chunks(ctx, arrivals, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (!own.is_arrival(i))
        std::memcpy(expand_x + plan.arrival_to_row[i] * row_bytes, arrival + own.arrived_at(i) * row_bytes,
                    static_cast<size_t>(row_bytes));
    }
  });
}

}  // namespace moe_onnx
