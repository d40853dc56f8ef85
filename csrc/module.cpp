// The Python module lpsim._C. Importing it loads this library, whose static TORCH_LIBRARY
// registrations define the lpsim ops; it also answers a few questions about the build, and offers
// `call`, the short way from Python to an lpsim op.
//
// call(handle, args) runs the op `handle` (from op_handle(name)) on the tuple `args`, given in the
// op's schema order (keyword-only arguments too), through the dispatcher, exactly as
// torch.ops.lpsim.<name> would: the same kernels at every key (autograd, CPU, CUDA, Python modes
// such as FakeTensorMode). It skips what torch.ops does in Python and in its generic argument
// parser (overload resolution, __torch_function__ handling), which costs about 10 us a call. So it
// takes only what lpsim's Python layer passes, and answers NotImplemented for anything else, for
// which lpsim._ops.call goes through torch.ops instead:
//   Tensor     a torch.Tensor or nn.Parameter, not a subclass (a subclass may define
//              __torch_function__); Tensor? also None. A Python int for a Tensor or Tensor?
//              argument becomes a 0-d int64 CPU tensor (a seed).
//   int, int?  a Python int in the int64 range (not a bool), or None for int?
//   float      a Python float or int
//   bool       a Python bool
//   ScalarType a torch.dtype
//   Tensor[]   a list or tuple of such tensors
// and nothing while a TorchFunctionMode is active (it must see the call).
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/scalar_tensor.h>
#include <Python.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <string>
#include <vector>

#include "cpu/loops.h"

