#include "status.h"

#include <exception>
#include <new>

namespace moe_onnx {

std::string session_config_entry(const OrtApi& api, const OrtSessionOptions* options, const char* key) {
  int has = 0;
  Ort::ThrowOnError(api.HasSessionConfigEntry(options, key, &has));
  if (!has) return {};
  size_t size = 0;
  Ort::ThrowOnError(api.GetSessionConfigEntry(options, key, nullptr, &size));
  std::string value(size, '\0');
  Ort::ThrowOnError(api.GetSessionConfigEntry(options, key, value.data(), &size));
  value.resize(size > 0 ? size - 1 : 0);  // the size counts the terminating NUL
  return value;
}

void throw_invalid(const std::string& message) { throw Ort::Exception(std::string(message), ORT_INVALID_ARGUMENT); }

OrtStatusPtr exception_status(const OrtApi& api, const std::string& where) {
  try {
    throw;
  } catch (const Ort::Exception& e) {
    return api.CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const AllocationFailure& e) {
    return api.CreateStatus(ORT_FAIL, (where + ": " + e.what()).c_str());
  } catch (const std::bad_alloc&) {
    return api.CreateStatus(ORT_FAIL, (where + ": out of memory").c_str());
  } catch (const std::exception& e) {
    return api.CreateStatus(ORT_FAIL, (where + ": " + e.what()).c_str());
  } catch (...) {
    return api.CreateStatus(ORT_FAIL, (where + ": unknown exception").c_str());
  }
}

}  // namespace moe_onnx
