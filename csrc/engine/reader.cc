#include "engine.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>
#ifdef FASTCKPT_HAVE_ISAL
#include <isa-l/crc.h>
#endif

#include <atomic>
#include <cerrno>
#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <system_error>
#include <thread>

#include "error.h"
#include "temp_file.h"

namespace fastckpt {

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

static uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
static uint64_t round_down(uint64_t v, uint64_t a) { return v / a * a; }

// ---------------------------------------------------------------- Engine

BackendLease::~BackendLease() { give_back(); }

void BackendLease::give_back() {
  if (be_ && eng_) eng_->give_back(std::move(be_));
}

Engine::Engine(const EngineConfig& cfg)
    : cfg_(cfg),
      pool_(new BufferPool((cfg.validate(), cfg.buffer_size), cfg.buffer_count)),
      pid_(static_cast<int>(::getpid())) {}

Engine::~Engine() {
  if (static_cast<int>(::getpid()) == pid_) return;
  for (auto& be : idle_) (void)be.release();
  (void)pool_.release();
}

void Engine::check_process() const {
  const int now = static_cast<int>(::getpid());
  if (now != pid_)
    throw UsageError("fastckpt engine: made in process " + std::to_string(pid_) + ", used in process " +
                     std::to_string(now) +
                     " after fork(): its I/O threads and io_uring rings belong to the parent. Make a new engine in "
                     "the child (fastckpt.get_engine() does so after a fork)");
}

std::unique_ptr<Backend> Engine::create_backend() {
  bool try_uring;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++created_;
    try_uring = cfg_.backend == BackendKind::Uring || (cfg_.backend == BackendKind::Auto && !uring_refused_);
  }
  if (try_uring) {
    try {
      return make_uring_backend(cfg_.queue_depth, pool_.get());
    } catch (const IoError& e) {
      if (cfg_.backend == BackendKind::Uring) throw;
      std::lock_guard<std::mutex> lk(mu_);
      uring_refused_ = true;
      refusal_ = e.what();
    }
  }
  return make_thread_backend(cfg_.io_threads, cfg_.queue_depth);
}

BackendLease Engine::lease() {
  check_process();  // before taking mu_, which a parent's thread may have held at fork()
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!idle_.empty()) {
      std::unique_ptr<Backend> be = std::move(idle_.back());
      idle_.pop_back();
      return BackendLease(this, std::move(be));
    }
  }
  std::unique_ptr<Backend> be = create_backend();
  {
    std::lock_guard<std::mutex> lk(mu_);
    resolved_ = be->name();
  }
  return BackendLease(this, std::move(be));
}

void Engine::give_back(std::unique_ptr<Backend> be) {
  std::lock_guard<std::mutex> lk(mu_);
  idle_.push_back(std::move(be));
}

std::string Engine::backend_name() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!resolved_.empty()) return resolved_;
  }
  BackendLease l = lease();
  return l.get().name();
}

uint64_t Engine::backends_created() {
  std::lock_guard<std::mutex> lk(mu_);
  return created_;
}

std::string Engine::uring_refusal() {
  std::lock_guard<std::mutex> lk(mu_);
  return refusal_;
}

// ---------------------------------------------------------------- Writer

BackendLease lease_for(Engine& engine, const std::string& path) {
  try {
    return engine.lease();
  } catch (const IoError& e) {
    throw e.saving(path);
  }
}

