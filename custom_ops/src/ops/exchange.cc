#include "exchange.h"

#include <tuple>

namespace moe_onnx {

WorkspacePool& exchange_workspaces() {
  static auto* pool = new WorkspacePool(2);  // never destroyed: a lease may end during exit
  return *pool;
}

const char* const kHeaderNames[kHeaderLength] = {
    "ep_world_size", "tp_world_size", "num_experts", "Bs", "K", "rows of expand_x", "R (arrival rows)",
    "expert_capacity"};

ExpertLayout read_layout(const Attributes& a) {
  ExpertLayout layout;
  comm::Layout& r = layout.ranks;
  std::tie(r.ep_size, r.ep_rank) = read_group(a, "ep_world_size", "ep_rank_id");
  std::tie(r.tp_size, r.tp_rank) = read_group(a, "tp_world_size", "tp_rank_id");
  layout.num_experts = a.get_int("num_experts");
  if (layout.num_experts < 1 || layout.num_experts % r.ep_size)
    a.fail("num_experts", "is " + std::to_string(layout.num_experts) + "; expected a multiple >= 1 of ep_world_size = " +
                              std::to_string(r.ep_size) +
                              " (each EP rank owns num_experts / ep_world_size experts)");
  return layout;
}

OwnRows own_rows(const comm::Layout& layout, const std::vector<int64_t>& send_counts,
                 const std::vector<int64_t>& recv_counts) {
  OwnRows own;
  own.sent = send_counts;
  own.arrived = recv_counts;
  if (layout.tp_size > 1) return own;
  const int64_t p = layout.ep_rank;
  for (int64_t p2 = 0; p2 < p; ++p2) {
    own.send_first += send_counts[p2];
    own.arrival_first += recv_counts[p2];
  }
  own.rows = send_counts[p];
  own.sent[p] = own.arrived[p] = 0;
  return own;
}

std::vector<int64_t> scaled(const std::vector<int64_t>& counts, int64_t unit) {
  std::vector<int64_t> out(counts.size());
  for (size_t i = 0; i < counts.size(); ++i) out[i] = counts[i] * unit;
  return out;
}

int64_t sum(const std::vector<int64_t>& values) {
  int64_t total = 0;
  for (int64_t v : values) total += v;
  return total;
}

}  // namespace moe_onnx
