// A fixed set of aligned staging buffers, allocated (and touched) once and
// reused: on virtual machines, memory touched for the first time fills many
// times slower than memory already in use.
#pragma once

#include <sys/uio.h>

#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <thread>
#include <vector>

namespace fastckpt {

class BufferPool {
 public:
  BufferPool(size_t buffer_size, size_t count);
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  size_t buffer_size() const { return size_; }
  size_t count() const { return count_; }
  char* data(int index) const { return base_ + static_cast<size_t>(index) * size_; }
  // One iovec per buffer, for io_uring buffer registration.
  const std::vector<iovec>& iovecs() const { return iov_; }

  // Blocks until a buffer is free. Throws UsageError instead of waiting
  // forever when every buffer is held by the calling thread (e.g. an open
  // Writer of this thread holds them all and this thread now reads): only
  // this thread could give one back.
  int acquire();
  int try_acquire();  // -1 when none is free
  void release(int index);
  // Takes a held buffer out of use for good: the kernel may still access it
  // (an I/O request on it was never reaped). It is never handed out again.
  void quarantine(int index);
  size_t quarantined() const;
  size_t available() const;

 private:
  size_t size_;
  size_t count_;
  size_t mapped_;
  char* base_;
  std::vector<iovec> iov_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> free_;
  size_t lost_ = 0;  // quarantined buffers
  std::vector<std::thread::id> owner_;  // the thread that took each buffer; id() when free
};

}  // namespace fastckpt
