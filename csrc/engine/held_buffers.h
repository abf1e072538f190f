// The staging buffers one writer or reader holds: at most `limit` taken from
// the pool, those not in flight kept for reuse (put_back).
#pragma once

#include <cstddef>
#include <vector>

#include "buffer_pool.h"
#include "io_queue.h"

namespace fastckpt {

class HeldBuffers {
 public:
  // A buffer not in flight, or a new one from the pool while fewer than
  // `limit` are held (blocking for it only when none of ours is in flight on
  // `q`, which could give one back); -1 when the caller must reap first.
  int try_take(BufferPool& pool, const IoQueue& q, size_t limit) {
    if (!free_.empty()) {
      int b = free_.back();
      free_.pop_back();
      return b;
    }
    if (held_.size() < limit) {
      int b = held_.empty() || q.inflight() == 0 ? pool.acquire() : pool.try_acquire();
      if (b >= 0) held_.push_back(b);
      return b;
    }
    return -1;
  }
  // try_take, reaping (which put_back()s what completed) until one is free.
  template <class Reap>
  int take(BufferPool& pool, const IoQueue& q, size_t limit, Reap reap) {
    for (;;) {
      int b = try_take(pool, q, limit);
      if (b >= 0) return b;
      reap();  // some of our buffers are in flight: wait for one
    }
  }
  void put_back(int b) { free_.push_back(b); }
  // Every held buffer back to the pool, except one the kernel may still be
  // reading (its request was never reaped: `unreaped`), which is quarantined.
  void release(BufferPool& pool, const std::vector<int>& unreaped) noexcept;

 private:
  std::vector<int> held_;  // taken from the pool
  std::vector<int> free_;  // of those, the ones not in flight
};

}  // namespace fastckpt