namespace {

bool cuda_built() {
#if defined(LPSIM_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

PyObject* py_cuda_built(PyObject*, PyObject*) { return PyBool_FromLong(cuda_built() ? 1 : 0); }

PyObject* py_cpu_generator(PyObject*, PyObject*) {
  return PyUnicode_FromString(lpsim::cpu::philox_group_isa());
}

// ---- call

std::vector<c10::OperatorHandle>& handles() {
  static std::vector<c10::OperatorHandle> all;
  return all;
}

// op_handle(name) -> int: the handle of lpsim::<name> (its default overload) for call().
PyObject* py_op_handle(PyObject*, PyObject* name) {
  HANDLE_TH_ERRORS
  const char* text = PyUnicode_AsUTF8(name);
  if (text == nullptr) return nullptr;
  const std::string qualified = std::string("lpsim::") + text;
  handles().push_back(c10::Dispatcher::singleton().findSchemaOrThrow(qualified.c_str(), ""));
  return PyLong_FromSize_t(handles().size() - 1);
  END_HANDLE_TH_ERRORS
}

bool to_int(PyObject* value, int64_t& out) {
  if (!PyLong_Check(value) || PyBool_Check(value)) return false;
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(value, &overflow);
  return overflow == 0 && !(out == -1 && PyErr_Occurred());
}

// `value` as the IValue of an argument of type `type`; false if call() does not take it.
bool to_ivalue(PyObject* value, const c10::TypePtr& type, c10::IValue& out) {
  using c10::TypeKind;
  TypeKind kind = type->kind();
  if (kind == TypeKind::OptionalType) {
    if (value == Py_None) {
      out = c10::IValue();
      return true;
    }
    kind = type->expectRef<c10::OptionalType>().getElementType()->kind();
  }
  int64_t integer = 0;
  switch (kind) {
    case TypeKind::TensorType:
      if (THPVariable_CheckExact(value)) {
        out = THPVariable_Unpack(value);
        return true;
      }
      if (!to_int(value, integer)) return false;
      out = at::scalar_tensor(integer, at::TensorOptions().dtype(at::kLong));
      return true;
    case TypeKind::IntType:
      if (!to_int(value, integer)) return false;
      out = integer;
      return true;
    case TypeKind::FloatType:
      if (PyFloat_Check(value)) {
        out = PyFloat_AS_DOUBLE(value);
        return true;
      }
      if (!to_int(value, integer)) return false;
      out = static_cast<double>(integer);
      return true;
    case TypeKind::BoolType:
      if (!PyBool_Check(value)) return false;
      out = value == Py_True;
      return true;
    case TypeKind::ScalarTypeType:  // a torch.dtype
      if (!THPDtype_Check(value)) return false;
      out = reinterpret_cast<THPDtype*>(value)->scalar_type;
      return true;
    case TypeKind::ListType: {  // Tensor[] or int[]: a list or tuple of tensors or ints
      const auto element = type->expectRef<c10::ListType>().getElementType();
      if (!PyList_Check(value) && !PyTuple_Check(value)) return false;
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
      if (element->kind() == TypeKind::IntType) {
        std::vector<int64_t> integers(static_cast<size_t>(n));
        for (Py_ssize_t i = 0; i < n; ++i) {
          if (!to_int(PySequence_Fast_GET_ITEM(value, i), integers[i])) return false;
        }
        out = c10::IValue(std::move(integers));
        return true;
      }
      if (element->kind() != TypeKind::TensorType) return false;
      c10::List<at::Tensor> tensors;
      tensors.reserve(n);
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* item = PySequence_Fast_GET_ITEM(value, i);
        if (!THPVariable_CheckExact(item)) return false;
        tensors.push_back(THPVariable_Unpack(item));
      }
      out = std::move(tensors);
      return true;
    }
    default:
      return false;
  }
}

PyObject* to_python(const c10::IValue& value) {
  if (value.isNone()) Py_RETURN_NONE;
  TORCH_INTERNAL_ASSERT(value.isTensor(), "lpsim._C.call: an op returned a ", value.tagKind());
  return THPVariable_Wrap(value.toTensor());
}

// Releases the GIL for the op's run, as torch.ops does; kernels that need Python take it back.
struct WithoutGil {
  PyThreadState* state = PyEval_SaveThread();
  ~WithoutGil() { PyEval_RestoreThread(state); }
};

// call(handle, args) -> the op's result (None, a tensor or a tuple of tensors), or NotImplemented.
PyObject* py_call(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  HANDLE_TH_ERRORS
  if (argc != 2 || !PyTuple_Check(argv[1])) {
    PyErr_SetString(PyExc_TypeError, "lpsim._C.call takes (handle, args: tuple)");
    return nullptr;
  }
  int64_t index = -1;
  if (!to_int(argv[0], index) || index < 0 || index >= static_cast<int64_t>(handles().size())) {
    PyErr_SetString(PyExc_ValueError, "lpsim._C.call: unknown op handle");
    return nullptr;
  }
  if (at::impl::torch_function_mode_enabled()) Py_RETURN_NOTIMPLEMENTED;
  const c10::OperatorHandle& op = handles()[index];
  const auto& arguments = op.schema().arguments();
  PyObject* args = argv[1];
  if (PyTuple_GET_SIZE(args) != static_cast<Py_ssize_t>(arguments.size())) {
    Py_RETURN_NOTIMPLEMENTED;  // torch.ops names the missing or extra argument
  }
  torch::jit::Stack stack;
  stack.reserve(arguments.size());
  for (size_t i = 0; i < arguments.size(); ++i) {
    c10::IValue value;
    if (!to_ivalue(PyTuple_GET_ITEM(args, i), arguments[i].real_type(), value)) {
      PyErr_Clear();
      Py_RETURN_NOTIMPLEMENTED;
    }
    stack.push_back(std::move(value));
  }
  {
    WithoutGil released;
    op.callBoxed(stack);
  }
  if (stack.size() == 1) return to_python(stack[0]);
  if (stack.empty()) Py_RETURN_NONE;
  PyObject* results = PyTuple_New(static_cast<Py_ssize_t>(stack.size()));
  if (results == nullptr) return nullptr;
  for (size_t i = 0; i < stack.size(); ++i) {
    PyObject* item = to_python(stack[i]);
    if (item == nullptr) {
      Py_DECREF(results);
      return nullptr;
    }
    PyTuple_SET_ITEM(results, static_cast<Py_ssize_t>(i), item);
  }
  return results;
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"cuda_built", py_cuda_built, METH_NOARGS, "Whether the CUDA kernels were compiled."},
    {"cpu_generator", py_cpu_generator, METH_NOARGS,
     "Which implementation of the random-word generator the CPU kernels use."},
    {"op_handle", py_op_handle, METH_O, "op_handle(name) -> the handle of lpsim::<name>."},
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_call)), METH_FASTCALL,
     "call(handle, args) -> the op's result, or NotImplemented (see csrc/module.cpp)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "lpsim's compiled kernels.", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&module); }
