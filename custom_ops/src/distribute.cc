// MoeDistributeDispatch and MoeDistributeCombine kernels (docs/distributed.md):
//
// Dispatch on rank g = (EP rank p, TP rank q):
// 1. validate the inputs as distribute.py does (expert ids in range and distinct in a row, before any
//    indexing), then all-gather every rank's [Bs, slots per expert] over the world;
// 2. plan from that table alone (Plan): which slots each expert keeps (identical on every rank), the
//    send permutation (kept slots by expert), the counts of every exchange and where each arrival row
//    goes in expand_x;
// 3. copy the rows into the send buffer, all-to-all-v them in the EP group, all-gather-v the received
//    rows in the TP group, and move each arrival row to its row of expand_x; write assist_info.
// Combine runs the path back from assist_info, which it checks against its inputs first (a
// corrupted handle is an error, never a read out of bounds): gather the arrival rows of expand_y in
// float32, reduce-scatter-v them over the TP group, all-to-all-v them back, then per token in float32
// out[t] = ((sum over kept j ascending of scales[t, j] * y(t, j)) + x1[t]) + x2[t], rounded once.
// Every copy and sum is split into tasks that write disjoint rows in a fixed order: the results do
// not depend on the thread count.
#include "distribute.h"

#include <algorithm>
#include <limits>

#include "kernel_util.h"
#include "parallel.h"

namespace moe_onnx {
namespace {

enum { X, EXPERT_IDS, N_DISPATCH_INPUTS };
enum { EXPAND_X, EXPERT_OFFSET, DISPATCH_ASSIST_INFO };
enum { EXPAND_Y, ASSIST_INFO, SCALES, X1, X2, N_COMBINE_INPUTS };

constexpr int64_t kHeaderLength = 8;

ExpertLayout read_layout(const Attributes& a) {
  ExpertLayout layout;
  comm::Layout& r = layout.ranks;
  layout.num_experts = a.get_int("num_experts");
  if (layout.num_experts < 1) a.fail("num_experts", "is " + std::to_string(layout.num_experts) + "; expected >= 1");
  r.ep_size = a.get_int("ep_world_size");
  if (r.ep_size < 1) a.fail("ep_world_size", "is " + std::to_string(r.ep_size) + "; expected >= 1");
  r.ep_rank = a.get_int("ep_rank_id");
  if (r.ep_rank < 0 || r.ep_rank >= r.ep_size)
    a.fail("ep_rank_id", "is " + std::to_string(r.ep_rank) + "; expected 0 <= ep_rank_id < ep_world_size (" +
                             std::to_string(r.ep_size) + ")");
  r.tp_size = a.get_int("tp_world_size");
  if (r.tp_size < 1) a.fail("tp_world_size", "is " + std::to_string(r.tp_size) + "; expected >= 1");
  r.tp_rank = a.get_int("tp_rank_id");
  if (r.tp_rank < 0 || r.tp_rank >= r.tp_size)
    a.fail("tp_rank_id", "is " + std::to_string(r.tp_rank) + "; expected 0 <= tp_rank_id < tp_world_size (" +
                             std::to_string(r.tp_size) + ")");
  if (layout.num_experts % r.ep_size)
    a.fail("num_experts", "is " + std::to_string(layout.num_experts) + "; expected a multiple of ep_world_size (" +
                              std::to_string(r.ep_size) + ")");
  return layout;
}

// Runs `fn(begin, end)` over chunks of [0, n) on the intra-op pool.
template <class Fn>
void for_chunks(const Ort::KernelContext& ctx, int64_t n, size_t min_chunk, Fn&& fn) {
  size_t chunk = 1;
  const size_t n_chunks = chunk_count(static_cast<size_t>(n), min_chunk, 64, &chunk);
  parallel_for(ctx, n_chunks, [&](size_t c) {
    fn(static_cast<int64_t>(c * chunk), std::min<int64_t>(n, static_cast<int64_t>((c + 1) * chunk)));
  });
}

// counts[i] * unit, for the byte or element counts of a collective.
std::vector<int64_t> scaled(const std::vector<int64_t>& counts, int64_t unit) {
  std::vector<int64_t> out(counts.size());
  for (size_t i = 0; i < counts.size(); ++i) out[i] = counts[i] * unit;
  return out;
}

int64_t sum(const std::vector<int64_t>& v) {
  int64_t total = 0;
  for (int64_t x : v) total += x;
  return total;
}

// A buffer of `count` elements for `what`, through allocate() (an AllocationFailure when it cannot be had).
template <class T>
std::vector<T> buffer(int64_t count, const char* what) {
  std::vector<T> v;
  allocate(v, count, T{}, what);
  return v;
}

// ------------------------------------------------------------------------------------ assist_info

// The sections of assist_info (docs/distributed.md), as views into the tensor.
struct AssistInfo {
  int64_t ep_size, tp_size, num_experts, tokens, k, rows, arrivals, capacity;
  const int64_t* tokens_per_rank;  // [W]
  const int64_t* tp_blocks;        // [tp]
  const int64_t* recv_counts;      // [ep]
  const int64_t* send_counts;      // [ep]
  const int64_t* slot_to_send;     // [Bs * K]
  const int64_t* arrival_to_row;   // [R]
};

// ------------------------------------------------------------------------------------ dispatch

// Every count of one dispatch, from the all-gathered [W, 1 + E] table: identical on every rank.
struct Plan {
  int64_t world = 0, experts = 0, local_experts = 0;
  std::vector<int64_t> tokens_per_rank;  // [W]
  std::vector<int64_t> kept;             // [W * E]: slots of rank g' that expert e keeps
  std::vector<int64_t> tp_blocks;        // [tp]
  std::vector<int64_t> recv_counts;      // [ep]
  std::vector<int64_t> send_counts;      // [ep]
  std::vector<int64_t> expert_offset;    // [E_local + 1]
  std::vector<int64_t> arrival_to_row;   // [R]
  int64_t rows = 0;                      // of expand_x

