// IoQueue: the one place where I/O results are interpreted. It keeps up to
// `max_inflight` requests in a Backend, requeues short transfers and
// EINTR/EAGAIN, applies the fault-injection hook, converts -errno to errno
// exactly once, and on any failure reaps every other in-flight request before
// it throws, so the caller may then free buffers and close descriptors. A
// backend that fails (submit or wait) marks the queue broken(): the backend
// is then discarded, never reused; buffers of requests that could not be
// reaped are listed by unreaped_buffers() and must not be reused either.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "backend.h"

namespace fastckpt {

struct Reaped {
  uint64_t tag;    // the caller's tag of the finished request
  uint64_t bytes;  // bytes transferred (reads stop early only at end of file)
};

class IoQueue {
 public:
  IoQueue(Backend& backend, unsigned max_inflight);
  ~IoQueue();
  IoQueue(const IoQueue&) = delete;
  IoQueue& operator=(const IoQueue&) = delete;

  // `path` names the file in errors; it must outlive the request. A read is
  // complete once min_len bytes arrived and the file ends (min_len defaults
  // to the whole length). A vectored read's segments (req.iov) are copied:
  // the caller's array need not outlive the call.
  void submit(const IoRequest& req, const std::string* path, uint64_t min_len = UINT64_MAX);
  Reaped reap();
  void drain() noexcept;

  unsigned inflight() const { return inflight_; }
  bool full() const { return inflight_ >= max_inflight_; }
  // Broken after a backend failure: the backend must not be reused.
  bool broken() const { return broken_; }
  // Staging buffers (IoRequest::buf_index) of requests the kernel took and
  // that were never reaped (the backend failed while waiting): the kernel
  // may still use them, so they must never be reused.
  const std::vector<int>& unreaped_buffers() const { return unreaped_; }
  uint64_t requeued() const { return requeued_; }

 private:
  struct Slot {
    IoRequest req;
    std::vector<iovec> iov;  // a vectored read's segments (req.iov pointed to the caller's)
    std::vector<iovec> cur;  // what is left of them, the array the backend reads
    const std::string* path = nullptr;
    uint64_t done = 0;
    uint64_t min_len = 0;
    unsigned retries = 0;
    bool busy = false;
    bool in_backend = false;  // the backend (kernel) holds it now
  };
  void issue(int slot);
  IoCompletion next_completion();
  void release(int slot);
  [[noreturn]] void fail(int slot, int err);

  Backend& be_;
  unsigned max_inflight_;
  unsigned inflight_ = 0;     // requests accepted and not yet reaped
  unsigned in_backend_ = 0;   // of those, how many the backend holds
  std::vector<Slot> slots_;
  std::vector<int> free_slots_;
  std::deque<IoCompletion> injected_;
  bool broken_ = false;
  uint64_t requeued_ = 0;
  std::vector<int> unreaped_;
};

}  // namespace fastckpt
