// The communication layer of comm.h inside libmoe_onnx_ops: layout checks, the groups of a one-rank
// layout (no MPI), and the groups over MPI, whose calls go through libmoe_onnx_mpi (comm_mpi.cc),
// loaded from beside this library the first time a node needs more than one rank.
#include "comm.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "comm_mpi_abi.h"
#include "status.h"
#include "workspace.h"

namespace moe_onnx {
namespace comm {
namespace {

const char* kTimeoutVariable = "MOE_ONNX_COMM_TIMEOUT_S";
constexpr double kDefaultTimeoutS = 300;
const char* kMpiLibrary = "libmoe_onnx_mpi.so";

std::string fmt_seconds(double s) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", s);
  return text;
}

// MOE_ONNX_COMM_TIMEOUT_S: seconds > 0 (default 300).
double timeout_seconds(const std::string& op) {
  const char* text = std::getenv(kTimeoutVariable);
  if (text == nullptr || *text == '\0') return kDefaultTimeoutS;
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(text, &end);
  while (std::isspace(static_cast<unsigned char>(*end))) ++end;  // as Python's float() takes it
  const bool hex = std::strpbrk(text, "xX") != nullptr;          // which float() refuses
  if (end == text || *end != '\0' || hex || errno != 0 || !std::isfinite(value) || !(value > 0))
    throw_invalid(op + ": environment variable " + kTimeoutVariable + " is " + py_str(text) +
                  "; expected a number of seconds > 0 (default " + fmt_seconds(kDefaultTimeoutS) + ")");
  return value;
}

// The all-to-all-v of a group of one rank: what it sends is what it receives, in one buffer.
class SoloAllToAll : public AllToAll {
 public:
  SoloAllToAll(int64_t bytes, const char* op, const char* what) : lease_(pool().lease()), op_(op), what_(what) {
    send_ = recv_ = lease_->take<char>(bytes, "an all-to-all-v's buffer");
  }
  void run(const int64_t* send_counts, const int64_t* recv_counts) override {
    if (send_counts[0] != recv_counts[0])
      throw_invalid(op_ + ": the all-to-all-v of " + what_ + " sends " + std::to_string(send_counts[0]) +
                    " bytes to its own rank but receives " + std::to_string(recv_counts[0]));
  }

 private:
  static WorkspacePool& pool() {
    static auto* buffers = new WorkspacePool(2);  // never destroyed: a lease may end during exit
    return *buffers;
  }
  WorkspacePool::Lease lease_;
  std::string op_, what_;
};

// A group of one rank: every collective is a copy.
class SoloGroup : public Group {
 public:
  int64_t size() const override { return 1; }
  int64_t rank() const override { return 0; }
  void all_reduce_sum(float*, int64_t, const char*, const char*) const override {}
  void all_reduce_sum(int32_t*, int64_t, const char*, const char*) const override {}
  void all_gather(const int64_t* send, int64_t count, int64_t* recv, const char*, const char*) const override {
    copy(send, recv, count * static_cast<int64_t>(sizeof(int64_t)));
  }
  std::unique_ptr<AllToAll> all_to_all_v(int64_t send_bytes, int64_t recv_bytes, const char* op,
                                         const char* what) const override {
    return std::make_unique<SoloAllToAll>(std::max(send_bytes, recv_bytes), op, what);
  }
  void all_gather_v(const void* send, int64_t send_count, void* recv, const int64_t* recv_counts, const char* op,
                    const char* what) const override {
    if (send_count != recv_counts[0])
      throw_invalid(std::string(op) + ": the all-gather-v of " + what + " sends " + std::to_string(send_count) +
                    " bytes but receives " + std::to_string(recv_counts[0]));
    copy(send, recv, send_count);
  }
  void reduce_scatter_v_sum(const float* send, float* recv, const int64_t* counts, const char*,
                            const char*) const override {
    copy(send, recv, counts[0] * static_cast<int64_t>(sizeof(float)));
  }