Writer::Writer(Engine& engine, const std::string& path, int64_t expected_size)
    : eng_(engine), cfg_(engine.config()), path_(path), dir_(sys::dirname(path)), lease_(lease_for(engine, path)) {
  t0_ = now_seconds();
  if (path.empty() || path.back() == '/') throw UsageError("Writer: not a file path: '" + path + "'");
  backend_ = lease_.get().name();
  q_.reset(new IoQueue(lease_.get(), cfg_.queue_depth));
  // What crashed saves of this same target left here (docs/ENGINE.md).
  leftovers_ = remove_leftovers(path_);
  try {
    open_temp();
    if (direct_) {
      sys::DioAlign al = sys::dio_alignment(fd_, tmp_);
      const uint64_t bs = eng_.pool().buffer_size();
      if (al.mem > 4096 || al.offset > bs || bs % al.offset != 0) {
        sys::set_direct(fd_, false, tmp_);
        direct_ = false;
        fallback_ = "unsupported direct-I/O alignment " + std::to_string(al.offset);
      } else {
        align_ = al.offset;
        // Probe: some filesystems accept O_DIRECT at open and refuse it at the
        // first write. The real data overwrites this block.
        cur_ = take_buffer();
        std::memset(eng_.pool().data(cur_), 0, align_);
        try {
          sys::pwrite_full(fd_, eng_.pool().data(cur_), align_, 0, tmp_);
          size_may_differ_ = true;
        } catch (const IoError& e) {
          if (e.err() != EINVAL) throw;
          sys::set_direct(fd_, false, tmp_);
          direct_ = false;
          align_ = 1;
          fallback_ = "write(O_DIRECT): EINVAL";
        }
      }
    }
    if (expected_size > 0 && cfg_.preallocate) {
      if (sys::fallocate(fd_, round_up(static_cast<uint64_t>(expected_size), align_), tmp_)) size_may_differ_ = true;
    }
    next_flush_ = cfg_.flush_interval;
  } catch (const IoError& e) {
    abort();
    throw e.saving(path_);
  } catch (...) {
    abort();
    throw;
  }
}

// Creates the temporary file (temp_file.h create_temp_file: O_EXCL, no
// links followed, locked until the rename), O_DIRECT when configured and
// accepted. Sets tmp_ only once the file is ours.
void Writer::open_temp() {
  direct_ = cfg_.direct;
  if (!direct_) fallback_ = "disabled by configuration";
  fd_ = create_temp_file(path_, &tmp_, &direct_, &fallback_);
}

Writer::~Writer() {
  if (state_ == State::Open) abort();
}

void Writer::ensure_open() const {
  if (state_ != State::Open)
    throw UsageError("Writer for " + path_ + " is already " + (state_ == State::Committed ? "committed" : "aborted"));
}

int Writer::take_buffer() { return bufs_.take(eng_.pool(), *q_, cfg_.queue_depth, [this] { reap_one(); }); }

void Writer::reap_one() {
  Reaped r = q_->reap();
  if (r.tag == UINT64_MAX) {
    flush_inflight_ = false;
    return;
  }
  done_bytes_ += r.bytes;
  bufs_.put_back(static_cast<int>(r.tag));
  if (cfg_.flush_interval && !flush_inflight_ && done_bytes_ >= next_flush_ && !q_->full()) {
    IoRequest f;
    f.kind = IoRequest::Fsync;
    f.fd = fd_;
    f.tag = UINT64_MAX;
    q_->submit(f, &tmp_);
    flush_inflight_ = true;
    next_flush_ = done_bytes_ + cfg_.flush_interval;
  }
}

void Writer::submit_current(uint64_t len) {
  while (q_->full()) reap_one();
  IoRequest r;
  r.kind = IoRequest::Write;
  r.fd = fd_;
  r.buf = eng_.pool().data(cur_);
  r.len = len;
  r.off = static_cast<int64_t>(buf_off_);
  r.buf_index = cur_;
  r.tag = static_cast<uint64_t>(cur_);
  q_->submit(r, &tmp_);
  ++requests_;
  cur_ = -1;
  buf_off_ += fill_;
  fill_ = 0;
}

uint32_t crc32(uint32_t crc, const void* data, uint64_t n) {
#ifdef FASTCKPT_HAVE_ISAL
  // Same running value as zlib's crc32 (inversions inside), 64-bit length.
  return crc32_gzip_refl(crc, static_cast<const unsigned char*>(data), n);
#else
  return static_cast<uint32_t>(::crc32_z(crc, static_cast<const Bytef*>(data), static_cast<z_size_t>(n)));
#endif
}

