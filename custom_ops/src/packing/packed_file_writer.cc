#include "packed_file_writer.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "parallel.h"

namespace moe_onnx {

void write_packed_file(const PackedFileRequest& file, const PackedFileLayout& layout, int64_t experts,
                       const MakeExperts& make_empty, const PackExpert& pack_expert, const SourceFiles& sources) {
  const int fd = create_packed_file(file.path, layout);
  std::vector<uint64_t> checksums(static_cast<size_t>(experts * (1 + layout.matrices)));
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(
      experts, file.threads > 0 ? file.threads : std::max<int64_t>(1, std::thread::hardware_concurrency()));
  try {
    on_own_threads(threads, [&](int64_t) {  // one expert at a time per thread, through one slot
      try {
        ExpertSlots one;
        one.slot_of_expert.assign(static_cast<size_t>(experts), -1);
        one.expert_of_slot = {0};
        PackedExperts buffer = make_empty(std::move(one));
        for (int64_t e = next++; e < experts; e = next++) {
          buffer.slots.expert_of_slot[0] = e;
          checksums[layout.checksum_index(e, -1)] = pack_expert(buffer, e);
          for (size_t m = 0; m < buffer.matrices.size(); ++m) {
            const PackedWeights& w = buffer.matrices[m];
            checksums[layout.checksum_index(e, static_cast<int64_t>(m))] = slot_checksum(w, 0);
            write_packed_bytes(fd, file.path, w.at(0), w.slot_bytes(), layout.panel_offsets[m] + e * w.slot_bytes());
            if (w.bias_bytes() > 0)
              write_packed_bytes(fd, file.path, w.bias_at(0), w.bias_bytes(), layout.bias_offsets[m] + e * w.bias_bytes());
          }
        }
      } catch (...) {
        next = experts;  // the other threads stop too
        throw;
      }
    });
    std::vector<SourceFileStamp> stamps = sources();
    const uint64_t count = stamps.size() <= kMaxSourceFiles ? stamps.size() : 0;
    stamps.resize(kMaxSourceFiles);
    write_packed_bytes(fd, file.path, &count, 8, layout.sources_offset);
    write_packed_bytes(fd, file.path, stamps.data(), static_cast<int64_t>(kMaxSourceFiles * sizeof(SourceFileStamp)),
                       layout.sources_offset + 8);
    write_packed_bytes(fd, file.path, checksums.data(), static_cast<int64_t>(checksums.size() * sizeof(uint64_t)),
                       layout.checksums_offset);
  } catch (const std::exception& x) {
    finish_packed_file(fd, file.path, false);
    throw std::runtime_error(std::string("writing its packed weights: ") + x.what());
  }
  finish_packed_file(fd, file.path, true);
}

uint64_t slot_checksum(const PackedWeights& matrix, int64_t slot) {
  const uint64_t panels = checksum(matrix.at(slot), static_cast<size_t>(matrix.slot_bytes()));
  const float* bias = matrix.bias_at(slot);
  return bias ? checksum(bias, static_cast<size_t>(matrix.panels() * kPanel) * sizeof(float), panels) : panels;
}

}  // namespace moe_onnx
