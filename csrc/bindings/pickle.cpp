// The pickle scanner (csrc/pickle).
#include "../pickle/pickle_scan.h"
#include "bindings.h"

namespace fastckpt {
namespace bindings {

void init_pickle(py::module_& m) {
  m.def("pickle_check",
        [](py::handle data, bool persistent, int64_t max_depth, uint64_t max_ratio, uint64_t min_budget,
           int64_t int_max_str_digits, bool call_objects) {
          Span s(data, false);
          const PickleVerdict v = without_gil([&] {
            return pickle_check(s.ptr(), s.len(), persistent, max_depth, max_ratio, min_budget, int_max_str_digits,
                                call_objects);
          });
          return py::make_tuple(static_cast<int>(v.kind), v.message, v.pos, v.cost, v.plain);
        },
        py::arg("data"), py::arg("persistent"), py::arg("max_depth"), py::arg("max_ratio"), py::arg("min_budget"),
        py::arg("int_max_str_digits") = 4300, py::arg("call_objects") = false,
        "The safety walk of a pickle (fastckpt.formats.unpickler's, in C++; the GIL is released): "
        "(kind, message, pos, cost, plain) with kind 0 accepted (cost: the estimated bytes; plain: the pickle "
        "keeps to a torch.save'd state dict's vocabulary, PickleVerdict::plain), 1 damaged or crafted at "
        "byte pos, 2 refused at byte pos, 3 damaged (what pickletools.genops refuses).");
}

}  // namespace bindings
}  // namespace fastckpt