uint32_t crc32_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
  static_assert(sizeof(z_off_t) >= sizeof(int64_t), "zlib's z_off_t must hold any file length");
  return static_cast<uint32_t>(::crc32_combine(crc1, crc2, static_cast<z_off_t>(len2)));
}

const char* crc32_impl() {
#ifdef FASTCKPT_HAVE_ISAL
  return "isa-l";
#else
  return "zlib";
#endif
}

void Writer::put(const char* src, uint64_t n, uint32_t* crc) {
  ensure_open();
  if (n > static_cast<uint64_t>(INT64_MAX) - pos_)
    throw UsageError("Writer for " + path_ + ": " + std::to_string(n) + " bytes at offset " + std::to_string(pos_) +
                     " would pass the largest file offset");
  const uint64_t bs = eng_.pool().buffer_size();
  // With a checksum, copy in pieces small enough to still be in the cache
  // when the CRC reads them back.
  const uint64_t piece = crc ? (256u << 10) : bs;
  try {
    while (n > 0) {
      if (cur_ < 0) cur_ = take_buffer();
      uint64_t k = bs - fill_ < n ? bs - fill_ : n;
      if (k > piece) k = piece;
      char* dst = eng_.pool().data(cur_) + fill_;
      if (src) {
        std::memcpy(dst, src, k);
        src += k;
      } else {
        std::memset(dst, 0, k);
      }
      if (crc) *crc = crc32(*crc, dst, k);
      fill_ += k;
      pos_ += k;
      n -= k;
      if (fill_ == bs) submit_current(bs);
    }
  } catch (const IoError& e) {
    abort();
    throw e.saving(path_);
  } catch (...) {
    abort();
    throw;
  }
}

void Writer::append(const void* src, uint64_t n, uint32_t* crc) {
  if (n && !src) throw UsageError("Writer::append: null source");
  put(static_cast<const char*>(src), n, crc);
}

void Writer::append_zeros(uint64_t n) { put(nullptr, n, nullptr); }

void Writer::write_at(const void* src, uint64_t n, uint64_t off) {
  ensure_open();
  if (off > static_cast<uint64_t>(INT64_MAX))
    throw UsageError("Writer::write_at: offset " + std::to_string(off) + " is beyond the largest file offset");
  if (off < pos_)
    throw UsageError("Writer::write_at: offset " + std::to_string(off) + " is behind the current position " +
                     std::to_string(pos_) + " (regions must be written in increasing order)");
  append_zeros(off - pos_);
  append(src, n);
}

WriteStats Writer::commit() {
  ensure_open();
  WriteStats st;
  try {
    if (cur_ >= 0 && fill_ > 0) {
      uint64_t len = fill_;
      if (direct_) {
        len = round_up(fill_, align_);
        std::memset(eng_.pool().data(cur_) + fill_, 0, len - fill_);
        if (len != fill_) size_may_differ_ = true;
      }
      uint64_t fill = fill_;
      fill_ = len;  // submit_current advances buf_off_ by fill_
      submit_current(len);
      buf_off_ -= len - fill;
    }
    while (q_->inflight() > 0) reap_one();
    if (size_may_differ_) sys::ftruncate(fd_, pos_, tmp_);
    const double tf = now_seconds();
    sys::fdatasync(fd_, tmp_);
    // Renamed while still open (and locked): a concurrent save of the same
    // target never takes the file for a crashed save's leftover.
    sys::rename(tmp_, path_);
    sys::close_quiet(fd_);
    fd_ = -1;
    state_ = State::Committed;
    release_buffers();
    sys::fsync_dir(dir_);
    st.flush_seconds = now_seconds() - tf;
  } catch (const IoError& e) {
    if (state_ == State::Open) abort();
    throw e.saving(path_);
  } catch (...) {
    if (state_ == State::Open) abort();
    throw;
  }
  st.bytes = pos_;
  st.requests = requests_;
  st.requeued = q_->requeued();
  q_.reset();
  lease_.give_back();
  st.seconds = now_seconds() - t0_;
  st.direct = direct_;
  st.backend = backend_;
  st.alignment = direct_ ? align_ : 0;
  st.fallback = fallback_;
  st.leftovers_removed = leftovers_;
  return st;
}

