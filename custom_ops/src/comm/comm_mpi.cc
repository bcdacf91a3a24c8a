// libmoe_onnx_mpi: the MPI calls of the communication layer (comm.h), behind the C table of
// comm_mpi_abi.h. libmoe_onnx_ops loads it only when a node needs more than one rank.
//
// Every collective is MPI's non-blocking form (MPI_Iallreduce, MPI_Ialltoallv, ...) polled with
// MPI_Test until it completes or its timeout passes, yielding the CPU between polls so that ranks
// sharing cores keep progressing. The buffers MPI works on are this library's own: copies of the
// caller's, or (the all-to-all-v of the exchanges) buffers the caller fills and reads in place. After a
// timeout the request stays pending (MPI cannot cancel a collective), so they are left allocated
// and the caller's buffers are never written late; the communicator is then marked broken, and the
// process does not call MPI_Finalize (it would wait for the lost collective): mpirun ends the job.
#include <mpi.h>
#include <sched.h>

#include <chrono>
#include <climits>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "comm_mpi_abi.h"
#include "workspace.h"

struct MoeOnnxMpiComm {
  MPI_Comm comm = MPI_COMM_NULL;
  int size = 0, rank = 0;
  bool broken = false;  // a collective on it timed out
};

namespace {

struct State {
  std::mutex mutex;                 // held around every MPI call (MPI may give less than MPI_THREAD_MULTIPLE)
  bool timed_out = false;           // some collective never completed: no MPI_Finalize
  MoeOnnxMpiComm world;             // our duplicate of MPI_COMM_WORLD, made by the first split
  bool world_ready = false;         // `world` is made
};

State& state() {
  static State s;
  return s;
}

int fail(char* error, const char* format, ...) {
  va_list args;
  va_start(args, format);
  std::vsnprintf(error, MOE_ONNX_MPI_ERROR_SIZE, format, args);
  va_end(args);
  return MOE_ONNX_MPI_ERROR;
}

int mpi_fail(int code, const char* call, char* error) {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int length = 0;
  MPI_Error_string(code, text, &length);
  return fail(error, "%s failed: %s", call, text);
}

void finalize_at_exit() {
  State& s = state();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && !s.timed_out) MPI_Finalize();
}

