// Hosts the Python kernels (moe_onnx.ops.OPS[name].reference) inside onnxruntime sessions.
//
// RegisterCustomOps asks moe_onnx.runtime.python_host.op_specs() for the ops (variant name, op name,
// optional flags of the inputs and outputs, output element types, attribute names and kinds) and
// registers one generic kernel per variant in the private domain "moe_onnx.python": those the session
// config entry "moe_onnx.python.variants" names (comma-separated; the variants of the model the session
// runs, which moe_onnx.runtime.session writes), else all of them. onnxruntime builds a schema and a kernel
// definition per registered op for every session, so a session of a few variants starts some 20x faster
// than one of all ~260. A variant is an
// op with concrete output types (onnxruntime must know them before running, and they may depend on
// attributes); moe_onnx.runtime.session(backend="python") rewrites the model's nodes to the variant
// that shape inference gives them. At kernel creation the node's attributes are read into a dict and
// which outputs it names into a tuple of bools; at Compute the kernel takes the GIL (onnxruntime may
// call from its own threads, and the Python binding releases the GIL during run), passes each input
// as a read-only memoryview over onnxruntime's buffer (no copy; None when absent) with its element
// type and shape to moe_onnx.runtime.python_host.compute, and copies the returned arrays into the named
// outputs. A Python exception becomes an onnxruntime error carrying its message.
//
// Built against Python's headers without linking libpython: the symbols come from the Python
// process that loads onnxruntime. Loading this library into a process without Python fails.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <deque>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "attributes.h"
#include "registration.h"
#include "status.h"
#include "tensor.h"

namespace {

const char* kDomain = "moe_onnx.python";
const char* kHostModule = "moe_onnx.runtime.python_host";  // op_specs, compute, MoeOpError
const char* kVariantsKey = "moe_onnx.python.variants";      // VARIANTS_KEY in moe_onnx/runtime/__init__.py

struct Gil {
  PyGILState_STATE state;
  Gil() : state(PyGILState_Ensure()) {}
  ~Gil() { PyGILState_Release(state); }
};

// Owned reference, released under the GIL the caller holds.
struct Ref {
  PyObject* p = nullptr;
  Ref() = default;
  explicit Ref(PyObject* o) : p(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  ~Ref() { Py_XDECREF(p); }
  PyObject* release() {
    PyObject* o = p;
    p = nullptr;
    return o;
  }
  explicit operator bool() const { return p != nullptr; }
};

// The UTF-8 text of a str object; characters UTF-8 cannot encode (lone surrogates) become
// backslash escapes. `fallback` when it is not a str or cannot be encoded at all.
std::string utf8_text(PyObject* text, const char* fallback) {
  if (!text || !PyUnicode_Check(text)) return fallback;
  Ref bytes(PyUnicode_AsEncodedString(text, "utf-8", "backslashreplace"));
  if (!bytes) {
    PyErr_Clear();
    return fallback;
  }
  return std::string(PyBytes_AS_STRING(bytes.p), static_cast<size_t>(PyBytes_GET_SIZE(bytes.p)));
}

// The pending Python exception as (message, onnxruntime error code); clears it.
std::pair<std::string, OrtErrorCode> take_python_error(const std::string& where) {
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  std::string message = "unknown Python error";
  OrtErrorCode code = ORT_RUNTIME_EXCEPTION;
  if (value) {
    Ref text(PyObject_Str(value));
    message = utf8_text(text.p, "(a message that cannot be shown)");
    PyErr_Clear();
  }
  bool contract_error = false;
  if (type) {
    Ref module(PyImport_ImportModule(kHostModule));
    if (module) {
      Ref cls(PyObject_GetAttrString(module.p, "MoeOpError"));
      if (cls && PyErr_GivenExceptionMatches(type, cls.p)) contract_error = true;
    }
    PyErr_Clear();
    if (!contract_error) {
      const char* name = reinterpret_cast<PyTypeObject*>(type)->tp_name;
      message = where + ": Python kernel raised " + std::string(name ? name : "an exception") + ": " + message;
    }
  }
  if (contract_error) code = ORT_INVALID_ARGUMENT;
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  return {message, code};
}

struct Spec {
  std::string name, op;  // variant name (registered), op name (what Python runs)
  std::vector<int> output_types;
  std::vector<bool> input_optional, output_optional;
  std::vector<std::pair<std::string, std::string>> attrs;  // name, kind (int, float, string, ints, floats)
};

struct PyKernel {
  PyKernel(const Spec& spec, const OrtKernelInfo* info);
  ~PyKernel();
  OrtStatusPtr ComputeV2(OrtKernelContext* context);
  void Compute(OrtKernelContext* context);

