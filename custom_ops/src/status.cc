#include "status.h"

#include <exception>
#include <new>

namespace moe_onnx {

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
