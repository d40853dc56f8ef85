// The Python module lpsim._C. Importing it loads this library, whose static TORCH_LIBRARY
// registrations define the lpsim ops; it also answers a few questions about the build.
#include <Python.h>

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

PyMethodDef methods[] = {
    {"cuda_built", py_cuda_built, METH_NOARGS, "Whether the CUDA kernels were compiled."},
    {"cpu_generator", py_cpu_generator, METH_NOARGS,
     "Which implementation of the random-word generator the CPU kernels use."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "lpsim's compiled kernels.", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&module); }
