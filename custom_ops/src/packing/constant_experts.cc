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
      weights_(weights),
      file_request_(file),
      current_(&experts_),
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
  layout_ = std::make_unique<PackedFileLayout>(matrices, weights, experts);
#if defined(__linux__) && defined(MADV_PAGEOUT)
  for (const MappedWeight& w : mapped_) advise_pages(w.data, w.bytes, MADV_PAGEOUT, false);  // what the fingerprint read
#endif
  if (file.write) {
    // recorded when they did not change while packing, nor just before it (settled)
    const std::vector<SourceFileStamp> sources = source_file_stamps(weights);
    const bool recordable = settled(sources);
    write_packed_file(
        file, *layout_, experts, make_empty,
        [this](PackedExperts& buffer, int64_t expert) {
          const uint64_t sum = weights_checksum(expert);
          pack_expert(buffer, 0, expert);
          return sum;
        },
        [&] { return recordable && source_file_stamps(weights) == sources ? sources : std::vector<SourceFileStamp>{}; });
  }
  std::string why;
  file_ = MappedPackedFile::open(file.path, *layout_, &why);
  if (!file_) {
    if (file.write) throw std::runtime_error("the packed-weights file it wrote cannot be used: " + why);
    const std::string message = file.where + ": packs its weights itself: " + why;
    ORT_CXX_LOG_NOEXCEPT(file.logger, ORT_LOGGING_LEVEL_WARNING, message.c_str());
    return;
  }
  // the weights' files are those the file was packed from, unchanged: their bytes need no checksum
  same_weights_ = !file_->source_files().empty() && source_file_stamps(weights) == file_->source_files();
  file_experts_ = make_empty(ExpertSlots::all(experts));
  for (size_t m = 0; m < file_experts_.matrices.size(); ++m)
    file_experts_.matrices[m].use_packed(file_->data() + layout_->panel_offsets[m],
                                         file_->data() + layout_->bias_offsets[m]);
  current_.store(&file_experts_, std::memory_order_release);
}

void ConstantExperts::advise_mapped_pages(int64_t expert, int advice, bool inner) const {
  const auto experts = static_cast<size_t>(experts_.slots.count());
  for (const MappedWeight& w : mapped_) {
    const size_t per_expert = w.bytes / experts;
    advise_pages(w.data + static_cast<size_t>(expert) * per_expert, per_expert, advice, inner);
  }
}

uint64_t ConstantExperts::weights_checksum(int64_t expert) const {
#if defined(__linux__) && defined(MADV_POPULATE_READ)
  advise_mapped_pages(expert, MADV_POPULATE_READ, false);  // one call maps the expert's pages
#endif
  return expert_weights_checksum(weights_, experts_.slots.count(), expert);
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

std::string ConstantExperts::check_file_expert(int64_t expert) const {
  auto named = [&] { return file_request_.path + ": expert " + std::to_string(expert); };
  if (!same_weights_) {
    const uint64_t weights_sum = weights_checksum(expert);
#if defined(__linux__) && defined(MADV_PAGEOUT)
    advise_mapped_pages(expert, MADV_PAGEOUT, true);  // as after packing
#endif
    if (weights_sum != file_->stored_checksum(layout_->checksum_index(expert, -1)))
      return named() + "'s weights differ from those the file was packed from (pack again after changing weights)";
  }
  for (size_t m = 0; m < file_experts_.matrices.size(); ++m) {
    const PackedWeights& matrix = file_experts_.matrices[m];
#if defined(__linux__) && defined(MADV_POPULATE_READ)
    advise_pages(static_cast<const char*>(matrix.at(expert)), static_cast<size_t>(matrix.slot_bytes()),
                 MADV_POPULATE_READ, false);
#endif
    if (slot_checksum(matrix, expert) != file_->stored_checksum(layout_->checksum_index(expert, static_cast<int64_t>(m))))
      return named() + "'s packed panels of matrix " + std::to_string(m) +
             " differ from their checksum (the file is damaged)";
  }
  return {};
}

void ConstantExperts::leave_file(const Ort::KernelContext& ctx, const std::string& why,
                                 const std::vector<int64_t>& also) {
  std::vector<int64_t> experts = also;
  for (int64_t e = 0; e < experts_.slots.count(); ++e)
    if (packed_[e].load(std::memory_order_acquire)) experts.push_back(e);
  parallel_for(ctx, experts.size(), [&](size_t i) { pack_expert(experts_, experts[i], experts[i]); });
  current_.store(&experts_, std::memory_order_release);
  const std::string message = file_request_.where + ": packs its weights itself: " + why;
  const Ort::Logger logger = ctx.GetLogger();
  ORT_CXX_LOG_NOEXCEPT(logger, ORT_LOGGING_LEVEL_WARNING, message.c_str());
}

const PackedExperts& ConstantExperts::for_run(const Ort::KernelContext& ctx, const int64_t* offsets) {
  if (current_.load(std::memory_order_acquire) == &file_experts_ && file_->changed()) {
    std::lock_guard<std::mutex> lock(packing_);
    if (current_.load(std::memory_order_acquire) == &file_experts_)
      leave_file(ctx, file_request_.path + " was written while the session ran", {});
  }
  const int64_t experts = experts_.slots.count();
  std::vector<int64_t> missing;
  for (int64_t e = 0; e < experts; ++e)
    if (offsets[e + 1] > offsets[e] && !packed_[e].load(std::memory_order_acquire)) missing.push_back(e);
  if (missing.empty()) return *current_.load(std::memory_order_acquire);
  std::lock_guard<std::mutex> lock(packing_);  // one run packs; a concurrent run waits, then finds them packed
  missing.erase(std::remove_if(missing.begin(), missing.end(),
                               [&](int64_t e) { return packed_[e].load(std::memory_order_acquire); }),
                missing.end());
  if (current_.load(std::memory_order_acquire) == &file_experts_) {
    std::vector<std::string> failed(missing.size());
    parallel_for(ctx, missing.size(), [&](size_t i) { failed[i] = check_file_expert(missing[i]); });
    const auto first = std::find_if(failed.begin(), failed.end(), [](const std::string& why) { return !why.empty(); });
    if (first != failed.end()) leave_file(ctx, *first, missing);
  } else {
    parallel_for(ctx, missing.size(), [&](size_t i) { pack_expert(experts_, missing[i], missing[i]); });
  }
  for (int64_t e : missing) packed_[e].store(true, std::memory_order_release);
  return *current_.load(std::memory_order_acquire);
}

}  // namespace moe_onnx
