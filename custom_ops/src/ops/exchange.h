// What MoeDistributeDispatch and MoeDistributeCombine share (moe_onnx/ops/_exchange.py is its
// Python twin): the layout attributes, assist_info's header, the op registration, count helpers.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "attributes.h"
#include "comm.h"
#include "signature_op.h"
#include "status.h"
#include "workspace.h"

namespace moe_onnx {

// The attributes both ops share: where the node sits and how many experts the world has.
struct ExpertLayout {
  comm::Layout ranks;
  int64_t num_experts = 0;
  int64_t local_experts() const { return num_experts / ranks.ep_size; }
};

// The layout attributes checked as read_layout in _exchange.py (same order and words).
ExpertLayout read_layout(const Attributes& attrs);

// assist_info (docs/distributed.md): a header of kHeaderLength entries, then tokens_per_rank [W],
// tp_blocks [tp], recv_counts [ep], send_counts [ep], slot_to_send [Bs * K], arrival_to_row [R].
enum AssistHeader { H_EP, H_TP, H_EXPERTS, H_TOKENS, H_K, H_ROWS, H_ARRIVALS, H_CAPACITY, kHeaderLength };
// The header entries' names, as messages say them.
extern const char* const kHeaderNames[kHeaderLength];

// Without TP, the rows a rank's dispatch sends to its own EP rank (and its combine sends back) skip
// MPI: its send positions [send_first, send_first + rows) and arrival rows [arrival_first, + rows). The
// all-to-all-v leaves them out of its counts and its buffers, which hold the others in the same order.
// With TP (every received row goes to the TP group too) none are left out.
struct OwnRows {
  int64_t send_first = 0, arrival_first = 0, rows = 0;
  std::vector<int64_t> sent, arrived;  // dispatch's send_counts and recv_counts (rows) without them

  bool is_sent(int64_t s) const { return s >= send_first && s < send_first + rows; }
  bool is_arrival(int64_t i) const { return i >= arrival_first && i < arrival_first + rows; }
  // The row of the all-to-all-v's buffer of send position s / arrival row i (one that is not left out).
  int64_t sent_at(int64_t s) const { return s < send_first ? s : s - rows; }
  int64_t arrived_at(int64_t i) const { return i < arrival_first ? i : i - rows; }
};
OwnRows own_rows(const comm::Layout& layout, const std::vector<int64_t>& send_counts,
                 const std::vector<int64_t>& recv_counts);

// counts[i] * unit: the byte or element counts of a collective.
std::vector<int64_t> scaled(const std::vector<int64_t>& counts, int64_t unit);
int64_t sum(const std::vector<int64_t>& values);

// A buffer of `count` elements for `what` (an AllocationFailure when it cannot be had).
template <class T>
std::vector<T> buffer(int64_t count, const char* what) {
  std::vector<T> v;
  allocate(v, count, T{}, what);
  return v;
}

// The workspaces of the exchange buffers (rows to send, arrival rows, TP blocks), kept between calls
// and shared by every dispatch and combine node of the process: a call leases one for its buffers.
WorkspacePool& exchange_workspaces();

// One registration per element type of input 0 (SignatureOp): output 0 has that type, the others are int64.
template <class Kernel, const OpSignature& kSignature>
struct DistributeOp : SignatureOp<DistributeOp<Kernel, kSignature>, Kernel, kSignature> {
  using SignatureOp<DistributeOp<Kernel, kSignature>, Kernel, kSignature>::SignatureOp;
  ElemType GetOutputType(size_t i) const { return i == 0 ? this->type_ : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64; }
};

}  // namespace moe_onnx
