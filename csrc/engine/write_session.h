// WriteSession: what the Writer (writer.h) and the RegionWriter
// (region_writer.h) share, one durable write of a temporary file that ends
// renamed over the user's target. It holds the backend leased for the write
// and its queue, the staging buffers taken from the pool, the temporary file's
// descriptors, the O_DIRECT decision, the leftovers of crashed saves removed
// and the lifecycle state, and it does the steps of the commit protocol both
// writers follow:
//
//   guarded(f)   any error: abort(), then rethrow (an IoError naming the target)
//   reap_all()   every request in flight reaped
//   sync()       fdatasync; the queue, the buffers and the backend given back
//   publish()    rename over the target while the file is still open (and
//                locked), close, fsync the directory
//   abort()      reap what is in flight before freeing a buffer or closing a
//                descriptor; remove the temporary file if this session owns it
//   fill(stats)  the statistics both writers report
//
// The writers keep only their data paths (how bytes reach the staging
// buffers and which requests carry them). Not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine.h"
#include "error.h"
#include "held_buffers.h"
#include "io_queue.h"

namespace fastckpt {

// The statistics both writers report; WriteStats and RegionStats add theirs.
struct WriteStatsBase {
  uint64_t bytes = 0;          // Writer: the true file size; RegionWriter: this process's regions
  uint64_t requests = 0;       // write requests issued (excluding requeues)
  uint64_t requeued = 0;       // short transfers and EINTR/EAGAIN resubmitted
  double seconds = 0;          // open to durable commit (RegionWriter: to finish or commit)
  bool direct = false;         // O_DIRECT was used (RegionWriter: available for aligned pieces)
  std::string backend;
  uint32_t alignment = 0;      // file offset alignment used for O_DIRECT (0: buffered only)
  std::string fallback;        // why O_DIRECT was not used, if it was not
  // Temporary files of crashed saves of the same target, removed before this
  // save began (names; see temp_file.h for when a file counts as one).
  std::vector<std::string> leftovers_removed;
};

class WriteSession {
 public:
  enum class State { Open, Finished, Committed, Aborted };

  // Leases a backend (a refusal names `target`) and checks that `target`
  // names a file; `kind` ("Writer", "RegionWriter") names the object in
  // errors. `owns_temp`: abort() removes the temporary file.
  WriteSession(Engine& engine, const char* kind, const std::string& target, bool owns_temp);
  // Aborts a session not committed.
  ~WriteSession() { abort(); }
  WriteSession(const WriteSession&) = delete;
  WriteSession& operator=(const WriteSession&) = delete;

  // Throws UsageError unless Open.
  void ensure_open() const;
  // Runs f; on any error aborts and rethrows (an IoError saying it happened
  // while saving the target).
  template <class F>
  auto guarded(F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (const IoError& e) {
      abort();
      throw e.saving(target);
    } catch (...) {
      abort();
      throw;
    }
  }
  // Every request in flight reaped (reap_one() reaps one and puts its buffer back).
  template <class Reap>
  void reap_all(Reap reap_one) {
    while (q->inflight() > 0) reap_one();
  }
  // After reap_all(): fdatasync the file; close the O_DIRECT descriptor (and
  // the other one too when this session does not own the file, which it will
  // never rename); give back the queue, the buffers and the backend. Finished.
  void sync();
  // After sync(), by the owner: rename over the target while the file is
  // still open and locked (a concurrent save of the same target never takes
  // it for a crashed save's leftover), close it, Committed, fsync the
  // directory.
  void publish();
  // No effect once committed or aborted.
  void abort() noexcept;
  // The session's first O_DIRECT write, made synchronously (through
  // fd_direct where the session has one, else fd): some filesystems accept
  // O_DIRECT at open and refuse it at the first write (EINVAL). True when it
  // was written. After EINVAL, false with nothing written and the session
  // buffered for good (fd_direct closed, or fd's O_DIRECT cleared; direct
  // false, align 1, fallback says why): the caller writes it again, buffered.
  // Any other error is thrown.
  bool write_first_direct(const char* buf, uint64_t len, uint64_t off);
  // The statistics common to both writers, as of now (requeued: as of sync()).
  void fill(WriteStatsBase& st) const;

  Engine& engine;
  const EngineConfig& cfg;
  const char* const kind;
  const std::string target;
  const std::string dir;      // the target's directory
  const bool owns_temp;
  std::string tmp;            // the temporary file, once it exists (or was named)
  BackendLease lease;
  std::string backend;        // the leased backend's name
  std::unique_ptr<IoQueue> q;
  HeldBuffers bufs;
  int fd = -1;                // the temporary file (the owner's holds its lock until publish())
  int fd_direct = -1;         // a second, O_DIRECT descriptor, or -1
  bool direct = false;
  uint32_t align = 1;         // file offset alignment of O_DIRECT transfers (when direct)
  std::string fallback;       // why O_DIRECT is not used
  std::vector<std::string> leftovers;
  State state = State::Open;
  uint64_t requeued = 0;
  double t0;
};

}  // namespace fastckpt
