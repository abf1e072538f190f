// The module fastckpt._C: its docstring, the translation of engine errors
// into Python exceptions, and each area's bindings (bindings.h).
#include <pybind11/pybind11.h>

#include <exception>
#include <string>

#include "../engine/error.h"
#include "bindings.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastckpt's C++ I/O engine (O_DIRECT + io_uring or a thread pool, atomic durable commit)";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const fastckpt::IoError& e) {
      // filename: the user's file (a Writer's target), not its temporary name;
      // the message names both.
      const std::string& filename = e.target().empty() ? e.path() : e.target();
      py::object err = py::module_::import("builtins").attr("OSError")(e.err(), std::string(e.what()), filename);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err.ptr())), err.ptr());
    } catch (const fastckpt::TruncatedError& e) {
      py::object fe = py::module_::import("fastckpt.errors").attr("FormatError");
      PyErr_SetString(fe.ptr(), e.what());
    } catch (const fastckpt::UsageError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  fastckpt::bindings::init_engine(m);
  fastckpt::bindings::init_io(m);
  fastckpt::bindings::init_tensor(m);
  fastckpt::bindings::init_pickle(m);
  fastckpt::bindings::init_testing(m);
}