 private:
  static void copy(const void* from, void* to, int64_t bytes) {
    if (bytes > 0 && from != to) std::memmove(to, from, static_cast<size_t>(bytes));
  }
};

// A group of several ranks over an MPI communicator of libmoe_onnx_mpi.
class MpiGroup : public Group {
  // Its all-to-all-v, over buffers of libmoe_onnx_mpi.
  class MpiAllToAll : public AllToAll {
   public:
    MpiAllToAll(const MpiGroup& group, const char* op, const char* what) : group_(group), op_(op), what_(what) {}
    ~MpiAllToAll() override {
      if (handle_) group_.mpi_.close_all_to_all_v(handle_);
    }
    void run(const int64_t* send_counts, const int64_t* recv_counts) override {
      group_.call(op_, "all-to-all-v", what_, [&](double timeout, char* error) {
        return group_.mpi_.run_all_to_all_v(handle_, send_counts, recv_counts, timeout, error);
      });
    }
    // Its buffers, from libmoe_onnx_mpi.
    void open(int64_t send_bytes, int64_t recv_bytes) {
      void *send = nullptr, *recv = nullptr;
      group_.call(op_, "all-to-all-v", what_, [&](double, char* error) {
        return group_.mpi_.open_all_to_all_v(group_.comm_, send_bytes, recv_bytes, &handle_, &send, &recv, error);
      });
      send_ = static_cast<char*>(send);
      recv_ = static_cast<char*>(recv);
    }

   private:
    MoeOnnxMpiAllToAll* handle_ = nullptr;
    const MpiGroup& group_;
    const char* op_;
    const char* what_;
  };

 public:
  MpiGroup(const MoeOnnxMpiTable& mpi, MoeOnnxMpiComm* comm, const char* name, std::vector<int64_t> world_ranks,
           int64_t rank)
      : mpi_(mpi), comm_(comm), name_(name), world_ranks_(std::move(world_ranks)), rank_(rank) {}

  int64_t size() const override { return static_cast<int64_t>(world_ranks_.size()); }
  int64_t rank() const override { return rank_; }

  void all_reduce_sum(float* data, int64_t count, const char* op, const char* what) const override {
    call(op, "all-reduce", what, [&](double timeout, char* error) {
      return mpi_.all_reduce_sum(comm_, data, count, MOE_ONNX_MPI_FLOAT32, timeout, error);
    });
  }
  void all_reduce_sum(int32_t* data, int64_t count, const char* op, const char* what) const override {
    call(op, "all-reduce", what, [&](double timeout, char* error) {
      return mpi_.all_reduce_sum(comm_, data, count, MOE_ONNX_MPI_INT32, timeout, error);
    });
  }
  void all_gather(const int64_t* send, int64_t count, int64_t* recv, const char* op, const char* what) const override {
    const std::vector<int64_t> bytes(world_ranks_.size(), count * static_cast<int64_t>(sizeof(int64_t)));
    call(op, "all-gather", what, [&](double timeout, char* error) {
      return mpi_.all_gather_v(comm_, send, bytes[0], recv, bytes.data(), timeout, error);
    });
  }
  std::unique_ptr<AllToAll> all_to_all_v(int64_t send_bytes, int64_t recv_bytes, const char* op,
                                         const char* what) const override {
    auto exchange = std::make_unique<MpiAllToAll>(*this, op, what);
    exchange->open(send_bytes, recv_bytes);
    return exchange;
  }
  void all_gather_v(const void* send, int64_t send_count, void* recv, const int64_t* recv_counts, const char* op,
                    const char* what) const override {
    call(op, "all-gather-v", what, [&](double timeout, char* error) {
      return mpi_.all_gather_v(comm_, send, send_count, recv, recv_counts, timeout, error);
    });
  }
  void reduce_scatter_v_sum(const float* send, float* recv, const int64_t* counts, const char* op,
                            const char* what) const override {
    call(op, "reduce-scatter-v", what, [&](double timeout, char* error) {
      return mpi_.reduce_scatter_v_sum(comm_, send, recv, counts, timeout, error);
    });
  }

