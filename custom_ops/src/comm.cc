// TEMPORARY (i14-cppdist): the one-rank groups only, until i14-cppcomm's comm.cc lands and replaces
// this file. A layout of more than one rank is refused.
#include "comm.h"

#include <cstring>

#include "common.h"

namespace moe_onnx {
namespace comm {
namespace {

class SelfGroup final : public Group {
 public:
  int64_t size() const override { return 1; }
  int64_t rank() const override { return 0; }
  void all_reduce_sum(float*, int64_t, const char*, const char*) const override {}
  void all_reduce_sum(int32_t*, int64_t, const char*, const char*) const override {}
  void all_gather(const int64_t* send, int64_t count, int64_t* recv, const char*, const char*) const override {
    copy(send, recv, count * static_cast<int64_t>(sizeof(int64_t)));
  }
  void all_to_all_v(const void* send, const int64_t* send_counts, void* recv, const int64_t*, const char*,
                    const char*) const override {
    copy(send, recv, send_counts[0]);
  }
  void all_gather_v(const void* send, int64_t send_count, void* recv, const int64_t*, const char*,
                    const char*) const override {
    copy(send, recv, send_count);
  }
  void reduce_scatter_v_sum(const float* send, float* recv, const int64_t* counts, const char*,
                            const char*) const override {
    copy(send, recv, counts[0] * static_cast<int64_t>(sizeof(float)));
  }

 private:
  static void copy(const void* from, void* to, int64_t bytes) {
    if (bytes > 0) std::memmove(to, from, static_cast<size_t>(bytes));
  }
};

}  // namespace

Groups groups(const Layout& layout, const std::string& op) {
  if (layout.world_size() != 1)
    throw_invalid(op + ": a layout of " + std::to_string(layout.world_size()) +
                  " ranks needs MPI, which this build lacks (temporary one-rank comm.cc)");
  static const auto self = std::make_shared<const SelfGroup>();
  return Groups{self, self, self};
}

}  // namespace comm
}  // namespace moe_onnx