void HeldBuffers::release(BufferPool& pool, const std::vector<int>& unreaped) noexcept {
  for (int b : held_) {
    if (std::find(unreaped.begin(), unreaped.end(), b) != unreaped.end()) pool.quarantine(b);
    else pool.release(b);
  }
  held_.clear();
  free_.clear();
}

void Writer::release_buffers(const std::vector<int>& unreaped) noexcept {
  bufs_.release(eng_.pool(), unreaped);
  cur_ = -1;
}

void Writer::abort() noexcept {
  if (state_ != State::Open) return;
  state_ = State::Aborted;
  std::vector<int> unreaped;
  if (q_) {
    q_->drain();
    unreaped = q_->unreaped_buffers();
    if (q_->broken()) lease_.discard();
    q_.reset();
  }
  lease_.give_back();  // an aborted writer holds no ring or threads
  release_buffers(unreaped);
  sys::close_quiet(fd_);
  fd_ = -1;
  if (!tmp_.empty()) sys::unlink_quiet(tmp_);
}

// ---------------------------------------------------------------- Reader

namespace {

struct Part {
  char* dst;
  uint64_t off;
  uint64_t len;
  int64_t piece = -1;  // its CrcPiece, when its range wants a CRC
};

struct Job {
  uint64_t off = 0;
  uint64_t len = 0;      // bytes requested from the file
  uint64_t need = 0;     // bytes that must arrive (the rest may lie past EOF)
  char* direct_dst = nullptr;
  int64_t piece = -1;    // a direct job's CrcPiece, when its range wants a CRC
  size_t part_begin = 0, part_end = 0;
  int buf = -1;
};

// One piece (a direct job or a staged part) of a range whose CRC was asked
// for. A range's pieces are consecutive in the list and in file order, so
// folding the list in order with crc32_combine gives each range's CRC.
struct CrcPiece {
  uint32_t* out;  // the range's ReadRange::crc
  uint64_t len;
  uint32_t crc;
  bool first;     // the range's first piece
};

constexpr uint64_t kPrefaultMin = 16u << 20;   // destination bytes of a read_ranges call worth a prefault thread
constexpr uint64_t kPrefaultPart = 64u << 10;  // staged parts smaller than this are left to the copy
constexpr uint64_t kCoalesceGap = 64u << 10;  // read through gaps up to this size
// A staged part is copied out and checksummed in pieces this big, so that the
// CRC reads what the copy just wrote while it is still in the cache.
constexpr uint64_t kCrcPiece = 256u << 10;

}  // namespace