 private:
  // Runs one call of the MPI table and turns its failure into the op's error.
  template <class Call>
  void call(const char* op, const char* collective, const char* what, Call&& mpi_call) const {
    const double timeout = timeout_seconds(op);
    char error[MOE_ONNX_MPI_ERROR_SIZE] = {0};
    const int status = mpi_call(timeout, error);
    if (status != MOE_ONNX_MPI_OK)
      throw_invalid(failure(op, std::string("the ") + collective + " of " + what, name_, world_ranks_, status, error,
                            timeout));
  }

 public:
  // "<op>: <action> over the TP group (world ranks [0, 1]) did not complete within 3 s ..." or "... failed: <error>".
  static std::string failure(const std::string& op, const std::string& action, const char* group,
                             const std::vector<int64_t>& world_ranks, int status, const char* error, double timeout) {
    const std::string where = op + ": " + action + " over the " + group + " group (world ranks " +
                              fmt_shape(world_ranks) + ")";
    if (status == MOE_ONNX_MPI_TIMEOUT)
      return where + " did not complete within " + fmt_seconds(timeout) + " s (" + kTimeoutVariable +
             "): a rank of the group failed or never reached it";
    return where + " failed: " + error;
  }

 private:
  const MoeOnnxMpiTable& mpi_;
  MoeOnnxMpiComm* comm_;
  const char* name_;
  std::vector<int64_t> world_ranks_;
  int64_t rank_;
};

// The error of a node of several ranks in a world of one (MPI started, no launcher), in the words of
// the references' refuse_without_group: "attribute 'tp_world_size' is 2: this node is one of 2 ranks...".
[[noreturn]] void refuse_one_process(const std::string& op, const Layout& layout, bool names_ep) {
  const std::string tp = std::to_string(layout.tp_size);
  const std::string subject = names_ep ? "attributes 'ep_world_size' and 'tp_world_size' are " +
                                             std::to_string(layout.ep_size) + " and " + tp
                                       : "attribute 'tp_world_size' is " + tp;
  throw_invalid(op + ": " + subject + ": this node is one of " + std::to_string(layout.world_size()) +
                " ranks and runs only with its group (under MPI, docs/distributed.md), not on one process");
}

std::string ranks_word(int64_t n) { return std::to_string(n) + (n == 1 ? " MPI rank" : " MPI ranks"); }

std::string layout_words(const Layout& layout) {
  return "ep_world_size " + std::to_string(layout.ep_size) + " x tp_world_size " + std::to_string(layout.tp_size);
}

// The path of this library (libmoe_onnx_ops), where libmoe_onnx_mpi is looked for.
std::string this_library_path() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&this_library_path), &info) == 0 || info.dli_fname == nullptr) return "";
  return info.dli_fname;
}

// The table of libmoe_onnx_mpi, loaded once (RTLD_NODELETE: MPI stays until the process ends).
const MoeOnnxMpiTable& mpi_table(const std::string& op, const Layout& layout) {
  static std::mutex mutex;
  static const MoeOnnxMpiTable* table = nullptr;
  std::lock_guard<std::mutex> lock(mutex);
  if (table) return *table;
  const std::string self = this_library_path();
  const size_t slash = self.rfind('/');
  const std::string path = (slash == std::string::npos ? std::string(".") : self.substr(0, slash)) + "/" + kMpiLibrary;
  const std::string needs = op + ": needs " + ranks_word(layout.world_size()) + " (" +
                            layout_words(layout) + "), but ";
  if (access(path.c_str(), F_OK) != 0)
    throw_invalid(needs + "this build has no MPI support (" + kMpiLibrary + " not found beside " + self +
                  "); rebuild with MPI (docs/building.md)");
  // RTLD_GLOBAL: MPI's own plugins, which MPI dlopens, may resolve symbols of libmpi through the
  // global namespace (Open MPI before 3.0: open-mpi/ompi issue 3705).
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL | RTLD_NODELETE);
  if (!handle)
    throw_invalid(needs + path + " does not load (" + dlerror() +
                  "); install the MPI it was built with (docs/building.md)");
  const auto get = reinterpret_cast<MoeOnnxMpiTableFunction>(dlsym(handle, "moe_onnx_mpi_table"));
  const MoeOnnxMpiTable* found = get ? get() : nullptr;
  if (!found || found->abi_version != MOE_ONNX_MPI_ABI_VERSION)
    throw_invalid(needs + path + " is not the MPI library of this build (no moe_onnx_mpi_table of version " +
                  std::to_string(MOE_ONNX_MPI_ABI_VERSION) + "); rebuild both (docs/building.md)");
  table = found;
  return *table;
}

