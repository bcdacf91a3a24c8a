// Packed-weights files: an expert op's packed panels (packed_weights.h), written once (`moe-onnx pack`)
// and mapped read-only by later sessions instead of packing, as GGUF files are used. One file per node
// whose weights are initializers, in the directory of the session config entry kPackedWeightsKey,
// named after the node's weight inputs (packed_file_name). docs/building.md ("Packed-weights files")
// describes the format and the rule: a file is used only when its header matches the node exactly
// (layout version, every matrix's layout, the weights' types and shapes, a fingerprint of their
// bytes) and its size is the size that header implies; anything else is never read past the header,
// and the node packs as without a file, saying why once in the kernel's log. Each expert's panels are
// used only after their checksums and the checksum of the expert's weights (unless the weights' files
// are those the file records) equal the file's (checked on the expert's first use, constant_experts.h),
// and only while the file is not written in place.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
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

// Bump on any change to where pack puts a weight (a panel layout, a WeightFormat's meaning) or to the
// file's format: files of another version are not used. 2: the weights' files and the checksum table;
// 3: E2M1 panels keep their E8M0 scale bytes (qgemm.h).
constexpr uint32_t kPackedLayoutVersion = 3;

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

// The identity of a file that weights are mapped from: its device, inode, size, modification and change
// times. While it is the same, the file holds the bytes it held (as git trusts its index's stat data):
// a write or truncation sets the change time, a copy or a file renamed into its place is another inode.
struct SourceFileStamp {
  uint64_t device = 0, inode = 0;
  int64_t size = 0, modified_s = 0, modified_ns = 0, changed_s = 0, changed_ns = 0;
  bool operator==(const SourceFileStamp& o) const {
    return device == o.device && inode == o.inode && size == o.size && modified_s == o.modified_s &&
           modified_ns == o.modified_ns && changed_s == o.changed_s && changed_ns == o.changed_ns;
  }
};
static_assert(sizeof(SourceFileStamp) == 56, "the file's layout of a stamp");
constexpr size_t kMaxSourceFiles = 4;  // a file records the identity of the weights' files up to this many
// The stamps of the files the present weights are mapped from (sorted, each once), when every one of them
// is mapped from a file that its path still names (the mapping's inode) and they are at most
// kMaxSourceFiles; else empty.
std::vector<SourceFileStamp> source_file_stamps(const std::vector<Input>& weights);
// Whether every stamp's change time is at least 2 s old: a later write then sets another change time even
// where timestamps are coarse (a jiffy; FAT's 2 s), so the stamp can be trusted (git's "racily clean" rule).
bool settled(const std::vector<SourceFileStamp>& stamps);

// Where everything lies in a node's file: a header (magic, kPackedLayoutVersion, the description's
// length, the fingerprint, the description), the source files' stamps (a count, then kMaxSourceFiles
// stamps), the checksum table (per expert: its weights' checksum, then each matrix's slot checksum),
// then each matrix's panels (every slot's, as pack lays them out) at a page-aligned offset, then each
// matrix's biases.
struct PackedFileLayout {
  struct Matrix {
    std::string layout;  // PackedWeights::layout()
    int64_t panel_bytes, bias_bytes;
  };
  PackedFileLayout(const std::vector<Matrix>& matrices, const std::vector<Input>& weights, int64_t experts);

  std::string description;  // the matrices' layouts and the weights' types and shapes, ';'-separated
  uint64_t fingerprint;     // weights_fingerprint
  int64_t experts, matrices;
  int64_t sources_offset;    // a uint64_t count, then kMaxSourceFiles SourceFileStamps
  int64_t checksums_offset;  // experts * (1 + matrices) uint64_t
  std::vector<int64_t> panel_offsets, bias_offsets;
  int64_t bytes;

  std::string header() const;
  // The index in the checksum table of the expert's weights' checksum (matrix -1) or of its slot of a matrix.
  size_t checksum_index(int64_t expert, int64_t matrix) const {
    return static_cast<size_t>(expert * (1 + matrices) + 1 + matrix);
  }
};

// A hash of the weights' bytes: a few small windows of each expert's bytes of each tensor (its first
// dim is the experts), so that computing it reads some pages, not the weights. Other weights of the
// same shapes differ in it unless they agree on every window.
uint64_t weights_fingerprint(const std::vector<Input>& weights, int64_t experts);

// A 64-bit checksum of `bytes` bytes (any alignment), continuing from `seed` (a previous checksum, to
// cover several ranges): a change of any one 8-byte word always changes it, other changes but by chance
// (2^-64). Not a cryptographic hash: it finds damage, not a forger.
uint64_t checksum(const void* data, size_t bytes, uint64_t seed = 0);
// The checksum of the expert's bytes of each weight input (their first dim is the experts), in order.
uint64_t expert_weights_checksum(const std::vector<Input>& weights, int64_t experts, int64_t expert);

// A packed-weights file mapped read-only (shared: its pages are the page cache's), its checksum table
// read, and its descriptor kept to see whether the file is written in place (changed).
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
  // The checksum table's entry (PackedFileLayout::checksum_index).
  uint64_t stored_checksum(size_t index) const { return index < checksums_.size() ? checksums_[index] : 0; }
  // The stamps of the files the weights were mapped from when it was written (empty: none recorded).
  const std::vector<SourceFileStamp>& source_files() const { return sources_; }
  // Whether the file was written or truncated since it was opened (its size or modification time differ,
  // or its change time while it still has a name: a file renamed over it leaves it unchanged). One fstat.
  bool changed() const;

 private:
  struct Stamp {
    int64_t size, modified_s, modified_ns, changed_s, changed_ns;
  };
  MappedPackedFile(int fd, const char* data, size_t bytes, Stamp stamp, std::vector<uint64_t> checksums,
                   std::vector<SourceFileStamp> sources)
      : fd_(fd),
        data_(data),
        bytes_(bytes),
        stamp_(stamp),
        checksums_(std::move(checksums)),
        sources_(std::move(sources)) {}
  int fd_;
  const char* data_;
  size_t bytes_;
  Stamp stamp_;  // at open
  std::vector<uint64_t> checksums_;
  std::vector<SourceFileStamp> sources_;
};

// Writes layout's header to a new file `path`.tmp.<pid> (sized layout.bytes); the caller pwrites the rest
// (the weights' files, the checksum table, the panels, the biases) to the descriptor and then calls
// finish_packed_file.
// std::runtime_error naming the file on failure.
int create_packed_file(const std::string& path, const PackedFileLayout& layout);
// Writes `bytes` at `offset` of the file (all of them, or std::runtime_error).
void write_packed_bytes(int fd, const std::string& path, const void* data, int64_t bytes, int64_t offset);
// Closes the descriptor and renames `path`.tmp.<pid> to `path` (ok), or removes it (not ok).
void finish_packed_file(int fd, const std::string& path, bool ok);

}  // namespace moe_onnx