  int64_t kept_of(int64_t g, int64_t e) const { return kept[g * experts + e]; }
};

// The [W, 1 + E] table after checking what other ranks sent (a rank of another model sends other
// counts): every Bs >= 0 and every count in [0, Bs].
void check_table(const std::vector<int64_t>& table, int64_t world, int64_t experts, const std::string& where) {
  for (int64_t g = 0; g < world; ++g) {
    const int64_t* row = &table[g * (1 + experts)];
    for (int64_t e = 0; e < experts; ++e)
      if (row[0] < 0 || row[1 + e] < 0 || row[1 + e] > row[0])
        throw_invalid(where + ": rank " + std::to_string(g) + " reports " + std::to_string(row[0]) +
                      " tokens and " + std::to_string(row[1 + e]) + " slots for expert " + std::to_string(e) +
                      "; expected 0 <= slots <= tokens (do all ranks run the same model?)");
  }
}

Plan make_plan(const ExpertLayout& layout, int64_t capacity, const std::vector<int64_t>& table) {
  const comm::Layout& r = layout.ranks;
  Plan plan;
  plan.world = r.world_size();
  plan.experts = layout.num_experts;
  plan.local_experts = layout.local_experts();
  const int64_t W = plan.world, E = plan.experts, L = plan.local_experts;
  plan.tokens_per_rank.resize(W);
  plan.kept.assign(W * E, 0);
  for (int64_t g = 0; g < W; ++g) plan.tokens_per_rank[g] = table[g * (1 + E)];
  for (int64_t e = 0; e < E; ++e) {  // an expert keeps its first C slots in global-token order
    int64_t before = 0;
    for (int64_t g = 0; g < W; ++g) {
      const int64_t count = table[g * (1 + E) + 1 + e];
      plan.kept[g * E + e] = capacity ? std::clamp<int64_t>(capacity - before, 0, count) : count;
      before += count;
    }
  }
  const int64_t p = r.ep_rank, q = r.tp_rank, g_self = r.global_rank();
  auto kept_to = [&](int64_t g, int64_t ep_rank) {  // rows rank g sends to EP rank ep_rank
    int64_t n = 0;
    for (int64_t l = 0; l < L; ++l) n += plan.kept_of(g, ep_rank * L + l);
    return n;
  };
  plan.tp_blocks.assign(r.tp_size, 0);
  plan.recv_counts.assign(r.ep_size, 0);
  plan.send_counts.assign(r.ep_size, 0);
  for (int64_t p2 = 0; p2 < r.ep_size; ++p2) {
    for (int64_t q2 = 0; q2 < r.tp_size; ++q2) plan.tp_blocks[q2] += kept_to(p2 * r.tp_size + q2, p);
    plan.recv_counts[p2] = kept_to(p2 * r.tp_size + q, p);
    plan.send_counts[p2] = kept_to(g_self, p2);
  }

  // start[l * W + g]: the first row of expand_x of local expert l's rows from rank g.
  std::vector<int64_t> start(L * W);
  plan.expert_offset.assign(L + 1, 0);
  int64_t row = 0;
  for (int64_t l = 0; l < L; ++l) {
    plan.expert_offset[l] = row = capacity ? l * capacity : row;
    for (int64_t g = 0; g < W; ++g) {
      start[l * W + g] = row;
      row += plan.kept_of(g, p * L + l);
    }
  }
  plan.rows = plan.expert_offset[L] = capacity ? L * capacity : row;

  // Arrival order: TP block q2, then source EP rank p2, then local expert l, then token.
  plan.arrival_to_row.reserve(static_cast<size_t>(sum(plan.tp_blocks)));
  for (int64_t q2 = 0; q2 < r.tp_size; ++q2)
    for (int64_t p2 = 0; p2 < r.ep_size; ++p2)
      for (int64_t l = 0; l < L; ++l) {
        const int64_t g = p2 * r.tp_size + q2, first = start[l * W + g];
        for (int64_t i = 0; i < plan.kept_of(g, p * L + l); ++i) plan.arrival_to_row.push_back(first + i);
      }
  return plan;
}

// slot t * K + j -> its row of the send buffer (kept slots by expert, token order inside), -1 if dropped.
std::vector<int64_t> send_positions(const Input& ids, const Plan& plan, int64_t g) {
  const int64_t E = plan.experts;
  std::vector<int64_t> next(E, 0), seen(E, 0);  // next[e]: the send row of expert e's next kept slot
  for (int64_t e = 0, row = 0; e < E; ++e) {
    next[e] = row;
    row += plan.kept_of(g, e);
  }
  std::vector<int64_t> position(static_cast<size_t>(ids.count), -1);
  for (int64_t f = 0; f < ids.count; ++f) {
    const int64_t e = load_index(ids, f);
    if (seen[e]++ < plan.kept_of(g, e)) position[f] = next[e]++;
  }
  return position;
}

// Expert ids in [0, E) and distinct within a row, checked before anything indexes with them.
void check_expert_ids(const Input& ids, int64_t experts, const std::string& where) {
  const int64_t k = ids.shape[1];
  for (int64_t f = 0; f < ids.count; ++f) {
    const int64_t e = load_index(ids, f);
    if (e < 0 || e >= experts)
      throw_invalid(where + ": expert_ids" + fmt_position(ids.shape, f) + " = " + std::to_string(e) +
                    " is outside [0, " + std::to_string(experts) + ") (num_experts)");
  }
  std::vector<int64_t> last_token(experts, -1), last_j(experts, -1);
  for (int64_t f = 0; f < ids.count; ++f) {
    const int64_t e = load_index(ids, f), t = f / k, j = f % k;
    if (last_token[e] == t)
      throw_invalid(where + ": expert_ids[" + std::to_string(t) + "] names expert " + std::to_string(e) +
                    " twice (k = " + std::to_string(last_j[e]) + " and " + std::to_string(j) +
                    "); expected distinct experts in a row");
    last_token[e] = t;
    last_j[e] = j;
  }
}

void write_assist_info(const Plan& plan, const ExpertLayout& layout, int64_t capacity, int64_t tokens, int64_t k,
                       const std::vector<int64_t>& slot_to_send, int64_t* out) {
  const comm::Layout& r = layout.ranks;
  const int64_t header[kHeaderLength] = {r.ep_size,  r.tp_size,  layout.num_experts,
                                         tokens,     k,          plan.rows,
                                         static_cast<int64_t>(plan.arrival_to_row.size()), capacity};
  out = std::copy(header, header + kHeaderLength, out);
  for (const std::vector<int64_t>* section : {&plan.tokens_per_rank, &plan.tp_blocks, &plan.recv_counts,
                                              &plan.send_counts, &slot_to_send, &plan.arrival_to_row})
    out = std::copy(section->begin(), section->end(), out);
}

// ------------------------------------------------------------------------------------ combine

// assist_info read and checked against the node and its inputs, section by section, before any of
// its values indexes anything.
AssistInfo read_assist_info(const Input& info, const ExpertLayout& layout, int64_t tokens, int64_t k,
                            int64_t y_rows, const std::string& where) {
  auto fail = [&](const std::string& message) { throw_invalid(where + ": assist_info " + message); };
  const int64_t n = info.count;
  const int64_t* v = info.as<int64_t>();
  if (n < kHeaderLength)
    fail("has " + std::to_string(n) + " entries; expected at least the " + std::to_string(kHeaderLength) +
         " of its header (is it MoeDistributeDispatch's assist_info?)");
  AssistInfo a{v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  const comm::Layout& r = layout.ranks;
  const std::pair<const char*, std::pair<int64_t, int64_t>> expected[] = {
      {"ep_world_size", {a.ep_size, r.ep_size}}, {"tp_world_size", {a.tp_size, r.tp_size}},
      {"num_experts", {a.num_experts, layout.num_experts}}, {"Bs", {a.tokens, tokens}}, {"K", {a.k, k}},
      {"rows of expand_x", {a.rows, y_rows}}};
  const char* sources[] = {"attribute 'ep_world_size'", "attribute 'tp_world_size'", "attribute 'num_experts'",
                           "scales dim 0", "scales dim 1", "expand_y dim 0"};
  for (size_t i = 0; i < std::size(expected); ++i) {
    const auto& [name, values] = expected[i];
    if (values.first != values.second)
      fail("header says " + std::string(name) + " = " + std::to_string(values.first) + "; expected " +
           std::to_string(values.second) + " (" + sources[i] + ")");
  }
  if (a.arrivals < 0) fail("header says R = " + std::to_string(a.arrivals) + "; expected >= 0");
  if (a.capacity < 0) fail("header says expert_capacity = " + std::to_string(a.capacity) + "; expected >= 0");
  const int64_t W = r.world_size();
  // Bs * K and R are bounded by the tensors (expand_y and scales exist) except R: bound it by n first.
  if (a.arrivals > n) fail("header says R = " + std::to_string(a.arrivals) + "; expected at most its length " +
                           std::to_string(n));
  const int64_t length = kHeaderLength + W + r.tp_size + 2 * r.ep_size + tokens * k + a.arrivals;
  if (n != length)
    fail("has " + std::to_string(n) + " entries; expected " + std::to_string(length) + " = 8 + W (" +
         std::to_string(W) + ") + tp (" + std::to_string(r.tp_size) + ") + 2 * ep (" + std::to_string(r.ep_size) +
         ") + Bs * K (" + std::to_string(tokens * k) + ") + R (" + std::to_string(a.arrivals) + ")");
  const int64_t* p = v + kHeaderLength;
  a.tokens_per_rank = p;
  a.tp_blocks = p += W;
  a.recv_counts = p += r.tp_size;
  a.send_counts = p += r.ep_size;
  a.slot_to_send = p += r.ep_size;
  a.arrival_to_row = p += tokens * k;

  // Every count >= 0; the sums bounded by the lengths they index, so no total overflows.
  auto check_counts = [&](const char* section, const int64_t* counts, int64_t size, int64_t bound) {
    int64_t total = 0;
    for (int64_t i = 0; i < size; ++i) {
      if (counts[i] < 0 || counts[i] > bound - total)
        fail(std::string(section) + "[" + std::to_string(i) + "] = " + std::to_string(counts[i]) +
             (counts[i] < 0 ? "; expected >= 0" : "; expected the section to sum to at most " + std::to_string(bound)));
      total += counts[i];
    }
    return total;
  };
  check_counts("tokens_per_rank", a.tokens_per_rank, W, std::numeric_limits<int64_t>::max());
  const int64_t g = r.global_rank();
  if (a.tokens_per_rank[g] != tokens)
    fail("tokens_per_rank[" + std::to_string(g) + "] = " + std::to_string(a.tokens_per_rank[g]) +
         "; expected Bs = " + std::to_string(tokens) + " (this rank's tokens)");
  if (check_counts("tp_blocks", a.tp_blocks, r.tp_size, a.arrivals) != a.arrivals)
    fail("tp_blocks sum to less than R = " + std::to_string(a.arrivals));
  const int64_t own_block = a.tp_blocks[r.tp_rank];
  if (check_counts("recv_counts", a.recv_counts, r.ep_size, own_block) != own_block)
    fail("recv_counts sum to less than tp_blocks[" + std::to_string(r.tp_rank) + "] = " + std::to_string(own_block));
  const int64_t sent = check_counts("send_counts", a.send_counts, r.ep_size, tokens * k);

  // slot_to_send: each send row named by exactly one slot; arrival_to_row: distinct rows of expand_y.
  std::vector<char> used(static_cast<size_t>(std::max(sent, y_rows)), 0);
  int64_t named = 0;
  for (int64_t f = 0; f < tokens * k; ++f) {
    const int64_t s = a.slot_to_send[f];
    if (s < -1 || s >= sent)
      fail("slot_to_send[" + std::to_string(f) + "] = " + std::to_string(s) + " is outside [-1, " +
           std::to_string(sent) + ") (the rows sent, or -1)");
    if (s < 0) continue;
    if (used[s]++) fail("slot_to_send names send row " + std::to_string(s) + " twice; expected each once");
    ++named;
  }
  if (named != sent)
    fail("slot_to_send names " + std::to_string(named) + " send rows; expected " + std::to_string(sent) +
         " (the sum of send_counts)");
  std::fill(used.begin(), used.end(), 0);
  for (int64_t i = 0; i < a.arrivals; ++i) {
    const int64_t row = a.arrival_to_row[i];
    if (row < 0 || row >= y_rows)
      fail("arrival_to_row[" + std::to_string(i) + "] = " + std::to_string(row) + " is outside [0, " +
           std::to_string(y_rows) + ") (the rows of expand_y)");
    if (used[row]++) fail("arrival_to_row names row " + std::to_string(row) + " twice; expected each once");
  }
  return a;
}

}  // namespace

// ------------------------------------------------------------------------------------ kernels

DistributeDispatchKernel::DistributeDispatchKernel(const OrtKernelInfo* info) {
  const OpSignature& sig = signatures::MoeDistributeDispatch;
  where = node_where(sig.name, Ort::ConstKernelInfo(info));
  const Attributes attrs(info, sig, where);
  layout = read_layout(attrs);
  capacity = attrs.get_int("expert_capacity");
  if (capacity < 0)
    attrs.fail("expert_capacity", "is " + std::to_string(capacity) + "; expected 0 (dropless) or >= 1");
  int64_t rows = 0;
  if (__builtin_mul_overflow(layout.local_experts(), capacity, &rows))
    attrs.fail("expert_capacity", "is " + std::to_string(capacity) +
                                      "; expected num_experts / ep_world_size * expert_capacity (the rows of "
                                      "expand_x) <= " + std::to_string(std::numeric_limits<int64_t>::max()));
}

OrtStatusPtr DistributeDispatchKernel::ComputeV2(OrtKernelContext* context) {
  return compute_status(where, [&] { Compute(context); });
}

void DistributeDispatchKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  const std::vector<Input> inputs = read_inputs(ctx, N_DISPATCH_INPUTS);
  const Checker v(where, signatures::MoeDistributeDispatch, inputs);
  v.expect_elem(X);
  v.expect_elem(EXPERT_IDS);
  DimBinder dims(v);
  v.expect_rank(X, 2);
  dims.shape(X, {"Bs", "H"});
  v.expect_rank(EXPERT_IDS, 2);
  dims.shape(EXPERT_IDS, {"Bs", "K"});
  const Input& x = inputs[X];
  const Input& ids = inputs[EXPERT_IDS];
  const int64_t tokens = dims.get("Bs"), H = dims.get("H"), k = dims.get("K"), E = layout.num_experts;
  check_expert_ids(ids, E, where);

