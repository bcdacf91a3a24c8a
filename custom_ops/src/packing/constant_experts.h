// The expert cache of initializer weights (ConstantExperts: packed on first use, or mapped from a
// packed-weights file), and the packed experts a run reads (experts_for_run).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "packed_file.h"
#include "packed_weights.h"
#include "parallel.h"
#include "tensor.h"

namespace moe_onnx {

// The expert cache: the packed experts of initializer weights, made at kernel creation with room for
// every expert: each expert is packed by the first run that routes rows to it (on that run's intra-op
// pool), then kept, so creating a session reads no weights and a model holds packed only the experts it uses.
// Before an expert is packed, its pages that onnxruntime mapped from an external data file are mapped
// at once (MADV_POPULATE_READ); then they are reclaimed (MADV_PAGEOUT: clean file pages, a later read
// maps them again from the file), so the weights are resident once, packed.
// With a packed-weights file (packed_file.h) that matches the weights, the panels are the file's
// pages instead: nothing is packed; on an expert's first use its pages of the file are mapped and its
// checksums checked (its panels', and its weights' against those it was packed from, unless the weights'
// files are those the file records, unchanged: source_file_stamps). A failed check,
// or a file written in place while the session runs (each run asks), and the node stops using the file:
// it packs the experts used so far and every later one itself, and says why once in the kernel's log.
// In write mode every expert is packed at creation into the file (packed_file_writer.h), which is then
// used so.
class ConstantExperts {
 public:
  // `weights`: the initializers pack_slot reads, each with the experts as its first dim; make_empty
  // gives the matrices of the experts in its slots, pack_slot packs one of them.
  ConstantExperts(int64_t experts, const MakeExperts& make_empty, PackSlot pack_slot, const std::vector<Input>& weights,
                  const PackedFileRequest& file);

  // The experts e with offsets[e + 1] > offsets[e] packed (offsets: experts + 1 row offsets).
  const PackedExperts& for_run(const Ort::KernelContext& ctx, const int64_t* offsets);

 private:
  // One weight tensor's bytes, when its pages are reclaimed after packing (mapped from a file).
  struct MappedWeight {
    const char* data;
    size_t bytes;
  };
  // madvise(advice) on the pages of the expert's weights in mapped_, the pages wholly inside them (inner)
  // or every page they touch.
  void advise_mapped_pages(int64_t expert, int advice, bool inner) const;
  // The checksum of the expert's weights (expert_weights_checksum), their pages mapped at once before.
  uint64_t weights_checksum(int64_t expert) const;
  // Packs the expert into its slot, its source pages mapped at once before and reclaimed after.
  void pack_expert(PackedExperts& into, int64_t slot, int64_t expert) const;
  // The file's slot of the expert: its pages mapped and its checksums checked. Empty when they match,
  // else why not (one line).
  std::string check_file_expert(int64_t expert) const;
  // Stops using the file (packing_ held): packs every expert used so far and `also` into experts_, which
  // later runs read, and logs why.
  void leave_file(const Ort::KernelContext& ctx, const std::string& why, const std::vector<int64_t>& also);

  PackedExperts experts_;  // packed here (no file, or after leaving it)
  PackSlot pack_slot_;
  std::vector<Input> weights_;
  std::vector<MappedWeight> mapped_;
  PackedFileRequest file_request_;
  std::unique_ptr<MappedPackedFile> file_;  // kept mapped until the end: a run may still read it
  std::unique_ptr<PackedFileLayout> layout_;
  PackedExperts file_experts_;  // the file's panels
  bool same_weights_ = false;   // the weights' files are those the file records (no checksum of the weights)
  std::atomic<const PackedExperts*> current_;  // &file_experts_ while the file is used, else &experts_
  std::unique_ptr<std::atomic<bool>[]> packed_;  // per expert: ready in *current_
  std::mutex packing_;
};

// The packed experts a run reads: `constant`'s when the weights are initializers (after their
// checks at kernel creation: a run that passes its own checks has the same weights); else `local`,
// made by empty(slots of the experts that have rows: offsets[e + 1] > offsets[e]) and filled by
// pack_slot(local, slot) on the intra-op pool.
template <class Empty, class Pack>
const PackedExperts& experts_for_run(const Ort::KernelContext& ctx, ConstantExperts* constant, const int64_t* offsets,
                                     int64_t experts, PackedExperts& local, Empty&& empty, Pack&& pack_slot) {
  if (constant) return constant->for_run(ctx, offsets);
  local = empty(ExpertSlots::with_rows(offsets, experts));
  parallel_for(ctx, static_cast<size_t>(local.slots.count()),
               [&](size_t slot) { pack_slot(local, static_cast<int64_t>(slot)); });
  return local;
}

}  // namespace moe_onnx
