#include "task_plan.h"

#include <algorithm>

#include "allocation.h"

namespace moe_onnx {

SlotsByExpert sort_slots_by_expert(const Input& expert_ids, int64_t first, int64_t end) {
  const int64_t slots = expert_ids.count, experts = end - first;
  std::vector<int64_t> bucket(static_cast<size_t>(slots));
  SlotsByExpert sorted;
  allocate(sorted.start, experts + 1, int64_t{0}, "the expert offsets of the slot sort");
  for (int64_t f = 0; f < slots; ++f) {
    const int64_t id = load_index(expert_ids, f);
    bucket[f] = id >= first && id < end ? id - first : -1;
    if (bucket[f] >= 0) ++sorted.start[bucket[f] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) sorted.start[e + 1] += sorted.start[e];
  sorted.order.resize(static_cast<size_t>(sorted.start[experts]));
  std::vector<int64_t> next(sorted.start.begin(), sorted.start.end() - 1);
  for (int64_t f = 0; f < slots; ++f)
    if (bucket[f] >= 0) sorted.order[next[bucket[f]]++] = f;
  return sorted;
}

std::vector<Task> make_tasks(const int64_t* offsets, int64_t experts, int64_t panels, const TaskShape& shape) {
  auto blocks_of = [&](int64_t e) { return (offsets[e + 1] - offsets[e] + shape.max_rows - 1) / shape.max_rows; };
  int64_t blocks = 0;
  for (int64_t e = 0; e < experts; ++e) blocks += blocks_of(e);
  int64_t group = std::min(panels, shape.max_panels);
  while (group > 1 && blocks * ((panels + group - 1) / group) < shape.min_tasks) group = (group + 1) / 2;
  std::vector<Task> tasks;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t begin = offsets[e], end = offsets[e + 1];
    if (end <= begin) continue;
    const int64_t block = shape.equal_rows ? (end - begin + blocks_of(e) - 1) / blocks_of(e) : shape.max_rows;
    for (int64_t r = begin; r < end; r += block)
      for (int64_t p = 0; p < panels; p += group)
        tasks.push_back({e, r, std::min(block, end - r), p, std::min(panels, p + group)});
  }
  return tasks;
}

}  // namespace moe_onnx
