// Asynchronous I/O backends behind one interface: io_uring (liburing) and a
// pwrite/pread thread pool. A backend only moves requests to the kernel and
// completions back; retries, short transfers and errors are handled once, in
// IoQueue (io_queue.h).
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fastckpt {

class BufferPool;

struct IoRequest {
  enum Kind : uint8_t { Write, Read, Fsync };
  Kind kind = Write;
  int fd = -1;
  char* buf = nullptr;
  uint64_t len = 0;
  int64_t off = 0;
  int buf_index = -1;  // index of a registered staging buffer, or -1
  uint64_t tag = 0;
  // A vectored read: `iovcnt` segments (their lengths add up to len) instead
  // of buf; the array must stay valid until the request is reaped.
  const iovec* iov = nullptr;
  unsigned iovcnt = 0;
};

struct IoCompletion {
  uint64_t tag;
  int64_t res;  // bytes transferred, or -errno
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  // Queues one request. The caller keeps at most max_inflight() requests
  // outstanding.
  virtual void submit(const IoRequest& req) = 0;
  // Blocks until one request completes.
  virtual IoCompletion wait() = 0;
  virtual unsigned max_inflight() const = 0;
  // Worker threads started so far (the thread backend starts them as
  // requests need them); 0 for backends without threads of their own.
  virtual unsigned threads_started() const { return 0; }
};

// Throws IoError (op "io_uring_queue_init") when the kernel refuses io_uring
// (EPERM under seccomp or io_uring_disabled, ENOSYS) or when fastckpt was
// built without liburing (ENOSYS).
// With a `pool` (which must outlive the backend), the ring registers an empty
// (sparse) table of pool->count() buffers when it is made, and buffer i the
// first time a request of at least 1 MiB (or the whole buffer, if smaller) on
// this ring uses it (IoRequest::buf_index), so that only buffers that carry
// large transfers are pinned; every later request on buffer i is a
// fixed-buffer read or write. A registration the kernel refuses (memlock
// limit, an old kernel) leaves that buffer, or all of them, to plain reads
// and writes.
std::unique_ptr<Backend> make_uring_backend(unsigned depth, BufferPool* pool);
std::unique_ptr<Backend> make_thread_backend(unsigned threads, unsigned depth);
bool uring_compiled();

}  // namespace fastckpt
