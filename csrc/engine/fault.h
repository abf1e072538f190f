// Test-only fault injection. Compiled in always (one relaxed atomic load when
// nothing is armed); armed only by tests through fault::arm(), from C++ or via
// fastckpt._C.fault_inject().
//
// A rule makes occurrences nth .. nth+times-1 of an operation (counted from the
// moment the rule is armed, across all threads) fail with `err`, come back
// short (`short_len` >= 0 bytes transferred), or stall for `delay_ms` first.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fastckpt {
namespace fault {

enum class Op : int {
  Open = 0,
  Write,
  Read,
  Fsync,      // fdatasync/fsync of a file or a directory, sync or via io_uring
  Rename,
  Fallocate,
  Truncate,
  UringSetup, // io_uring_queue_init
  UringSubmit, // io_uring_submit fails (the prepared SQE stays in the submission queue, as in the kernel)
  UringWait,   // io_uring_wait_cqe fails (completions can no longer be reaped)
  UringRegister, // a ring's (sparse) buffer table at its creation, then each buffer's registration at its
                 // first use on that ring: refused, the I/O goes through plain reads and writes
  ReadCached,    // read_ranges' page-cache read (preadv2 RWF_NOWAIT) of a range: EAGAIN = not cached,
                 // EOPNOTSUPP/EINVAL = refused by the kernel (both: the range goes through the normal
                 // path), short_len = only that many bytes cached; any other errno fails the read.
                 // The read then also counts as an Op::Read, like any read of file data.
  CacheQuery,    // read_ranges' question how much of a step the page cache holds (cachestat): short_len =
                 // the answer is at most that many bytes' pages (0: none cached); an errno = the kernel
                 // cannot say (ENOSYS: before Linux 6.5)
  kCount
};

const char* op_name(Op op);
// Parses "open", "write", ... ; throws UsageError for an unknown name.
Op op_from_name(const std::string& name);

struct Rule {
  Op op = Op::Write;
  uint64_t nth = 1;        // 1-based occurrence that fires first
  uint64_t times = 1;      // how many consecutive occurrences fire (0 = all from nth on)
  int err = 0;             // errno to fail with (0 = do not fail)
  int64_t short_len = -1;  // >= 0: transfer only this many bytes (reads/writes)
  int delay_ms = 0;        // sleep before the operation
  std::string path_contains;  // only count operations on paths containing this (a temporary file: or its target's)
};

struct Action {
  int err = 0;
  int64_t short_len = -1;
  int delay_ms = 0;
  bool fire() const { return err != 0 || short_len >= 0 || delay_ms > 0; }
};

void arm(const Rule& rule);
void clear();
// Number of rule firings since the last clear() (lets tests prove a fault happened).
uint64_t fired();

// Called by the syscall layer before (or, for asynchronous I/O, at the
// completion of) each operation. Sleeps for delay_ms itself.
Action on(Op op, const std::string& path);

}  // namespace fault
}  // namespace fastckpt
