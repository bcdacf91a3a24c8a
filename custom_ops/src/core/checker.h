// The input checks of the references' NodeView (moe_onnx/ops/_common.py), with the same wording,
// over a node's concrete inputs: presence, element types, ranks (Checker) and named sizes bound
// across inputs (DimBinder).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "signature.h"

namespace moe_onnx {

class Checker {
 public:
  Checker(std::string where, const OpSignature& op, const std::vector<Input>& inputs)
      : where_(std::move(where)), op_(op), inputs_(inputs) {}

  [[noreturn]] void fail(const std::string& subject, const std::string& message) const;
  std::string input_name(size_t i) const { return std::string("input '") + name(i) + "'"; }
  const char* name(size_t i) const { return op_.inputs[i].name; }
  bool has(size_t i) const { return i < inputs_.size() && inputs_[i].present; }
  const Input& require(size_t i) const;
  // Input i's element type, after checking it is one the signature allows.
  ElemType expect_elem(size_t i) const;
  void expect_same_elem(size_t i, size_t ref) const;
  const std::vector<int64_t>& expect_rank(size_t i, int rank, int min_rank = -1) const;

 private:
  std::string where_;
  const OpSignature& op_;
  const std::vector<Input>& inputs_;
};

// Binds named sizes (E, H, k...) to the first value seen and reports disagreements.
class DimBinder {
 public:
  explicit DimBinder(const Checker& checker) : checker_(checker) {}
  int64_t bind(const std::string& symbol, int64_t value, const std::string& source);
  // Bind each dim of input i to its symbol: "" skips a dim, "2X" binds X to half an even dim.
  void shape(size_t i, const std::vector<std::string>& symbols);
  // The value bound to `symbol`, -1 when none is.
  int64_t get(const std::string& symbol) const;

 private:
  const Checker& checker_;
  std::map<std::string, std::pair<int64_t, std::string>> values_;
};

}  // namespace moe_onnx