  const comm::Groups groups = comm::groups(layout.ranks, where);
  const int64_t W = layout.ranks.world_size(), g = layout.ranks.global_rank();
  std::vector<int64_t> counts(1 + E, 0), table = buffer<int64_t>(W * (1 + E), "the slot counts of every rank");
  counts[0] = tokens;
  for (int64_t f = 0; f < ids.count; ++f) ++counts[1 + load_index(ids, f)];
  groups.world->all_gather(counts.data(), 1 + E, table.data(), where.c_str(), "the slot counts of every rank");
  check_table(table, W, E, where);
  const Plan plan = make_plan(layout, capacity, table);
  const std::vector<int64_t> slot_to_send = send_positions(ids, plan, g);

  const int64_t row_bytes = H * static_cast<int64_t>(elem_size(x.type));
  const int64_t sent = sum(plan.send_counts), received = plan.tp_blocks[layout.ranks.tp_rank];
  const int64_t arrivals = static_cast<int64_t>(plan.arrival_to_row.size());
  std::vector<char> send = buffer<char>(sent * row_bytes, "the rows to send");
  for_chunks(ctx, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t f = begin * k; f < end * k; ++f)
      if (slot_to_send[f] >= 0 && row_bytes)
        std::memcpy(&send[slot_to_send[f] * row_bytes], static_cast<const char*>(x.data) + (f / k) * row_bytes,
                    static_cast<size_t>(row_bytes));
  });
  std::vector<char> arrival = buffer<char>(arrivals * row_bytes, "the arrival rows");
  std::vector<char> own_block = layout.ranks.tp_size > 1 ? buffer<char>(received * row_bytes, "the received rows")
                                                         : std::vector<char>();
  char* received_rows = layout.ranks.tp_size > 1 ? own_block.data() : arrival.data();
  groups.ep->all_to_all_v(send.data(), scaled(plan.send_counts, row_bytes).data(), received_rows,
                          scaled(plan.recv_counts, row_bytes).data(), where.c_str(), "the rows to the experts");
  if (layout.ranks.tp_size > 1)
    groups.tp->all_gather_v(own_block.data(), received * row_bytes, arrival.data(),
                            scaled(plan.tp_blocks, row_bytes).data(), where.c_str(), "the rows of the TP group");

  try {
    check_allocatable({plan.rows, H}, elem_size(x.type), "output 'expand_x'");
  } catch (const AllocationFailure& failure) {
    throw_invalid(where + ": " + failure.what());
  }
  char* expand_x = static_cast<char*>(ctx.GetOutput(EXPAND_X, {plan.rows, H}).GetTensorMutableRawData());
  const int64_t L = layout.local_experts();
  auto* offsets = ctx.GetOutput(EXPERT_OFFSET, {L + 1}).GetTensorMutableData<int64_t>();
  std::copy(plan.expert_offset.begin(), plan.expert_offset.end(), offsets);
  const int64_t info_length = kHeaderLength + W + layout.ranks.tp_size + 2 * layout.ranks.ep_size + tokens * k + arrivals;
  auto* info = ctx.GetOutput(DISPATCH_ASSIST_INFO, {info_length}).GetTensorMutableData<int64_t>();
  write_assist_info(plan, layout, capacity, tokens, k, slot_to_send, info);
  if (row_bytes == 0) return;
  if (capacity) std::memset(expand_x, 0, static_cast<size_t>(plan.rows * row_bytes));  // the padding rows
  for_chunks(ctx, arrivals, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      std::memcpy(expand_x + plan.arrival_to_row[i] * row_bytes, &arrival[i * row_bytes],
                  static_cast<size_t>(row_bytes));
  });
}

