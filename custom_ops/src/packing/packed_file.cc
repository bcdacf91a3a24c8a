#include "packed_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace moe_onnx {
namespace {

constexpr char kMagic[8] = {'M', 'O', 'E', 'P', 'A', 'C', 'K', '\0'};
constexpr int64_t kPageBytes = 4096;
// magic, version (u32), description bytes (u32), fingerprint (u64)
constexpr size_t kFixedHeader = sizeof kMagic + 4 + 4 + 8;
constexpr uint32_t kMaxDescription = 1 << 20;

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

uint64_t fnv1a(uint64_t h, const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001b3ULL;
  return h;
}
constexpr uint64_t kFnvBasis = 0xcbf29ce484222325ULL;

std::string shape_text(const Input& w) {
  if (!w.present) return "absent";
  std::string s = std::string(elem_name(w.type)) + "[";
  for (size_t i = 0; i < w.shape.size(); ++i) s += (i ? "," : "") + std::to_string(w.shape[i]);
  return s + "]";
}

// Where a file is written before it is renamed into place (a partial file is never used).
std::string temporary_name(const std::string& path) { return path + ".tmp." + std::to_string(getpid()); }

std::string system_error(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

// The first ';'-separated item where the file's description and the expected one differ, both sides.
std::string first_difference(const std::string& file, const std::string& expected) {
  auto item = [](const std::string& s, size_t& pos) {
    const size_t end = std::min(s.find(';', pos), s.size());
    std::string out = s.substr(pos, end - pos);
    pos = end + 1;
    return out;
  };
  for (size_t a = 0, b = 0; a < file.size() || b < expected.size();) {
    const std::string x = a < file.size() ? item(file, a) : "(nothing)";
    const std::string y = b < expected.size() ? item(expected, b) : "(nothing)";
    if (x != y) return "the file has " + x + " where this node needs " + y;
  }
  return "the descriptions differ";
}

}  // namespace

PackedFileRequest packed_file_request(const PackedWeightsFiles* files, const Ort::ConstKernelInfo& kinfo, const char* op,
                                      const std::string& where, const std::vector<int>& weight_inputs) {
  PackedFileRequest request;
  if (!files || files->dir.empty()) return request;
  std::vector<std::string> names;
  for (int i : weight_inputs)
    names.push_back(static_cast<size_t>(i) < kinfo.GetInputCount() ? kinfo.GetInputName(static_cast<size_t>(i)) : "");
  request.path = files->dir + "/" + packed_file_name(op, names);
  request.write = files->write;
  request.threads = files->threads;
  request.where = where;
  request.logger = kinfo.GetLogger();
  return request;
}

std::string packed_file_name(const std::string& op, const std::vector<std::string>& input_names) {
  std::string joined = op, readable = op;
  for (const std::string& name : input_names) {
    joined += '\n' + name;
    if (!name.empty() && readable.size() < 96) readable += "-" + name;
  }
  for (char& c : readable)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_')) c = '_';
  char hash[17];
  std::snprintf(hash, sizeof hash, "%016llx",
                static_cast<unsigned long long>(fnv1a(kFnvBasis, joined.data(), joined.size())));
  return readable.substr(0, 96) + "-" + hash + ".moepack";
}

uint64_t weights_fingerprint(const std::vector<Input>& weights, int64_t experts) {
  constexpr size_t kWindow = 64;
  std::vector<std::pair<const char*, size_t>> windows;
  for (const Input& w : weights) {
    if (!w.present || !w.data || experts <= 0) continue;
    const size_t per_expert = static_cast<size_t>(w.count) * elem_size(w.type) / static_cast<size_t>(experts);
    for (int64_t e = 0; e < experts; ++e) {
      const char* first = static_cast<const char*>(w.data) + static_cast<size_t>(e) * per_expert;
      if (per_expert <= 2 * kWindow) {
        windows.emplace_back(first, per_expert);
        continue;
      }
      // the expert's first bytes and a window that moves with the expert
      const size_t moving = (per_expert - kWindow) / 2 + static_cast<size_t>(e) * 4099 % (per_expert / 2 - kWindow + 1);
      windows.emplace_back(first, kWindow);
      windows.emplace_back(first + moving, kWindow);
    }
  }
  // every window's pages asked for at once: weights mapped from a file not in the page cache are then
  // read with many requests in flight, not one page fault after another
  for (const auto& [data, bytes] : windows) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(data) / kPageBytes * kPageBytes;
    madvise(reinterpret_cast<void*>(start), reinterpret_cast<uintptr_t>(data) + bytes - start, MADV_WILLNEED);
  }
  uint64_t h = kFnvBasis;
  for (const auto& [data, bytes] : windows) h = fnv1a(h, data, bytes);
  return h;
}