// Polls `request` until it completes (OK) or `timeout_s` passes (TIMEOUT, `comm` marked broken).
int wait(MPI_Request* request, MoeOnnxMpiComm* comm, double timeout_s, const char* call, char* error) {
  State& s = state();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (int64_t polls = 0;; ++polls) {
    int done = 0, rc;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      rc = MPI_Test(request, &done, MPI_STATUS_IGNORE);
    }
    if (rc != MPI_SUCCESS) return mpi_fail(rc, call, error);
    if (done) return MOE_ONNX_MPI_OK;
    if (std::chrono::steady_clock::now() >= deadline) {
      comm->broken = true;
      s.timed_out = true;
      return MOE_ONNX_MPI_TIMEOUT;
    }
    if (polls < 1000)
      sched_yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// MPI counts are int: `value` (bytes or elements of `what`) as one, or an error.
bool to_int(int64_t value, const char* what, int* out, char* error) {
  if (value < 0 || value > INT_MAX) {
    fail(error, "%s is %lld, outside MPI's int counts [0, %d]; run fewer tokens at once", what,
         static_cast<long long>(value), INT_MAX);
    return false;
  }
  *out = static_cast<int>(value);
  return true;
}

// Per-rank counts and their displacements (exclusive prefix sums) as MPI's ints; `total` their sum.
bool rank_counts(const int64_t* counts, int size, const char* what, std::vector<int>& out, std::vector<int>& displs,
                 int64_t* total, char* error) {
  out.resize(size);
  displs.resize(size);
  int64_t sum = 0;
  for (int r = 0; r < size; ++r) {
    if (!to_int(sum, what, &displs[r], error) || !to_int(counts[r], what, &out[r], error)) return false;
    sum += counts[r];
  }
  *total = sum;
  return true;
}

// The workspaces of the collectives' staging copies, with room for a few groups at once.
moe_onnx::WorkspacePool& staging_workspaces() {
  static auto* pool = new moe_onnx::WorkspacePool(3);  // never destroyed: a lease may end during exit
  return *pool;
}

// A staging copy: `size` bytes at `data` (null for none), not zero-filled (MPI or a copy writes all
// of it first).
struct Staging {
  char* data = nullptr;
  size_t size = 0;
};

// One collective in flight: MPI's copies of the buffers (in a leased workspace) and the count arrays.
// Leaked after a timeout (MPI may still read and write them). The two copies cost about as much as
// the transfer on one machine, but they are what keeps a timeout safe: the caller's buffers are freed
// when its exception unwinds, and a collective completing later would read or write freed memory.
// They are made without a zero-fill and in reused workspaces (workspace.h), which costs no page faults.
struct Pending {
  moe_onnx::WorkspacePool::Lease buffers = staging_workspaces().lease();
  Staging send, recv;
  std::vector<int> send_counts, send_displs, recv_counts, recv_displs;
  MPI_Request request = MPI_REQUEST_NULL;

  // `bytes` unwritten bytes, or a copy of them from `from`.
  Staging stage(size_t bytes, const void* from = nullptr) {
    Staging copy{buffers->take<char>(static_cast<int64_t>(bytes), "a collective's staging copy"), bytes};
    if (from && bytes) std::memcpy(copy.data, from, bytes);
    return copy;
  }
};

// Starts the collective `start` made of `pending`, waits for it; releases `pending` unless it timed out.
template <class Start>
int run(MoeOnnxMpiComm* comm, std::unique_ptr<Pending>& pending, double timeout_s, const char* call, char* error,
        Start&& start) {
  if (comm->broken)
    return fail(error, "an earlier collective of this group did not complete; the group cannot be used again");
  int rc;
  {
    std::lock_guard<std::mutex> lock(state().mutex);
    rc = start(*pending);
  }
  if (rc != MPI_SUCCESS) return mpi_fail(rc, call, error);
  const int status = wait(&pending->request, comm, timeout_s, call, error);
  if (status == MOE_ONNX_MPI_TIMEOUT) pending.release();  // still MPI's: see the file's comment
  return status;
}

}  // namespace

// An all-to-all-v whose buffers the caller fills and reads (open/run/close_all_to_all_v).
struct MoeOnnxMpiAllToAll {
  MoeOnnxMpiComm* comm = nullptr;
  std::unique_ptr<Pending> pending;  // null once a run timed out: MPI keeps it
};

namespace {

int world(int64_t* size, int64_t* rank, char* error) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) return fail(error, "MPI is already finalized in this process");
  if (!initialized) {
    int provided = 0;
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Init_thread", error);
    std::atexit(finalize_at_exit);  // MPI_Init_thread was ours: so is MPI_Finalize
  }
  int world_size = 0, world_rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  *size = world_size;
  *rank = world_rank;
  return MOE_ONNX_MPI_OK;
}

// Our duplicate of MPI_COMM_WORLD (errors returned, not fatal), made on first use. MPI writes the
// new communicator into s.world.comm (static: it may still do so after a timeout).
int world_comm(double timeout_s, MoeOnnxMpiComm** out, char* error) {
  State& s = state();
  if (!s.world_ready && !s.world.broken) {
    MPI_Request request = MPI_REQUEST_NULL;
    int rc;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      rc = MPI_Comm_idup(MPI_COMM_WORLD, &s.world.comm, &request);
    }
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Comm_idup", error);
    const int status = wait(&request, &s.world, timeout_s, "MPI_Comm_idup", error);
    if (status != MOE_ONNX_MPI_OK) return status;
    std::lock_guard<std::mutex> lock(s.mutex);
    MPI_Comm_set_errhandler(s.world.comm, MPI_ERRORS_RETURN);
    MPI_Comm_size(s.world.comm, &s.world.size);
    MPI_Comm_rank(s.world.comm, &s.world.rank);
    s.world_ready = true;
  }
  if (s.world.broken) return fail(error, "an earlier MPI set-up did not complete; MPI cannot be used again");
  *out = &s.world;
  return MOE_ONNX_MPI_OK;
}