  const Spec& spec;
  std::string node_name, where;
  PyObject* attrs = nullptr;          // dict name -> value (absent attributes are left out)
  PyObject* named_outputs = nullptr;  // tuple of bools: whether the node names output i
};

struct PyOp : Ort::CustomOpBase<PyOp, PyKernel, true> {
  explicit PyOp(Spec s) : spec(std::move(s)) {}
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return moe_onnx::create_kernel_status(api, spec.op.c_str(), info, kernel, [&] { return new PyKernel(spec, info); });
  }
  const char* GetName() const { return spec.name.c_str(); }
  size_t GetInputTypeCount() const { return spec.input_optional.size(); }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  // Every input is optional for onnxruntime: the Python kernel reports a missing one in its own words.
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t) const { return INPUT_OUTPUT_OPTIONAL; }
  size_t GetOutputTypeCount() const { return spec.output_optional.size(); }
  ONNXTensorElementDataType GetOutputType(size_t i) const {
    return static_cast<ONNXTensorElementDataType>(spec.output_types[i]);
  }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return spec.output_optional[i] ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }

  Spec spec;
};

PyKernel::PyKernel(const Spec& s, const OrtKernelInfo* info) : spec(s) {
  Ort::ConstKernelInfo kinfo(info);
  try {
    node_name = kinfo.GetNodeName();
  } catch (const Ort::Exception&) {
  }
  where = moe_onnx::node_where(spec.op.c_str(), kinfo);
  moe_onnx::AttrReader reader{info};
  for (const auto& [name, kind] : spec.attrs) {  // every given attribute has its kind's type (as Attributes checks)
    const std::string problem = reader.type_problem(name.c_str(), kind.c_str());
    if (!problem.empty()) moe_onnx::throw_invalid(where + ": " + problem);
  }
  Gil gil;
  Ref dict(PyDict_New());
  for (const auto& [name, kind] : spec.attrs) {
    Ref value;
    if (kind == "string") {
      std::string v;
      if (reader.has_string(name.c_str(), &v)) value.p = PyUnicode_DecodeUTF8(v.data(), v.size(), "replace");
    } else if (kind == "float") {
      float v;
      if (reader.has_float(name.c_str(), &v)) value.p = PyFloat_FromDouble(v);
    } else if (kind == "int") {
      int64_t v;
      if (reader.has_int(name.c_str(), &v)) value.p = PyLong_FromLongLong(v);
    } else if (kind == "ints") {
      std::vector<int64_t> v;
      if (reader.has_ints(name.c_str(), &v)) {
        value.p = PyList_New(static_cast<Py_ssize_t>(v.size()));
        for (size_t i = 0; value && i < v.size(); ++i) PyList_SET_ITEM(value.p, i, PyLong_FromLongLong(v[i]));
      }
    } else if (kind == "floats") {
      std::vector<float> v;
      if (reader.has_floats(name.c_str(), &v)) {
        value.p = PyList_New(static_cast<Py_ssize_t>(v.size()));
        for (size_t i = 0; value && i < v.size(); ++i) PyList_SET_ITEM(value.p, i, PyFloat_FromDouble(v[i]));
      }
    }
    if (value) PyDict_SetItemString(dict.p, name.c_str(), value.p);
  }
  const size_t n_out = kinfo.GetOutputCount();
  Ref named(PyTuple_New(static_cast<Py_ssize_t>(n_out)));
  if (!named) throw Ort::Exception(take_python_error(where).first, ORT_FAIL);
  for (size_t i = 0; i < n_out; ++i) PyTuple_SET_ITEM(named.p, i, PyBool_FromLong(!kinfo.GetOutputName(i).empty()));
  attrs = dict.release();
  named_outputs = named.release();
}

PyKernel::~PyKernel() {
  if ((attrs || named_outputs) && Py_IsInitialized()) {
    Gil gil;
    Py_XDECREF(attrs);
    Py_XDECREF(named_outputs);
  }
}

OrtStatusPtr PyKernel::ComputeV2(OrtKernelContext* context) {
  return moe_onnx::compute_status(where, [&] { Compute(context); });
}

void PyKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  static char empty_buffer[1];
  Gil gil;
  auto python_error = [&]() {
    auto [message, code] = take_python_error(where);
    throw Ort::Exception(std::move(message), code);
  };

  const size_t n_in = spec.input_optional.size();
  const std::vector<moe_onnx::Input> given = moe_onnx::read_inputs(ctx, n_in);
  Ref inputs(PyList_New(static_cast<Py_ssize_t>(n_in)));
  if (!inputs) python_error();
  for (size_t i = 0; i < n_in; ++i) {
    const moe_onnx::Input& in = given[i];
    if (!in.present) {
      Py_INCREF(Py_None);
      PyList_SET_ITEM(inputs.p, i, Py_None);
      continue;
    }
    const auto type = in.type;
    const size_t esize = moe_onnx::elem_size(type);
    if (esize == 0)
      throw Ort::Exception(where + ": input " + std::to_string(i) + " has type " + moe_onnx::elem_name(type) +
                               ", which Python kernels do not take",
                           ORT_INVALID_ARGUMENT);
    const std::vector<int64_t>& shape = in.shape;
    char* ptr = in.data ? static_cast<char*>(const_cast<void*>(in.data)) : empty_buffer;
    Ref view(PyMemoryView_FromMemory(ptr, static_cast<Py_ssize_t>(static_cast<size_t>(in.count) * esize), PyBUF_READ));
    Ref dims(PyTuple_New(static_cast<Py_ssize_t>(shape.size())));
    if (!view || !dims) python_error();
    for (size_t a = 0; a < shape.size(); ++a) PyTuple_SET_ITEM(dims.p, a, PyLong_FromLongLong(shape[a]));
    PyObject* item = Py_BuildValue("(OiO)", view.p, static_cast<int>(type), dims.p);
    if (!item) python_error();
    PyList_SET_ITEM(inputs.p, i, item);
  }

  Ref module(PyImport_ImportModule(kHostModule));
  if (!module) python_error();
  Ref fn(PyObject_GetAttrString(module.p, "compute"));
  if (!fn) python_error();
  const size_t n_out = ctx.GetOutputCount();
  Ref result(PyObject_CallFunction(fn.p, "ssOOO", spec.op.c_str(), node_name.c_str(), inputs.p, attrs,
                                   named_outputs));
  if (!result) python_error();
  if (!PyList_Check(result.p) || static_cast<size_t>(PyList_GET_SIZE(result.p)) < n_out)
    throw Ort::Exception(where + ": internal: moe_onnx.runtime.python_host.compute returned a wrong value", ORT_FAIL);

  for (size_t i = 0; i < n_out; ++i) {
    PyObject* item = PyList_GET_ITEM(result.p, i);  // (elem_type, shape tuple, uint8 array), None: not named
    if (item == Py_None) continue;
    int elem = 0;
    PyObject *dims = nullptr, *bytes = nullptr;
    if (!PyArg_ParseTuple(item, "iO!O", &elem, &PyTuple_Type, &dims, &bytes)) python_error();
    std::vector<int64_t> shape(static_cast<size_t>(PyTuple_GET_SIZE(dims)));
    for (size_t a = 0; a < shape.size(); ++a) {
      shape[a] = PyLong_AsLongLong(PyTuple_GET_ITEM(dims, a));
      if (shape[a] == -1 && PyErr_Occurred()) python_error();
    }
    Ort::UnownedValue out = ctx.GetOutput(i, shape);
    if (!out) continue;  // an output the node does not use
    const auto expected = out.GetTensorTypeAndShapeInfo().GetElementType();
    if (static_cast<int>(expected) != elem)
      throw Ort::Exception(where + ": the Python kernel's output " + std::to_string(i) + " has type " +
                               moe_onnx::elem_name(static_cast<ONNXTensorElementDataType>(elem)) + "; expected " +
                               moe_onnx::elem_name(expected) + " (the type onnxruntime inferred for it)",
                           ORT_INVALID_ARGUMENT);
    Py_buffer buffer;
    if (PyObject_GetBuffer(bytes, &buffer, PyBUF_C_CONTIGUOUS) != 0) python_error();
    const size_t need = out.GetTensorTypeAndShapeInfo().GetElementCount() * moe_onnx::elem_size(expected);
    if (static_cast<size_t>(buffer.len) != need) {
      PyBuffer_Release(&buffer);
      throw Ort::Exception(where + ": internal: output " + std::to_string(i) + " has the wrong byte size", ORT_FAIL);
    }
    if (need) std::memcpy(out.GetTensorMutableRawData(), buffer.buf, need);
    PyBuffer_Release(&buffer);
  }
}

