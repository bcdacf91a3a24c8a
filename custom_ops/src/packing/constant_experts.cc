#include "constant_experts.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "packed_file_writer.h"
#include "panel_memory.h"

namespace moe_onnx {

ConstantExperts::ConstantExperts(int64_t experts, const MakeExperts& make_empty, PackSlot pack_slot,
                                 const std::vector<Input>& weights, const PackedFileRequest& file)
    : experts_(make_empty(ExpertSlots::all(experts))),
      pack_slot_(std::move(pack_slot)),
      packed_(new std::atomic<bool>[static_cast<size_t>(experts)]) {
  for (int64_t e = 0; e < experts; ++e) packed_[e].store(false, std::memory_order_relaxed);
  for (const Input& w : weights) {
    const size_t bytes = static_cast<size_t>(w.count) * elem_size(w.type);
    if (w.present && w.data && in_file_mapping(w.data, bytes))
      mapped_.push_back({static_cast<const char*>(w.data), bytes});
  }
  if (file.path.empty()) return;
  std::vector<PackedFileLayout::Matrix> matrices;
  for (const PackedWeights& m : experts_.matrices)
    matrices.push_back({m.layout(), m.slot_bytes() * experts, m.bias_bytes()});
  const PackedFileLayout layout(matrices, weights, experts);
#if defined(__linux__) && defined(MADV_PAGEOUT)
  for (const MappedWeight& w : mapped_) advise_pages(w.data, w.bytes, MADV_PAGEOUT, false);  // what the fingerprint read
#endif
  if (file.write)
    write_packed_file(file, layout, experts, make_empty,
                      [this](PackedExperts& buffer, int64_t expert) { pack_expert(buffer, 0, expert); });
  std::string why;
  file_ = MappedPackedFile::open(file.path, layout, &why);
  if (!file_) {
    if (file.write) throw std::runtime_error("the packed-weights file it wrote cannot be used: " + why);
    const std::string message = file.where + ": packs its weights itself: " + why;
    ORT_CXX_LOG_NOEXCEPT(file.logger, ORT_LOGGING_LEVEL_WARNING, message.c_str());
    return;
  }
  for (size_t m = 0; m < experts_.matrices.size(); ++m)
    experts_.matrices[m].use_packed(file_->data() + layout.panel_offsets[m], file_->data() + layout.bias_offsets[m]);
}

void ConstantExperts::advise_mapped_pages(int64_t expert, int advice, bool inner) const {
  const auto experts = static_cast<size_t>(experts_.slots.count());
  for (const MappedWeight& w : mapped_) {
    const size_t per_expert = w.bytes / experts;
    advise_pages(w.data + static_cast<size_t>(expert) * per_expert, per_expert, advice, inner);
  }
}

void ConstantExperts::pack_expert(PackedExperts& into, int64_t slot, int64_t expert) const {
#if defined(__linux__) && defined(MADV_POPULATE_READ)
  advise_mapped_pages(expert, MADV_POPULATE_READ, false);  // one call maps the expert's pages
#endif
  pack_slot_(into, slot);
#if defined(__linux__) && defined(MADV_PAGEOUT)
  // reclaims the clean pages (a later read maps them from the file again); a page onnxruntime had
  // written (copy on write) would only go to swap. Pages shared with the next expert are kept.
  advise_mapped_pages(expert, MADV_PAGEOUT, true);
#endif
}

void ConstantExperts::prepare_expert(int64_t expert) {
  if (!file_) return pack_expert(experts_, expert, expert);
#if defined(__linux__) && defined(MADV_POPULATE_READ)
  for (const PackedWeights& m : experts_.matrices)
    advise_pages(static_cast<const char*>(m.at(expert)), static_cast<size_t>(m.slot_bytes()), MADV_POPULATE_READ, false);
#endif
}

const PackedExperts& ConstantExperts::for_run(const Ort::KernelContext& ctx, const int64_t* offsets) {
  const int64_t experts = experts_.slots.count();
  std::vector<int64_t> missing;
  for (int64_t e = 0; e < experts; ++e)
    if (offsets[e + 1] > offsets[e] && !packed_[e].load(std::memory_order_acquire)) missing.push_back(e);
  if (missing.empty()) return experts_;
  std::lock_guard<std::mutex> lock(packing_);  // one run packs; a concurrent run waits, then finds them packed
  missing.erase(std::remove_if(missing.begin(), missing.end(),
                               [&](int64_t e) { return packed_[e].load(std::memory_order_acquire); }),
                missing.end());
  parallel_for(ctx, missing.size(), [&](size_t i) { prepare_expert(missing[i]); });
  for (int64_t e : missing) packed_[e].store(true, std::memory_order_release);
  return experts_;
}

}  // namespace moe_onnx