int split(int64_t color, int64_t key, double timeout_s, MoeOnnxMpiComm** comm, char* error) {
  MoeOnnxMpiComm* world_dup = nullptr;
  int status = world_comm(timeout_s, &world_dup, error);
  if (status != MOE_ONNX_MPI_OK) return status;
  int mpi_color = 0, mpi_key = 0;
  if (!to_int(color, "the split's color", &mpi_color, error) || !to_int(key, "the split's key", &mpi_key, error))
    return MOE_ONNX_MPI_ERROR;
  // MPI_Comm_split has no non-blocking form: a bounded barrier first, so that it is only entered
  // once every rank is there.
  auto pending = std::make_unique<Pending>();
  status = run(world_dup, pending, timeout_s, "MPI_Ibarrier", error,
               [&](Pending& p) { return MPI_Ibarrier(world_dup->comm, &p.request); });
  if (status != MOE_ONNX_MPI_OK) return status;
  auto made = std::make_unique<MoeOnnxMpiComm>();
  std::lock_guard<std::mutex> lock(state().mutex);
  const int rc = MPI_Comm_split(world_dup->comm, mpi_color, mpi_key, &made->comm);
  if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Comm_split", error);
  MPI_Comm_size(made->comm, &made->size);
  MPI_Comm_rank(made->comm, &made->rank);
  *comm = made.release();
  return MOE_ONNX_MPI_OK;
}

int all_reduce_sum(MoeOnnxMpiComm* comm, void* data, int64_t count, int element, double timeout_s, char* error) {
  int n = 0;
  if (!to_int(count, "the all-reduce's element count", &n, error)) return MOE_ONNX_MPI_ERROR;
  const MPI_Datatype type = element == MOE_ONNX_MPI_INT32 ? MPI_INT32_T : MPI_FLOAT;
  const size_t bytes = static_cast<size_t>(count) * 4;
  auto pending = std::make_unique<Pending>();
  pending->recv = pending->stage(bytes, data);
  const int status = run(comm, pending, timeout_s, "MPI_Iallreduce", error, [&](Pending& p) {
    return MPI_Iallreduce(MPI_IN_PLACE, p.recv.data, n, type, MPI_SUM, comm->comm, &p.request);
  });
  if (status == MOE_ONNX_MPI_OK && bytes) std::memcpy(data, pending->recv.data, bytes);
  return status;
}

int open_all_to_all_v(MoeOnnxMpiComm* comm, int64_t send_size, int64_t recv_size, MoeOnnxMpiAllToAll** exchange,
                      void** send, void** recv, char* error) {
  auto made = std::make_unique<MoeOnnxMpiAllToAll>();
  made->comm = comm;
  made->pending = std::make_unique<Pending>();
  try {
    made->pending->send = made->pending->stage(static_cast<size_t>(send_size));
    made->pending->recv = made->pending->stage(static_cast<size_t>(recv_size));
  } catch (const std::exception& failure) {  // no exception crosses the table
    return fail(error, "%s", failure.what());
  }
  *send = made->pending->send.data;
  *recv = made->pending->recv.data;
  *exchange = made.release();
  return MOE_ONNX_MPI_OK;
}

