#include "buffer_pool.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "error.h"

namespace fastckpt {

BufferPool::BufferPool(size_t buffer_size, size_t count)
    : size_(buffer_size), count_(count), mapped_(buffer_size * count), base_(nullptr) {
  if (buffer_size == 0 || buffer_size % 4096 != 0 || count == 0)
    throw UsageError("BufferPool: buffer size must be a positive multiple of 4096 and count > 0");
  void* p = ::mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw_io(errno, "mmap", "<staging buffers>", -1, mapped_);
  base_ = static_cast<char*>(p);
  // Transparent huge pages where the kernel offers them: fewer, larger
  // physically contiguous segments per O_DIRECT request. Advisory only.
  (void)::madvise(base_, mapped_, MADV_HUGEPAGE);
  // Touch every page now so that no save pays the first-touch cost.
  for (size_t off = 0; off < mapped_; off += 4096) base_[off] = 0;
  iov_.resize(count);
  owner_.resize(count);
  free_.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    iov_[i].iov_base = data(static_cast<int>(i));
    iov_[i].iov_len = size_;
    free_.push_back(static_cast<int>(count - 1 - i));
  }
}

BufferPool::~BufferPool() {
  if (base_) ::munmap(base_, mapped_);
}

int BufferPool::acquire() {
  const std::thread::id me = std::this_thread::get_id();
  std::unique_lock<std::mutex> lk(mu_);
  while (free_.empty()) {
    size_t mine = 0;
    for (const std::thread::id& o : owner_) mine += o == me;
    if (mine + lost_ == count_) {
      if (mine == 0)
        throw IoError("acquire", "<staging buffers: every one was lost to an I/O request that was never reaped>", -1,
                      0, EIO);
      throw UsageError("staging buffers: all " + std::to_string(count_ - lost_) +
                       " are held by open writers or reads of this same thread, so waiting for one would never "
                       "end; commit or abort the open Writer first, or make FASTCKPT_BUFFER_COUNT larger than "
                       "FASTCKPT_QUEUE_DEPTH");
    }
    cv_.wait(lk);
  }
  int i = free_.back();
  free_.pop_back();
  owner_[static_cast<size_t>(i)] = me;
  return i;
}

int BufferPool::try_acquire() {
  std::lock_guard<std::mutex> lk(mu_);
  if (free_.empty()) return -1;
  int i = free_.back();
  free_.pop_back();
  owner_[static_cast<size_t>(i)] = std::this_thread::get_id();
  return i;
}

void BufferPool::release(int index) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    owner_[static_cast<size_t>(index)] = std::thread::id();
    free_.push_back(index);
  }
  cv_.notify_one();
}

void BufferPool::quarantine(int index) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    owner_[static_cast<size_t>(index)] = std::thread::id();
    ++lost_;
  }
  cv_.notify_all();  // a waiter may now find that no buffer will ever come back
}

size_t BufferPool::quarantined() const {
  std::lock_guard<std::mutex> lk(mu_);
  return lost_;
}

size_t BufferPool::available() const {
  std::lock_guard<std::mutex> lk(mu_);
  return free_.size();
}

}  // namespace fastckpt
