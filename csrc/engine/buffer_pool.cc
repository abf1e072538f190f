#include "buffer_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "error.h"
#include "sys.h"

namespace fastckpt {

namespace {
constexpr size_t kHugePage = 2u << 20;
}

BufferPool::BufferPool(size_t buffer_size, size_t count)
    : size_(buffer_size), count_(count), mapped_(0), map_(nullptr), base_(nullptr) {
  if (buffer_size == 0 || buffer_size % 4096 != 0 || count == 0)
    throw UsageError("BufferPool: buffer size must be a positive multiple of 4096 and count > 0");
  // Address space only: the kernel backs a page when it is first touched.
  // 2 MiB of slack, so that the buffers start on a huge-page boundary (a huge
  // page then never straddles two buffers of a size that is a multiple of it).
  const size_t bytes = buffer_size * count;
  mapped_ = bytes + kHugePage;
  void* p = ::mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw_io(errno, "mmap", "<staging buffers>", -1, mapped_);
  map_ = static_cast<char*>(p);
  base_ = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(map_) + kHugePage - 1) / kHugePage * kHugePage);
  // Small pages until a large session asks for huge ones (expect), also where
  // the kernel's THP mode is "always". Advisory only.
  (void)::madvise(base_, bytes, MADV_NOHUGEPAGE);
  owner_.resize(count);
  touched_.assign(count, 0);
  registered_.assign(count, 0);
  warm_.reserve(count);
  cold_.reserve(count);
  for (size_t i = 0; i < count; ++i) cold_.push_back(static_cast<int>(count - 1 - i));
}

BufferPool::~BufferPool() {
  if (map_) ::munmap(map_, mapped_);
}

void BufferPool::expect(uint64_t bytes) {
  if (huge() || huge_verdict() != 0 || bytes < kPoolHugeMin || !prefer_huge_pages()) return;
  std::lock_guard<std::mutex> lk(judge_mu_);
  if (huge_.load(std::memory_order_relaxed) || huge_verdict() != 0) return;
  // Transparent huge pages where the kernel offers them: fewer, larger
  // physically contiguous segments per O_DIRECT request, and a first touch
  // that backs 2 MiB at a time. Advisory only; pages backed already stay small.
  (void)::madvise(base_, size_ * count_, MADV_HUGEPAGE);
  huge_.store(true, std::memory_order_release);
}

void BufferPool::judge(int index) {
  if (!huge() || huge_verdict() != 0) return;
  std::lock_guard<std::mutex> lk(judge_mu_);
  if (huge_verdict() != 0) return;
  if (!window_) window_.emplace(0);
  char* p = data(index);
  for (size_t off = 0; off < size_; off += kHugeJudgeStep) {
    const size_t n = size_ - off < kHugeJudgeStep ? size_ - off : kHugeJudgeStep;
    const double cpu0 = sys::thread_cpu_seconds();
    if (sys::populate_write_raw(p + off, n) < 0) {  // unsupported: the copies fault the pages in themselves
      verdict_.store(1, std::memory_order_release);
      window_.reset();
      return;
    }
    const HugeWindow::State w = window_->add(n, sys::thread_cpu_seconds() - cpu0);
    if (w == HugeWindow::kOpen) continue;
    window_.reset();
    if (w == HugeWindow::kSlow) {
      // Buffers are handed out for the first time lowest index first: every
      // page past this step's is not backed yet.
      char* rest = p + off + n;
      char* end = base_ + size_ * count_;
      if (rest < end) (void)sys::advise_small_pages_raw(rest, static_cast<uint64_t>(end - rest));
      huge_.store(false, std::memory_order_release);
    }
    verdict_.store(w == HugeWindow::kSlow ? 2 : 1, std::memory_order_release);
    return;
  }
  // The window is still open: the next buffer handed out for the first time goes on with it.
}

int BufferPool::take_locked(bool* fresh) {
  int i;
  *fresh = false;
  if (!warm_.empty()) {
    i = warm_.back();
    warm_.pop_back();
  } else if (!cold_.empty()) {
    i = cold_.back();
    cold_.pop_back();
    touched_[static_cast<size_t>(i)] = 1;
    ++n_touched_;
    *fresh = true;
  } else {
    return -1;
  }
  owner_[static_cast<size_t>(i)] = std::this_thread::get_id();
  return i;
}

int BufferPool::acquire() {
  const std::thread::id me = std::this_thread::get_id();
  std::unique_lock<std::mutex> lk(mu_);
  while (warm_.empty() && cold_.empty()) {
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
  bool fresh;
  const int i = take_locked(&fresh);
  lk.unlock();
  if (fresh) judge(i);
  return i;
}

int BufferPool::try_acquire() {
  bool fresh;
  int i;
  {
    std::lock_guard<std::mutex> lk(mu_);
    i = take_locked(&fresh);
  }
  if (fresh) judge(i);
  return i;
}

void BufferPool::release(int index) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    owner_[static_cast<size_t>(index)] = std::thread::id();
    warm_.push_back(index);
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
  return warm_.size() + cold_.size();
}

size_t BufferPool::resident_bytes() const {
  const long ps = ::sysconf(_SC_PAGESIZE);
  const size_t page = ps > 0 ? static_cast<size_t>(ps) : 4096, bytes = size_ * count_;
  std::vector<unsigned char> vec((bytes + page - 1) / page);
  if (::mincore(base_, bytes, vec.data()) != 0) return 0;
  size_t n = 0;
  for (unsigned char v : vec) n += v & 1;
  return n * page;
}

size_t BufferPool::touched() const {
  std::lock_guard<std::mutex> lk(mu_);
  return n_touched_;
}

bool BufferPool::is_touched(int index) const {
  std::lock_guard<std::mutex> lk(mu_);
  return index >= 0 && static_cast<size_t>(index) < count_ && touched_[static_cast<size_t>(index)];
}

void BufferPool::note_registered(int index, bool ok) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!ok) {
    ++refusals_;
  } else if (index >= 0 && static_cast<size_t>(index) < count_ && !registered_[static_cast<size_t>(index)]) {
    registered_[static_cast<size_t>(index)] = 1;
    ++n_registered_;
  }
}

size_t BufferPool::registered() const {
  std::lock_guard<std::mutex> lk(mu_);
  return n_registered_;
}

size_t BufferPool::registration_refusals() const {
  std::lock_guard<std::mutex> lk(mu_);
  return refusals_;
}

}  // namespace fastckpt