int run_all_to_all_v(MoeOnnxMpiAllToAll* exchange, const int64_t* send_bytes, const int64_t* recv_bytes,
                     double timeout_s, char* error) {
  MoeOnnxMpiComm* comm = exchange->comm;
  if (!exchange->pending) return fail(error, "an earlier run of this all-to-all-v did not complete");
  Pending& p = *exchange->pending;
  int64_t send_total = 0, recv_total = 0;
  if (!rank_counts(send_bytes, comm->size, "the bytes sent", p.send_counts, p.send_displs, &send_total, error) ||
      !rank_counts(recv_bytes, comm->size, "the bytes received", p.recv_counts, p.recv_displs, &recv_total, error))
    return MOE_ONNX_MPI_ERROR;
  if (static_cast<size_t>(send_total) > p.send.size || static_cast<size_t>(recv_total) > p.recv.size)
    return fail(error, "the all-to-all-v moves %lld bytes out and %lld in; its buffers hold %zu and %zu",
                static_cast<long long>(send_total), static_cast<long long>(recv_total), p.send.size, p.recv.size);
  p.request = MPI_REQUEST_NULL;
  return run(comm, exchange->pending, timeout_s, "MPI_Ialltoallv", error, [&](Pending& q) {
    return MPI_Ialltoallv(q.send.data, q.send_counts.data(), q.send_displs.data(), MPI_BYTE, q.recv.data,
                          q.recv_counts.data(), q.recv_displs.data(), MPI_BYTE, comm->comm, &q.request);
  });
}

void close_all_to_all_v(MoeOnnxMpiAllToAll* exchange) { delete exchange; }

int all_gather_v(MoeOnnxMpiComm* comm, const void* send, int64_t send_bytes, void* recv, const int64_t* recv_bytes,
                 double timeout_s, char* error) {
  auto pending = std::make_unique<Pending>();
  Pending& p = *pending;
  int send_count = 0;
  int64_t recv_total = 0;
  if (!to_int(send_bytes, "the bytes sent", &send_count, error) ||
      !rank_counts(recv_bytes, comm->size, "the bytes received", p.recv_counts, p.recv_displs, &recv_total, error))
    return MOE_ONNX_MPI_ERROR;
  p.send = p.stage(static_cast<size_t>(send_bytes), send);
  p.recv = p.stage(static_cast<size_t>(recv_total));
  const int status = run(comm, pending, timeout_s, "MPI_Iallgatherv", error, [&](Pending& q) {
    return MPI_Iallgatherv(q.send.data, send_count, MPI_BYTE, q.recv.data, q.recv_counts.data(),
                           q.recv_displs.data(), MPI_BYTE, comm->comm, &q.request);
  });
  if (status == MOE_ONNX_MPI_OK && recv_total > 0) std::memcpy(recv, pending->recv.data, pending->recv.size);
  return status;
}

int reduce_scatter_v_sum(MoeOnnxMpiComm* comm, const float* send, float* recv, const int64_t* counts,
                         double timeout_s, char* error) {
  auto pending = std::make_unique<Pending>();
  Pending& p = *pending;
  int64_t total = 0;
  if (!rank_counts(counts, comm->size, "the elements reduced", p.recv_counts, p.recv_displs, &total, error))
    return MOE_ONNX_MPI_ERROR;
  const char* first = reinterpret_cast<const char*>(send);
  p.send = p.stage(static_cast<size_t>(total) * 4, first);
  p.recv = p.stage(static_cast<size_t>(p.recv_counts[comm->rank]) * 4);
  const int status = run(comm, pending, timeout_s, "MPI_Ireduce_scatter", error, [&](Pending& q) {
    return MPI_Ireduce_scatter(q.send.data, q.recv.data, q.recv_counts.data(), MPI_FLOAT, MPI_SUM,
                               comm->comm, &q.request);
  });
  if (status == MOE_ONNX_MPI_OK && pending->recv.size)
    std::memcpy(recv, pending->recv.data, pending->recv.size);
  return status;
}

const MoeOnnxMpiTable kTable = {MOE_ONNX_MPI_ABI_VERSION, world, split, all_reduce_sum, open_all_to_all_v,
                                run_all_to_all_v, close_all_to_all_v, all_gather_v,
                                reduce_scatter_v_sum};

}  // namespace

extern "C" __attribute__((visibility("default"))) const MoeOnnxMpiTable* moe_onnx_mpi_table(void) { return &kTable; }