// The groups of a one-rank layout.
Groups solo_groups() {
  static const std::shared_ptr<const Group> solo = std::make_shared<SoloGroup>();
  return Groups{solo, solo, solo};
}

// The size of MPI_COMM_WORLD and this process's rank in it, MPI started if need be.
std::pair<int64_t, int64_t> mpi_world(const MoeOnnxMpiTable& mpi, const std::string& op) {
  char error[MOE_ONNX_MPI_ERROR_SIZE] = {0};
  int64_t size = 0, rank = 0;
  if (mpi.world(&size, &rank, error) != MOE_ONNX_MPI_OK) throw_invalid(op + ": MPI does not start: " + error);
  return {size, rank};
}

// The groups of a valid layout of more than one rank, over MPI.
Groups mpi_groups(const Layout& layout, const std::string& op) {
  const double timeout = timeout_seconds(op);  // a bad value is reported before MPI is loaded
  const MoeOnnxMpiTable& mpi = mpi_table(op, layout);
  const auto [size, rank] = mpi_world(mpi, op);
  char error[MOE_ONNX_MPI_ERROR_SIZE] = {0};
  const int64_t W = layout.world_size(), g = layout.global_rank();
  if (size == 1) refuse_one_process(op, layout, true);
  if (size != W)
    throw_invalid(op + ": runs with " + ranks_word(size) + "; the node needs " + std::to_string(W) + " (" +
                  layout_words(layout) + "; start it under mpirun -n " + std::to_string(W) + ")");
  if (rank != g)
    throw_invalid(op + ": runs as MPI rank " + std::to_string(rank) + ", but the node is global rank " +
                  std::to_string(g) + " (ep_rank_id " + std::to_string(layout.ep_rank) + " * tp_world_size " +
                  std::to_string(layout.tp_size) + " + tp_rank_id " + std::to_string(layout.tp_rank) +
                  "); expected rank " + std::to_string(rank) + "'s model");
  // One group per (name, color): the world, this rank's TP group, its EP group, each split from the
  // world in this order on every rank (a split is a collective of the world).
  auto make = [&](const char* name, int64_t color, int64_t key, std::vector<int64_t> world_ranks) {
    if (world_ranks.size() == 1) return std::shared_ptr<const Group>(std::make_shared<SoloGroup>());
    MoeOnnxMpiComm* comm = nullptr;
    const int status = mpi.split(color, key, timeout, &comm, error);
    if (status != MOE_ONNX_MPI_OK)
      throw_invalid(MpiGroup::failure(op, "the communicator split", name, world_ranks, status, error, timeout));
    return std::shared_ptr<const Group>(std::make_shared<MpiGroup>(mpi, comm, name, std::move(world_ranks), key));
  };
  std::vector<int64_t> world_ranks, tp_ranks, ep_ranks;
  for (int64_t r = 0; r < W; ++r) world_ranks.push_back(r);
  for (int64_t q = 0; q < layout.tp_size; ++q) tp_ranks.push_back(g - layout.tp_rank + q);
  for (int64_t p = 0; p < layout.ep_size; ++p) ep_ranks.push_back(p * layout.tp_size + layout.tp_rank);
  Groups groups;
  groups.world = make("world", 0, g, std::move(world_ranks));
  groups.tp = make("TP", layout.ep_rank, layout.tp_rank, std::move(tp_ranks));
  groups.ep = make("EP", layout.tp_rank, layout.ep_rank, std::move(ep_ranks));
  return groups;
}

}  // namespace

