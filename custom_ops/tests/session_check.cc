// moe_onnx_session_check: runs one model in an onnxruntime session with libmoe_onnx_ops registered, on
// inputs from .npy files, and writes the outputs as .npy files. It loads onnxruntime's shared library
// by path (dlopen; nothing is linked), so one build runs any onnxruntime >= the headers' version: on an
// x86-64 machine, custom_ops/arm64.sh runs its aarch64 build under qemu with the aarch64 library of
// onnxruntime's PyPI wheel, and compares the outputs with the x86-64 ones (tests/arm64_sessions.py).
//
// Usage: moe_onnx_session_check ORT_LIBRARY OPS_LIBRARY MODEL INPUT_DIR OUTPUT_DIR [THREADS]
//   INPUT_DIR holds <name>.npy for each graph input (its bytes are taken as the input's element type:
//   bfloat16 as uint16); OUTPUT_DIR receives <name>.npy for each output (bfloat16 as '<u2').
// Exit status 0 when the session ran; otherwise the error on stderr.
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

namespace {

struct Array {
  std::vector<int64_t> shape;
  std::vector<char> bytes;
};

// The .npy format, version 1: magic, version, header length, a Python dict literal, the data (C order).
Array read_npy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::vector<char> file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (file.size() < 10 || std::memcmp(file.data(), "\x93NUMPY", 6) != 0) throw std::runtime_error(path + " is not .npy");
  const bool v1 = file[6] == 1;
  const size_t header_len = v1 ? static_cast<uint8_t>(file[8]) | static_cast<uint8_t>(file[9]) << 8
                               : static_cast<uint8_t>(file[8]) | static_cast<uint8_t>(file[9]) << 8 |
                                     static_cast<uint8_t>(file[10]) << 16 | static_cast<uint8_t>(file[11]) << 24;
  const size_t start = (v1 ? 10 : 12) + header_len;
  const std::string header(file.data() + (v1 ? 10 : 12), header_len);
  if (header.find("'fortran_order': False") == std::string::npos) throw std::runtime_error(path + ": not C order");
  Array a;
  const size_t open = header.find('(', header.find("'shape'")), close = header.find(')', open);
  std::stringstream dims(header.substr(open + 1, close - open - 1));
  std::string dim;
  while (std::getline(dims, dim, ','))
    if (dim.find_first_not_of(' ') != std::string::npos) a.shape.push_back(std::stoll(dim));
  a.bytes.assign(file.begin() + static_cast<std::ptrdiff_t>(start), file.end());
  return a;
}

void write_npy(const std::string& path, const char* descr, const std::vector<int64_t>& shape, const void* data,
               size_t bytes) {
  std::string dims;
  for (int64_t d : shape) dims += std::to_string(d) + ", ";
  if (shape.size() > 1) dims.resize(dims.size() - 1);  // "(3,)" for one dimension, "(2, 3)" for more
  std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (" + dims + "), }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  out.write("\x93NUMPY\x01\x00", 8);
  const uint16_t len = static_cast<uint16_t>(header.size());
  out.put(static_cast<char>(len & 0xff)).put(static_cast<char>(len >> 8));
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!out) throw std::runtime_error("cannot write " + path);
}

// The .npy descr and element bytes of an onnxruntime element type.
std::pair<const char*, size_t> npy_type(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return {"<f4", 4};
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return {"<f2", 2};
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return {"<u2", 2};
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return {"|i1", 1};
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return {"|u1", 1};
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return {"<i4", 4};
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return {"<i8", 8};
    default: throw std::runtime_error("element type " + std::to_string(static_cast<int>(type)) + " is not handled");
  }
}

int run(int argc, char** argv) {
  if (argc < 6 || argc > 7) {
    std::fprintf(stderr, "usage: %s ORT_LIBRARY OPS_LIBRARY MODEL INPUT_DIR OUTPUT_DIR [THREADS]\n", argv[0]);
    return 2;
  }
  const std::string ort_library = argv[1], ops_library = argv[2], model = argv[3], inputs = argv[4], outputs = argv[5];
  const int threads = argc == 7 ? std::stoi(argv[6]) : 1;

  void* handle = dlopen(ort_library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) throw std::runtime_error(std::string("dlopen: ") + dlerror());
  using GetApiBase = const OrtApiBase* (*)();
  auto get_api_base = reinterpret_cast<GetApiBase>(dlsym(handle, "OrtGetApiBase"));
  if (!get_api_base) throw std::runtime_error(ort_library + " has no OrtGetApiBase");
  const OrtApi* api = get_api_base()->GetApi(ORT_API_VERSION);
  if (!api) throw std::runtime_error(ort_library + " does not serve API version " + std::to_string(ORT_API_VERSION));
  Ort::InitApi(api);
  std::printf("onnxruntime %s\n", get_api_base()->GetVersionString());

  Ort::Env env(ORT_LOGGING_LEVEL_WARNING, "session_check");
  Ort::SessionOptions options;
  options.SetIntraOpNumThreads(threads);
  options.RegisterCustomOpsLibrary(ops_library.c_str());
  Ort::Session session(env, model.c_str(), options);
  Ort::AllocatorWithDefaultOptions allocator;
  const Ort::MemoryInfo memory = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);

  std::vector<std::string> input_names, output_names;
  std::vector<Array> arrays;
  std::vector<Ort::Value> values;
  for (size_t i = 0; i < session.GetInputCount(); ++i) {
    input_names.push_back(session.GetInputNameAllocated(i, allocator).get());
    const auto type = session.GetInputTypeInfo(i).GetTensorTypeAndShapeInfo().GetElementType();
    arrays.push_back(read_npy(inputs + "/" + input_names.back() + ".npy"));
    Array& a = arrays.back();
    int64_t count = 1;
    for (int64_t d : a.shape) count *= d;
    if (static_cast<size_t>(count) * npy_type(type).second != a.bytes.size())
      throw std::runtime_error("input '" + input_names.back() + "': " + std::to_string(a.bytes.size()) +
                               " bytes do not hold its shape in its element type");
    values.push_back(Ort::Value::CreateTensor(memory, a.bytes.data(), a.bytes.size(), a.shape.data(), a.shape.size(),
                                              type));
  }
  for (size_t i = 0; i < session.GetOutputCount(); ++i)
    output_names.push_back(session.GetOutputNameAllocated(i, allocator).get());
  std::vector<const char*> in_names, out_names;
  for (const auto& n : input_names) in_names.push_back(n.c_str());
  for (const auto& n : output_names) out_names.push_back(n.c_str());
  auto results = session.Run(Ort::RunOptions{}, in_names.data(), values.data(), values.size(), out_names.data(),
                             out_names.size());
  for (size_t i = 0; i < results.size(); ++i) {
    const auto info = results[i].GetTensorTypeAndShapeInfo();
    const auto [descr, size] = npy_type(info.GetElementType());
    write_npy(outputs + "/" + output_names[i] + ".npy", descr, info.GetShape(), results[i].GetTensorRawData(),
              info.GetElementCount() * size);
  }
  std::printf("%zu outputs written\n", results.size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "session_check: %s\n", e.what());
    return 1;
  }
}
