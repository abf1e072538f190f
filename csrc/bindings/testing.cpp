// Test-only hooks: the engine's fault injection (fault.h).
#include <string>

#include "../engine/fault.h"
#include "../engine/first_touch.h"
#include "bindings.h"

namespace fastckpt {
namespace bindings {

void init_testing(py::module_& m) {
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
  m.def("note_slow_huge_pages", &note_slow_huge_pages, py::arg("bytes"), py::arg("cpu_s"),
        "Test-only: record a window of huge-page faults as found slow (as the prefault helper does).");
  m.def("reset_huge_pages_verdict", &reset_huge_pages_verdict,
        "Test-only: forget the huge-page verdict (the next large enough call measures).");
}

}  // namespace bindings
}  // namespace fastckpt
