// The communication the distributed kernels need (docs/distributed.md), over MPI.
//
// libmoe_onnx_ops never links MPI: the MPI calls live in libmoe_onnx_mpi (comm_mpi.cc, built only
// where CMake finds MPI), which this layer loads from the directory of libmoe_onnx_ops the first time
// a node needs more than one rank. A single-process model (every group of size 1) never loads it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace moe_onnx {
namespace comm {

// Where a node sits: its attributes ep_world_size, ep_rank_id, tp_world_size, tp_rank_id.
struct Layout {
  int64_t ep_size = 1;
  int64_t ep_rank = 0;
  int64_t tp_size = 1;
  int64_t tp_rank = 0;

  int64_t world_size() const { return ep_size * tp_size; }
  int64_t global_rank() const { return ep_rank * tp_size + tp_rank; }
};

// An all-to-all-v whose buffers the communication layer holds: the caller writes what it sends into
// send() and reads what arrived from recv(), so the bytes are copied neither in nor out (over MPI the
// buffers stay MPI's after a timeout, as the other collectives' own copies do). Reused between calls.
class AllToAll {
 public:
  virtual ~AllToAll() = default;
  char* send() const { return send_; }
  const char* recv() const { return recv_; }
  // Bytes: send_counts[r] bytes of send() (consecutive, rank order) go to rank r; recv_counts[r] arrive
  // from it (consecutive in recv(), rank order). Errors as the group's collectives.
  virtual void run(const int64_t* send_counts, const int64_t* recv_counts) = 0;

 protected:
  char* send_ = nullptr;
  char* recv_ = nullptr;
};

// The ranks of one group (the world, a TP group or an EP group), in group-rank order. Every call is a
// collective of the whole group, waits at most the timeout (MOE_ONNX_COMM_TIMEOUT_S, default 300 s)
// and throws an invalid-argument error naming `op`, the collective, `what` and the group's world
// ranks when it does not complete. Counts and displacements are in elements of the buffer's type.
class Group {
 public:
  virtual ~Group() = default;
  virtual int64_t size() const = 0;
  virtual int64_t rank() const = 0;

  virtual void all_reduce_sum(float* data, int64_t count, const char* op, const char* what) const = 0;
  virtual void all_reduce_sum(int32_t* data, int64_t count, const char* op, const char* what) const = 0;
  // recv[r * count .. (r + 1) * count) = rank r's send[0 .. count).
  virtual void all_gather(const int64_t* send, int64_t count, int64_t* recv, const char* op,
                          const char* what) const = 0;
  // An all-to-all-v of `what` with room for send_bytes to send and recv_bytes to receive (not zero-filled).
  virtual std::unique_ptr<AllToAll> all_to_all_v(int64_t send_bytes, int64_t recv_bytes, const char* op,
                                                 const char* what) const = 0;
  // Bytes: recv is every rank's send concatenated in rank order; recv_counts[r] bytes from rank r.
  virtual void all_gather_v(const void* send, int64_t send_count, void* recv, const int64_t* recv_counts,
                            const char* op, const char* what) const = 0;
  // send is [sum of counts] floats in rank blocks; rank r receives the element-wise sum over the group
  // of block r (counts[r] floats).
  virtual void reduce_scatter_v_sum(const float* send, float* recv, const int64_t* counts, const char* op,
                                    const char* what) const = 0;
};

// The groups of one layout.
struct Groups {
  std::shared_ptr<const Group> world, tp, ep;
};

// The first problem of `layout` in the words of the ops' validation ("attribute 'tp_rank_id' is 2;
// expected 0 <= tp_rank_id < tp_world_size = 2"), "" when it is valid.
std::string layout_problem(const Layout& layout);

// The groups of `layout`, made once per layout and process. Throws an invalid-argument error naming
// `op` when the layout is invalid, when this build has no MPI (libmoe_onnx_mpi missing), or when the
// process's MPI world does not match (size != world_size, rank != global_rank; a world of one rank,
// a process started without mpirun, gets the references' "runs only with its group ... not on one
// process"). A one-rank layout needs no MPI: its groups are trivial.
Groups groups(const Layout& layout, const std::string& op);

// The groups of a node that names only its TP group (MOE, MoeRowParallelLinear: tp_world_size,
// tp_rank_id): the world is any multiple of tp_size ranks, its EP side taken from the process's rank
// (ep_world_size = world size / tp_size, ep_rank_id = rank / tp_size); the process's rank must be
// TP rank tp_rank of its group. Errors as groups(); tp_size 1 needs no MPI (every group trivial).
Groups tp_groups(int64_t tp_size, int64_t tp_rank, const std::string& op);

// The TP group of a node, made by tp_groups at its first use and kept (null while tp_size is 1).
class TpGroup {
 public:
  const Group* get(int64_t tp_size, int64_t tp_rank, const std::string& op) {
    if (tp_size == 1) return nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    if (!group_) group_ = tp_groups(tp_size, tp_rank, op).tp;
    return group_.get();
  }

 private:
  std::mutex mutex_;
  std::shared_ptr<const Group> group_;
};

}  // namespace comm
}  // namespace moe_onnx
