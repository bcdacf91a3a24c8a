#include "registration.h"

#include <exception>
#include <map>
#include <mutex>

namespace moe_onnx {

OrtStatus* register_domains(OrtSessionOptions* options, const OrtApiBase* api_base,
                            const std::function<std::string(const OrtApi&, const OrtSessionOptions*)>& setting,
                            const std::function<std::vector<OpDomain>(const OrtApi&, const OrtSessionOptions*)>& make) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) return nullptr;
  Ort::InitApi(api);
  try {
    static std::mutex mutex;
    static std::map<std::string, std::vector<OrtCustomOpDomain*>> made;  // per setting, never freed
    const std::string key = setting(*api, options);
    std::lock_guard<std::mutex> lock(mutex);
    auto found = made.find(key);
    if (found == made.end()) {
      std::vector<OrtCustomOpDomain*> domains;
      for (const OpDomain& spec : make(*api, options)) {
        OrtCustomOpDomain* domain = nullptr;
        Ort::ThrowOnError(api->CreateCustomOpDomain(spec.name, &domain));
        for (const OrtCustomOp* op : spec.ops) Ort::ThrowOnError(api->CustomOpDomain_Add(domain, op));
        domains.push_back(domain);
      }
      found = made.emplace(key, std::move(domains)).first;
    }
    for (OrtCustomOpDomain* domain : found->second) Ort::ThrowOnError(api->AddCustomOpDomain(options, domain));
  } catch (const Ort::Exception& e) {
    return api->CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}

}  // namespace moe_onnx
