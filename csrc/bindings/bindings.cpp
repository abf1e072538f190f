// fastckpt._C: thin bindings over csrc/engine and csrc/pickle. Tensors and buffer-protocol
// objects become (pointer, bytes); the GIL is released during I/O; engine
// errors become OSError(errno, message, path), fastckpt.FormatError
// (truncated files) and ValueError (misuse). No I/O decisions here.
#include <fcntl.h>
// Not <torch/extension.h>: it brings in the whole C++ frontend (autograd, nn,
// optim, data), which took two thirds of the extension's compile time. These
// are what the bindings use: pybind11 with torch's tensor casters, THPVariable,
// at::empty and the CPU allocator.
#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "../engine/config.h"
#include "../engine/crc32.h"
#include "../engine/engine.h"
#include "../engine/error.h"
#include "../engine/fault.h"
#include "../engine/reader.h"
#include "../engine/region_writer.h"
#include "../engine/sys.h"
#include "../engine/temp_file.h"
#include "../engine/writer.h"
#include "../pickle/pickle_scan.h"

namespace py = pybind11;
using namespace fastckpt;

namespace {

// A contiguous CPU memory region borrowed from a Python object for the
// duration of one call.
class Span {
 public:
  Span(py::handle obj, bool writable) {
    if (THPVariable_Check(obj.ptr())) {
      const at::Tensor& t = THPVariable_Unpack(obj.ptr());
      if (!t.device().is_cpu())
        throw py::value_error("fastckpt._C: tensor must be on the CPU (got " + t.device().str() + ")");
      if (!t.is_contiguous()) throw py::value_error("fastckpt._C: tensor must be contiguous");
      ptr_ = static_cast<char*>(t.data_ptr());
      len_ = t.nbytes();
      return;
    }
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) throw py::error_already_set();
    has_view_ = true;
    ptr_ = static_cast<char*>(view_.buf);
    len_ = static_cast<uint64_t>(view_.len);
  }
  ~Span() {
    if (has_view_) PyBuffer_Release(&view_);  // called with the GIL held
  }
  Span(const Span&) = delete;
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

py::dict write_stats_dict(const WriteStats& s) {
  py::dict d;
  d["bytes"] = s.bytes;
  d["requests"] = s.requests;
  d["requeued"] = s.requeued;
  d["seconds"] = s.seconds;
  d["flush_seconds"] = s.flush_seconds;
  d["direct"] = s.direct;
  d["backend"] = s.backend;
  d["alignment"] = s.alignment;
  d["fallback"] = s.fallback;
  d["leftovers_removed"] = s.leftovers_removed;
  return d;
}

py::dict read_stats_dict(const ReadStats& s) {
  py::dict d;
  d["bytes"] = s.bytes;
  d["bytes_read"] = s.bytes_read;
  d["requests"] = s.requests;
  d["direct_requests"] = s.direct_requests;
  d["cached_bytes"] = s.cached_bytes;
  d["prefaulted_bytes"] = s.prefaulted_bytes;
  d["seconds"] = s.seconds;
  d["direct"] = s.direct;
  d["backend"] = s.backend;
  return d;
}

py::dict region_stats_dict(const RegionStats& s) {
  py::dict d;
  d["bytes"] = s.bytes;
  d["requests"] = s.requests;
  d["direct_requests"] = s.direct_requests;
  d["requeued"] = s.requeued;
  d["seconds"] = s.seconds;
  d["direct"] = s.direct;
  d["backend"] = s.backend;
  d["alignment"] = s.alignment;
  d["fallback"] = s.fallback;
  d["leftovers_removed"] = s.leftovers_removed;
  return d;
}

struct PyRegionWriter {
  std::unique_ptr<RegionWriter> w;
  RegionWriter& get() {
    if (!w) throw py::value_error("RegionWriter is closed");
    return *w;
  }
};

// The Python Writer owns the engine Writer; the Engine object is kept alive by
// pybind11's keep_alive.
struct PyWriter {
  std::unique_ptr<Writer> w;
  Writer& get() {
    if (!w) throw py::value_error("Writer is closed");
    return *w;
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastckpt's C++ I/O engine (O_DIRECT + io_uring or a thread pool, atomic durable commit)";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IoError& e) {
      // filename: the user's file (a Writer's target), not its temporary name;
      // the message names both.
      const std::string& filename = e.target().empty() ? e.path() : e.target();
      py::object err = py::module_::import("builtins").attr("OSError")(e.err(), std::string(e.what()), filename);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err.ptr())), err.ptr());
    } catch (const TruncatedError& e) {
      py::object fe = py::module_::import("fastckpt.errors").attr("FormatError");
      PyErr_SetString(fe.ptr(), e.what());
    } catch (const UsageError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  py::class_<EngineConfig>(m, "EngineConfig")
      .def(py::init<>())
      .def_static("from_env", []() { return EngineConfig::from_env(); },
                  "Defaults overridden by the FASTCKPT_* environment variables.")
      .def_readwrite("buffer_size", &EngineConfig::buffer_size)
      .def_readwrite("buffer_count", &EngineConfig::buffer_count)
      .def_readwrite("queue_depth", &EngineConfig::queue_depth)
      .def_readwrite("io_threads", &EngineConfig::io_threads)
      .def_property(
          "backend", [](const EngineConfig& c) { return std::string(backend_kind_name(c.backend)); },
          [](EngineConfig& c, const std::string& v) { c.backend = backend_kind_from_name(v); })
      .def_readwrite("direct", &EngineConfig::direct)
      .def_readwrite("flush_interval", &EngineConfig::flush_interval)
      .def_readwrite("preallocate", &EngineConfig::preallocate)
      .def_readwrite("prefault", &EngineConfig::prefault)
      .def("validate", &EngineConfig::validate)
      .def("__repr__", [](const EngineConfig& c) {
        return "EngineConfig(buffer_size=" + std::to_string(c.buffer_size) +
               ", buffer_count=" + std::to_string(c.buffer_count) + ", queue_depth=" + std::to_string(c.queue_depth) +
               ", io_threads=" + std::to_string(c.io_threads) + ", backend='" + backend_kind_name(c.backend) +
               "', direct=" + (c.direct ? "True" : "False") + ", flush_interval=" + std::to_string(c.flush_interval) +
               ", preallocate=" + (c.preallocate ? "True" : "False") +
               ", prefault=" + (c.prefault ? "True" : "False") + ")";
      });

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
      .def(py::init([](const EngineConfig& cfg) {
             py::gil_scoped_release nogil;
             return std::make_shared<Engine>(cfg);  // cheap: the pool and backends grow at the first I/O
           }),
           py::arg("config"))
      .def_property_readonly("config", &Engine::config)
      .def_property_readonly("backend", [](Engine& e) {
        py::gil_scoped_release nogil;
        return e.backend_name();
      })
      .def_property_readonly("uring_refusal", &Engine::uring_refusal)
      .def_property_readonly("backends_created", &Engine::backends_created,
                             "I/O backends (io_uring rings, thread pools) this engine has made so far; a "
                             "read served wholly from the page cache makes none.")
      .def_property_readonly("buffers_available", [](Engine& e) { return e.pool().available(); })
      .def_property_readonly("buffers_quarantined", [](Engine& e) { return e.pool().quarantined(); },
                             "Staging buffers taken out of use because the kernel may still access them.")
      .def_property_readonly("buffers_touched", [](Engine& e) { return e.pool().touched(); },
                             "Staging buffers touched so far: each when the pool first handed it out.")
      .def_property_readonly("buffers_registered", [](Engine& e) { return e.pool().registered(); },
                             "Staging buffers registered with at least one io_uring ring (each at its first "
                             "I/O on that ring).")
      .def_property_readonly("buffer_registrations_refused",
                             [](Engine& e) { return e.pool().registration_refusals(); },
                             "io_uring buffer registrations the kernel refused (that I/O used plain reads and "
                             "writes).")
      .def_property_readonly("buffers_resident_bytes", [](Engine& e) { return e.pool().resident_bytes(); },
                             "Bytes of the staging pool backed by memory now (mincore).");

  py::class_<PyWriter>(m, "Writer")
      .def(py::init([](std::shared_ptr<Engine> eng, const std::string& path, int64_t expected_size) {
             py::gil_scoped_release nogil;
             return PyWriter{std::unique_ptr<Writer>(new Writer(*eng, path, expected_size))};
           }),
           py::arg("engine"), py::arg("path"), py::arg("expected_size") = -1, py::keep_alive<1, 2>())
      .def("write", [](PyWriter& w, py::handle obj) {
             Span s(obj, false);
             Writer& wr = w.get();
             py::gil_scoped_release nogil;
             wr.append(s.ptr(), s.len());
           },
           py::arg("data"), "Append the bytes of a contiguous CPU tensor or buffer.")
      .def("write_at", [](PyWriter& w, py::handle obj, uint64_t off) {
             Span s(obj, false);
             Writer& wr = w.get();
             py::gil_scoped_release nogil;
             wr.write_at(s.ptr(), s.len(), off);
           },
           py::arg("data"), py::arg("offset"))
      .def("write_many", [](PyWriter& w, py::sequence items) {
             // Each item is data or (data, offset); one GIL release for all.
             std::vector<Span> spans;
             std::vector<int64_t> offs;
             spans.reserve(py::len(items));
             for (py::handle it : items) {
               if (py::isinstance<py::tuple>(it)) {
                 py::tuple t = py::reinterpret_borrow<py::tuple>(it);
                 if (t.size() != 2) throw py::value_error("write_many: items are data or (data, offset)");
                 int64_t off = t[1].cast<int64_t>();
                 if (off < 0)
                   throw py::value_error("write_many: negative offset " + std::to_string(off) + " in item " +
                                         std::to_string(spans.size()) + " (an item without offset is appended)");
                 spans.emplace_back(t[0], false);
                 offs.push_back(off);
               } else {
                 spans.emplace_back(it, false);
                 offs.push_back(-1);
               }
             }
             Writer& wr = w.get();
             py::gil_scoped_release nogil;
             for (size_t i = 0; i < spans.size(); ++i) {
               if (offs[i] < 0) wr.append(spans[i].ptr(), spans[i].len());
               else wr.write_at(spans[i].ptr(), spans[i].len(), static_cast<uint64_t>(offs[i]));
             }
           },
           py::arg("items"))
      .def("write_crc", [](PyWriter& w, py::handle obj, uint32_t crc) {
             Span s(obj, false);
             Writer& wr = w.get();
             py::gil_scoped_release nogil;
             wr.append(s.ptr(), s.len(), &crc);
             return crc;
           },
           py::arg("data"), py::arg("crc") = 0,
           "Append like write() and return the zip CRC-32 of the data, continued from `crc`.")
      .def("write_zeros", [](PyWriter& w, uint64_t n) {
             Writer& wr = w.get();
             py::gil_scoped_release nogil;
             wr.append_zeros(n);
           })
      .def_property_readonly("position", [](PyWriter& w) { return w.get().position(); })
      .def_property_readonly("direct", [](PyWriter& w) { return w.get().direct(); })
      .def_property_readonly("backend", [](PyWriter& w) { return w.get().backend_name(); })
      .def_property_readonly("path", [](PyWriter& w) { return w.get().path(); })
      .def_property_readonly("tmp_path", [](PyWriter& w) { return w.get().tmp_path(); })
      .def("commit", [](PyWriter& w) {
        Writer& wr = w.get();
        WriteStats st;
        {
          py::gil_scoped_release nogil;
          st = wr.commit();
        }
        return write_stats_dict(st);
      }, "Make the file durable and rename it to its final name; returns statistics.")
      .def("abort", [](PyWriter& w) {
        if (!w.w) return;
        py::gil_scoped_release nogil;
        w.w->abort();
      }, "Discard the temporary file (no effect after commit).")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyWriter& w, py::object, py::object, py::object) {
        if (!w.w) return false;
        py::gil_scoped_release nogil;
        w.w->abort();  // a Writer left without commit() is discarded
        return false;
      });

  py::class_<PyRegionWriter>(m, "RegionWriter")
      .def(py::init([](std::shared_ptr<Engine> eng, const std::string& target, const std::string& tmp, bool create,
                       uint64_t size) {
             py::gil_scoped_release nogil;
             return PyRegionWriter{std::unique_ptr<RegionWriter>(new RegionWriter(*eng, target, tmp, create, size))};
           }),
           py::arg("engine"), py::arg("target"), py::arg("tmp") = "", py::arg("create") = false, py::arg("size") = 0,
           py::keep_alive<1, 2>(),
           "One process's part of a file written by several (region_writer.h): create=True makes the temporary "
           "file of `target`, `size` bytes long (tmp_path names it); otherwise opens the existing temporary file "
           "`tmp`.")
      .def("write_at", [](PyRegionWriter& w, py::handle obj, uint64_t off, bool crc) -> py::object {
             Span s(obj, false);
             RegionWriter& wr = w.get();
             uint32_t c = 0;
             {
               py::gil_scoped_release nogil;
               wr.write_at(s.ptr(), s.len(), off, crc ? &c : nullptr);
             }
             if (!crc) return py::none();
             return py::int_(c);
           },
           py::arg("data"), py::arg("offset"), py::arg("crc") = false,
           "Write the bytes of a contiguous CPU tensor or buffer at `offset`; with crc=True return their zip CRC-32.")
      .def("finish", [](PyRegionWriter& w) {
             RegionWriter& wr = w.get();
             RegionStats st;
             {
               py::gil_scoped_release nogil;
               st = wr.finish();
             }
             return region_stats_dict(st);
           },
           "Reap every write and fdatasync the file.")
      .def("commit", [](PyRegionWriter& w) {
             RegionWriter& wr = w.get();
             RegionStats st;
             {
               py::gil_scoped_release nogil;
               st = wr.commit();
             }
             return region_stats_dict(st);
           },
           "The creator only: finish(), rename over the target, fsync the directory.")
      .def("abort", [](PyRegionWriter& w) {
             if (!w.w) return;
             py::gil_scoped_release nogil;
             w.w->abort();
           },
           "Stop: reap what is in flight; the creator removes the temporary file.")
      .def_property_readonly("tmp_path", [](PyRegionWriter& w) { return w.get().tmp_path(); })
      .def_property_readonly("target", [](PyRegionWriter& w) { return w.get().target(); })
      .def_property_readonly("owner", [](PyRegionWriter& w) { return w.get().owner(); })
      .def_property_readonly("direct", [](PyRegionWriter& w) { return w.get().direct(); })
      .def_property_readonly("backend", [](PyRegionWriter& w) { return w.get().backend_name(); });

  m.def("read_ranges", [](std::shared_ptr<Engine> eng, const std::string& path, py::sequence items, int fd,
                          bool crc) {
          // Each item: (destination, file_offset[, want_crc]); the whole destination is filled.
          const size_t n = py::len(items);
          std::vector<Span> spans;
          std::vector<ReadRange> ranges;
          std::vector<uint32_t> crcs(n, 0);
          std::vector<char> want(n, 0);
          bool any_crc = false;
          spans.reserve(n);
          ranges.reserve(n);
          for (py::handle it : items) {
            const size_t i = ranges.size();
            py::tuple t = py::cast<py::tuple>(it);
            if (t.size() != 2 && t.size() != 3)
              throw py::value_error("read_ranges: items are (destination, offset) or (destination, offset, crc)");
            int64_t off = t[1].cast<int64_t>();
            if (off < 0) throw py::value_error("read_ranges: negative offset");
            want[i] = t.size() == 3 ? t[2].cast<bool>() : crc;
            any_crc = any_crc || want[i];
            spans.emplace_back(t[0], true);
            ranges.push_back(ReadRange{spans.back().ptr(), spans.back().len(), static_cast<uint64_t>(off),
                                       want[i] ? &crcs[i] : nullptr});
          }
          ReadStats st;
          {
            py::gil_scoped_release nogil;
            st = read_ranges(*eng, path, ranges, fd);
          }
          py::dict d = read_stats_dict(st);
          if (any_crc) {
            py::list out(n);
            for (size_t i = 0; i < n; ++i) out[i] = want[i] ? py::object(py::int_(crcs[i])) : py::object(py::none());
            d["crcs"] = out;
          }
          return d;
        },
        py::arg("engine"), py::arg("path"), py::arg("ranges"), py::arg("fd") = -1, py::arg("crc") = false,
        "Fill each (destination, offset) from the file with parallel reads; with fd, from the file that open "
        "descriptor refers to (consistent with what was read through it, even if path is renamed over meanwhile). "
        "With crc=True (every item) or an item (destination, offset, True), the engine also computes the zip "
        "CRC-32 of each such destination's bytes as they land, in parallel with the reads: the returned dict's "
        "'crcs' holds one per item (None for items that did not ask).");

  m.def("empty_aligned", [](int64_t nbytes, int64_t alignment) {
          // A uint8 CPU tensor whose data starts on a multiple of `alignment`
          // (torch's allocator gives 64), so that the engine can read O_DIRECT
          // straight into it. The storage stays resizable: a resize allocates
          // through torch's CPU allocator and frees this block with free().
          if (nbytes < 0) throw py::value_error("empty_aligned: negative size");
          if (alignment < 64 || (alignment & (alignment - 1)) != 0)
            throw py::value_error("empty_aligned: alignment must be a power of two >= 64");
          void* p = nullptr;
          const size_t n = nbytes > 0 ? static_cast<size_t>(nbytes) : 1;
          if (posix_memalign(&p, static_cast<size_t>(alignment), n) != 0) throw std::bad_alloc();
          c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(nbytes),
                               at::DataPtr(p, p, &std::free, at::Device(at::kCPU)), c10::GetAllocator(at::kCPU),
                               /*resizable=*/true);
          return at::empty({0}, at::TensorOptions().dtype(at::kByte)).set_(storage, 0, {nbytes}, {1});
        },
        py::arg("nbytes"), py::arg("alignment") = 4096,
        "An uninitialized uint8 CPU tensor of nbytes whose data is aligned to `alignment` bytes (for reads "
        "straight into it with O_DIRECT); its storage is resizable like torch.empty's.");

  m.def("set_resizable", [](const at::Tensor& t, bool resizable) {
          // torch.load's storages are not resizable: a tensor that a damaged pickle
          // stretches past its record (set_ with a larger size) is then torch's error,
          // not a reallocation of memory the engine may still be reading into.
          t.storage().unsafeGetStorageImpl()->set_resizable(resizable);
        },
        py::arg("tensor"), py::arg("resizable"),
        "Make the storage of `tensor` resizable or not (torch.load's storages are not).");

  m.def("dio_alignment", [](const std::string& path) {
    int fd = sys::open(path, O_RDONLY);
    sys::DioAlign a;
    try {
      a = sys::dio_alignment(fd, path);
    } catch (...) {
      sys::close_quiet(fd);
      throw;
    }
    sys::close_quiet(fd);
    py::dict d;
    d["mem"] = a.mem;
    d["offset"] = a.offset;
    d["source"] = a.source;
    return d;
  });

  m.def("crc32", [](py::handle obj, uint32_t crc) {
          Span s(obj, false);
          if (s.len() < (64u << 10)) return fastckpt::crc32(crc, s.ptr(), s.len());  // less than a GIL round trip
          py::gil_scoped_release nogil;
          return fastckpt::crc32(crc, s.ptr(), s.len());
        },
        py::arg("data"), py::arg("crc") = 0,
        "Zip CRC-32 of a CPU tensor or buffer, continued from `crc` (equal to zlib.crc32; the GIL is released "
        "for inputs of 64 KiB and more).");
  m.def("pickle_check",
        [](py::handle data, bool persistent, int64_t max_depth, uint64_t max_ratio, uint64_t min_budget,
           int64_t int_max_str_digits) {
          Span s(data, false);
          fastckpt::PickleVerdict v;
          {
            py::gil_scoped_release nogil;
            v = fastckpt::pickle_check(s.ptr(), s.len(), persistent, max_depth, max_ratio, min_budget,
                                       int_max_str_digits);
          }
          return py::make_tuple(static_cast<int>(v.kind), v.message, v.pos, v.cost);
        },
        py::arg("data"), py::arg("persistent"), py::arg("max_depth"), py::arg("max_ratio"), py::arg("min_budget"),
        py::arg("int_max_str_digits") = 4300,
        "The safety walk of a pickle (fastckpt._unpickle.check's verdicts, in C++; the GIL is released): "
        "(kind, message, pos, cost) with kind 0 accepted (cost: the estimated bytes), 1 damaged or crafted at "
        "byte pos, 2 refused at byte pos, 3 damaged (what pickletools.genops refuses).");
  m.def("crc32_combine", &fastckpt::crc32_combine, py::arg("crc1"), py::arg("crc2"), py::arg("len2"),
        "The CRC-32 of a followed by b, from crc32(a), crc32(b) and len(b) (zlib's crc32_combine).");
  m.def("crc32_impl", []() { return std::string(fastckpt::crc32_impl()); },
        "The CRC-32 implementation of this build: 'isa-l' (hardware-accelerated) or 'zlib'.");

  m.def("fsync_dir", [](const std::string& path) {
          py::gil_scoped_release nogil;
          sys::fsync_dir(path);
        },
        py::arg("path"),
        "fsync a directory (makes renames and removals in it durable) through the engine's checker and fault hook.");

  m.def("remove_leftovers", [](const std::string& path) {
          py::gil_scoped_release nogil;
          return remove_leftovers(path);
        },
        py::arg("path"),
        "Remove the temporary files that crashed saves of `path` left next to it (only this host's, only of dead "
        "processes, only unlocked ones; see docs/ENGINE.md); returns their names. Every Writer does this first.");
  m.def("temp_host", &temp_host_token, "This host's name as it appears in temporary file names.");
  m.def("parse_temp_name", [](const std::string& entry, const std::string& target_name) -> py::object {
          TempNameInfo i;
          if (!parse_temp_name(entry, target_name, &i)) return py::none();
          py::dict d;
          d["pid"] = i.pid;
          d["host"] = i.host;
          d["start"] = i.start;
          return d;
        },
        py::arg("entry"), py::arg("target_name"),
        "The fields of a temporary file name of `target_name` ({pid, host, start}), or None.");

  m.def("uring_compiled", &uring_compiled, "Whether this build has the io_uring backend.");

  m.def("fault_inject", [](const std::string& op, uint64_t nth, int err, int64_t short_len, uint64_t times,
                           int delay_ms, const std::string& path_contains) {
          fault::Rule r;
          r.op = fault::op_from_name(op);
          r.nth = nth;
          r.err = err;
          r.short_len = short_len;
          r.times = times;
          r.delay_ms = delay_ms;
          r.path_contains = path_contains;
          fault::arm(r);
        },
        py::arg("op"), py::arg("nth") = 1, py::arg("errno") = 0, py::arg("short") = -1, py::arg("times") = 1,
        py::arg("delay_ms") = 0, py::arg("path_contains") = "",
        "Test-only: make occurrences nth..nth+times-1 of op fail with errno, come back short, or stall.");
  m.def("fault_clear", &fault::clear);
  m.def("fault_fired", &fault::fired);
}
