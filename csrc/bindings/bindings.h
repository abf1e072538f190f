// fastckpt._C: thin bindings over csrc/engine and csrc/pickle, one file per
// area; module.cpp makes the module and calls each area's init_*(). Tensors
// and buffer-protocol objects become (pointer, bytes); the GIL is released
// during I/O; engine errors become OSError(errno, message, path),
// fastckpt.FormatError (truncated files) and ValueError (misuse). No I/O
// decisions here.
//
// Only tensor.cpp includes torch's headers (the slow part of the build); the
// others need pybind11 alone.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace fastckpt {
namespace bindings {

namespace py = pybind11;

// A contiguous CPU memory region borrowed from a Python object (a CPU
// tensor, or any object with the buffer protocol) for the duration of one
// call. Made and destroyed with the GIL held.
class Span {
 public:
  Span(py::handle obj, bool writable);  // tensor.cpp
  ~Span() {
    if (has_view_) PyBuffer_Release(&view_);
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  Span(Span&& o) noexcept : view_(o.view_), has_view_(o.has_view_), ptr_(o.ptr_), len_(o.len_) {
    o.has_view_ = false;
  }
  char* ptr() const { return ptr_; }
  uint64_t len() const { return len_; }

 private:
  Py_buffer view_{};
  bool has_view_ = false;
  char* ptr_ = nullptr;
  uint64_t len_ = 0;
};

// f() run with the GIL released; its result is converted after the GIL is
// taken back.
template <class F>
auto without_gil(F&& f) -> decltype(f()) {
  py::gil_scoped_release nogil;
  return f();
}

// Each area's functions and classes, added to the module in this order (a
// signature names a class registered before it: Engine before the writers).
void init_engine(py::module_& m);   // EngineConfig, Engine, uring_compiled
void init_io(py::module_& m);       // Writer, RegionWriter, read_ranges, CRC-32, files and temporary names
void init_tensor(py::module_& m);   // empty_aligned, copy_bytes, set_resizable (and Span)
void init_pickle(py::module_& m);   // pickle_check
void init_testing(py::module_& m);  // fault injection

}  // namespace bindings
}  // namespace fastckpt
