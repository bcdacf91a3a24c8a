// Writing a node's packed-weights file (packed_file.h's format): every expert packed, one at a time per
// thread, and its panels and biases written at their offsets (`moe-onnx pack`; a session in write mode).
#pragma once

#include <cstdint>
#include <functional>

#include "packed_file.h"
#include "packed_weights.h"

namespace moe_onnx {

// Packs `expert` into slot 0 of `buffer` (a one-slot PackedExperts whose slot 0 is that expert's).
using PackExpert = std::function<void(PackedExperts& buffer, int64_t expert)>;

// Writes the file file.path of `layout` (the node's `experts` experts) and renames it into place:
// file.threads threads (0: the machine's), each packing one expert at a time into a buffer of one slot
// (make_empty) with pack_expert and writing it. std::runtime_error ("writing its packed weights: ...")
// when anything fails, the file removed.
void write_packed_file(const PackedFileRequest& file, const PackedFileLayout& layout, int64_t experts,
                       const MakeExperts& make_empty, const PackExpert& pack_expert);

}  // namespace moe_onnx
