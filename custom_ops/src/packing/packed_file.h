// Packed-weights files: an expert op's packed panels (packed_weights.h), written once (`moe-onnx pack`)
// and mapped read-only by later sessions instead of packing, as GGUF files are used. One file per node
// whose weights are initializers, in the directory of the session config entry kPackedWeightsKey,
// named after the node's weight inputs (packed_file_name). docs/building.md ("Packed-weights files")
// describes the format and the rule: a file is used only when its header matches the node exactly
// (layout version, every matrix's layout, the weights' types and shapes, a fingerprint of their
// bytes) and its size is the size that header implies; anything else is never read past the header,
// and the node packs as without a file, saying why once in the kernel's log.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ort_api.h"
#include "tensor.h"

namespace moe_onnx {

// Session config entries (moe_onnx/runtime: session's packed_weights), read when the library is
// registered on the session options: the directory of the files; "1" to pack every expert at
// kernel creation and write the files (then map them); the threads that pack (default: the
// machine's).
constexpr const char* kPackedWeightsKey = "moe_onnx.packed_weights";
constexpr const char* kPackedWeightsWriteKey = "moe_onnx.packed_weights_write";
constexpr const char* kPackedWeightsThreadsKey = "moe_onnx.packed_weights_threads";

// Bump on any change to where pack puts a weight (a panel layout, a WeightFormat's meaning): files of
// another version are not used.
constexpr uint32_t kPackedLayoutVersion = 1;

// The packed-weights settings of the sessions of one registration.
struct PackedWeightsFiles {
  std::string dir;  // empty: no files
  bool write = false;
  int threads = 0;  // writing: 0 = the machine's hardware threads
};

// One node's file, and where it reports on it.
struct PackedFileRequest {
  std::string path;  // empty: no file
  bool write = false;
  int threads = 0;
  std::string where;  // the node, as its messages name it
  Ort::Logger logger;
};
// The file of the `op` node whose weights are its inputs `weight_inputs` (files null: no file).
PackedFileRequest packed_file_request(const PackedWeightsFiles* files, const Ort::ConstKernelInfo& kinfo, const char* op,
                                      const std::string& where, const std::vector<int>& weight_inputs);
// A file name (no directory) that is the same for the same op and input names, and differs between
// different ones: the names' safe characters and a hash of them all.
std::string packed_file_name(const std::string& op, const std::vector<std::string>& input_names);

// Where everything lies in a node's file: a header (magic, kPackedLayoutVersion, the description's
// length, the fingerprint, the description), then each matrix's panels (every slot's, as pack lays
// them out) at a page-aligned offset, then each matrix's biases.
struct PackedFileLayout {
  struct Matrix {
    std::string layout;  // PackedWeights::layout()
    int64_t panel_bytes, bias_bytes;
  };
  PackedFileLayout(const std::vector<Matrix>& matrices, const std::vector<Input>& weights, int64_t experts);

  std::string description;  // the matrices' layouts and the weights' types and shapes, ';'-separated
  uint64_t fingerprint;     // weights_fingerprint
  std::vector<int64_t> panel_offsets, bias_offsets;
  int64_t bytes;

  std::string header() const;
};

// A hash of the weights' bytes: a few small windows of each expert's bytes of each tensor (its first
// dim is the experts), so that computing it reads some pages, not the weights. Other weights of the
// same shapes differ in it unless they agree on every window.
uint64_t weights_fingerprint(const std::vector<Input>& weights, int64_t experts);

// A packed-weights file mapped read-only (shared: its pages are the page cache's).
class MappedPackedFile {
 public:
  // The file at `path` when its header is layout's and its size layout.bytes; else null, with the
  // reason (one line) in `why`.
  static std::unique_ptr<MappedPackedFile> open(const std::string& path, const PackedFileLayout& layout,
                                                std::string* why);
  ~MappedPackedFile();
  MappedPackedFile(const MappedPackedFile&) = delete;
  MappedPackedFile& operator=(const MappedPackedFile&) = delete;

  const char* data() const { return data_; }

 private:
  MappedPackedFile(const char* data, size_t bytes) : data_(data), bytes_(bytes) {}
  const char* data_;
  size_t bytes_;
};

// Writes layout's header to a new file `path`.tmp.<pid> (sized layout.bytes); the caller pwrites the rest
// to the descriptor and then calls finish_packed_file. std::runtime_error naming the file on failure.
int create_packed_file(const std::string& path, const PackedFileLayout& layout);
// Writes `bytes` at `offset` of the file (all of them, or std::runtime_error).
void write_packed_bytes(int fd, const std::string& path, const void* data, int64_t bytes, int64_t offset);
// Closes the descriptor and renames `path`.tmp.<pid> to `path` (ok), or removes it (not ok).
void finish_packed_file(int fd, const std::string& path, bool ok);

}  // namespace moe_onnx