PackedFileLayout::PackedFileLayout(const std::vector<Matrix>& matrices, const std::vector<Input>& weights,
                                   int64_t experts)
    : fingerprint(weights_fingerprint(weights, experts)) {
  for (size_t m = 0; m < matrices.size(); ++m) description += "matrix" + std::to_string(m) + "=" + matrices[m].layout + ";";
  for (size_t i = 0; i < weights.size(); ++i) description += "input" + std::to_string(i) + "=" + shape_text(weights[i]) + ";";
  int64_t at = round_up(static_cast<int64_t>(kFixedHeader + description.size()), kPageBytes);
  for (const Matrix& m : matrices) {
    panel_offsets.push_back(at);
    at = round_up(at + m.panel_bytes, kPageBytes);
  }
  for (const Matrix& m : matrices) {
    bias_offsets.push_back(at);
    at = round_up(at + m.bias_bytes, 64);
  }
  bytes = at;
}

std::string PackedFileLayout::header() const {
  std::string h(kMagic, sizeof kMagic);
  const uint32_t version = kPackedLayoutVersion, length = static_cast<uint32_t>(description.size());
  h.append(reinterpret_cast<const char*>(&version), 4);
  h.append(reinterpret_cast<const char*>(&length), 4);
  h.append(reinterpret_cast<const char*>(&fingerprint), 8);
  return h + description;
}

std::unique_ptr<MappedPackedFile> MappedPackedFile::open(const std::string& path, const PackedFileLayout& layout,
                                                         std::string* why) {
  // O_NONBLOCK: opening a FIFO put in the file's place returns at once (reads of a regular file ignore it)
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    *why = errno == ENOENT ? "there is no " + path : system_error("cannot open", path);
    return nullptr;
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    *why = system_error("cannot stat", path);
    return nullptr;
  }
  if (!S_ISREG(st.st_mode)) {
    *why = path + " is not a regular file";
    return nullptr;
  }
  char fixed[kFixedHeader];
  const auto size = static_cast<int64_t>(st.st_size);
  if (size < static_cast<int64_t>(kFixedHeader) || pread(fd, fixed, kFixedHeader, 0) != static_cast<ssize_t>(kFixedHeader) ||
      std::memcmp(fixed, kMagic, sizeof kMagic) != 0) {
    *why = path + " is not a packed-weights file (no MOEPACK header)";
    return nullptr;
  }
  uint32_t version = 0, length = 0;
  uint64_t fingerprint = 0;
  std::memcpy(&version, fixed + 8, 4);
  std::memcpy(&length, fixed + 12, 4);
  std::memcpy(&fingerprint, fixed + 16, 8);
  if (version != kPackedLayoutVersion) {
    *why = path + " has packing layout version " + std::to_string(version) + "; this library reads version " +
           std::to_string(kPackedLayoutVersion);
    return nullptr;
  }
  std::string description(std::min(length, kMaxDescription), '\0');
  if (length > kMaxDescription || static_cast<int64_t>(kFixedHeader + length) > size ||
      pread(fd, description.data(), length, kFixedHeader) != static_cast<ssize_t>(length)) {
    *why = path + " is truncated or damaged (its header is cut short)";
    return nullptr;
  }
  if (description != layout.description) {
    *why = path + " was packed for another layout or other weight shapes: " + first_difference(description, layout.description);
    return nullptr;
  }
  if (fingerprint != layout.fingerprint) {
    *why = path + " was packed from other weights (their fingerprint differs)";
    return nullptr;
  }
  if (size != layout.bytes) {
    *why = path + " is " + std::to_string(size) + " bytes; its header needs " + std::to_string(layout.bytes) +
           " (truncated or damaged)";
    return nullptr;
  }
  void* data = mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    *why = system_error("cannot map", path);
    return nullptr;
  }
  return std::unique_ptr<MappedPackedFile>(new MappedPackedFile(static_cast<const char*>(data), static_cast<size_t>(size)));
}

MappedPackedFile::~MappedPackedFile() { munmap(const_cast<char*>(data_), bytes_); }

int create_packed_file(const std::string& path, const PackedFileLayout& layout) {
  const std::string temporary = temporary_name(path);
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error(system_error("cannot create", temporary));
  try {
    if (ftruncate(fd, static_cast<off_t>(layout.bytes)) != 0) throw std::runtime_error(system_error("cannot size", temporary));
    const std::string header = layout.header();
    write_packed_bytes(fd, temporary, header.data(), static_cast<int64_t>(header.size()), 0);
  } catch (...) {
    finish_packed_file(fd, path, false);
    throw;
  }
  return fd;
}

void write_packed_bytes(int fd, const std::string& path, const void* data, int64_t bytes, int64_t offset) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = pwrite(fd, p, static_cast<size_t>(bytes), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw std::runtime_error(system_error("cannot write", path));
    p += n;
    bytes -= n;
    offset += n;
  }
}

void finish_packed_file(int fd, const std::string& path, bool ok) {
  const std::string temporary = temporary_name(path);
  const bool closed = ::close(fd) == 0;
  if (ok && closed && std::rename(temporary.c_str(), path.c_str()) == 0) return;
  const std::string error = system_error(closed ? "cannot rename to" : "cannot close", path);
  std::remove(temporary.c_str());
  if (ok) throw std::runtime_error(error);
}

}  // namespace moe_onnx
