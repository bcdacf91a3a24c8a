#include "messages.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace moe_onnx {

std::string py_float(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char buf[64];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, value);
    if (std::strtod(buf, nullptr) == value) break;
  }
  std::string s(buf);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

namespace {

// Length of the valid UTF-8 sequence at value[i], or 0 (then the maximal invalid subpart, which
// errors="replace" turns into one U+FFFD, is *invalid bytes long).
size_t utf8_sequence(const std::string& value, size_t i, size_t* invalid) {
  const auto byte = [&](size_t k) { return k < value.size() ? static_cast<unsigned char>(value[k]) : 0u; };
  const unsigned lead = byte(i);
  size_t length = 0;
  unsigned low = 0x80, high = 0xBF;  // the range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) low = 0xA0;
    if (lead == 0xED) high = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) low = 0x90;
    if (lead == 0xF4) high = 0x8F;
  }
  *invalid = 1;
  if (!length) return 0;
  for (size_t k = 1; k < length; ++k) {
    const unsigned b = byte(i + k);
    if (k == 1 ? (b < low || b > high) : (b < 0x80 || b > 0xBF)) return 0;
    *invalid = k + 1;
  }
  return length;
}

}  // namespace

std::string py_str(const std::string& value) {
  const bool double_quotes = value.find('\'') != std::string::npos && value.find('"') == std::string::npos;
  const char quote = double_quotes ? '"' : '\'';
  std::string s(1, quote);
  char buf[8];
  for (size_t i = 0; i < value.size();) {
    const char c = value[i];
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x80) {
      size_t invalid = 0;
      const size_t length = utf8_sequence(value, i, &invalid);
      const unsigned second = length ? static_cast<unsigned char>(value[i + 1]) : 0;
      const unsigned code = length == 2 ? ((byte & 0x1Fu) << 6) | (second & 0x3Fu) : 0x100;
      if (!length) {
        s += "\xEF\xBF\xBD";  // U+FFFD
      } else if (code <= 0xA0 || code == 0xAD) {  // not printable for Python: escaped
        std::snprintf(buf, sizeof buf, "\\x%02x", code);
        s += buf;
      } else {
        s.append(value, i, length);
      }
      i += length ? length : invalid;
      continue;
    }
    if (c == '\\' || c == quote) {
      s += '\\';
      s += c;
    } else if (c == '\n') {
      s += "\\n";
    } else if (c == '\r') {
      s += "\\r";
    } else if (c == '\t') {
      s += "\\t";
    } else if (byte < 0x20 || byte == 0x7f) {
      std::snprintf(buf, sizeof buf, "\\x%02x", byte);
      s += buf;
    } else {
      s += c;
    }
    ++i;
  }
  return s + quote;
}

std::string fmt_shape(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string fmt_position(const std::vector<int64_t>& shape, int64_t f) {
  std::vector<int64_t> pos(shape.size());
  for (size_t a = shape.size(); a-- > 0;) {
    pos[a] = shape[a] ? f % shape[a] : 0;
    f = shape[a] ? f / shape[a] : 0;
  }
  return fmt_shape(pos);
}

std::string node_where(const char* op, const Ort::ConstKernelInfo& info) {
  std::string name;
  try {
    name = info.GetNodeName();
  } catch (const Ort::Exception&) {
  }
  return name.empty() ? std::string(op) : std::string(op) + " node '" + name + "'";
}

}  // namespace moe_onnx
