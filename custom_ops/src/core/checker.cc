#include "checker.h"

#include "messages.h"
#include "status.h"

namespace moe_onnx {

void Checker::fail(const std::string& subject, const std::string& message) const {
  throw_invalid(where_ + ": " + subject + " " + message);
}

const Input& Checker::require(size_t i) const {
  if (!has(i)) fail(input_name(i), "is required");
  return inputs_[i];
}

ElemType Checker::expect_elem(size_t i) const {
  const Input& in = require(i);
  if (op_.inputs[i].allows(in.type)) return in.type;
  const std::vector<ElemType>& allowed = op_.inputs[i].types;
  std::string names;
  for (size_t j = 0; j < allowed.size(); ++j) names += (j ? ", " : "") + std::string(elem_name(allowed[j]));
  fail(input_name(i), std::string("has type ") + elem_name(in.type) + "; expected " + names);
}

void Checker::expect_same_elem(size_t i, size_t ref) const {
  if (!has(i) || !has(ref)) return;
  if (inputs_[i].type != inputs_[ref].type)
    fail(input_name(i), std::string("has type ") + elem_name(inputs_[i].type) + "; expected " +
                            elem_name(inputs_[ref].type) + ", the type of " + input_name(ref));
}

const std::vector<int64_t>& Checker::expect_rank(size_t i, int rank, int min_rank) const {
  const auto& shape = require(i).shape;
  const int r = static_cast<int>(shape.size());
  if (rank >= 0 && r != rank)
    fail(input_name(i), "has rank " + std::to_string(r) + " (shape " + fmt_shape(shape) + "); expected rank " +
                            std::to_string(rank));
  if (min_rank >= 0 && r < min_rank)
    fail(input_name(i), "has rank " + std::to_string(r) + " (shape " + fmt_shape(shape) + "); expected rank >= " +
                            std::to_string(min_rank));
  return shape;
}

int64_t DimBinder::bind(const std::string& symbol, int64_t value, const std::string& source) {
  auto it = values_.find(symbol);
  if (it == values_.end()) {
    values_[symbol] = {value, source};
    return value;
  }
  if (it->second.first != value)
    checker_.fail(source, "is " + std::to_string(value) + "; expected " + symbol + " = " +
                              std::to_string(it->second.first) + " (from " + it->second.second + ")");
  return value;
}

void DimBinder::shape(size_t i, const std::vector<std::string>& symbols) {
  const auto& shape = checker_.require(i).shape;
  for (size_t axis = 0; axis < symbols.size() && axis < shape.size(); ++axis) {
    const std::string& symbol = symbols[axis];
    const int64_t dim = shape[axis];
    if (symbol.empty()) continue;
    if (symbol.size() > 1 && symbol[0] == '2') {
      if (dim % 2)
        checker_.fail(checker_.input_name(i), "dim " + std::to_string(axis) + " is " + std::to_string(dim) +
                                                  "; expected an even size (" + symbol + ")");
      bind(symbol.substr(1), dim / 2,
           std::string("input '") + checker_.name(i) + "' dim " + std::to_string(axis) + " (= " + symbol + ")");
    } else {
      bind(symbol, dim, std::string("input '") + checker_.name(i) + "' dim " + std::to_string(axis));
    }
  }
}

int64_t DimBinder::get(const std::string& symbol) const {
  auto it = values_.find(symbol);
  return it == values_.end() ? -1 : it->second.first;
}

}  // namespace moe_onnx
