// Writing a node's packed-weights file (packed_file.h's format): every expert packed, one at a time per
// thread, and its panels and biases written at their offsets (`moe-onnx pack`; a session in write mode).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "packed_file.h"
#include "packed_weights.h"

namespace moe_onnx {

// Packs `expert` into slot 0 of `buffer` (a one-slot PackedExperts whose slot 0 is that expert's); returns
// the checksum of the expert's weights (expert_weights_checksum).
using PackExpert = std::function<uint64_t(PackedExperts& buffer, int64_t expert)>;

// The stamps of the weights' files to record, asked once every expert is packed (empty: none).
using SourceFiles = std::function<std::vector<SourceFileStamp>()>;

// Writes the file file.path of `layout` (the node's `experts` experts) and renames it into place:
// file.threads threads (0: the machine's), each packing one expert at a time into a buffer of one slot
// (make_empty) with pack_expert and writing it; then the source files' stamps and the checksum table.
// std::runtime_error ("writing its packed weights: ...") when anything fails, the file removed.
void write_packed_file(const PackedFileRequest& file, const PackedFileLayout& layout, int64_t experts,
                       const MakeExperts& make_empty, const PackExpert& pack_expert, const SourceFiles& sources);

// The checksum of the slot of a matrix as a file holds it: its panels, then its bias (if any).
uint64_t slot_checksum(const PackedWeights& matrix, int64_t slot);

}  // namespace moe_onnx
