// What the two libraries' RegisterCustomOps share (host/ops_library.cc: the C++ kernels;
// host/python_host.cc: the Python kernels): the API table, the domains made once per session setting
// and kept, and every error as the returned status.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "ort_api.h"

namespace moe_onnx {

// One custom-op domain of a library: its name and its ops (which live until the process ends).
struct OpDomain {
  const char* name;
  std::vector<const OrtCustomOp*> ops;
};

// The body of a library's RegisterCustomOps. Takes the API table of the headers' version from api_base
// (every onnxruntime from that version up provides it; an older runtime gets nullptr: it could not read
// a status of this version), then adds the library's domains for the session's setting to `options`:
// setting(api, options) names the setting (from the session's config entries), make(api, options) makes
// the domains of a setting the first registration with it asks for. They are kept until the process ends
// (onnxruntime keeps pointers to them, and a session only reads them), so one set per setting serves
// every SessionOptions and registering again keeps no memory. Any exception becomes the returned status:
// an Ort::Exception's code and message, ORT_FAIL with another's.
OrtStatus* register_domains(OrtSessionOptions* options, const OrtApiBase* api_base,
                            const std::function<std::string(const OrtApi&, const OrtSessionOptions*)>& setting,
                            const std::function<std::vector<OpDomain>(const OrtApi&, const OrtSessionOptions*)>& make);

}  // namespace moe_onnx