std::string layout_problem(const Layout& layout) {
  const auto size_problem = [](const char* name, int64_t size) {
    return std::string("attribute '") + name + "' is " + std::to_string(size) + "; expected >= 1";
  };
  const auto rank_problem = [](const char* name, int64_t rank, const char* size_name, int64_t size) {
    return std::string("attribute '") + name + "' is " + std::to_string(rank) + "; expected 0 <= " + name + " < " +
           size_name + " = " + std::to_string(size);
  };
  if (layout.ep_size < 1) return size_problem("ep_world_size", layout.ep_size);
  if (layout.ep_rank < 0 || layout.ep_rank >= layout.ep_size)
    return rank_problem("ep_rank_id", layout.ep_rank, "ep_world_size", layout.ep_size);
  if (layout.tp_size < 1) return size_problem("tp_world_size", layout.tp_size);
  if (layout.tp_rank < 0 || layout.tp_rank >= layout.tp_size)
    return rank_problem("tp_rank_id", layout.tp_rank, "tp_world_size", layout.tp_size);
  if (layout.ep_size > INT_MAX / layout.tp_size)
    return "attributes 'ep_world_size' x 'tp_world_size' = " + std::to_string(layout.ep_size) + " x " +
           std::to_string(layout.tp_size) + "; expected at most " + std::to_string(INT_MAX) + " ranks (MPI's int)";
  return "";
}

Groups groups(const Layout& layout, const std::string& op) {
  const std::string problem = layout_problem(layout);
  if (!problem.empty()) throw_invalid(op + ": " + problem);
  if (layout.world_size() == 1) return solo_groups();
  static std::mutex mutex;
  static std::map<std::tuple<int64_t, int64_t, int64_t, int64_t>, Groups> made;
  std::lock_guard<std::mutex> lock(mutex);  // every rank makes its groups in one order
  const auto key = std::make_tuple(layout.ep_size, layout.ep_rank, layout.tp_size, layout.tp_rank);
  auto found = made.find(key);
  if (found == made.end()) found = made.emplace(key, mpi_groups(layout, op)).first;
  return found->second;
}

Groups tp_groups(int64_t tp_size, int64_t tp_rank, const std::string& op) {
  const Layout tp_only{1, 0, tp_size, tp_rank};
  const std::string problem = layout_problem(tp_only);
  if (!problem.empty()) throw_invalid(op + ": " + problem);
  if (tp_size == 1) return solo_groups();
  timeout_seconds(op);  // a bad MOE_ONNX_COMM_TIMEOUT_S is reported before MPI is loaded
  const auto [size, rank] = mpi_world(mpi_table(op, tp_only), op);
  if (size == 1) refuse_one_process(op, tp_only, false);
  if (size % tp_size != 0)
    throw_invalid(op + ": runs with " + ranks_word(size) + "; the node needs a multiple of tp_world_size " +
                  std::to_string(tp_size) + " (start it under mpirun -n " + std::to_string(tp_size) + ")");
  if (rank % tp_size != tp_rank)
    throw_invalid(op + ": runs as MPI rank " + std::to_string(rank) + ", TP rank " + std::to_string(rank % tp_size) +
                  " of its group, but the node has tp_rank_id " + std::to_string(tp_rank) + "; expected rank " +
                  std::to_string(rank) + "'s model");
  return groups(Layout{size / tp_size, rank / tp_size, tp_size, tp_rank}, op);
}

}  // namespace comm
}  // namespace moe_onnx
