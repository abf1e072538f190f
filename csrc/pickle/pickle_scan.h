// The safety walk of a pickle's opcodes (protocols 0-5), in C++: the one walk
// fastckpt runs (fastckpt/formats/unpickler.py's `check()` and `loads()`), with
// the verdicts of the Python walk there (`check_reference`), which is kept only
// as the test oracle (tests/python/formats/test_pickle_walk.py). Nothing is built and
// nothing is imported: the walk follows the unpickler's stack and refuses a
// pickle whose opcodes or arguments are damaged (what pickletools.genops
// refuses), that uses an opcode torch.save never writes, a persistent id where
// none are allowed, a call of anything but a global (or, with
// `call_objects`, of an object a call returned: torch's weights-only unpickler,
// which runs next, judges every callable by its value), a memo index beyond the
// entries stored so far, a FRAME longer than the bytes that follow, containers
// nested more than `max_depth` deep as they are built, or whose objects would
// take more than max(min_budget, max_ratio * size) bytes (the estimate of
// unpickler.py). More than 2^32 - 1 values (a pickle of over 4 GiB of opcodes)
// is refused too: values are numbered in 32 bits.
//
// Iterative (hostile inputs nest a million deep) and with memory proportional
// to the input's size only (one small record per opcode at most). Pure C++:
// no torch, no Python.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fastckpt {

struct PickleVerdict {
  enum Kind : int {
    kAccepted = 0,
    kBad = 1,       // FormatError "... at byte POS of the N-byte pickle (damaged or crafted; ...)"
    kRefused = 2,   // Refused "refused to unpickle: ... at byte POS"
    kDamaged = 3,   // FormatError "damaged pickle (MESSAGE)": what pickletools.genops raises on
  };
  Kind kind = kAccepted;
  std::string message;  // without the caller's path and without the position
  uint64_t pos = 0;     // the opcode's offset (kBad, kRefused)
  uint64_t cost = 0;    // the estimated bytes (kAccepted)
  // kAccepted: whether the pickle keeps to the vocabulary of a torch.save'd state dict, on which
  // CPython's C unpickler (globals looked up in torch's allow-list, storages through a persistent
  // id handler) builds what torch's weights-only unpickler builds, op for op: protocol 2; GLOBAL
  // collections.OrderedDict, torch._utils._rebuild_tensor_v2 / _v3 / _rebuild_parameter,
  // torch.Size and other names of module torch (storage classes and dtypes, as values only);
  // REDUCE only of OrderedDict and of those functions; BUILD only of an OrderedDict a REDUCE made,
  // with a dict; SETITEM(S) only into a dict or such an OrderedDict; APPEND(S) only onto a list;
  // BINPERSID; the binary memo, int, float and str opcodes, NONE, NEWTRUE/NEWFALSE, LONG1, the
  // empty list/dict/tuple and TUPLE* opcodes, MARK and STOP. Anything else: false (the caller then
  // leaves the pickle to torch's unpickler).
  bool plain = false;
};

// `int_max_str_digits`: Python's limit on the digits of a decimal int
// (sys.get_int_max_str_digits(); 0 = none); a longer INT/LONG/GET/PUT argument
// is damaged, as int() refuses it.
PickleVerdict pickle_check(const char* data, size_t n, bool persistent, int64_t max_depth, uint64_t max_ratio,
                           uint64_t min_budget, int64_t int_max_str_digits = 4300, bool call_objects = false);

}  // namespace fastckpt