ReadStats read_ranges(Engine& engine, const std::string& path, const std::vector<ReadRange>& ranges,
                      int same_file_fd) {
  const double t0 = now_seconds();
  const EngineConfig& cfg = engine.config();
  BufferPool& pool = engine.pool();
  const uint64_t bs = pool.buffer_size();
  ReadStats st;

  // A new descriptor (O_DIRECT is per open file), on the caller's file if given.
  const std::string open_path = same_file_fd >= 0 ? "/proc/self/fd/" + std::to_string(same_file_fd) : path;
  int fd = -1;
  bool direct = cfg.direct;
  if (direct) {
    try {
      fd = sys::open(open_path, O_RDONLY | O_DIRECT, 0, &path);
    } catch (const IoError& e) {
      if (e.err() != EINVAL) throw;
      direct = false;
    }
  }
  if (fd < 0) fd = sys::open(open_path, O_RDONLY, 0, &path);
  std::unique_ptr<BackendLease> lease;  // only when something is left for the disk
  HeldBuffers bufs;
  std::unique_ptr<IoQueue> q;
  std::thread prefaulter;
  std::atomic<bool> stop_prefault{false};
  // The prefault helper's next job; the submitter moves it past every direct
  // job it submits (whose pages the read then faults in itself), so that the
  // two never fault the same destination.
  std::atomic<size_t> prefault_next{0};
  std::atomic<uint64_t> prefaulted{0};
  auto cleanup = [&]() noexcept {
    stop_prefault = true;
    if (prefaulter.joinable()) prefaulter.join();
    st.prefaulted_bytes = prefaulted.load();
    std::vector<int> unreaped;
    if (q) {
      q->drain();
      unreaped = q->unreaped_buffers();
      if (q->broken() && lease) lease->discard();
    }
    bufs.release(pool, unreaped);
    q.reset();
    lease.reset();
    sys::close_quiet(fd);
  };

  try {
    const uint64_t fsize = sys::file_size(fd, path);

    std::vector<ReadRange> sorted;
    sorted.reserve(ranges.size());
    for (const ReadRange& r : ranges) {
      if (r.crc) *r.crc = 0;  // the CRC of no bytes
      if (r.len == 0) continue;
      if (!r.dst) throw UsageError("read_ranges: null destination");
      if (r.off > fsize || r.len > fsize - r.off) throw TruncatedError(path, r.off, r.len, fsize);
      sorted.push_back(r);
      st.bytes += r.len;
    }
    std::sort(sorted.begin(), sorted.end(), [](const ReadRange& x, const ReadRange& y) { return x.off < y.off; });

    // Page cache first. The first range not wholly cached ends this phase
    // (what follows it was most likely not read lately either, and each miss
    // costs a syscall); it and the ones after go to the disk. A range whose
    // cached prefix was read continues from there (`cont`), its CRC so far
    // already in *crc.
    // A file of which nothing is cached skips the phase: a miss of preadv2
    // with RWF_NOWAIT still starts the kernel's readahead of the file's next
    // window (read_ahead_kb, 8 MiB here), read for nothing while the disk path
    // reads the same bytes with O_DIRECT. cachestat(2) asks without reading
    // (kernels without it: the phase runs, as before).
    std::vector<char> cont(sorted.size(), 0);
    size_t first_left = 0;
    bool none_cached = false;
    if (!sorted.empty()) {
      uint64_t end = 0;
      for (const ReadRange& r : sorted) end = std::max(end, r.off + r.len);
      none_cached = sys::cached_pages_raw(fd, sorted.front().off, end - sorted.front().off) == 0;
    }
    if (!sorted.empty() && !none_cached) {
      if (direct) sys::set_direct(fd, false, path);
      for (; first_left < sorted.size(); ++first_left) {
        ReadRange& r = sorted[first_left];
        // With a CRC: in kCrcPiece steps, each checksummed right after its copy
        // (still in the CPU cache), as the staged pieces below.
        const uint64_t step = r.crc ? kCrcPiece : r.len;
        uint64_t got = 0;
        uint32_t crc = 0;
        while (got < r.len) {
          const uint64_t want = r.len - got < step ? r.len - got : step;
          char* at = static_cast<char*>(r.dst) + got;
          const int64_t k = sys::pread_cached(fd, at, want, static_cast<int64_t>(r.off + got), path);
          if (k <= 0) break;  // not cached, or RWF_NOWAIT refused (-1): the normal path
          if (r.crc) crc = crc32(crc, at, static_cast<uint64_t>(k));
          got += static_cast<uint64_t>(k);
          if (static_cast<uint64_t>(k) < want) break;
        }
        if (got == 0) break;
        st.cached_bytes += got;
        if (r.crc) *r.crc = crc;
        if (got < r.len) {
          r.dst = static_cast<char*>(r.dst) + got;
          r.off += got;
          r.len -= got;
          cont[first_left] = 1;
          break;
        }
      }
      st.bytes_read += st.cached_bytes;
      sorted.erase(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(first_left));
      cont.erase(cont.begin(), cont.begin() + static_cast<std::ptrdiff_t>(first_left));
    }
    if (sorted.empty()) {
      cleanup();
      st.seconds = now_seconds() - t0;
      st.direct = false;
      st.backend = "page cache";
      return st;
    }

    if (direct) {
      try {
        sys::set_direct(fd, true, path);
      } catch (const IoError& e) {
        if (e.err() != EINVAL) throw;
        direct = false;
      }
    }
    lease.reset(new BackendLease(engine.lease()));
    st.backend = lease->get().name();
    uint64_t a = 1, mem_a = 1;
    if (direct) {
      sys::DioAlign al = sys::dio_alignment(fd, path);
      if (al.mem > 4096 || al.offset > bs || bs % al.offset != 0) {
        sys::set_direct(fd, false, path);
        direct = false;
      } else {
        a = al.offset;
        mem_a = al.mem;
      }
    }

    // Plan: direct jobs for aligned ranges, staging windows for the rest.
    std::vector<Job> jobs;
    std::vector<Part> parts;
    std::vector<CrcPiece> pieces;
    auto new_piece = [&](const ReadRange& r, uint64_t len, bool first) -> int64_t {
      if (!r.crc) return -1;
      pieces.push_back(CrcPiece{r.crc, len, 0, first});
      return static_cast<int64_t>(pieces.size() - 1);
    };
    bool open_window = false;
    uint64_t win_end = 0;  // end of the furthest part in the open window
    auto close_window = [&]() {
      if (!open_window) return;
      Job& j = jobs.back();
      j.need = win_end - j.off;
      j.len = round_up(win_end, a) - j.off;
      j.part_end = parts.size();
      open_window = false;
    };
    for (size_t ri = 0; ri < sorted.size(); ++ri) {
      const ReadRange& r = sorted[ri];
      const bool starts = !cont[ri];  // the range's first byte is read here (not from the cache)
      char* dst = static_cast<char*>(r.dst);
      // The aligned body of a range with an aligned destination and offset
      // is read straight into the destination; the rest goes through staging.
      uint64_t body = 0;
      if (direct && reinterpret_cast<uintptr_t>(dst) % mem_a == 0 && r.off % a == 0) body = round_down(r.len, a);
      if (body > 0) {
        close_window();
        for (uint64_t done = 0; done < body; done += bs) {
          Job j;
          j.off = r.off + done;
          j.len = j.need = body - done < bs ? body - done : bs;
          j.direct_dst = dst + done;
          j.piece = new_piece(r, j.len, starts && done == 0);
          jobs.push_back(j);
        }
      }
      uint64_t off = r.off + body, left = r.len - body;
      dst += body;
      while (left > 0) {
        if (open_window) {
          // Join the open window when the range starts inside it or near its
          // end (reading a small gap beats another request) and fits in it.
          // (An earlier, longer range may have moved the window past `off`.)
          const Job& w = jobs.back();
          if (off < w.off || off >= w.off + bs || (off > win_end && off - win_end > kCoalesceGap)) close_window();
        }
        if (!open_window) {
          Job j;
          j.off = round_down(off, a);
          j.part_begin = parts.size();
          jobs.push_back(j);
          open_window = true;
          win_end = off;
        }
        Job& j = jobs.back();
        uint64_t room = j.off + bs - off;
        uint64_t take = left < room ? left : room;
        parts.push_back(Part{dst, off, take, new_piece(r, take, starts && off == r.off)});
        if (off + take > win_end) win_end = off + take;
        dst += take;
        off += take;
        left -= take;
        if (win_end == j.off + bs) close_window();
      }
    }
    close_window();

    // Fresh memory costs more to fault in than the disk takes to fill it (on
    // a VM, about half of a load's CPU time). A helper thread faults the
    // destinations in ahead of the reads, in file order, in parallel with the
    // submissions, the copies out of staging and the CRCs: the direct jobs'
    // and the staged parts' of at least kPrefaultPart bytes (memory already
    // resident costs it a page-table walk). It starts after the first
    // queue_depth jobs, which the first submissions fault in themselves, and
    // it skips every direct job submitted before it got there (the submitter
    // moves prefault_next on): two threads faulting the same pages cost more
    // than one (page-table lock contention, a second walk; on this VM a tenth
    // of a load's CPU). A read or copy that gets ahead of it faults its pages
    // itself, as without it.
    uint64_t fault_bytes = 0;
    for (const Job& j : jobs) {
      if (j.direct_dst) fault_bytes += j.len;
      for (size_t p = j.part_begin; p < j.part_end; ++p)
        if (parts[p].len >= kPrefaultPart) fault_bytes += parts[p].len;
    }
    prefault_next = std::min<size_t>(jobs.size(), cfg.queue_depth);
    if (cfg.prefault && fault_bytes >= kPrefaultMin && prefault_next < jobs.size()) {
      try {
        prefaulter = std::thread([&jobs, &parts, &stop_prefault, &prefault_next, &prefaulted]() {
          uint64_t done = 0;
          for (;;) {
            const size_t i = prefault_next.fetch_add(1);
            if (i >= jobs.size() || stop_prefault.load(std::memory_order_relaxed)) break;
            const Job& j = jobs[i];
            if (j.direct_dst) {
              if (sys::populate_write_raw(j.direct_dst, j.len) < 0) break;  // unsupported: stop
              done += j.len;
            }
            bool ok = true;
            for (size_t p = j.part_begin; ok && p < j.part_end; ++p) {
              if (parts[p].len < kPrefaultPart) continue;
              ok = sys::populate_write_raw(parts[p].dst, parts[p].len) >= 0;
              if (ok) done += parts[p].len;
            }
            if (!ok) break;
          }
          prefaulted = done;
        });
      } catch (const std::system_error&) {
        // No thread to be had (a process at its thread limit): the reads fault
        // their pages themselves, as with prefault off.
      }
    }

    q.reset(new IoQueue(lease->get(), cfg.queue_depth));
    size_t next = 0, finished = 0;
    while (finished < jobs.size()) {
      while (next < jobs.size() && !q->full()) {
        Job& j = jobs[next];
        IoRequest req;
        req.kind = IoRequest::Read;
        req.fd = fd;
        req.off = static_cast<int64_t>(j.off);
        req.len = j.len;
        req.tag = next;
        if (j.direct_dst) {
          req.buf = j.direct_dst;
          ++st.direct_requests;
          // This read faults its destination in itself: the helper skips it.
          size_t pf = prefault_next.load(std::memory_order_relaxed);
          while (pf <= next && !prefault_next.compare_exchange_weak(pf, next + 1, std::memory_order_relaxed)) {
          }
        } else {
          const int b = bufs.try_take(pool, *q, cfg.queue_depth);
          if (b < 0) break;  // wait for one of ours to come back
          j.buf = b;
          req.buf = pool.data(b);
          req.buf_index = b;
        }
        q->submit(req, &path, j.need);
        ++st.requests;
        ++next;
      }
      Reaped r = q->reap();
      Job& j = jobs[r.tag];
      st.bytes_read += r.bytes;
      // The other requests stay in flight while this one is copied out and
      // checksummed.
      if (j.direct_dst) {
        if (j.piece >= 0) pieces[j.piece].crc = crc32(0, j.direct_dst, j.need);
      } else {
        const char* src = pool.data(j.buf);
        for (size_t p = j.part_begin; p < j.part_end; ++p) {
          const Part& part = parts[p];
          const char* from = src + (part.off - j.off);
          if (part.piece < 0) {
            std::memcpy(part.dst, from, part.len);
            continue;
          }
          uint32_t crc = 0;
          for (uint64_t done = 0; done < part.len; done += kCrcPiece) {
            const uint64_t k = part.len - done < kCrcPiece ? part.len - done : kCrcPiece;
            std::memcpy(part.dst + done, from + done, k);
            crc = crc32(crc, part.dst + done, k);
          }
          pieces[part.piece].crc = crc;
        }
        bufs.put_back(j.buf);
        j.buf = -1;
      }
      ++finished;
    }
    for (const CrcPiece& p : pieces) *p.out = p.first ? p.crc : crc32_combine(*p.out, p.crc, p.len);
  } catch (...) {
    cleanup();
    throw;
  }
  cleanup();
  st.seconds = now_seconds() - t0;
  st.direct = direct;
  return st;
}

}  // namespace fastckpt
