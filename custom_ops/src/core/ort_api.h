// The one include of onnxruntime's C++ API for every source of the library.
//
// ORT_API_MANUAL_INIT: the API table is not taken at load time (the headers' version may be older
// than the runtime that loads us); RegisterCustomOps calls Ort::InitApi with the table of the
// headers' ORT_API_VERSION, which every onnxruntime from that version up provides.
#pragma once
#ifndef ORT_API_MANUAL_INIT
#define ORT_API_MANUAL_INIT
#endif
#include <onnxruntime_cxx_api.h>
