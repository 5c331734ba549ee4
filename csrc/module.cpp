// The Python module ulysses_kernels._C: build facts, the kernels' limits and the NCCL
// communicator lifecycle. The ops themselves are registered with TORCH_LIBRARY (ops.cpp,
// nccl_ops.cpp); ulysses_kernels/ops.py loads this module (torch first) and is the one
// Python face of all of it.
//
// Written against the plain CPython API (no pybind11, no torch headers): it compiles in
// about a second instead of a minute.
//
// NCCL communicators cross into Python as integers (the ncclComm_t pointer) and unique
// ids as 128 bytes; the Python side (the NCCLCommunicator) owns their lifetime.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <string>

#include "kernels/pack.h"  // kMaxPeers, kMaxRoles, the kernel variant (torch-free)

#ifdef ULYSSES_KERNELS_WITH_NCCL
#include <cuda_runtime.h>  // cudaThreadExchangeStreamCaptureMode (the watchdog's thread)

#include "nccl_check.h"
#endif

// setup.py passes the arch list as a bare token (";" -> "_", e.g. 8.0_9.0).
#define UK_STR2(x) #x
#define UK_STR(x) UK_STR2(x)

namespace {

int set_item(PyObject* d, const char* key, PyObject* value) {
  if (value == nullptr) return -1;
  const int rc = PyDict_SetItemString(d, key, value);
  Py_DECREF(value);
  return rc;
}

PyObject* build_info(PyObject*, PyObject*) {
  PyObject* d = PyDict_New();
  if (d == nullptr) return nullptr;
#ifdef ULYSSES_KERNELS_WITH_CUDA
  const bool cuda = true;
#else
  const bool cuda = false;
#endif
#ifdef ULYSSES_KERNELS_ARCHS
  const char* archs = UK_STR(ULYSSES_KERNELS_ARCHS);
#else
  const char* archs = "";
#endif
  int rc = set_item(d, "cuda", PyBool_FromLong(cuda));
  rc |= set_item(d, "archs", PyUnicode_FromString(archs));
  // The kernels' parameter structs hold every peer's head ranges for up to kMaxRoles
  // tensors: Python reads these limits here instead of keeping a copy of them.
  rc |= set_item(d, "max_peers", PyLong_FromLong(ulysses_kernels::kMaxPeers));
  rc |= set_item(d, "max_roles", PyLong_FromLong(ulysses_kernels::kMaxRoles));
#ifdef ULYSSES_KERNELS_WITH_NCCL
  rc |= set_item(d, "nccl", PyBool_FromLong(1));
  rc |= set_item(d, "nccl_header_version", PyLong_FromLong(NCCL_VERSION_CODE));
  rc |= set_item(d, "nccl_alltoall", PyBool_FromLong(UK_NCCL_HAS_ALLTOALL));
#else
  rc |= set_item(d, "nccl", PyBool_FromLong(0));
#endif
  if (rc != 0) {
    Py_DECREF(d);
    return nullptr;
  }
  return d;
}

#ifdef ULYSSES_KERNELS_WITH_NCCL
// Runs `body` (which may throw) and turns a C++ exception into a Python RuntimeError.
template <class F>
PyObject* guarded(F body) {
  try {
    return body();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

bool parse_comm(PyObject* arg, ncclComm_t* comm) {
  const long long handle = PyLong_AsLongLong(arg);
  if (handle == -1 && PyErr_Occurred()) return false;
  if (handle == 0) {
    PyErr_SetString(PyExc_ValueError, "ulysses_kernels: NCCL communicator handle is 0 (destroyed or never created)");
    return false;
  }
  *comm = reinterpret_cast<ncclComm_t>(static_cast<uintptr_t>(handle));
  return true;
}

PyObject* nccl_version(PyObject*, PyObject*) {
  return guarded([] {
    int v = 0;
    UK_NCCL_CHECK(ncclGetVersion(&v), nullptr);
    return PyLong_FromLong(v);
  });
}

PyObject* nccl_unique_id(PyObject*, PyObject*) {
  return guarded([] {
    ncclUniqueId id;
    UK_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
    return PyBytes_FromStringAndSize(id.internal, sizeof(id.internal));
  });
}

// nccl_comm_init_rank(unique_id: bytes, nranks: int, rank: int) -> int. Blocks until all
// ranks have joined (without the GIL); uses the calling thread's current CUDA device.
PyObject* nccl_comm_init_rank(PyObject*, PyObject* args) {
  const char* raw = nullptr;
  Py_ssize_t len = 0;
  int nranks = 0, rank = 0;
  if (!PyArg_ParseTuple(args, "y#ii:nccl_comm_init_rank", &raw, &len, &nranks, &rank)) return nullptr;
  ncclUniqueId id;
  if (len != static_cast<Py_ssize_t>(sizeof(id.internal))) {
    PyErr_Format(PyExc_ValueError, "ulysses_kernels.nccl_comm_init_rank: unique_id expected %d bytes, got %zd",
                 static_cast<int>(sizeof(id.internal)), len);
    return nullptr;
  }
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    PyErr_Format(PyExc_ValueError, "ulysses_kernels.nccl_comm_init_rank: rank expected in [0, %d), got %d", nranks,
                 rank);
    return nullptr;
  }
  std::memcpy(id.internal, raw, sizeof(id.internal));
  ncclComm_t comm = nullptr;
  std::string error;
  Py_BEGIN_ALLOW_THREADS
  try {
    UK_NCCL_CHECK(ncclCommInitRank(&comm, nranks, id, rank), nullptr);
  } catch (const std::exception& e) {
    error = e.what();
  }
  Py_END_ALLOW_THREADS
  if (!error.empty()) {
    PyErr_SetString(PyExc_RuntimeError, error.c_str());
    return nullptr;
  }
  return PyLong_FromLongLong(static_cast<long long>(reinterpret_cast<uintptr_t>(comm)));
}

template <ncclResult_t (*Fn)(ncclComm_t)>
PyObject* comm_call(PyObject*, PyObject* arg) {
  ncclComm_t comm = nullptr;
  if (!parse_comm(arg, &comm)) return nullptr;
  ncclResult_t result = ncclSuccess;
  Py_BEGIN_ALLOW_THREADS
  result = Fn(comm);
  Py_END_ALLOW_THREADS
  return guarded([&] {
    UK_NCCL_CHECK(result, nullptr);
    Py_RETURN_NONE;
  });
}

// (nranks, rank, cuda device) of a communicator, once it is ready: a nonblocking one
// (torch's, when it made it so) may still be initializing, so its state is settled first
// (without the GIL) and an initialization error raises here.
PyObject* nccl_comm_info(PyObject*, PyObject* arg) {
  ncclComm_t comm = nullptr;
  if (!parse_comm(arg, &comm)) return nullptr;
  ncclResult_t state = ncclSuccess;
  Py_BEGIN_ALLOW_THREADS
  state = ulysses_kernels::nccl_settle(comm);
  Py_END_ALLOW_THREADS
  return guarded([&] {
    UK_NCCL_CHECK(state, comm);
    int count = 0, rank = 0, device = 0;
    UK_NCCL_CHECK(ncclCommCount(comm, &count), comm);
    UK_NCCL_CHECK(ncclCommUserRank(comm, &rank), comm);
    UK_NCCL_CHECK(ncclCommCuDevice(comm, &device), comm);
    return Py_BuildValue("(iii)", count, rank, device);
  });
}

// nccl_comm_async_error(handle) -> (int, str): ncclCommGetAsyncError of a communicator, as
// its ncclResult_t and NCCL's error string (with NCCL's last error message when it is an
// error). (0, "no error") while healthy; 7 (ncclInProgress) while a nonblocking
// communicator's call is still being set up. Host-only and non-blocking: the watchdog
// (ulysses_kernels/comm/watchdog.py) polls it from its own thread while GPU work runs.
PyObject* nccl_comm_async_error(PyObject*, PyObject* arg) {
  ncclComm_t comm = nullptr;
  if (!parse_comm(arg, &comm)) return nullptr;
  ncclResult_t state = ncclSuccess;
  ncclResult_t rc = ncclSuccess;
  Py_BEGIN_ALLOW_THREADS
  rc = ncclCommGetAsyncError(comm, &state);
  Py_END_ALLOW_THREADS
  return guarded([&] {
    UK_NCCL_CHECK(rc, nullptr);  // the query itself failed (not the communicator's state)
    std::string msg = ncclGetErrorString(state);
    const char* last = state != ncclSuccess && state != ncclInProgress ? ncclGetLastError(comm) : nullptr;
    if (last != nullptr && last[0] != '\0') msg += std::string(": ") + last;
    return Py_BuildValue("(is)", static_cast<int>(state), msg.c_str());
  });
}

// cuda_thread_capture_mode_local() -> int: sets the calling thread's CUDA stream-capture
// mode to cudaStreamCaptureModeThreadLocal and returns the previous mode. For the
// watchdog's own thread only: in the default (global) mode its cudaEventQuery while
// another thread captures a CUDA graph would invalidate that capture (torch's NCCL
// watchdog sets the same mode around its event queries).
PyObject* cuda_thread_capture_mode_local(PyObject*, PyObject*) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal;
  const cudaError_t err = cudaThreadExchangeStreamCaptureMode(&mode);
  if (err != cudaSuccess) {
    PyErr_Format(PyExc_RuntimeError, "ulysses_kernels: cudaThreadExchangeStreamCaptureMode failed at %s:%d: %s",
                 __FILE__, __LINE__, cudaGetErrorString(err));
    return nullptr;
  }
  return PyLong_FromLong(static_cast<long>(mode));
}
#endif

// pack_variant([variant]) -> int: the variant of the pack/unpack CUDA kernels (layout_math.h
// kVariantNew, the only one); ValueError for any other. Python's face:
// ulysses_kernels.extension.pack_variant / set_pack_variant.
PyObject* pack_variant(PyObject*, PyObject* args) {
  int variant = ulysses_kernels::kVariantNew;
  if (!PyArg_ParseTuple(args, "|i", &variant)) return nullptr;
  if (variant != ulysses_kernels::kVariantNew) {
    PyErr_Format(PyExc_ValueError, "ulysses_kernels._C.pack_variant: variant expected %d (new), got %d",
                 ulysses_kernels::kVariantNew, variant);
    return nullptr;
  }
  return PyLong_FromLong(ulysses_kernels::kVariantNew);
}

PyMethodDef methods[] = {
    {"pack_variant", pack_variant, METH_VARARGS,
     "pack_variant([variant]) -> int: the CUDA pack/unpack kernel variant (1: new, the only one); ValueError for another"},
    {"build_info", build_info, METH_NOARGS, "How this extension was built (cuda, archs, nccl, nccl_header_version) and its limits (max_peers, max_roles)"},
#ifdef ULYSSES_KERNELS_WITH_NCCL
    {"nccl_version", nccl_version, METH_NOARGS, "ncclGetVersion() of the NCCL library loaded in this process"},
    {"nccl_unique_id", nccl_unique_id, METH_NOARGS, "A new ncclUniqueId as 128 bytes"},
    {"nccl_comm_init_rank", nccl_comm_init_rank, METH_VARARGS,
     "nccl_comm_init_rank(unique_id, nranks, rank) -> int handle, on the current CUDA device"},
    {"nccl_comm_destroy", comm_call<ncclCommDestroy>, METH_O, "ncclCommDestroy(handle)"},
    {"nccl_comm_abort", comm_call<ncclCommAbort>, METH_O, "ncclCommAbort(handle)"},
    {"nccl_comm_info", nccl_comm_info, METH_O, "(nranks, rank, cuda device) of a communicator"},
    {"nccl_comm_async_error", nccl_comm_async_error, METH_O,
     "ncclCommGetAsyncError(handle) as (ncclResult_t, NCCL's error string); non-blocking"},
    {"cuda_thread_capture_mode_local", cuda_thread_capture_mode_local, METH_NOARGS,
     "Set this thread's CUDA stream-capture mode to thread-local; returns the previous mode"},
#endif
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C",
                          "ulysses_kernels C++/CUDA extension (ops under torch.ops.ulysses_kernels)", -1, methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module_def); }
