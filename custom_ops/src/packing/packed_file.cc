#include "packed_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <stdexcept>
#include <tuple>
#include <utility>

#include "panel_memory.h"

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

uint64_t checksum(const void* data, size_t bytes, uint64_t seed) {
  // Four independent lanes (the multiplications of one overlap the others'), each word folded in by
  // xor, an odd multiplier and a rotation: each step is a bijection of the lane for a given word and of
  // the word for a given lane, so one changed word always changes its lane and the result. The lanes
  // are four variables, not an array, so that they stay in registers.
  constexpr uint64_t k0 = 0x9e3779b97f4a7c15ULL, k1 = 0xc2b2ae3d27d4eb4fULL, k2 = 0x165667b19e3779f9ULL,
                     k3 = 0xd6e8feb86659fd93ULL;
  auto step = [](uint64_t lane, uint64_t word, uint64_t k) {
    const uint64_t x = (lane ^ word) * k;
    return (x << 29) | (x >> 35);
  };
  auto mix = [](uint64_t x) {  // a bijection that spreads every bit over the word
    x = (x ^ (x >> 31)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 29)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 32);
  };
  auto word_at = [](const unsigned char* p) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    return w;
  };
  uint64_t a = mix(seed + k0), b = mix(seed + k1), c = mix(seed + k2), d = mix(seed + k3);
  const auto* p = static_cast<const unsigned char*>(data);
  size_t at = 0;
  for (; at + 32 <= bytes; at += 32) {
    a = step(a, word_at(p + at), k0);
    b = step(b, word_at(p + at + 8), k1);
    c = step(c, word_at(p + at + 16), k2);
    d = step(d, word_at(p + at + 24), k3);
  }
  uint64_t tail[4] = {0, 0, 0, 0};  // the last bytes, zero-padded to four words
  std::memcpy(tail, p + at, bytes - at);
  a = step(a, tail[0], k0);
  b = step(b, tail[1], k1);
  c = step(c, tail[2], k2);
  d = step(d, tail[3], k3);
  return mix((((((mix(bytes) ^ mix(a)) * k0) ^ mix(b)) * k1 ^ mix(c)) * k2 ^ mix(d)) * k3);
}

uint64_t expert_weights_checksum(const std::vector<Input>& weights, int64_t experts, int64_t expert) {
  uint64_t h = 0;
  for (const Input& w : weights) {
    if (!w.present || !w.data || experts <= 0) continue;
    const size_t per_expert = static_cast<size_t>(w.count) * elem_size(w.type) / static_cast<size_t>(experts);
    h = checksum(static_cast<const char*>(w.data) + static_cast<size_t>(expert) * per_expert, per_expert, h);
  }
  return h;
}

std::vector<SourceFileStamp> source_file_stamps(const std::vector<Input>& weights) {
  std::vector<SourceFileStamp> stamps;
  for (const Input& w : weights) {
    if (!w.present || !w.data) continue;
    MappedFile file;
    struct stat st {};
    if (!in_file_mapping(w.data, static_cast<size_t>(w.count) * elem_size(w.type), &file) ||
        stat(file.path.c_str(), &st) != 0 || st.st_ino != file.inode || major(st.st_dev) != file.major ||
        minor(st.st_dev) != file.minor)
      return {};
    stamps.push_back({static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), static_cast<int64_t>(st.st_size),
                      st.st_mtim.tv_sec, st.st_mtim.tv_nsec, st.st_ctim.tv_sec, st.st_ctim.tv_nsec});
  }
  std::sort(stamps.begin(), stamps.end(), [](const SourceFileStamp& a, const SourceFileStamp& b) {
    return std::tie(a.device, a.inode) < std::tie(b.device, b.inode);
  });
  stamps.erase(std::unique(stamps.begin(), stamps.end()), stamps.end());
  if (stamps.size() > kMaxSourceFiles) return {};
  return stamps;
}

bool settled(const std::vector<SourceFileStamp>& stamps) {
  const int64_t now = static_cast<int64_t>(std::time(nullptr));
  return std::all_of(stamps.begin(), stamps.end(), [now](const SourceFileStamp& s) { return s.changed_s + 2 <= now; });
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
    : fingerprint(weights_fingerprint(weights, experts)),
      experts(experts),
      matrices(static_cast<int64_t>(matrices.size())) {
  for (size_t m = 0; m < matrices.size(); ++m) description += "matrix" + std::to_string(m) + "=" + matrices[m].layout + ";";
  for (size_t i = 0; i < weights.size(); ++i) description += "input" + std::to_string(i) + "=" + shape_text(weights[i]) + ";";
  sources_offset = round_up(static_cast<int64_t>(kFixedHeader + description.size()), 8);
  checksums_offset = sources_offset + static_cast<int64_t>(8 + kMaxSourceFiles * sizeof(SourceFileStamp));
  int64_t at = round_up(checksums_offset + experts * (1 + this->matrices) * 8, kPageBytes);
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
    ~Closer() {
      if (fd >= 0) ::close(fd);
    }
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
  std::vector<uint64_t> checksums(static_cast<size_t>(layout.experts * (1 + layout.matrices)));
  const auto table_bytes = static_cast<ssize_t>(checksums.size() * sizeof(uint64_t));
  if (pread(fd, checksums.data(), static_cast<size_t>(table_bytes), layout.checksums_offset) != table_bytes) {
    *why = system_error("cannot read the checksums of", path);
    return nullptr;
  }
  uint64_t source_count = 0;
  std::vector<SourceFileStamp> sources(kMaxSourceFiles);
  if (pread(fd, &source_count, 8, layout.sources_offset) != 8 ||
      pread(fd, sources.data(), kMaxSourceFiles * sizeof(SourceFileStamp), layout.sources_offset + 8) !=
          static_cast<ssize_t>(kMaxSourceFiles * sizeof(SourceFileStamp))) {
    *why = system_error("cannot read the source files of", path);
    return nullptr;
  }
  sources.resize(std::min<uint64_t>(source_count, kMaxSourceFiles));
  void* data = mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    *why = system_error("cannot map", path);
    return nullptr;
  }
  closer.fd = -1;  // kept: changed() asks it
  const Stamp stamp{size, st.st_mtim.tv_sec, st.st_mtim.tv_nsec, st.st_ctim.tv_sec, st.st_ctim.tv_nsec};
  return std::unique_ptr<MappedPackedFile>(
      new MappedPackedFile(fd, static_cast<const char*>(data), static_cast<size_t>(size), stamp, std::move(checksums),
                           std::move(sources)));
}

bool MappedPackedFile::changed() const {
  struct stat st {};
  if (fstat(fd_, &st) != 0) return true;
  const bool modified = st.st_size != stamp_.size || st.st_mtim.tv_sec != stamp_.modified_s ||
                        st.st_mtim.tv_nsec != stamp_.modified_ns;
  // a write restoring the modification time (cp -p) still sets the change time; so does unlinking the
  // file (a new one renamed over it), which leaves these bytes as they are
  const bool touched = st.st_ctim.tv_sec != stamp_.changed_s || st.st_ctim.tv_nsec != stamp_.changed_ns;
  return modified || (touched && st.st_nlink > 0);
}

MappedPackedFile::~MappedPackedFile() {
  munmap(const_cast<char*>(data_), bytes_);
  ::close(fd_);
}

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
