// A fixed set of aligned staging buffers, reused by every save and load of an
// engine. The pool grows lazily: the constructor only reserves address space
// (2 MiB-aligned, on small pages until a large session asks for huge ones:
// expect) and the kernel backs a page when an I/O or a copy first touches
// it; backed pages stay for the life of the pool. Memory touched for the
// first time fills several times slower than memory already in use, so
// buffers handed out before ("touched") are handed out again before untouched
// ones, the one released last first. A small load touches a few pages of one
// or two buffers, not the whole pool; a large save touches every buffer it
// cycles through once.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "first_touch.h"

namespace fastckpt {

// The smallest session that moves the pool to huge pages (expect): one huge page.
constexpr uint64_t kPoolHugeMin = 2u << 20;

class BufferPool {
 public:
  // Reserves buffer_size x count bytes of address space; touches nothing.
  BufferPool(size_t buffer_size, size_t count);
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  size_t buffer_size() const { return size_; }
  size_t count() const { return count_; }
  char* data(int index) const { return base_ + static_cast<size_t>(index) * size_; }
  // Buffer `index` as an iovec, for io_uring buffer registration.
  iovec iov(int index) const { return iovec{data(index), size_}; }
  // Whether these buffers can carry O_DIRECT transfers of a file with these
  // direct-I/O alignments (sys::dio_alignment): their memory is page-aligned
  // (4096) and their size must be a multiple of the file offset alignment.
  bool fits_direct_io(uint64_t mem_align, uint64_t offset_align) const {
    return mem_align <= 4096 && offset_align <= size_ && size_ % offset_align == 0;
  }

  // A session (a write or a read through these buffers) that will move
  // `bytes` through them: from kPoolHugeMin bytes on (a session that fills a
  // huge page), unless this process found huge pages slow
  // (prefer_huge_pages), the buffers are advised MADV_HUGEPAGE; pages
  // already backed stay small (khugepaged may merge them later). Why huge
  // pages: an O_DIRECT request from them carries 2 MiB segments, one per
  // 4 KiB page otherwise (a virtio disk takes 254 a request): measured here,
  // a 4 MiB O_DIRECT write took 3.4 ms from small pages, 1.8 from huge ones.
  // The buffers handed out for the first time after that are then judged
  // (first_touch.h, HugeWindow):
  // faulted in by the pool itself, a huge page at a time, timed, until a
  // window's verdict. A slow one advises every page not backed yet small
  // pages again, for the life of the pool (32 huge pages took 0.6-1 s to
  // fault in on a VM host that reclaims free memory, against 25 ms for small
  // ones), and is recorded for the loads of the process. Cheap once decided
  // (atomic loads). Advisory: the pool works the same either way.
  void expect(uint64_t bytes);
  // Whether the buffers not backed yet are advised huge pages now.
  bool huge() const { return huge_.load(std::memory_order_acquire); }
  // The pool's own verdict on huge pages: 0 none yet, 1 fast, 2 slow.
  int huge_verdict() const { return verdict_.load(std::memory_order_acquire); }

  // Blocks until a buffer is free. Hands out an already-touched buffer when
  // one is free (the one released last first), otherwise an untouched one
  // (lowest index first). Throws UsageError instead
  // of waiting forever when every buffer is held by the calling thread (e.g.
  // an open Writer of this thread holds them all and this thread now reads):
  // only this thread could give one back.
  int acquire();
  int try_acquire();  // -1 when none is free
  void release(int index);
  // Takes a held buffer out of use for good: the kernel may still access it
  // (an I/O request on it was never reaped). It is never handed out again.
  void quarantine(int index);
  size_t quarantined() const;
  size_t available() const;  // free buffers, touched or not

  // Buffers handed out at least once so far (only these can have backed
  // pages; a touched buffer stays touched).
  size_t touched() const;
  bool is_touched(int index) const;
  // Bytes of the pool backed by memory now (mincore; 0 if it fails).
  size_t resident_bytes() const;
  // Registration bookkeeping of the io_uring backends (the pool itself
  // registers nothing): a ring calls note_registered(i, true) when it
  // registered buffer i, (i, false) when the kernel refused.
  void note_registered(int index, bool ok);
  size_t registered() const;            // buffers registered with at least one ring
  size_t registration_refusals() const;  // registrations the kernel refused

 private:
  // A free buffer (touched ones first), marked held by this thread; -1 if
  // none. *fresh: whether it was never handed out before.
  int take_locked(bool* fresh);
  // A buffer handed out for the first time: judged while a judge is open.
  void judge(int index);

  size_t size_;
  size_t count_;
  size_t mapped_;    // bytes reserved (the buffers plus alignment slack)
  char* map_;        // the reservation
  char* base_;       // the first buffer: map_ rounded up to 2 MiB
  std::atomic<bool> huge_{false};
  std::atomic<int> verdict_{0};  // huge_verdict()
  std::mutex judge_mu_;          // one judge at a time; held over window_
  std::optional<HugeWindow> window_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> warm_;  // free buffers already touched; the last released at the back
  std::vector<int> cold_;  // never handed out; the lowest index at the back
  std::vector<char> touched_, registered_;  // per buffer
  size_t n_touched_ = 0, n_registered_ = 0, refusals_ = 0;
  size_t lost_ = 0;  // quarantined buffers
  std::vector<std::thread::id> owner_;  // the thread that took each buffer; id() when free
};

}  // namespace fastckpt