// The specs from moe_onnx.runtime.python_host.op_specs(), read once.
std::deque<PyOp>& load_ops() {
  static std::deque<PyOp> ops;
  if (!ops.empty()) return ops;
  Ref module(PyImport_ImportModule(kHostModule));
  if (!module) throw Ort::Exception(take_python_error("moe_onnx python host").first, ORT_FAIL);
  Ref specs(PyObject_CallMethod(module.p, "op_specs", nullptr));
  if (!specs) throw Ort::Exception(take_python_error("moe_onnx python host").first, ORT_FAIL);
  Ref seq(PySequence_Fast(specs.p, "specs"));
  if (!seq) throw Ort::Exception(take_python_error("moe_onnx python host").first, ORT_FAIL);
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq.p); ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq.p, i);
    const char *name = nullptr, *op = nullptr;
    PyObject *ins = nullptr, *outs = nullptr, *types = nullptr, *attrs = nullptr;
    if (!PyArg_ParseTuple(item, "ssOOOO", &name, &op, &ins, &outs, &types, &attrs))
      throw Ort::Exception(take_python_error("moe_onnx python host").first, ORT_FAIL);
    Spec spec;
    spec.name = name;
    spec.op = op;
    for (Py_ssize_t j = 0; j < PySequence_Size(types); ++j) {
      Ref t(PySequence_GetItem(types, j));
      spec.output_types.push_back(static_cast<int>(PyLong_AsLong(t.p)));
    }
    for (Py_ssize_t j = 0; j < PySequence_Size(ins); ++j) {
      Ref flag(PySequence_GetItem(ins, j));
      spec.input_optional.push_back(PyObject_IsTrue(flag.p) == 1);
    }
    for (Py_ssize_t j = 0; j < PySequence_Size(outs); ++j) {
      Ref flag(PySequence_GetItem(outs, j));
      spec.output_optional.push_back(PyObject_IsTrue(flag.p) == 1);
    }
    for (Py_ssize_t j = 0; j < PySequence_Size(attrs); ++j) {
      Ref pair(PySequence_GetItem(attrs, j));
      const char *aname = nullptr, *kind = nullptr;
      if (!PyArg_ParseTuple(pair.p, "ss", &aname, &kind))
        throw Ort::Exception(take_python_error("moe_onnx python host").first, ORT_FAIL);
      spec.attrs.emplace_back(aname, kind);
    }
    ops.emplace_back(std::move(spec));
  }
  return ops;
}

// The comma-separated names of `variants` (empty: every op), each checked against `ops`.
std::vector<const PyOp*> chosen_ops(const std::deque<PyOp>& ops, const std::string& variants) {
  std::vector<const PyOp*> chosen;
  if (variants.empty()) {
    for (const PyOp& op : ops) chosen.push_back(&op);
    return chosen;
  }
  std::set<std::string> wanted;
  for (size_t start = 0; start <= variants.size();) {
    size_t end = variants.find(',', start);
    if (end == std::string::npos) end = variants.size();
    if (end > start) wanted.insert(variants.substr(start, end - start));
    start = end + 1;
  }
  for (const PyOp& op : ops)
    if (wanted.erase(op.spec.name)) chosen.push_back(&op);
  if (!wanted.empty())
    throw Ort::Exception(std::string("moe_onnx python host: session config entry ") + kVariantsKey +
                             " names an op the host does not have: " + *wanted.begin(),
                         ORT_INVALID_ARGUMENT);
  return chosen;
}

// The session's setting, named (registration.h): the set of variants it asks for.
std::string setting(const OrtApi& api, const OrtSessionOptions* options) {
  if (!Py_IsInitialized())
    throw std::runtime_error("the moe_onnx Python-kernel host needs a running Python interpreter");
  return moe_onnx::session_config_entry(api, options, kVariantsKey);
}

// The domain of a set of variants, made on the first registration that asks for it.
std::vector<moe_onnx::OpDomain> domains(const OrtApi& api, const OrtSessionOptions* options) {
  std::deque<PyOp>* ops = nullptr;
  {
    Gil gil;
    ops = &load_ops();
  }
  std::vector<const OrtCustomOp*> chosen;
  for (const PyOp* op : chosen_ops(*ops, moe_onnx::session_config_entry(api, options, kVariantsKey)))
    chosen.push_back(op);
  return {{kDomain, chosen}};
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                              const OrtApiBase* api_base) {
  return moe_onnx::register_domains(options, api_base, setting, domains);
}

}  // extern "C"
