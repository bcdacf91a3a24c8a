#include "exchange.h"

#include "block_pool.h"

namespace moe_onnx {
namespace {

// A group's size (>= 1) and this rank's index in it (check_group_attrs in _common.py).
void read_group(const Attributes& a, const char* size_name, const char* rank_name, int64_t* size, int64_t* rank) {
  *size = a.get_int(size_name);
  *rank = a.get_int(rank_name);
  if (*size < 1) a.fail(size_name, "is " + std::to_string(*size) + "; expected >= 1");
  if (*rank < 0 || *rank >= *size)
    a.fail(rank_name, "is " + std::to_string(*rank) + "; expected 0 <= " + rank_name + " < " + size_name + " = " +
                          std::to_string(*size));
}

// The blocks of take_scratch: enough for one dispatch or combine (send, arrival and TP buffers).
BlockPool& scratch_pool() {
  static BlockPool* pool = new BlockPool(6);  // never destroyed: a block may come back during exit
  return *pool;
}

}  // namespace

ScratchBytes take_scratch(size_t bytes) {
  if (bytes == 0) return ScratchBytes();
  const auto [block, capacity] = scratch_pool().take(bytes);
  return ScratchBytes(block, ScratchReturn{capacity});
}

void ScratchReturn::operator()(char* block) const { scratch_pool().give_back(block, capacity); }

const char* const kHeaderNames[kHeaderLength] = {
    "ep_world_size", "tp_world_size", "num_experts", "Bs", "K", "rows of expand_x", "R (arrival rows)",
    "expert_capacity"};

ExpertLayout read_layout(const Attributes& a) {
  ExpertLayout layout;
  comm::Layout& r = layout.ranks;
  read_group(a, "ep_world_size", "ep_rank_id", &r.ep_size, &r.ep_rank);
  read_group(a, "tp_world_size", "tp_rank_id", &r.tp_size, &r.tp_rank);
  layout.num_experts = a.get_int("num_experts");
  if (layout.num_experts < 1 || layout.num_experts % r.ep_size)
    a.fail("num_experts", "is " + std::to_string(layout.num_experts) + "; expected a multiple >= 1 of ep_world_size = " +
                              std::to_string(r.ep_size) +
                              " (each EP rank owns num_experts / ep_world_size experts)");
  return layout;
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