DistributeCombineKernel::DistributeCombineKernel(const OrtKernelInfo* info) {
  const OpSignature& sig = signatures::MoeDistributeCombine;
  where = node_where(sig.name, Ort::ConstKernelInfo(info));
  const Attributes attrs(info, sig, where);
  layout = read_layout(attrs);
  gather_tokens = attrs.choice("gather_tokens", {0, 1}) == 1;
}

OrtStatusPtr DistributeCombineKernel::ComputeV2(OrtKernelContext* context) {
  return compute_status(where, [&] { Compute(context); });
}

void DistributeCombineKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  const std::vector<Input> inputs = read_inputs(ctx, N_COMBINE_INPUTS);
  const Checker v(where, signatures::MoeDistributeCombine, inputs);
  v.expect_elem(EXPAND_Y);
  v.expect_elem(ASSIST_INFO);
  for (int i : {SCALES, X1, X2})
    if (i == SCALES || v.has(i)) {
      v.expect_elem(i);
      v.expect_same_elem(i, EXPAND_Y);
    }
  DimBinder dims(v);
  v.expect_rank(EXPAND_Y, 2);
  dims.shape(EXPAND_Y, {"A", "H"});
  v.expect_rank(ASSIST_INFO, 1);
  v.expect_rank(SCALES, 2);
  dims.shape(SCALES, {"Bs", "K"});
  for (int i : {X1, X2})
    if (v.has(i)) {
      v.expect_rank(i, 2);
      dims.shape(i, {"Bs", "H"});
    }
  const int64_t tokens = dims.get("Bs"), H = dims.get("H"), k = dims.get("K"), y_rows = dims.get("A");
  const AssistInfo a = read_assist_info(inputs[ASSIST_INFO], layout, tokens, k, y_rows, where);

  const comm::Groups groups = comm::groups(layout.ranks, where);
  const comm::Layout& r = layout.ranks;
  const Input& y = inputs[EXPAND_Y];
  const ElemType type = y.type;
  const int64_t esize = static_cast<int64_t>(elem_size(type));
  // Arrival rows of expand_y in float32; with TP, summed over the group into this rank's own block.
  std::vector<float> arrival = buffer<float>(a.arrivals * H, "the arrival rows");
  for_chunks(ctx, a.arrivals, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      to_float(type, static_cast<const char*>(y.data) + a.arrival_to_row[i] * H * esize, &arrival[i * H], H);
  });
  const std::vector<int64_t> tp_blocks(a.tp_blocks, a.tp_blocks + r.tp_size);
  const std::vector<int64_t> recv_counts(a.recv_counts, a.recv_counts + r.ep_size);
  const std::vector<int64_t> send_counts(a.send_counts, a.send_counts + r.ep_size);
  std::vector<float> own_block;
  if (r.tp_size > 1) {
    own_block = buffer<float>(tp_blocks[r.tp_rank] * H, "the received rows");
    groups.tp->reduce_scatter_v_sum(arrival.data(), own_block.data(), scaled(tp_blocks, H).data(), where.c_str(),
                                    "the partial expert outputs of the TP group");
  }
  const float* own = r.tp_size > 1 ? own_block.data() : arrival.data();
  const int64_t row_floats = H * static_cast<int64_t>(sizeof(float));
  std::vector<float> back = buffer<float>(sum(send_counts) * H, "the expert outputs sent back");
  groups.ep->all_to_all_v(own, scaled(recv_counts, row_floats).data(), back.data(),
                          scaled(send_counts, row_floats).data(), where.c_str(), "the expert outputs back");

  std::vector<int64_t> tokens_per_rank(a.tokens_per_rank, a.tokens_per_rank + r.world_size());
  const int64_t out_tokens = gather_tokens ? sum(tokens_per_rank) : tokens;
  try {
    check_allocatable({out_tokens, H}, static_cast<size_t>(esize), "output 'out'");
  } catch (const AllocationFailure& failure) {
    throw_invalid(where + ": " + failure.what());
  }
  char* out = static_cast<char*>(ctx.GetOutput(0, {out_tokens, H}).GetTensorMutableRawData());
  std::vector<char> mine = gather_tokens ? buffer<char>(tokens * H * esize, "this rank's tokens") : std::vector<char>();
  char* result = gather_tokens ? mine.data() : out;
  const Input& scales = inputs[SCALES];
  for_chunks(ctx, H ? tokens : 0, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(H)), add(static_cast<size_t>(H));
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t s = a.slot_to_send[t * k + j];
        if (s < 0) continue;
        const float weight = load_float(type, scales.data, t * k + j);
        const float* row = &back[s * H];
        for (int64_t h = 0; h < H; ++h) acc[h] += weight * row[h];
      }
      for (int i : {X1, X2})
        if (inputs[i].present) {
          to_float(type, static_cast<const char*>(inputs[i].data) + t * H * esize, add.data(), H);
          for (int64_t h = 0; h < H; ++h) acc[h] += add[h];
        }
      from_float(type, acc.data(), result + t * H * esize, H);
    }
  });
  if (gather_tokens)
    groups.world->all_gather_v(mine.data(), tokens * H * esize, out, scaled(tokens_per_rank, H * esize).data(),
                               where.c_str(), "the tokens of every rank");
}

}  // namespace moe_onnx
