// Work planning of the expert ops: the routed slots grouped by expert (MOE, MoeInitRouting) and the
// split of every expert's rows x weight panels into tasks (MOE, MoeRowParallelLinear).
//
// Determinism: each task owns its rows x panels of the output and the GEMM sums in a fixed order,
// so results do not depend on the thread count; the split only decides how work is shared.
#pragma once

#include <cstdint>
#include <vector>

#include "tensor.h"

namespace moe_onnx {

// Slots ordered by expert: expert e's slots are order[start[e], start[e + 1]), in slot order.
struct SlotsByExpert {
  std::vector<int64_t> start;  // experts + 1 offsets
  std::vector<int64_t> order;  // sorted position -> slot

  int64_t count(int64_t e) const { return start[e + 1] - start[e]; }
};

// Stable counting sort of the slots of expert_ids (int32 or int64; flat element f is slot f) by
// expert: a slot with first <= id < end goes to bucket id - first, the others are left out.
SlotsByExpert sort_slots_by_expert(const Input& expert_ids, int64_t first, int64_t end);

// Rows [row0, row0 + rows) of one expert times its panels [p0, p1).
struct Task {
  int64_t expert, row0, rows, p0, p1;
};

// How an op cuts its work.
struct TaskShape {
  int64_t max_rows;    // rows of one task at most
  bool equal_rows;     // an expert's rows in as few equal blocks as fit (else blocks of max_rows, the last shorter)
  int64_t max_panels;  // panels of one task at most
  int64_t min_tasks;   // halve the panels per task (down to 1) while there are fewer tasks than this
};

// The tasks of experts whose rows are [offsets[e], offsets[e + 1]) (experts + 1 offsets), with
// `panels` weight panels each, in expert, row, panel order.
std::vector<Task> make_tasks(const int64_t* offsets, int64_t experts, int64_t panels, const TaskShape& shape);

}  // namespace moe_onnx
