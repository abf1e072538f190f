// EngineConfig, Engine and what the build has (uring_compiled).
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "../engine/backend.h"
#include "../engine/config.h"
#include "../engine/engine.h"
#include "bindings.h"

namespace fastckpt {
namespace bindings {

void init_engine(py::module_& m) {
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
                             "Bytes of the staging pool backed by memory now (mincore).")
      .def_property_readonly("buffers_huge", [](Engine& e) { return e.pool().huge(); },
                             "Whether the staging buffers not backed yet are advised transparent huge pages: "
                             "from the first save or read of 2 MiB or more through them on, unless this process "
                             "found huge pages slow (the pool's own first touch judges them); before that, "
                             "small pages.");

  m.def("uring_compiled", &uring_compiled, "Whether this build has the io_uring backend.");
}

}  // namespace bindings
}  // namespace fastckpt
